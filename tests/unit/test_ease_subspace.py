import math

import numpy as np
import pytest
import scipy.linalg
import torch

from app.ml.unlearning.ease.subspace import (
    energy_basis,
    forget_exclusive,
    principal_angles,
    project_model,
    project_out,
    retain_support,
)


def _constructed(p: int = 24, seed: int = 0):
    """Q_r = span(e0, e1, e2); U_f = 4 directions at known angles 10°, 30°, 60°, 90° from Q_r, randomly mixed."""
    rng = np.random.default_rng(seed)
    rot, _ = np.linalg.qr(rng.normal(size=(p, p)))  # a random rotation of the whole space
    e = rot  # columns e_i: an orthonormal basis
    angles = np.deg2rad([10.0, 30.0, 60.0, 90.0])
    q_r = e[:, :3]
    dirs = [math.cos(a) * e[:, i] + math.sin(a) * e[:, 10 + i] if i < 3 else e[:, 15] for i, a in enumerate(angles)]
    u_true = np.stack(dirs, axis=1)  # orthonormal: disjoint supports
    mix, _ = np.linalg.qr(rng.normal(size=(4, 4)))
    u_f = u_true @ mix  # same span, principal vectors hidden
    return torch.tensor(u_f), torch.tensor(q_r), torch.tensor(u_true), np.rad2deg(angles)


def test_principal_angles_recover_known_angles_and_match_scipy():
    u_f, q_r, _, angles = _constructed()
    pa = principal_angles(u_f, q_r)
    assert np.allclose(np.sort(pa.degrees.numpy()), angles, atol=1e-8)
    scipy_deg = np.sort(np.rad2deg(scipy.linalg.subspace_angles(u_f.numpy(), q_r.numpy())))
    assert np.allclose(np.sort(pa.degrees.numpy())[:3], scipy_deg, atol=1e-6)  # scipy reports min(r_f, r_r) angles
    # principal vectors are orthonormal and sit in span(U_f)
    w = pa.vectors
    assert torch.allclose(w.T @ w, torch.eye(4, dtype=w.dtype), atol=1e-10)
    assert torch.allclose(u_f @ (u_f.T @ w), w, atol=1e-10)


@pytest.mark.parametrize(("delta", "expected"), [(5.0, 4), (20.0, 3), (45.0, 2), (75.0, 1), (90.0, 1)])
def test_forget_exclusive_split_exactly_recovers_the_directions_beyond_delta(delta, expected):
    u_f, q_r, u_true, angles = _constructed()
    u_mu, pa = forget_exclusive(u_f, q_r, delta)
    assert u_mu.shape[1] == expected
    want = u_true[:, angles >= delta]  # the constructed directions at angle ≥ δ
    # same subspace: projectors agree
    assert torch.allclose(u_mu @ u_mu.T, want @ want.T, atol=1e-8)


def test_projection_is_idempotent_and_leaves_retain_support_untouched():
    u_f, q_r, u_true, _ = _constructed()
    u_mu, _ = forget_exclusive(u_f, q_r, 89.0)  # only the 90° direction: exactly orthogonal to Q_r
    x = torch.randn(24, 5, dtype=torch.float64)
    once = project_out(x, u_mu)
    assert torch.allclose(project_out(once, u_mu), once, atol=1e-12)
    assert torch.allclose(u_mu.T @ once, torch.zeros(u_mu.shape[1], 5, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(project_out(q_r, u_mu), q_r, atol=1e-12)  # retain support untouched
    # with δ = 45° the retain support moves by at most cos δ (the bound the threshold buys)
    u_mu45, _ = forget_exclusive(u_f, q_r, 45.0)
    moved = torch.linalg.norm(project_out(q_r, u_mu45) - q_r, dim=0)
    assert float(moved.max()) <= math.cos(math.radians(45.0)) + 1e-9


def test_project_model_removes_only_the_displacement_along_u_mu():
    u_f, q_r, _, _ = _constructed()
    u_mu, _ = forget_exclusive(u_f, q_r, 45.0)
    ref = torch.randn(24, dtype=torch.float64)
    theta = ref + torch.randn(24, dtype=torch.float64)
    out = project_model(theta, ref, u_mu)
    assert torch.allclose(u_mu.T @ (out - ref), torch.zeros(u_mu.shape[1], dtype=torch.float64), atol=1e-12)
    assert torch.allclose(project_model(out, ref, u_mu), out, atol=1e-12)


def test_energy_basis_cut_and_retain_support():
    torch.manual_seed(0)
    basis, _ = torch.linalg.qr(torch.randn(50, 3, dtype=torch.float64))
    cols = (
        basis @ torch.diag(torch.tensor([10.0, 3.0, 0.1], dtype=torch.float64)) @ torch.randn(3, 8, dtype=torch.float64)
    )
    full, s = energy_basis(cols, 1.0)
    assert full.shape[1] == 3 and s.numel() == 8
    cut, _ = energy_basis(cols, 0.95)
    assert cut.shape[1] < 3
    assert energy_basis(torch.zeros(50, 4), 0.9)[0].shape == (50, 0)
    q = retain_support([full[:, :1], full[:, 1:], torch.zeros(50, 0, dtype=torch.float64)])
    assert q.shape[1] == 3 and torch.allclose(q.T @ q, torch.eye(3, dtype=torch.float64), atol=1e-10)


def test_empty_retain_support_makes_every_forget_direction_exclusive():
    u_f, _, _, _ = _constructed()
    u_mu, pa = forget_exclusive(u_f, torch.zeros(24, 0, dtype=torch.float64), 45.0)
    assert u_mu.shape[1] == 4 and torch.allclose(pa.degrees, torch.full((4,), 90.0, dtype=torch.float64))


def _block_bases(columns: torch.Tensor, blocks):
    from app.ml.unlearning.ease.subspace import block_bases

    return block_bases(columns, blocks, 1.0)


def test_one_block_is_the_flat_decomposition():
    """``blockwise_exclusive`` with the single block [(0, p)] gives the flat GSD's U_μ (ease-notes §3 steps 2–5)."""
    from app.ml.unlearning.ease.subspace import blockwise_exclusive

    u_f, q_r, _, _ = _constructed()
    blocks = [(0, 24)]
    _, q_out, u_mu, pa = blockwise_exclusive([[u_f]], [[q_r]], blocks, 1.0, 45.0)
    want, pa_flat = forget_exclusive(u_f, q_r, 45.0)
    assert torch.allclose(u_mu @ u_mu.T, want @ want.T, atol=1e-8)
    assert torch.allclose(pa.angles, pa_flat.angles, atol=1e-10)
    assert torch.allclose(q_out @ q_out.T, q_r @ q_r.T, atol=1e-10)


def test_blocks_compare_like_with_like():
    """Two blocks (a LoRA A and B): the forget direction of block 1 is exclusive there (90° from block 1's retain
    support) and the one of block 2 shared (0°). Per block, exactly block 1's direction is exclusive; the flat
    decomposition of the same vectors sees one mixed direction at an angle set by the blocks' relative scale."""
    from app.ml.unlearning.ease.subspace import blockwise_exclusive

    p1, p2 = 6, 8
    blocks = [(0, p1), (p1, p2)]
    e = torch.eye(p1 + p2, dtype=torch.float64)
    # forget: one vector with a part in each block; retain: shares block 2's part, is orthogonal in block 1
    forget = (e[:, 0] + 10.0 * e[:, p1]).reshape(-1, 1)
    retain = (e[:, 1] + e[:, p1]).reshape(-1, 1)
    u_f_b, q_r_b = _block_bases(forget, blocks), _block_bases(retain, blocks)
    u_f, q_r, u_mu, pa = blockwise_exclusive([u_f_b], [q_r_b], blocks, 1.0, 65.0)
    assert u_mu.shape[1] == 1
    assert torch.allclose((u_mu @ u_mu.T)[:, 0], e[:, 0], atol=1e-10)  # block 1's forget direction, alone
    assert sorted(round(float(a), 6) for a in pa.degrees) == [0.0, 90.0]
    # flat: one mixed direction, not exclusive at 65° (its angle depends on the 10:1 scale of the two parts)
    flat_u, flat_q, flat_mu, flat_pa = blockwise_exclusive(
        [_block_bases(forget, [(0, p1 + p2)])], [_block_bases(retain, [(0, p1 + p2)])], [(0, p1 + p2)], 1.0, 65.0
    )
    assert flat_mu.shape[1] == 0 and float(flat_pa.degrees[0]) < 65.0
    # the bases are orthonormal and zero outside their blocks
    assert torch.allclose(u_f.T @ u_f, torch.eye(u_f.shape[1], dtype=torch.float64), atol=1e-10)
    assert torch.allclose(q_r.T @ q_r, torch.eye(q_r.shape[1], dtype=torch.float64), atol=1e-10)

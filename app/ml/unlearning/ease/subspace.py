"""GSD — Gradient Subspace Decomposition (ease-notes §3).

The paper states GSD "isolat[es] forget-exclusive directions from retain support" by a Cosine–Sine decomposition of
client-update subspaces built by per-client SVD, with principal angles [PAPER/SECONDARY]. The concrete steps below
are the notes' standard reconstruction [INFERENCE], each with a named setting:

1. per-client basis: thin SVD of the client's update stack ``D_c = [Δ_c^(1) … Δ_c^(T)]`` keeping the smallest rank
   whose energy reaches ``τ`` (:func:`energy_basis`, setting ``tau``);
2. retain support ``Q_r``: an orthonormal basis of the retained clients' bases together, with its own energy cut
   (:func:`retain_support`, setting ``tau_retain``);
3. principal angles between ``U_f`` and ``Q_r`` by Björck–Golub: the SVD ``U_fᵀQ_r = P cos(Θ) Rᵀ`` gives the cosines
   and the principal vectors ``W = U_f P`` (:func:`principal_angles`);
4. forget-exclusive directions ``U_μ = {W_i : θ_i ≥ δ}`` (:func:`forget_exclusive`, setting ``delta``);
5. the projector ``I − U_μU_μᵀ`` (:func:`project_out`) and the model projection
   ``θ ← θ_ref + (I − U_μU_μᵀ)(θ − θ_ref)`` (:func:`project_model`, θ_ref a setting of the method).

All linear algebra runs in float64 on the CPU: the matrices are p × (rounds) — thin — so this is cheap even for a
ViT-B-32's LoRA.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


def energy_basis(columns: torch.Tensor, tau: float, max_rank: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Orthonormal basis ``[p × r]`` of the column span of ``columns`` ``[p × T]`` with energy fraction ≥ ``tau``.

    Returns the basis and all singular values. Zero columns are ignored; an all-zero input gives an empty basis.
    ``tau = 1`` keeps every non-negligible direction.
    """
    x = columns.detach().to(torch.float64).cpu()
    if x.ndim != 2:
        raise ValueError("columns must be [p × T]")
    keep = x.abs().sum(dim=0) > 0
    x = x[:, keep]
    if x.shape[1] == 0:
        return torch.zeros(columns.shape[0], 0, dtype=torch.float64), torch.zeros(0, dtype=torch.float64)
    u, s, _ = torch.linalg.svd(x, full_matrices=False)
    energy = s**2
    total = float(energy.sum())
    if total <= 0:
        return torch.zeros(columns.shape[0], 0, dtype=torch.float64), s
    nonneg = int((s > s[0] * 1e-10).sum())
    cum = torch.cumsum(energy, 0) / total
    r = int(torch.searchsorted(cum, torch.tensor(min(tau, 1.0) - 1e-12, dtype=torch.float64)).item()) + 1
    r = min(r, nonneg)
    if max_rank is not None:
        r = min(r, max_rank)
    return u[:, :r].contiguous(), s


def orthonormalize(columns: torch.Tensor, tau: float = 1.0) -> torch.Tensor:
    """Orthonormal basis of the span of ``columns`` (SVD with an energy cut ``tau``)."""
    return energy_basis(columns, tau)[0]


def retain_support(bases: Sequence[torch.Tensor], tau: float = 1.0) -> torch.Tensor:
    """Pool retained clients' bases into one orthonormal ``Q_r`` (ease-notes §3 step 3, pooled variant [INFERENCE])."""
    nonempty = [b.to(torch.float64) for b in bases if b.numel() and b.shape[1]]
    if not nonempty:
        p = bases[0].shape[0] if bases else 0
        return torch.zeros(p, 0, dtype=torch.float64)
    return orthonormalize(torch.cat(nonempty, dim=1), tau)


@dataclass
class PrincipalAngles:
    """Principal angles (radians, ascending) between span(U_f) and span(Q_r), and the principal vectors in U_f."""

    angles: torch.Tensor  # [r_f]
    vectors: torch.Tensor  # [p × r_f], W = U_f P, orthonormal, column i paired with angles[i]

    @property
    def degrees(self) -> torch.Tensor:
        return torch.rad2deg(self.angles)


def principal_angles(u_f: torch.Tensor, q_r: torch.Tensor) -> PrincipalAngles:
    """Björck–Golub (1973): SVD of ``U_fᵀQ_r`` = P cos Θ Rᵀ for orthonormal ``U_f``, ``Q_r``.

    Every one of the r_f directions of U_f gets an angle: when r_f exceeds rank(Q_r) the extra principal vectors are
    orthogonal to Q_r (angle π/2). Cosines are clamped to [0, 1] against round-off; for angles below ~1e-8 rad the
    cosine form loses accuracy (the sine form would not), irrelevant for a threshold δ of degrees.
    """
    u_f = u_f.to(torch.float64)
    q_r = q_r.to(torch.float64)
    r_f = u_f.shape[1]
    if r_f == 0:
        return PrincipalAngles(torch.zeros(0, dtype=torch.float64), u_f)
    if q_r.shape[1] == 0:
        return PrincipalAngles(torch.full((r_f,), math.pi / 2, dtype=torch.float64), u_f)
    p_mat, cos, _ = torch.linalg.svd(u_f.T @ q_r, full_matrices=True)
    cos_full = torch.zeros(r_f, dtype=torch.float64)
    cos_full[: cos.numel()] = cos.clamp(0.0, 1.0)
    angles = torch.arccos(cos_full)
    vectors = u_f @ p_mat
    order = torch.argsort(angles)
    return PrincipalAngles(angles[order], vectors[:, order])


def forget_exclusive(u_f: torch.Tensor, q_r: torch.Tensor, delta_deg: float) -> tuple[torch.Tensor, PrincipalAngles]:
    """``U_μ``: principal vectors of the forget subspace at angle ≥ δ (degrees) from the retain support."""
    pa = principal_angles(u_f, q_r)
    keep = pa.degrees >= delta_deg - 1e-9
    return pa.vectors[:, keep].contiguous(), pa


def project_out(x: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """``(I − UUᵀ)x`` for an orthonormal ``U`` ``[p × k]``; ``x`` may be a vector or ``[p × m]``."""
    if basis.numel() == 0 or basis.shape[1] == 0:
        return x.clone()
    u = basis.to(device=x.device, dtype=torch.float64)
    xd = x.to(torch.float64)
    return (xd - u @ (u.T @ xd)).to(x.dtype)


def project_onto(x: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """``UUᵀx``."""
    if basis.numel() == 0 or basis.shape[1] == 0:
        return torch.zeros_like(x)
    u = basis.to(device=x.device, dtype=torch.float64)
    return (u @ (u.T @ x.to(torch.float64))).to(x.dtype)


def project_model(theta: torch.Tensor, theta_ref: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """``θ_ref + (I − U_μU_μᵀ)(θ − θ_ref)``: remove the model's displacement along U_μ (ease-notes §4 [INFERENCE])."""
    return theta_ref + project_out(theta - theta_ref, basis)


def tensor_blocks(layout: Sequence[dict]) -> list[tuple[int, int]]:
    """``(offset, size)`` of every LoRA tensor in θ (``clip.lora_layout``): A and B of each adapted layer apart."""
    return [(int(t["offset"]), int(math.prod(t["shape"]))) for t in layout]


def block_bases(
    columns: torch.Tensor, blocks: Sequence[tuple[int, int]], tau: float, max_rank: int | None = None
) -> list[torch.Tensor]:
    """One source's energy-cut basis per block: the thin SVD of each block's rows of ``columns`` [p × T], and one
    energy cut ``τ`` over all blocks' directions together (largest singular values first).

    Why one cut: a block the source barely moves (a small share of its energy) still has T directions of its own,
    and a per-block cut would keep them — noise that looks orthogonal to everything and would be taken for
    forget-exclusive. Cut jointly, a source keeps what carries ``τ`` of its energy wherever it lies; with a single
    block this is :func:`energy_basis`. ``max_rank`` caps each block.
    """
    x = columns.detach().to(torch.float64).cpu()
    x = x[:, x.abs().sum(dim=0) > 0]
    svds = [torch.linalg.svd(x[o : o + n], full_matrices=False)[:2] if x.shape[1] else None for o, n in blocks]
    energies = [(float(sv[1][i]) ** 2, b, i) for b, sv in enumerate(svds) if sv is not None for i in range(len(sv[1]))]
    total = sum(e for e, _, _ in energies)
    keep = [0] * len(blocks)
    if total > 0:
        top = max(e for e, _, _ in energies)
        cum = 0.0
        for e, b, _i in sorted(energies, key=lambda t: -t[0]):
            if cum / total >= min(tau, 1.0) - 1e-12 or e <= top * 1e-20:
                break
            if max_rank is None or keep[b] < max_rank:
                keep[b] += 1
            cum += e
    return [
        svds[b][0][:, : keep[b]].contiguous() if svds[b] is not None else torch.zeros(n, 0, dtype=torch.float64)
        for b, (_o, n) in enumerate(blocks)
    ]


def blockwise_exclusive(
    forget: Sequence[Sequence[torch.Tensor]],
    retain: Sequence[Sequence[torch.Tensor]],
    blocks: Sequence[tuple[int, int]],
    tau_retain: float,
    delta_deg: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, PrincipalAngles]:
    """GSD block by block (ease-notes §3 steps 2–5 inside each block): ``U_f``, ``Q_r``, ``U_μ`` and the angles.

    ``forget[i][b]`` / ``retain[j][b]``: source i's (j's) orthonormal basis in block b (:func:`block_bases`). Within a
    block the forget sources' bases are pooled (no cut), the retain sources' bases pooled with ``tau_retain``, and the
    principal angles split off the exclusive directions. Why blocks: LoRA is bilinear (ΔW = B·A), and a flat
    [A; B] direction mixes the two factors with weights set by their scales — a principal angle between such mixtures
    says nothing about either factor. Taken per tensor, every direction lives in one factor of one layer, so the
    angle compares like with like (measured-findings §EASE "algebra checked"; issue 24 item 3). The returned bases
    are [p × ·], zero outside their block; directions of different blocks are orthogonal by construction, so the
    concatenations stay orthonormal. A single block ``[(0, p)]`` is the flat decomposition.
    """
    p = sum(n for _, n in blocks)
    u_fs, q_rs, u_mus, angles, vectors = [], [], [], [], []

    def embed(x: torch.Tensor, o: int) -> torch.Tensor:
        out = torch.zeros(p, x.shape[1], dtype=torch.float64)
        out[o : o + x.shape[0]] = x
        return out

    for b, (o, n) in enumerate(blocks):
        parts_f = [src[b] for src in forget if src[b].shape[1]]
        u_f = orthonormalize(torch.cat(parts_f, dim=1), 1.0) if parts_f else torch.zeros(n, 0, dtype=torch.float64)
        q_r = retain_support([src[b] for src in retain], tau_retain) if retain else torch.zeros(n, 0)
        if q_r.shape[0] != n:  # every retain basis was empty
            q_r = torch.zeros(n, 0, dtype=torch.float64)
        pa = principal_angles(u_f, q_r)
        keep = pa.degrees >= delta_deg - 1e-9
        u_fs.append(embed(u_f, o))
        q_rs.append(embed(q_r.to(torch.float64), o))
        u_mus.append(embed(pa.vectors[:, keep], o))
        angles.append(pa.angles)
        vectors.append(embed(pa.vectors, o))
    cat = lambda xs: torch.cat(xs, dim=1) if xs else torch.zeros(p, 0, dtype=torch.float64)  # noqa: E731
    all_angles = torch.cat(angles) if angles else torch.zeros(0, dtype=torch.float64)
    order = torch.argsort(all_angles)
    return cat(u_fs), cat(q_rs), cat(u_mus), PrincipalAngles(all_angles[order], cat(vectors)[:, order])

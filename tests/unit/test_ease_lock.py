import pytest
import torch

from app.ml.federation.lock import ForgetLock


def _lock(p: int = 30, k: int = 4, alpha: float = 7.0) -> ForgetLock:
    torch.manual_seed(0)
    basis, _ = torch.linalg.qr(torch.randn(p, k))
    return ForgetLock(basis=basis, alpha=alpha, theta_unl=torch.randn(p))


def test_penalty_gradient_matches_analytic_and_autograd():
    lock = _lock()
    theta = torch.randn(30, requires_grad=True)
    lock.penalty(theta).backward()
    analytic = lock.alpha * lock.basis @ lock.basis.T @ (theta.detach() - lock.theta_unl)
    assert torch.allclose(theta.grad, analytic, atol=1e-5)
    assert torch.allclose(lock.gradient(theta.detach()), analytic, atol=1e-5)
    # no force outside span(U_μ), no penalty at the anchor
    assert torch.allclose(
        lock.basis.T @ (theta.grad - lock.basis @ (lock.basis.T @ theta.grad)), torch.zeros(4), atol=1e-5
    )
    assert float(lock.penalty(lock.theta_unl)) == pytest.approx(0.0)


def test_server_projection_removes_locked_directions():
    lock = _lock()
    delta = torch.randn(30)
    out = lock.project(delta)
    assert torch.allclose(lock.basis.T @ out, torch.zeros(4), atol=1e-5)
    assert torch.allclose(lock.project(out), out, atol=1e-6)
    assert lock.drift(lock.theta_unl + out) == pytest.approx(0.0, abs=1e-5)


def test_bytes_round_trip():
    lock = _lock(alpha=12.5)
    data = lock.to_bytes()
    back = ForgetLock.from_bytes(data)
    assert back.alpha == 12.5 and torch.equal(back.basis, lock.basis) and torch.equal(back.theta_unl, lock.theta_unl)
    with pytest.raises(ValueError):
        ForgetLock.from_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")


def test_empty_lock_is_a_no_op():
    lock = ForgetLock(torch.zeros(10, 0), 5.0, torch.zeros(10))
    d = torch.randn(10)
    assert torch.equal(lock.project(d), d) and float(lock.penalty(d)) == 0.0


def test_merged_lock_keeps_every_locked_direction():
    from app.ml.federation.lock import merge_locks

    first = _lock(p=30, k=4, alpha=3.0)
    torch.manual_seed(1)
    second_basis, _ = torch.linalg.qr(torch.cat([first.basis[:, :1], torch.randn(30, 2)], dim=1))  # shares a direction
    second = ForgetLock(second_basis, 5.0, torch.randn(30))
    merged = merge_locks(first, second)
    # orthonormal, spanning both: 4 + 3 directions with one shared → rank 6
    assert merged.rank == 6
    assert torch.allclose(merged.basis.T @ merged.basis, torch.eye(6), atol=1e-5)
    for old in (first.basis, second.basis):
        residual = old - merged.basis @ (merged.basis.T @ old)
        assert float(residual.norm()) < 1e-4
    # the anchor is the newest unlearned model, α the stronger; the server projection now removes both locks' drift
    assert torch.equal(merged.theta_unl, second.theta_unl) and merged.alpha == 5.0
    delta = torch.randn(30)
    assert torch.allclose(first.basis.T @ merged.project(delta), torch.zeros(4), atol=1e-5)
    # merging again adds nothing; no previous lock (or another layout) leaves the new one as it is
    assert merge_locks(first, merged).rank == 6
    assert merge_locks(None, second) is second
    assert merge_locks(_lock(p=12, k=2), second) is second

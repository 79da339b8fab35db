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

"""The service bugs of issue 11 item 5, at the level of app.ml: clients removed by earlier deletions, and the lock of
an earlier deletion carried into the next."""

import numpy as np
import pytest
import torch

from app.ml.federation import trajectory
from app.ml.unlearning.base import get_method
from app.ml.unlearning.clip_objectives import data_gradient
from app.ml.unlearning.ease.method import EaseConfig, decompose
from app.ml.unlearning.ease.subspace import energy_basis

from .clip_helpers import tiny_demo

FAST = {"excision_steps": 2, "excision_batch": 8, "replay_points": 2, "max_probes": 2}


def _support(problem, k: int, space: str) -> torch.Tensor:
    """Client k's own vectors in the space GSD compares (issue 24 item 3): its stored updates in client scope or in
    class scope's ``"mixed"`` space; in the ``"gradient"`` space its CLIP-loss gradients at the replayed models."""
    if problem.scope == "client" or space == "mixed":
        return problem.client_history(k).T
    cfg = EaseConfig(**FAST)
    rounds = int(problem.n_rounds)
    thetas = trajectory(problem.theta_init, problem.full_history()[:rounds], problem.weights)
    points = np.unique(np.linspace(0, rounds - 1, cfg.replay_points).round().astype(int))
    model = problem.get_model()
    return torch.stack([data_gradient(model, thetas[t], problem.retain_data(k)) for t in points], dim=1)


def _captured(problem, support: torch.Tensor, space: str) -> float:
    """How much of a client's support (``_support``) the retain support Q_r spans (1 = all of it)."""
    cfg = EaseConfig(**FAST, tau=1.0, replay_max_pairs=None, gsd_space=space)
    q_r = decompose(problem, cfg, problem.get_model()).q_r
    b, _ = energy_basis(support, 1.0)
    return float(torch.linalg.norm(q_r.T @ b) ** 2 / b.shape[1])


@pytest.mark.parametrize(("scope", "space"), [("client", "mixed"), ("class", "mixed"), ("class", "gradient")])
def test_a_removed_client_is_out_of_the_retain_support_and_carries_no_weight(scope, space):
    demo = tiny_demo()  # 3 clients; client 0 holds the star (client scope), class holders are 1..2
    gone = 2 if scope == "client" else 0
    kept = demo.problem(scope)
    support = _support(kept, gone, space)
    assert gone in kept.retained_clients() and _captured(kept, support, space) > 0.99  # what it taught is protected
    problem = demo.problem(
        scope, removed=[gone]
    )  # the stored rows are *not* zeroed here: exclusion must not rely on it
    assert gone not in problem.retained_clients() and gone not in problem.holders()
    assert float(problem.weights[gone]) == 0.0 and len(problem.retain_data(gone)) == 0
    assert _captured(problem, support, space) < _captured(kept, support, space) - 0.05
    # the rebuilt trajectory ignores it: the same as with its stored rows zeroed (what the service's erasure does)
    zeroed = problem.full_history().clone()
    zeroed[:, gone] = 0.0
    assert torch.allclose(
        trajectory(problem.theta_init, problem.full_history(), problem.weights),
        trajectory(problem.theta_init, zeroed, problem.weights),
        atol=1e-6,
    )
    # a repair round never asks it for an update
    result = get_method("ease").build(FAST).unlearn(problem)
    assert gone in result.info["gsd"]["removed_clients_excluded"]
    repair = [s for s in result.info["stages"] if s["stage"].startswith("repair")]
    retained = problem.retained_clients()
    assert (
        repair
        and result.info["bytes_by_item"]["up"]["repair round 1: updates from clients"]
        == len(retained) * 4 * problem.theta.numel()
    )


def test_a_client_cannot_leave_twice():
    demo = tiny_demo()
    with pytest.raises(ValueError):
        demo.problem("client", removed=[0])


def test_the_next_deletion_keeps_the_previous_lock():
    from app.ml.federation.lock import ForgetLock

    demo = tiny_demo()
    first = get_method("ease").build(FAST).unlearn(demo.problem("client"))
    lock1 = ForgetLock.from_bytes(first.artifacts["forget_lock"])
    problem = demo.problem("class", theta=first.theta, removed=[0], forget_lock=lock1)
    second = get_method("ease").build(FAST).unlearn(problem)
    lock2 = ForgetLock.from_bytes(second.artifacts["forget_lock"])
    assert second.info["lock_rank_previous"] == lock1.rank and lock2.rank > lock1.rank
    residual = lock1.basis - lock2.basis @ (lock2.basis.T @ lock1.basis)
    assert float(residual.norm()) < 1e-3  # what the first deletion locked stays locked

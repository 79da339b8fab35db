"""Issue 24 item 5: an EASE deletion must lower the held-out forget pairs' R@1 by more than retraining's own
run-to-run spread — for the client-scope default (the server's excision from the stored updates) and for BKE at the
leaving client — and the same bar must reject an EASE that does nothing to the leaving client's knowledge: BKE and the
server path each with neither the GSD projection nor the excision (only the protected repair rounds). Switching off
the excision alone is not "nothing removed": the GSD projection off the leaving client's exclusive update directions
forgets too (at stop 40 the server path with only its excision off passed the bar), so both do-nothing variants switch
off both steps.

Every figure is a mean over the six federations of ``clip_helpers.client_world`` (60 held-out forget queries each):
one federation's R@1 moves by whole queries with the machine's floating-point bits, and stop 50's one-federation
version passed on the session's machine and failed on CI's (the default's drop 5.6 against a bar of 8, on another
host the server path's do-nothing 8.3 above it). Measured when written (stop 51), mean drops over seeds 0-5: the
default 15.0, BKE 20.7; the repair rounds alone 5.8 (BKE's) and 3.9 (the server path's); retraining's own drop 16.
Per federation the do-nothing variants dropped -2.5 … 14.2 and the default 8.3 … 19.2: no single federation separates
them, their mean does. Seeds 6-11, run once after the bar was set (not used to set anything): the default 12.5, BKE
13.8, the repair rounds alone -0.1 and 1.5.

The samples deletion's version of these tests is test_ease_does_something_samples.py (its own file, so that
`make test`'s two pytest-xdist workers run the two sets side by side).
"""

import dataclasses
import functools

import pytest
import torch

from app.ml.federation.accounting import Ledger
from app.ml.unlearning.base import get_method
from app.ml.unlearning.ease.method import Ease, EaseConfig, ProbeJudge
from app.ml.verification.retrieval import evaluate_retrieval

from .clip_helpers import CLIENT_WORLD_SEEDS, client_world

MIN_DROP = 10.0
"""Points the mean held-out forget R@1 must fall by at least, whatever retraining's spread: about two thirds of
retraining's own mean drop (16 points), above what the repair rounds alone remove (4-6 points on average)."""


def heldout_r1(seed: int, theta: torch.Tensor, world=client_world) -> float:
    model, problem, gallery, _ = world(seed)
    model.set_theta(theta)
    return evaluate_retrieval(model, problem.heldout_forget_data(), gallery).mean_r1


def test_probe_split_keeps_the_heldout_forget_pairs_out_of_the_control():
    _, problem, _, _ = client_world(CLIENT_WORLD_SEEDS[0])
    probe, heldout = problem.probe_data(), problem.heldout_forget_data()
    assert len(probe) + len(heldout) == len(problem.forget_data()) and len(heldout) > len(probe) > 0
    assert not set(probe.ids) & set(heldout.ids)


@functools.cache
def retraining(world=client_world) -> tuple[float, float]:
    """Means over the federations of |R@1 of retraining in one data order − in another| (the spread) and of the
    original's held-out forget R@1 − retraining's (what an exact deletion removes)."""
    gaps, drops = [], []
    for seed in CLIENT_WORLD_SEEDS:
        _, problem, _, theta = world(seed)
        retrained = []
        for order in (0, 1000):  # retraining against retraining: another data order
            settings = dataclasses.replace(problem.fed_settings, seed=order)
            run = get_method("fed_retrain").build({}).unlearn(dataclasses.replace(problem, fed_settings=settings))
            retrained.append(heldout_r1(seed, run.theta, world))
        gaps.append(abs(retrained[0] - retrained[1]))
        drops.append(heldout_r1(seed, theta, world) - retrained[0])
    return sum(gaps) / len(gaps), sum(drops) / len(drops)


def retraining_spread() -> float:
    return retraining()[0]


def drop(settings: dict, world=client_world) -> float:
    """Mean over the federations of the original's held-out forget R@1 − the EASE deletion's."""
    drops = []
    for seed in CLIENT_WORLD_SEEDS:
        _, problem, _, theta = world(seed)
        unlearned = get_method("ease").build(settings).unlearn(problem).theta
        drops.append(heldout_r1(seed, theta, world) - heldout_r1(seed, unlearned, world))
    return sum(drops) / len(drops)


@pytest.mark.parametrize("settings", [{}, {"client_excision": "bke"}], ids=["default", "bke"])
def test_an_ease_deletion_lowers_the_heldout_forget_r1_by_more_than_retrainings_spread(settings):
    assert drop(settings) > max(retraining_spread(), MIN_DROP)


@pytest.mark.parametrize(
    "settings",
    [{"client_excision": "bke", "excision_steps": 0, "gsd": "none"}, {"gsd": "none", "offline_scale": 0.0}],
    ids=["bke-nothing-removed", "server-path-nothing-removed"],
)
def test_the_bar_rejects_an_ease_that_removes_nothing(settings):
    """The test above can fail: an EASE that removes nothing of the leaving client's knowledge stays under the bar."""
    assert drop(settings) <= max(retraining_spread(), MIN_DROP)


def test_the_probe_response_falls_with_the_scale():
    """Along the excision line θ_p + s·E + Δ_rep the forget R@1 falls: the monotone knob the search turns.

    On the client worlds, not on the tiny demo of test_ease_strength (its forget R@1 sits at chance, where nothing can
    fall), as the mean over the six federations: one federation's 40-pair probe moves by whole queries with the
    machine's bits (measured when written: single federations rose by one or two queries between neighbouring scales,
    the mean fell at every step). Its module's worlds stay in one process under `make test`'s pytest-xdist."""
    bke = {"excision_steps": 3, "excision_batch": 8, "excision_lr": 0.05, "excision_objective": "uce"}
    ease = Ease(EaseConfig(**bke, client_excision="bke"))
    scales = (0.0, 4.0, 16.0, 64.0)
    per_world = []
    for seed in CLIENT_WORLD_SEEDS:
        model, problem, _, _ = client_world(seed)
        line = ease.line(problem, Ledger())
        assert float(line.excision.norm()) > 0
        # the repair round's update is orthogonal to the locked excision direction
        unit = line.excision / line.excision.norm()
        assert abs(float(unit @ line.repair)) < 1e-4 * max(float(line.repair.norm()), 1e-12) + 1e-6
        judge = ProbeJudge(problem, model, Ledger())
        per_world.append([judge.level(line.at(s)) for s in scales])
    levels = [sum(column) / len(column) for column in zip(*per_world, strict=True)]
    assert all(a > b for a, b in zip(levels, levels[1:], strict=False)), (levels, per_world)
    assert levels[-1] < levels[0] / 2, levels

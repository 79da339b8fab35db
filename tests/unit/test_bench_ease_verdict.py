"""bench.ease --verdict: every row is judged by the service's own verdict (clip_verdict.federated_verdict), and the
cost of a deletion as ``auto`` runs it counts the verifier's replay and a failed verdict's escalation to retraining."""

import numpy as np
import pytest

from app.ml.unlearning.base import UnlearningResult, get_method
from app.ml.verification.clip_evidence import split_reference
from app.ml.verification.clip_shadows import ClipShadowSettings
from bench import ease as bench

from .clip_helpers import tiny_demo


def near(x: float):
    return pytest.approx(x, abs=1e-4)  # the ratios are stored to 4 decimals


def _rows(retrain_replayed: bool, ease_pass: bool, from_reference: bool = False) -> dict:
    def row(x: float, verdict: str | None, exact: bool = False, replayed: bool = False) -> dict:
        out = {"bytes": 100.0 * x, "cpu_seconds": 10.0 * x, "critical_seconds": 5.0 * x, "client_round_trips": 20 * x}
        out["pair_grads"] = 1000 * x
        out["exact"] = exact
        if verdict is not None:
            out["verdict"] = {"verdict": verdict, "replayed": replayed, "replay_from_reference": from_reference}
        return out

    return {
        "retrain": row(1.0, "pass", exact=True, replayed=retrain_replayed),
        "ease": row(0.1, "pass" if ease_pass else "fail"),
        "unjudged": row(0.2, None),
    }


def test_a_failed_verdict_pays_for_the_retraining_it_escalates_to():
    plan = {"n_shadows": 4, "trained": 2, "data_fraction": 0.5}
    rows = _rows(retrain_replayed=True, ease_pass=False)
    bench.add_costs(rows, plan, 20)
    # verified retraining: retrain, its replay (the excess did not decide) and 2 shadows at retrain's bytes
    assert rows["ease"]["bytes_ratio_with_escalation"] == near((10 + 200 + 200) / (200 + 200))
    assert rows["ease"]["time_ratio_with_escalation"] == near((1 + 20 + 10) / (20 + 10))
    assert rows["ease"]["client_round_trips_with_escalation"] == 2 + 20 + 40
    assert rows["ease"]["certified"] is False
    assert rows["retrain"]["bytes_ratio_with_escalation"] == near(1.0) and rows["retrain"]["certified"]
    assert "bytes_ratio_with_escalation" not in rows["unjudged"]  # no verdict measured: no escalated cost
    # the "with verification" figure keeps its meaning: the method's verdict assumed to certify, no replay
    assert rows["ease"]["bytes_ratio_with_verification"] == near((10 + 200) / (100 + 200))


def test_a_replay_that_is_the_references_recipe_run_costs_no_retraining():
    """Since stop 47 the replay is the reference's run 0 (clip_shadows.reference_replay): a verified retraining is the
    retraining and its reference, and a failed verdict's escalation adds the retraining alone."""
    rows = _rows(retrain_replayed=True, ease_pass=False, from_reference=True)
    bench.add_costs(rows, {"n_shadows": 4, "trained": 2, "data_fraction": 0.5}, 20)
    assert rows["ease"]["bytes_ratio_with_escalation"] == near((10 + 200 + 100) / (100 + 200))
    assert rows["ease"]["client_round_trips_with_escalation"] == 2 + 20 + 20
    assert rows["retrain"]["bytes_ratio_with_escalation"] == near(1.0)


def test_a_verified_retraining_is_its_reference_when_the_service_publishes_run_0():
    """Stop 48 (app/jobs/federated.py _verifiers_run): an exact deletion's θ′ is the reference's run 0, so a verified
    retraining pays the reference's runs alone; an approximate row pays its method on top, escalated or not (the
    escalation publishes the same run). Plans of older code keep their rules (the tests above)."""
    plan = bench.verification_plan(2)  # two runs of the recipe on everything that remains
    assert bench.publishes_run_0(plan) and not bench.publishes_run_0({**plan, "data_fraction": 0.5})
    rows = _rows(retrain_replayed=True, ease_pass=False, from_reference=True)
    rows["retrain_other_order"] = {**rows["retrain"], "verdict": {"verdict": "pass", "replayed": False}}
    bench.add_costs(rows, plan, 20)
    assert rows["retrain"]["bytes_ratio_with_verification"] == near(1.0)
    # exact retraining in another data order is no run of the reference: it pays its own run on top
    assert rows["retrain_other_order"]["bytes_ratio_with_verification"] == near((100 + 200) / 200)
    assert rows["retrain_other_order"]["bytes_ratio_with_escalation"] == near((100 + 200) / 200)
    assert rows["retrain"]["bytes_ratio_with_escalation"] == near(1.0)
    assert rows["retrain"]["client_round_trips_with_verification"] == 20  # run 0's rounds are the reference's
    assert rows["ease"]["bytes_ratio_with_verification"] == near((10 + 200) / 200)
    assert rows["ease"]["bytes_ratio_with_verification_batch"] == near((100 + 200) / 200)
    assert rows["ease"]["time_ratio_with_escalation"] == near((1 + 20) / 20)
    assert rows["ease"]["bytes_ratio_with_escalation"] == near((10 + 200) / 200) and not rows["ease"]["certified"]
    assert rows["ease"]["client_round_trips_with_escalation"] == 2 + 20


def test_a_certified_row_pays_only_its_verification():
    rows = _rows(retrain_replayed=False, ease_pass=True)
    bench.add_costs(rows, {"n_shadows": 4, "trained": 2, "data_fraction": 0.5}, 20)
    assert rows["ease"]["bytes_ratio_with_escalation"] == near((10 + 200) / (100 + 200))
    assert rows["ease"]["client_round_trips_with_escalation"] == 2 + 20
    assert rows["ease"]["certified"] is True


def test_the_means_count_the_seeds_the_verdict_certified():
    per_seed = {}
    for seed, ok in ((2, True), (3, False), (4, False)):
        rows = _rows(retrain_replayed=False, ease_pass=ok)
        rows["retrain"] |= {"forget_r1": 40.0, "retain_r1": 80.0}
        rows["ease"] |= {"forget_r1": 42.0, "retain_r1": 79.0}
        bench.add_costs(rows, {"n_shadows": 4, "trained": 2, "data_fraction": 0.5}, 20)
        per_seed[seed] = {"methods": {k: v for k, v in rows.items() if k != "unjudged"}}
    means = bench.method_means(per_seed)["ease"]
    assert means["certified_seeds"] == 1 and means["verdict_seeds"] == 3
    assert means["bytes_ratio_with_escalation"] == near(((10 + 200) + 2 * (10 + 200 + 100)) / 3 / 300)


def test_the_verdict_of_a_row_is_the_services(monkeypatch, tmp_path):
    """On a tiny federation: retraining is certified (its excess does not decide there, so the verifier replays the
    recipe); the original model handed back as θ′ — doing nothing — is not."""
    demo = tiny_demo()
    problem, _ = bench.scenario_problem(demo, "client")
    monkeypatch.setattr(bench, "SHADOWS", ClipShadowSettings(n_shadows=4))
    shadows = bench.shadows_for(demo, str(tmp_path), log=lambda *_: None)
    assert len(list((tmp_path / "shadows").glob("*.bin"))) == 1

    def no_training(*args, **kwargs):
        raise AssertionError("the cached shadows were trained again")

    monkeypatch.setattr(bench, "train_clip_shadows", no_training)  # cached by the federation's bits
    assert bench.shadows_for(demo, str(tmp_path)).thetas.equal(shadows.thetas)
    nonmembers = split_reference(demo.data.test)[1]
    model = problem.get_model()
    before = bench.deletion_retrieval(model, problem, problem.theta)
    retrained = get_method("fed_retrain").build({}).unlearn(problem)
    ok = bench.verdict_of(problem, model, shadows, nonmembers, retrained, True, before)
    assert ok["verdict"] == "pass" and ok["replayed"] and not ok["failed"]
    nothing = UnlearningResult(theta=problem.theta.clone(), info={})
    bad = bench.verdict_of(problem, model, shadows, nonmembers, nothing, False, before)
    assert bad["verdict"] == "fail" and "parameters_changed" in bad["failed"]
    assert bad["audited"].startswith("all")  # no probes ran: every forget pair is audited


def test_the_bench_judges_against_the_shadows_without_the_pairs_as_the_worker_does(monkeypatch, tmp_path):
    """bench.ease.reference_for: the deletion's reference set (clip_shadows.shadows_without), whose pool holds none of
    the forget pairs, cached by the federation's bits and the pairs; retraining is certified against it."""
    demo = tiny_demo()
    problem, _ = bench.scenario_problem(demo, "client")
    monkeypatch.setattr(bench, "SHADOWS", ClipShadowSettings(n_shadows=4))
    shadows = bench.pool_for(demo)  # the registration's pool, as the service stores it: no run trained
    assert shadows.n_shadows == 0
    reference = bench.reference_for(demo, problem, shadows, str(tmp_path), log=lambda *_: None)
    positions = np.flatnonzero(np.concatenate(problem.forget_masks)).tolist()
    assert positions and not set(positions) & set(reference.row_ids.tolist())
    assert set(reference.row_ids.tolist()) == set(shadows.row_ids.tolist()) - set(positions)

    def no_training(*args, **kwargs):
        raise AssertionError("the cached reference was trained again")

    monkeypatch.setattr(bench, "shadows_without", no_training)
    assert bench.reference_for(demo, problem, shadows, str(tmp_path)).thetas.equal(reference.thetas)
    nonmembers = split_reference(demo.data.test)[1]
    model = problem.get_model()
    before = bench.deletion_retrieval(model, problem, problem.theta)
    retrained = get_method("fed_retrain").build({}).unlearn(problem)
    ok = bench.verdict_of(problem, model, reference, nonmembers, retrained, True, before)
    assert ok["verdict"] == "pass" and not ok["failed"]
    assert ok["replay_from_reference"]  # the reference's run 0 is the recipe: no second retraining

"""Membership audit of federated CLIP deletions (issue 9 item 2): shadow LoRA runs and offline LiRA over a fixed
caption gallery (app/ml/verification/clip_shadows.py), on the tiny CLIP.

Two models: the barely-pretrained test CLIP (clip_helpers) for the bookkeeping (membership, storage, replacement after
erasure: cheap), and a CLIP pretrained a little longer whose LoRA memorises a small membership federation (each
caption carries a nuisance word its image does not show), for the attack's power: its memorised pairs are flagged
clearly above chance, and a model that never saw them is at chance within the verdict's margin.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from app.ml.data.captions import make_membership_federation
from app.ml.federation import Federation, FedSettings
from app.ml.unlearning.base import get_method
from app.ml.verification.clip_evidence import replay_of
from app.ml.verification.clip_shadows import (
    REFERENCE_SEED_STRIDE,
    REPLAY_SOURCES,
    ClipShadowSettings,
    audit_clip_deletion,
    clip_shadows_from_bytes,
    clip_shadows_to_bytes,
    reference_replay,
    shadow_pool,
    shadows_without,
    train_clip_shadows,
)
from app.ml.verification.plots import plot_data
from app.ml.verification.policy import decide
from app.reports.plots import render
from bench.ease import verification_plan

from .clip_helpers import MEMO_HELDOUT, MEMO_PAIRS, memorising_world, tiny_demo, tiny_model

CHEAP = FedSettings(rounds=1, batch_size=8, lr=3e-3)


def _cheap_world():
    data = make_membership_federation(0, n_clients=2, pairs_per_client=12, n_test=4, n_heldout=12)
    return tiny_model(), data


def test_shadow_runs_leave_every_pair_out_of_half_of_them_and_round_trip():
    model, data = _cheap_world()
    shadows = train_clip_shadows(model, model.theta_init, data.clients, CHEAP, ClipShadowSettings(n_shadows=4))
    assert shadows.thetas.shape == (4, model.num_params) and shadows.client_sizes == [12, 12]
    assert ((~shadows.in_mask).sum(axis=0) == 2).all()  # balanced: every pair OUT of exactly two runs
    assert all(not torch.equal(shadows.thetas[0], t) for t in shadows.thetas[1:])  # different subsets, different θ
    back = clip_shadows_from_bytes(clip_shadows_to_bytes(shadows))
    assert torch.equal(back.thetas, shadows.thetas) and (back.in_mask == shadows.in_mask).all()
    assert back.settings == shadows.settings and back.fed_settings == shadows.fed_settings
    with pytest.raises(ValueError):
        ClipShadowSettings(n_shadows=3)  # one OUT run per pair cannot fit a Gaussian


def test_the_audit_reference_is_the_recipe_retrained_without_the_deletions_pairs():
    """clip_shadows.shadows_without: as many runs as the model has shadows, each the recipe on every remaining pair
    with its own data order — exact retraining is one more draw of the same process — so every forget pair is OUT of
    every run and every remaining pair IN, where the registration set has each pair IN half of the runs. Against it
    the audit carries the runs' own leave-one-out draws of the forget excess (the verdict's null); a pool holding
    some forget pairs and not others is neither set, and refused."""
    model, data = _cheap_world()
    shadows = train_clip_shadows(model, model.theta_init, data.clients, CHEAP, ClipShadowSettings(n_shadows=4))
    original = Federation(model, data.clients, CHEAP).train(model.theta_init, record_history=False).theta
    erased = [0, 1, 2, 3, 4, 5]  # half of client 0
    reference, counts = shadows_without(shadows, erased, model, model.theta_init, data.clients)
    assert counts["trained"] == 4 and counts["kept"] == 0 and reference.generation == 1
    assert counts["trained"] == verification_plan(4)["trained"]  # bench.ease prices what the service trains
    assert not set(erased) & set(reference.row_ids.tolist()) and reference.client_sizes == [6, 12]
    assert reference.in_mask.all() and reference.in_mask.shape == (4, 18)
    remaining = [data.clients[0].subset(range(6, 12)), data.clients[1]]
    for j in (0, 3):  # run j: the recipe on what remains with data-order seed + j·stride, nothing else
        order = dataclasses.replace(CHEAP, seed=CHEAP.seed + REFERENCE_SEED_STRIDE * j)
        rerun = Federation(model, remaining, order).train(model.theta_init, record_history=False).theta
        assert torch.equal(reference.thetas[j], rerun)
    assert all(not torch.equal(reference.thetas[0], t) for t in reference.thetas[1:])  # other data orders
    # run 0 is the recipe itself, in its own data order: exact retraining on what remains, bit for bit
    exact = Federation(model, remaining, CHEAP).train(model.theta_init, record_history=False).theta
    assert torch.equal(reference.thetas[0], exact) and counts["recipe_run"] == 0
    forget = data.clients[0].subset(erased)
    args = (model, forget, erased, data.heldout, original, original.clone())
    report, against_reference = audit_clip_deletion(reference, *args)
    registration_report, at_registration = audit_clip_deletion(shadows, *args)
    # the attack counts the pairs net of the shift the runs allow (clip_evidence.net_of_group_shift): not raw
    shift = report["attack"]["group_shift"]["unlearned"]
    assert 0 <= shift["removed"] <= shift["allowance"] and "group_shift" not in registration_report["attack"]
    k = len(erased)
    assert (against_reference.fit.n_in[:k] == 0).all() and (against_reference.fit.n_out[:k] == 4).all()
    assert (at_registration.fit.n_in[:k] == 2).all() and (at_registration.fit.n_out[:k] == 2).all()
    assert against_reference.null_excess is not None and len(against_reference.null_excess) == 4
    # each population its own run-to-run σ (clip_evidence.forget_groups): one for the forget pairs, one for the others
    sigma = against_reference.fit.std_out
    assert np.unique(sigma[:k]).size == 1 and np.unique(sigma[k:]).size == 1 and sigma[0] != sigma[-1]
    assert at_registration.null_excess is None  # random halves: no run is a draw of "never saw the set"
    with pytest.raises(ValueError, match="some forget pairs and not others"):
        audit_clip_deletion(reference, model, data.clients[0].subset([5, 6]), [5, 6], data.heldout, original, original)


def test_registration_stores_the_pool_untrained_and_a_deletions_reference_is_the_same_as_from_trained_runs():
    """clip_shadows.shadow_pool (stop 48): what a model stores at registration — the pool's positions, the settings and
    the recipe, no run trained. A deletion's reference drawn from it is the one drawn from trained registration runs,
    bit for bit (shadows_without reads no registration run), and the pool itself cannot be audited against."""
    model, data = _cheap_world()
    settings = ClipShadowSettings(n_shadows=4)
    pool = clip_shadows_from_bytes(clip_shadows_to_bytes(shadow_pool(data.clients, CHEAP, settings)))
    assert pool.n_shadows == 0 and pool.generation == 0 and pool.client_sizes == [12, 12]
    assert pool.row_ids.tolist() == list(range(24)) and pool.settings == settings
    erased = [0, 1, 2, 3, 4, 5]
    from_pool, counts = shadows_without(pool, erased, model, model.theta_init, data.clients)
    trained = train_clip_shadows(model, model.theta_init, data.clients, CHEAP, settings)
    from_trained, _ = shadows_without(trained, erased, model, model.theta_init, data.clients)
    assert counts["trained"] == 4 and counts["dropped"] == 0 and counts["saw_erased_pairs"] == 0
    assert torch.equal(from_pool.thetas, from_trained.thetas) and (from_pool.in_mask == from_trained.in_mask).all()
    assert (from_pool.row_ids == from_trained.row_ids).all() and from_pool.generation == from_trained.generation == 1
    forget = data.clients[0].subset(erased)
    with pytest.raises(ValueError, match="trained runs"):
        audit_clip_deletion(pool, model, forget, erased, data.heldout, model.theta_init, model.theta_init)


@pytest.mark.parametrize("scope", ["client", "class"])
def test_an_exact_methods_replay_is_the_references_recipe_run_where_the_schedule_is_the_models(scope):
    """clip_shadows.reference_replay: run 0 of the deletion's reference is exact retraining (fed_retrain on the same
    problem gives the same bits), so the verifier replays nothing more; a model whose schedule is not the reference's
    (trained on for more rounds) and the registration set (random halves) get the recipe run again."""
    demo = tiny_demo()
    problem = demo.problem(scope)
    shadows = train_clip_shadows(
        demo.model, demo.theta_init, demo.data.clients, demo.fed_settings, ClipShadowSettings(n_shadows=4)
    )
    positions = np.flatnonzero(np.concatenate(problem.forget_masks)).tolist()
    reference, _ = shadows_without(shadows, positions, demo.model, demo.theta_init, demo.data.clients)
    retrained = get_method("fed_retrain").build({}).unlearn(problem).theta
    replay, source = reference_replay(reference, problem)
    assert source == REPLAY_SOURCES[True] and torch.equal(replay(), retrained)
    longer = dataclasses.replace(problem, n_rounds=int(problem.n_rounds) + 1)
    for ref, prob in ((reference, longer), (shadows, problem)):
        replay, source = reference_replay(ref, prob)
        assert source == REPLAY_SOURCES[False]
        assert torch.equal(replay(), replay_of(prob)())


def test_memorised_pairs_are_flagged_above_chance_and_a_model_that_never_saw_them_is_not():
    model, data, shadows, original, retrained = memorising_world()
    forget, positions = data.clients[0], np.arange(MEMO_PAIRS)
    report, scores = audit_clip_deletion(
        shadows, model, forget, positions, data.heldout, original, retrained, theta_retrained=retrained
    )
    assert report["attack"]["mode"] == "offline" and report["attack"]["variance"] == "global"
    assert report["attack"]["min_out_shadows"] == 2 and report["gallery_size"] == MEMO_PAIRS + MEMO_HELDOUT
    margin = report["chance"]
    orig, retrained_lira = report["models"]["original"]["lira"], report["models"]["unlearned"]["lira"]
    # the audit's power as an ordering: the original's training pairs score above the retrained model's
    assert orig["auc"] > retrained_lira["auc"] and retrained_lira["auc"] < 0.65, (orig["auc"], retrained_lira["auc"])
    informative = orig["detected_at_fpr"]["0.01"] > margin["max_detected"]
    assert report["informative"] is informative
    verdict = decide(report, exact=True)
    attack = next(c for c in verdict["checks"] if c["name"] == "forget_attack")
    same, _ = audit_clip_deletion(shadows, model, forget, positions, data.heldout, original, original.clone())
    failed = {c["name"] for c in decide(same)["checks"] if c["passed"] is False}
    if informative:
        # exact retraining without the pairs: at chance within the margin, so the attack check passes
        assert attack["passed"] is True, attack["message"]
        assert retrained_lira["detected_at_fpr"]["0.01"] <= margin["max_detected"]
        # doing nothing fails: the memorised pairs are still flagged, and the parameters did not change
        assert failed == {"forget_attack", "parameters_changed"}
    else:  # no power at 1 % FPR on this backbone: the attack check carries no evidence either way
        assert attack["passed"] is None and "uninformative" in attack["message"]
        # and with no informative evidence at all, doing nothing cannot pass (policy.decide's rule)
        assert failed == {"parameters_changed", "informative_evidence"}
    plots = {name: render(name, data) for name, data in plot_data(scores).items()}
    assert set(plots) == {"roc.png", "phi_hist.png"} and all(p[:4] == b"\x89PNG" for p in plots.values())


def test_an_uninformative_audit_is_not_a_pass_of_the_attack_check():
    """A model that never memorised anything (the barely-pretrained CLIP, one round): nothing to detect even before
    unlearning, so the report says uninformative and the attack check is not counted (policy.decide's rule)."""
    model, data = _cheap_world()
    shadows = train_clip_shadows(model, model.theta_init, data.clients, CHEAP, ClipShadowSettings(n_shadows=4))
    original = Federation(model, data.clients, CHEAP).train(model.theta_init, record_history=False).theta
    report, _ = audit_clip_deletion(
        shadows, model, data.clients[0], np.arange(12), data.heldout, original, model.theta_init
    )
    assert report["informative"] is False, report["informative_detail"]
    attack = next(c for c in decide(report)["checks"] if c["name"] == "forget_attack")
    assert attack["passed"] is None and "uninformative" in attack["message"]


def test_auto_goes_exact_where_the_federated_verdict_trains_the_exact_deletion_anyway():
    """federated.Deletion.exact_in_verification (stop 48): a model with the audit's pool whose reference is trained to
    its own round count (federated._reference_rounds: the model's, past its recipe's too, unless the shadow settings fix
    one), and fed_retrain without rounds of its own — the reference's run 0 is exact retraining, so ``auto`` runs
    fed_retrain (which publishes that run) from the start; not without a pool, not when the settings fix the
    reference's rounds at another count, not when fed_retrain has rounds of its own (its run would not be the
    reference's)."""
    from types import SimpleNamespace

    from app.jobs.federated import Deletion

    def work(rounds: int, pool: bool = True, own_rounds: int | None = None, shadow_rounds: int | None = None):
        spec = {"fed_settings": {"rounds": 3}, "verification": {"shadows": {"n_shadows": 4, "rounds": shadow_rounds}}}
        if own_rounds is not None:
            spec["method_settings"] = {"fed_retrain": {"rounds": own_rounds}}
        state = {"rounds": ["r"] * rounds, "verification": {"shadows": "digest", "n_shadows": 4} if pool else {}}
        return SimpleNamespace(model=SimpleNamespace(spec=spec, state=state))

    wing = Deletion()
    reason = wing.exact_in_verification(work(3))
    assert reason is not None and "run 0 is exact retraining" in reason and "4 runs" in reason
    assert wing.exact_in_verification(work(3, own_rounds=3)) is not None
    assert wing.exact_in_verification(work(3, pool=False)) is None
    assert wing.exact_in_verification(work(4)) is not None  # past its recipe: the reference follows the model
    assert wing.exact_in_verification(work(4, shadow_rounds=3)) is None  # a fixed length: no run 0 to publish
    assert wing.exact_in_verification(work(3, own_rounds=5)) is None

"""The verdict on one federated CLIP deletion, as one pure function (the worker and bench.ease both call it).

The worker (app/jobs/federated.py) loads the shadows, the data and the request and stores what this returns; the
benchmark judges every method's θ′ with the very same steps, so that its certification rate and its cost with
``auto``'s escalation (a failed verdict retrains) are the service's, not a re-implementation's. The steps: the
retrieval figures before and after (:func:`deletion_retrieval`), the pairs the audit scores
(:func:`audited_positions`: those a method's strength control never measured), the offline LiRA audit
(clip_shadows.audit_clip_deletion, against the shadows without the deletion's pairs), its evidence
(clip_evidence.clip_evidence: the forget excess and, for a class, the forget pairs' retrieval against version 1's),
the retain R@1 drop (:func:`retain_check`), the retain R@1 against the reference's runs
(:func:`reference_retain_check`) and the policy's decision (policy.decide).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from app.ml.clip import ClipLoRA
from app.ml.data.captions import CaptionDataset
from app.ml.federation import FederatedProblem
from app.ml.federation.problem import MIN_PROBE_SPLIT
from app.ml.verification.audit import AuditScores
from app.ml.verification.clip_evidence import CONCEPT_SCOPES, clip_evidence, null_spread
from app.ml.verification.clip_shadows import ClipShadowSet, audit_clip_deletion, recipe_run
from app.ml.verification.policy import VerdictPolicy, decide
from app.ml.verification.retrieval import RetrievalScores, evaluate_retrieval

EVAL_RETAIN_PAIRS = 500
"""Retained pairs (a fixed random sample) on which a deletion's before/after retain R@1 is measured."""
EVAL_SAMPLE_SEED = 0
MIN_REFERENCE_RUNS = 3
"""Fewer retrainings on what remains are no utility reference: no spread to judge against."""


class AuditUnavailable(ValueError):
    """The shadow audit cannot run on this deletion (e.g. a pair outside the shadow pool): the worker says so and
    judges without shadows; any other error of the verdict fails the job."""


def retained_sample(problem: FederatedProblem) -> CaptionDataset:
    """The fixed sample of retained pairs on which every retain R@1 of a deletion is measured (θ, θ′, the reference's
    runs alike)."""
    retain = CaptionDataset.concat([problem.retain_data(k) for k in problem.retained_clients()])
    return retain.subset(np.random.default_rng(EVAL_SAMPLE_SEED).permutation(len(retain))[:EVAL_RETAIN_PAIRS])


def deletion_retrieval(clip: ClipLoRA, problem: FederatedProblem, theta: torch.Tensor) -> dict[str, float]:
    """Forget / retain / test R@1 of θ as a deletion's report shows them: every forget pair against the methods'
    gallery (``problem.gallery``: the verdict's reference is the other half), a fixed sample of the retained pairs,
    and the gallery's own pairs. The retain figure is what :func:`retain_check` judges."""
    test = problem.gallery
    sets = {"forget": problem.forget_data(), "retain": retained_sample(problem), "test": test}
    clip.set_theta(theta)
    out = {}
    for name, subset in sets.items():
        if subset is not None and len(subset):
            scores = evaluate_retrieval(clip, subset, test if name == "forget" else None)
            out[f"{name}_r1"] = round(scores.mean_r1, 3)
    return out


def audited_positions(
    problem: FederatedProblem, ids: Sequence[str], positions: Sequence[int], probed: bool
) -> tuple[list[int], str]:
    """The forget pairs the verdict scores (``positions`` index the data set whose pair ids are ``ids``): all of
    them, unless the method measured itself on the probe split (EASE's strength probes), then only the others — a
    verdict on pairs its control never saw (issue 24 item 1)."""
    positions = sorted(int(p) for p in positions)
    if not probed:
        return positions, f"all {len(positions)} forget pairs (the method measured none of them)"
    if problem.probe_masks is None:
        return positions, (
            f"all {len(positions)} forget pairs, which the method's strength control also measured (fewer than "
            f"{MIN_PROBE_SPLIT}: no probe split)"
        )
    probe = set(problem.probe_data().ids)
    held = [p for p in positions if ids[p] not in probe]
    return held, f"{len(held)} of {len(positions)} forget pairs: those the method's strength control never measured"


def probed(method_info: dict[str, Any]) -> bool:
    """Whether a method's run measured forget pairs (EASE's strength search records its probes)."""
    return bool(method_info.get("strength", {}).get("probes"))


def retain_check(
    before: dict[str, float],
    after: dict[str, float],
    policy: VerdictPolicy,
    exact: bool = False,
    reference_levels: Sequence[float] | None = None,
) -> dict[str, Any]:
    """The federated utility check (the model's ``max_retain_r1_drop_points``); exact retraining is the reference, so
    its drop is reported, not judged (as the tabular policy treats its test accuracy).

    The drop is measured from min(the original's retain R@1, the reference runs' mean) where the deletion has a
    reference of retrainings on what remains (:func:`reference_retain_levels`), else from the original's. Why
    (stop 51): exact retraining itself loses up to 5.4 points of the original's retained R@1 on bench.verify's
    most-exposed 50-pair sets (median 3.2), so a limit read against the original failed retraining in another data
    order on 4 of 40 such trials — the limit charged a method for what the deletion costs when done exactly. The
    operator's limit now bounds what a method loses *beyond* that."""
    original = before.get("retain_r1", 0.0)
    usable = reference_levels is not None and len(reference_levels) >= MIN_REFERENCE_RUNS
    exact_level = float(np.mean(reference_levels)) if usable else None
    baseline = original if exact_level is None else min(float(original), exact_level)
    drop = baseline - after.get("retain_r1", 0.0)
    limit = policy.max_retain_r1_drop_points
    source = (
        f"the original's {original}"
        if exact_level is None
        else f"min(the original's {original}, the exact deletion's {exact_level:.2f}: the reference runs' mean)"
    )
    return {
        "name": "retain_r1_drop",
        "figure": round(drop, 3),
        "threshold": limit,
        "passed": None if exact else drop <= limit,
        "baseline": round(float(baseline), 3),
        "message": f"retain R@1 {after.get('retain_r1')}: {drop:.2f} points below {source}, max {limit}"
        + (" [exact retraining is the reference: its utility is reported, not judged]" if exact else ""),
    }


def reference_retain_levels(
    clip: ClipLoRA, problem: FederatedProblem, reference: ClipShadowSet
) -> tuple[list[float] | None, int]:
    """(retain R@1 of each run of a deletion's reference, the number of retained queries) on
    :func:`retained_sample` — where the runs are the recipe retrained on everything that remains
    (clip_shadows.shadows_without: every pool pair IN, at least three runs), else None (registration runs on random
    halves are no utility reference: each saw half the pairs)."""
    sample = retained_sample(problem)
    if reference.generation < 1 or not reference.in_mask.all() or reference.n_shadows < MIN_REFERENCE_RUNS:
        return None, len(sample)
    levels = []
    for theta in reference.thetas:
        clip.set_theta(theta)
        levels.append(round(evaluate_retrieval(clip, sample).mean_r1, 3))
    return levels, len(sample)


def reference_retain_check(
    levels: Sequence[float] | None,
    before: dict[str, float],
    after: dict[str, float],
    exact: bool = False,
    n_queries: int = EVAL_RETAIN_PAIRS,
) -> dict[str, Any]:
    """θ′'s retain R@1 against the deletion's reference runs — retraining itself, in as many data orders.

    Why (stop 50): :func:`retain_check` then measured the drop against the *original* with the policy's fixed
    allowance (5 points), so an approximate method could trade retained utility for forgetting well beyond anything
    retraining does and still be certified (bench.verify's panel, stop 49: gradient ascent passed on two most-exposed
    sets 6.6 and 2.8 points below the exact deletion, where retraining in another data order stayed within −2.0 …
    +1.8 of it on all 60 trials). The reference measures what a deletion costs the retained pairs when done exactly,
    and how much that varies from one data order to the next.
    Figure: D′ = min(the original's retain R@1, the runs' mean) − θ′'s: the utility θ′ lost that neither the model
    had nor retraining would (retraining freed of a class often retrieves the retained pairs *better* than the
    original — bench.ease class, 2.09 points on average —; a method is not failed for keeping the original's level).
    Null: each run against the mean of the others (leave one out, as clip_evidence.null_excess does for the forget
    excess), s their root mean square, t the Student quantile at Z_NULL's confidence (clip_evidence.null_spread) — no
    constant set on any benchmark. Pass iff D′ ≤ max(t·s, one query's worth: 50 / n_queries points); one-sided. The
    leave-one-out draw compares a run with n − 1 others, θ′ with n: the allowance is, if anything, generous. Exact
    methods: reported, not judged (the reference *is* theirs)."""
    name = "retain_r1_vs_reference"
    after_r1 = after.get("retain_r1")
    if levels is None or len(levels) < MIN_REFERENCE_RUNS or after_r1 is None:
        return {
            "name": name,
            "figure": None,
            "threshold": None,
            "passed": None,
            "message": "retain R@1 against the reference: not judged (no reference of at least three retrainings on "
            "what remains)",
        }
    runs = np.asarray(levels, dtype=np.float64)
    n = len(runs)
    draws = np.array([runs[np.arange(n) != j].mean() - runs[j] for j in range(n)])
    spread, quantile = null_spread(draws)
    allowance = max(quantile * spread, 50.0 / max(int(n_queries), 1))
    original = before.get("retain_r1")
    baseline = float(runs.mean()) if original is None else min(float(original), float(runs.mean()))
    figure = baseline - float(after_r1)
    return {
        "name": name,
        "figure": round(figure, 3),
        "threshold": round(allowance, 3),
        "passed": None if exact else figure <= allowance,
        "reference_levels": [float(v) for v in levels],
        "message": f"retain R@1 {after_r1}: {figure:.2f} points below min(the original's {original}, the reference "
        f"runs' mean {runs.mean():.2f} of {[float(v) for v in levels]}), allowance {allowance:.2f} (t {quantile:.2f} "
        f"× retraining's own spread {spread:.2f})"
        + (" [exact retraining is the reference: reported, not judged]" if exact else ""),
    }


def retrieval_of(
    clip: ClipLoRA, theta: torch.Tensor, pairs: CaptionDataset, distractors: CaptionDataset
) -> RetrievalScores:
    """R@1 of ``pairs`` under θ, ranked against themselves and ``distractors``."""
    clip.set_theta(theta)
    return evaluate_retrieval(clip, pairs, distractors)


def federated_verdict(
    shadows: ClipShadowSet,
    clip: ClipLoRA,
    problem: FederatedProblem,
    forget: CaptionDataset,
    positions: Sequence[int],
    nonmembers: CaptionDataset,
    theta_new: torch.Tensor,
    *,
    exact: bool,
    scope: str,
    policy: VerdictPolicy,
    before: dict[str, float],
    after: dict[str, float],
    replay: Callable[[], torch.Tensor] | None,
) -> tuple[dict[str, Any], dict[str, Any], AuditScores]:
    """(report, verdict, scores) of one deletion: offline LiRA with the ``shadows`` on the audited ``forget`` pairs
    (at data-set ``positions``) against the verifier's ``nonmembers``, for the parent ``problem.theta`` and θ′ — the
    service passes the deletion's reference set (clip_shadows.shadows_without: no run saw a forget pair, so a model
    that never saw them scores them at the shadows' level whatever group they form); the
    evidence of clip_evidence.py (the forget excess; for a class, the forget pairs' retrieval against version 1's;
    for an exact method whose excess does not decide, ``replay`` — always where the reference's run 0 is the recipe
    (clip_shadows.recipe_run: the replay is trained already; clip_evidence.clip_evidence says why);
    the retain R@1 drop, against the original and against the reference's runs; the policy's decision (an
    approximate method without informative evidence is not certified). Raises AuditUnavailable where the audit
    cannot run (a pair outside the shadow pool)."""
    # the federated utility figure is the retain R@1 drop (its own check), not a test-accuracy loss
    fed_policy = dataclasses.replace(policy, max_utility_loss_points=None)
    try:
        report, scores = audit_clip_deletion(
            shadows,
            clip,
            forget,
            positions,
            nonmembers,
            problem.theta,
            theta_new,
            theta_retrained=theta_new if exact else None,
            trained_on_forget=True,
            policy=policy,
        )
    except ValueError as exc:  # only the audit's own refusals; anything later is a bug and fails the job
        raise AuditUnavailable(str(exc)) from exc
    rounds = int(problem.n_rounds or problem.fed_settings.rounds)
    levels = None
    if scope in CONCEPT_SCOPES:  # the class's retrieval against version 1's (clip_evidence, forget_retrieval)
        thetas = {"unlearned": theta_new, "original": problem.theta, "version_1": problem.theta_init}
        levels = {name: retrieval_of(clip, theta, forget, nonmembers) for name, theta in thetas.items()}
    evidence = clip_evidence(
        scores,
        problem.theta,
        theta_new,
        exact,
        scope,
        replay,
        policy.max_residual_ratio,
        levels=levels,
        replay_at_hand=exact and recipe_run(shadows, problem.fed_settings, rounds) is not None,
    )
    reference_levels, n_queries = reference_retain_levels(clip, problem, shadows)
    utility = [retain_check(before, after, policy, exact, reference_levels)]
    if policy.retain_against_reference:
        utility.append(reference_retain_check(reference_levels, before, after, exact, n_queries))
    verdict = decide(
        report,
        fed_policy,
        exact=exact,
        evidence=evidence,
        extra_checks=utility,
        attack_supports=scope != "samples",  # one-sided: a samples deletion is judged two-sided (excess)
    )
    return report, verdict, scores

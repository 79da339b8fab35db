"""Evidence for federated CLIP deletions (issue 20 item 1, the federated wing; evidence.py has the tabular classes).

A CLIP LoRA model has no retained optimum to measure against (non-convex, federated, trained for a fixed number of
rounds), so its evidence is what the audit's own data can show, each judged against doing nothing as in evidence.py:

``forget_excess`` (every method)
    The LiRA statistic φ of each audited pair, standardised by the shadow runs that did NOT train on it
    (z = (φ − μ_out) / σ_out: pair difficulty removed, clip_shadows.py), averaged over the forget pairs, minus the same
    average over matched non-member pairs scored by the same model: E(θ) = mean z(forget) − mean z(non-members). The
    non-members are the reference: pairs no model trained on, which no method's control sees (verify_federated) — a
    model that never saw the forget pairs scores them like those (E ≈ 0); the original scores its members higher.
    figure  E(θ′) (samples scope: |E(θ′)|, below);  do-nothing  E(θ);
    floor   Z_NULL · SE, SE = sd(z of the non-members under θ′) · √(1/k + 1/m): the spread of E under "the forget pairs
            are non-members" (k forget, m non-member pairs) — a correct approximate deletion fails by chance with
            probability ≈ 2Φ(−Z_NULL) (then ``auto`` retrains);
    pass iff figure ≤ max(ρ·E(θ), floor) (exact methods: max(EXACT_MAX_RATIO·E(θ), floor)); informative iff
    E(θ) ≥ MIN_POWER × that threshold, i.e. doing nothing would fail with margin.
    Sidedness: a samples deletion's pairs should score like non-members, neither above nor below — a set of pairs
    that sits far BELOW comparable pairs is as recognisable as one above (gradient ascent overshoots so), so its figure
    is |E(θ′)|. A client or class deletion removes a whole concept: its exact retrain legitimately scores the concept's
    pairs below the non-members (the shadows that calibrate z learned the concept from the very pairs deleted), so
    only the excess above is judged there.

``replay`` (exact methods, when the excess does not decide: uninformative — a random one-pair forget set nearly
always is — or failed) — FedAvg from the model's θ₀ with its recorded schedule on the pairs the verifier determined as
retained, run again: federated retraining is deterministic (seeded client sampling and batches; measured bitwise
equal on CPU, and the full-data replay reproduces the original model bit for bit), so θ′ must equal it
(evidence.replay_check). Independent of the method's run, never a comparison of the retrain with itself: a retrain
that kept a pair or dropped another one lands elsewhere.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from app.ml.data.captions import CaptionDataset
from app.ml.federation import FederatedProblem
from app.ml.verification.audit import AuditScores
from app.ml.verification.evidence import (
    DEFAULT_MAX_RESIDUAL_RATIO,
    EXACT_MAX_RATIO,
    MIN_POWER,
    _check,
    replay_check,
)

REFERENCE_SEED = 20
"""Seeds the fixed split of the held-out pairs into the methods' half and the verifier's reference half."""
Z_NULL = 2.0
"""[INFERENCE] the excess of a correct deletion is ~N(0, SE²): at 2 SE an approximate method that did remove the pairs
is failed by chance ≤ 5 % of the time (two-sided; one-sided 2.3 %) — the attack check's own confidence (95 %) — and
``auto`` then retrains; an exact method is never failed by chance, the replay decides where the excess does not
pass. Informative then needs E₀ ≥ MIN_POWER·2 = 4 SE. Measured on the 300-pair panel federation: federated
retraining at −2.9 to +1.9 SE on 6 random 50-pair sets."""
TWO_SIDED_SCOPES = frozenset({"samples"})


def split_reference(pairs: CaptionDataset) -> tuple[CaptionDataset, CaptionDataset]:
    """(the methods' half, the verifier's reference half) of held-out pairs, by a fixed permutation: whatever a method
    measures itself on (EASE's strength control ranks the forget pairs against a gallery, a membership federation's
    held-out split is its target) never holds the pairs the verdict compares the forget pairs with (issue 20: a
    reference measured on pairs the evaluation does not use). The reference gets the odd one."""
    order = np.random.default_rng(REFERENCE_SEED).permutation(len(pairs))
    half = len(pairs) // 2
    return pairs.subset(np.sort(order[:half])), pairs.subset(np.sort(order[half:]))


def excess(scores: AuditScores, name: str) -> tuple[float, float]:
    """(E, SE) of the module docstring for the audited model ``name`` (a key of the audit's scores)."""
    fit = scores.fit
    if fit is None:
        raise ValueError("the audit has no shadow fit: the forget excess needs the shadows' OUT statistics")
    forget, others = scores.forget_phi[name], scores.nonmember_phi[name]
    k, m = len(forget), len(others)
    if m < 2:
        raise ValueError("the forget excess needs at least two non-member pairs")
    z_forget = (forget - fit.mu_out[:k]) / fit.std_out[:k]
    z_others = (others - fit.mu_out[k:]) / fit.std_out[k:]
    se = float(np.std(z_others, ddof=1)) * math.sqrt(1.0 / k + 1.0 / m)
    return float(z_forget.mean() - z_others.mean()), se


def forget_excess(
    scores: AuditScores, exact: bool, two_sided: bool, max_ratio: float = DEFAULT_MAX_RESIDUAL_RATIO
) -> dict[str, Any]:
    """The ``forget_excess`` check of the module docstring (needs the audit's "original" and "unlearned" scores)."""
    e0, se0 = excess(scores, "original")
    e1, se1 = excess(scores, "unlearned")
    figure = abs(e1) if two_sided else e1
    floor = Z_NULL * se1
    threshold = max((EXACT_MAX_RATIO if exact else max_ratio) * e0, floor)
    power = e0 / threshold if threshold > 0 else math.inf
    informative = power >= MIN_POWER
    passed = (figure <= threshold) if informative else None
    k = len(scores.forget_phi["unlearned"])
    m = len(scores.nonmember_phi["unlearned"])
    shown = f"|E′| = {abs(e1):.3g}" if two_sided else f"E′ = {e1:.3g}"
    rule = f"max({EXACT_MAX_RATIO if exact else max_ratio:g}·E₀, {Z_NULL:g}·SE)"
    message = (
        f"forget pairs' excess over {m} matched non-member pairs (shadow-standardised LiRA statistic): {shown} "
        f"{'≤' if passed else '>'} {threshold:.3g} ({rule}, SE {se1:.3g}); doing nothing: E₀ = {e0:.3g} "
        f"(power {power:.3g}×)"
    )
    if not informative:
        message = (
            f"uninformative: the original model's {k} forget pairs sit E₀ = {e0:.3g} above the non-members, within "
            f"{MIN_POWER:g}× of the threshold {threshold:.3g} (SE {se1:.3g}): the pairs are not measurably memorised"
        )
    detail = {
        "excess": e1,
        "excess_do_nothing": e0,
        "se": se1,
        "se_do_nothing": se0,
        "z_null": Z_NULL,
        "two_sided": two_sided,
        "n_forget": k,
        "n_nonmembers": m,
        "exact": exact,
        "max_ratio": max_ratio,
        "ratio": None if e0 <= 0 else figure / e0,
    }
    return _check("forget_excess", figure, threshold, passed, informative, power, message, detail)


def replay_of(problem: FederatedProblem) -> Callable[[], torch.Tensor]:
    """The exact recipe run again by the verifier (``replay``): FedAvg from θ₀ with the model's recorded schedule on
    the retained pairs the problem holds (the job's own determination, at load), as fed_retrain trains them."""
    rounds = int(problem.n_rounds or problem.fed_settings.rounds)
    return lambda: (
        problem.federation().train(problem.theta_init, rounds, problem.retained_clients(), record_history=False).theta
    )


def clip_evidence(
    scores: AuditScores | None,
    theta_parent: torch.Tensor,
    theta_new: torch.Tensor,
    exact: bool,
    scope: str,
    replay: Callable[[], torch.Tensor] | None = None,
    max_ratio: float = DEFAULT_MAX_RESIDUAL_RATIO,
    retained: str = "the retained pairs",
) -> list[dict[str, Any]]:
    """The evidence of one federated deletion: the forget excess (when shadows audited it), and for an exact method
    whose excess did not decide, the replay (``replay``: runs the recipe on the retained pairs; called only then)."""
    checks: list[dict[str, Any]] = []
    if scores is not None:
        check = forget_excess(scores, exact, scope in TWO_SIDED_SCOPES, max_ratio)
        if not exact or (check["informative"] and check["passed"]):
            return [check]
        note = " [not decisive for an exact method: the replay below decides]"
        checks.append({**check, "passed": None, "informative": False, "message": check["message"] + note})
    if exact and replay is not None:
        checks.append(replay_check(theta_parent, theta_new, replay(), retained))
    return checks

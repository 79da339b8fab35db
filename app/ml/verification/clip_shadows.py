"""Shadow LoRA runs and offline LiRA for federated CLIP models (issue 9 item 2; notes Part 2 §2.1, §2.6).

Why offline, and why random halves: a shadow is one full federated LoRA training run (the model's own FedAvg recipe
from its θ₀), far too costly on CPU for LiRA's 64+ online shadows. Carlini et al.'s offline attack needs only OUT
shadows (§VI-C; at most ~20 % lower TPR at 0.1 % FPR than online with as many models). The deleted pairs are not
known when the shadows are trained (at registration), so, as in the tabular wing, each shadow trains on a balanced
random subset of the model's pairs (``keep_fraction``, 0.5 by default, client structure kept): every pair is OUT for
a fixed share of the shadows, whichever pairs a request later deletes. Matched non-members (pairs no model trained
on: the federation's held-out split, or its test pairs) are OUT for every shadow.

The statistic is LiRA's φ over a fixed caption gallery (signals.clip_pair_confidence, both directions averaged):
the gallery is the audited pairs themselves (forget ∪ non-members), the same for every model compared (shadows,
original, unlearned). With fewer than 64 shadows the OUT variance is global (lira.fit_gaussians "auto").

A deletion is audited against its own reference (``shadows_without``): as many runs of the recipe on every pair that
remains, each with its own data order — run 0 the recipe's: exact retraining itself — so that no run saw a forget pair
(for a client, a class or a subject alike; the registration set's OUT runs of a pair trained on half of its group) and
the forget excess of a correct deletion falls within the runs' own leave-one-out spread (clip_evidence). The worker
trains it before the verdict, the erasure stores it in place of the model's set. At registration the model stores
only the pool (``shadow_pool``: the pairs' positions, the audit's settings and the recipe, no run trained): since stop
46 no verdict reads a registration run, so training them there (one federated run per shadow) was work thrown away.
Everything here is pure: the worker (app/jobs/federated.py) loads the data and stores the set.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from app.ml.clip import ClipLoRA
from app.ml.data.captions import CaptionDataset
from app.ml.federation import FederatedProblem, Federation, FedSettings
from app.ml.verification.audit import AuditScores, report_from_scores, scores_from_phi, theta_facts
from app.ml.verification.clip_evidence import forget_groups, net_of_group_shift, null_excess, replay_of
from app.ml.verification.policy import VerdictPolicy
from app.ml.verification.shadows import balanced_in_mask, pack_shadows, unpack_shadows
from app.ml.verification.signals import clip_pair_confidence

DEFAULT_N_CLIP_SHADOWS = 4
"""[INFERENCE] The smallest count that leaves every pair two OUT shadows at keep_fraction 0.5 (a Gaussian needs two
samples); each shadow is a full federated training run, so this is the audit's cost at registration and after every
erasure. Raise it where CPU allows: LiRA's power grows with the count up to ~64 (Carlini et al. 2022, Fig. 9)."""
MIN_OUT_SHADOWS = 2
"""Offline LiRA fits each pair's OUT mean from the shadows that did not train on it: at least two per pair."""
REFERENCE_SEED_STRIDE = 104729
"""Data-order seed of reference run j ≥ 1: the recipe's seed + j × this (a prime; never bench.ease's other-order
retrain, +1000). Run 0 has the recipe's own seed: it is exact retraining (:func:`shadows_without`)."""
CLIP_SHADOW_FORMAT = "lethe-clip-shadows/1"
STATISTIC = "phi = mean over i2t and t2i of (tau*cos(true) - logsumexp_{others} tau*cos) over the audited pairs"

ProgressFn = Callable[[int, int], None]


@dataclass
class ClipShadowSettings:
    """How CLIP shadow runs are drawn and trained (bounded at the API: app/registry/settings.py ClipShadowSettingsIn).

    ``rounds``: FedAvg rounds per shadow; None = the model's own schedule (a deletion's reference: as many rounds as
    the model has trained, app/jobs/federated.py; else ``fed_settings.rounds``, its recipe). Every shadow
    uses the recipe's seeds, so the only randomness between shadows is the pair subset ([INFERENCE], as the tabular
    shadows' "recipe" seed mode: the service's rounds are seeded the same way).
    """

    n_shadows: int = DEFAULT_N_CLIP_SHADOWS
    keep_fraction: float = 0.5
    seed: int = 0
    rounds: int | None = None

    def __post_init__(self) -> None:
        if int(self.n_shadows) < 2:
            raise ValueError("n_shadows must be at least 2")
        if not 0.0 < self.keep_fraction < 1.0:
            raise ValueError("keep_fraction must lie in (0, 1)")
        if self.rounds is not None and int(self.rounds) < 1:
            raise ValueError("rounds must be at least 1")
        n_out = int(self.n_shadows) - int(round(self.keep_fraction * int(self.n_shadows)))
        if n_out < MIN_OUT_SHADOWS:
            raise ValueError(
                f"{self.n_shadows} shadows at keep_fraction {self.keep_fraction:g} leave {n_out} OUT shadow(s) per "
                "pair; offline LiRA needs two"
            )


@dataclass
class ClipShadowSet:
    """Shadow LoRA vectors [N, p] and membership ``in_mask`` [N, n_pool] over the pool's pairs (``row_ids``: their
    data-set positions, never pair ids). ``client_sizes`` splits the pool's columns into the clients' pairs, in
    order. ``seconds`` is the training time of each shadow in this set (for the cost report)."""

    thetas: torch.Tensor
    in_mask: np.ndarray
    row_ids: np.ndarray
    client_sizes: list[int]
    settings: ClipShadowSettings = field(default_factory=ClipShadowSettings)
    fed_settings: dict[str, Any] = field(default_factory=dict)
    generation: int = 0
    seconds: list[float] = field(default_factory=list)
    rounds: int | None = None
    """FedAvg rounds each run trained (a deletion's reference records them: the worker trains it to the model's own
    schedule); None for sets that do not (registration runs: ``settings.rounds`` or the recipe's)."""

    def __post_init__(self) -> None:
        if self.thetas.ndim != 2 or self.in_mask.shape != (self.thetas.shape[0], len(self.row_ids)):
            raise ValueError("thetas [N, p], in_mask [N, n_pool] and row_ids [n_pool] disagree")
        if sum(self.client_sizes) != len(self.row_ids):
            raise ValueError("client_sizes must split the pool's columns")

    @property
    def n_shadows(self) -> int:
        return int(self.thetas.shape[0])

    def columns_of(self, positions: Sequence[int] | np.ndarray) -> np.ndarray:
        """Pool columns of the given data-set positions (raises on one not in the pool, e.g. an erased pair)."""
        lookup = {int(r): j for j, r in enumerate(self.row_ids)}
        try:
            return np.array([lookup[int(p)] for p in np.asarray(positions).reshape(-1)], dtype=np.int64)
        except KeyError as exc:
            raise ValueError(f"pair position {exc.args[0]} is not in the shadow pool") from exc


def _split(mask_row: np.ndarray, clients: Sequence[CaptionDataset]) -> list[CaptionDataset]:
    out, start = [], 0
    for client in clients:
        n = len(client)
        out.append(client.subset(np.flatnonzero(mask_row[start : start + n])))
        start += n
    return out


def _train_runs(
    model: ClipLoRA,
    theta_init: torch.Tensor,
    clients: Sequence[CaptionDataset],
    mask: np.ndarray,
    fed: FedSettings | Sequence[FedSettings],
    rounds: int,
    progress: ProgressFn | None,
) -> tuple[torch.Tensor, list[float]]:
    """One federated run per row of ``mask`` (its pairs), each with ``fed`` (or its own entry of a list)."""
    thetas, seconds = [], []
    for i, row in enumerate(mask):
        if not row.any():
            raise ValueError("a shadow subset is empty: the pool is too small for this keep_fraction")
        started = time.perf_counter()
        run = fed if isinstance(fed, FedSettings) else fed[i]
        result = Federation(model, _split(row, clients), run).train(theta_init, rounds, record_history=False)
        thetas.append(result.theta.detach().float().clone())
        seconds.append(time.perf_counter() - started)
        if progress is not None:
            progress(i + 1, len(mask))
    return torch.stack(thetas), seconds


def _pool_ids(clients: Sequence[CaptionDataset], row_ids: np.ndarray | None) -> tuple[list[int], np.ndarray]:
    """The clients' sizes and the pool's data-set positions (default 0..n−1), checked."""
    sizes = [len(c) for c in clients]
    n = sum(sizes)
    if n < 2:
        raise ValueError("the clients must hold at least two pairs")
    ids = np.arange(n) if row_ids is None else np.asarray(row_ids, dtype=np.int64)
    if len(ids) != n or len(np.unique(ids)) != n:
        raise ValueError("row_ids must be unique and name every pair of the pool")
    return sizes, ids


def shadow_pool(
    clients: Sequence[CaptionDataset],
    fed_settings: FedSettings,
    settings: ClipShadowSettings | None = None,
    row_ids: np.ndarray | None = None,
) -> ClipShadowSet:
    """What a federated model stores at registration: the pool its deletions' references are drawn from (every pair's
    data-set position, the clients' sizes), the audit's settings and the recipe — no run trained (generation 0, an
    empty ``thetas``). The first deletion's :func:`shadows_without` trains ``settings.n_shadows`` runs on what
    remains; no verdict reads a registration run since stop 46 (README "Stop 48")."""
    settings = settings or ClipShadowSettings()
    sizes, ids = _pool_ids(clients, row_ids)
    empty = torch.zeros((0, 0))
    return ClipShadowSet(empty, np.zeros((0, len(ids)), bool), ids, sizes, settings, asdict(fed_settings), 0, [])


def train_clip_shadows(
    model: ClipLoRA,
    theta_init: torch.Tensor,
    clients: Sequence[CaptionDataset],
    fed_settings: FedSettings,
    settings: ClipShadowSettings | None = None,
    row_ids: np.ndarray | None = None,
    progress: ProgressFn | None = None,
) -> ClipShadowSet:
    """``settings.n_shadows`` federated LoRA runs of the model's recipe (FedAvg from θ₀ with ``fed_settings``), each
    on a balanced random subset of every client's pairs. The pool is the clients' pairs concatenated in order;
    ``row_ids`` names them (default 0..n−1)."""
    settings = settings or ClipShadowSettings()
    sizes, ids = _pool_ids(clients, row_ids)
    rng = np.random.default_rng([int(settings.seed), 0])
    mask = balanced_in_mask(int(settings.n_shadows), len(ids), settings.keep_fraction, rng)
    rounds = int(settings.rounds or fed_settings.rounds)
    thetas, seconds = _train_runs(model, theta_init, clients, mask, fed_settings, rounds, progress)
    return ClipShadowSet(thetas, mask, ids, sizes, settings, asdict(fed_settings), 0, seconds)


def remaining_clients(
    shadows: ClipShadowSet, clients: Sequence[CaptionDataset], gone: set[int]
) -> list[CaptionDataset]:
    """Each client's pairs that stay in the shadows' pool once the data-set positions ``gone`` are erased (the
    ``clients`` hold every pair of the data set, erased ones of earlier deletions included: positions index them)."""
    remaining = {int(p) for p in shadows.row_ids} - gone
    out, offset = [], 0
    for client in clients:
        out.append(client.subset([i for i in range(len(client)) if offset + i in remaining]))
        offset += len(client)
    return out


def shadows_without(
    shadows: ClipShadowSet,
    erased_positions: Sequence[int],
    model: ClipLoRA,
    theta_init: torch.Tensor,
    clients: Sequence[CaptionDataset],
    progress: ProgressFn | None = None,
    rounds: int | None = None,
) -> tuple[ClipShadowSet, dict[str, Any]]:
    """The deletion's reference set: ``shadows.n_shadows`` runs of the model's recipe from θ₀ on every pair that
    remains, each with its own data order: run 0 the recipe's own (it *is* exact retraining, bit for bit, where the
    registration schedule is the model's: :func:`recipe_run`), the others :data:`REFERENCE_SEED_STRIDE` apart. A θ′
    that never saw the pairs is one more draw of the process, and its forget excess is judged against the runs' own
    leave-one-out spread (clip_evidence.null_excess). Every erased pair is OUT of every run, whatever group it forms;
    every remaining pair IN. It replaces the stored set at erasure (each registration run that saw an erased pair is a
    copy of it).

    ``rounds``: the runs' FedAvg rounds (the worker passes the model's own count unless the settings fix one, so run 0
    stays its exact retraining after it trained past its recipe); default ``settings.rounds`` or the recipe's.

    Why run 0 has the recipe's order (stop 47): an approximate θ′ starts from the original, which trained in that
    order, and exact retraining shares it; with other orders only, the null missed what sharing it does to the forget
    pairs (exact retraining's E′ sat +0.16 above other-order retraining's on the tuning seeds, +1.42 on a reported
    class seed, where the attack failed exact retraining itself). And the verifier's replay of an exact method's
    recipe is then the run it trained anyway: one federated retraining less per verified exact deletion.

    Why not the registration runs (random halves) with those that saw a pair retrained: their OUT runs of a pair
    trained on half of the pair's own client, class or subject (an exact retrain of the group scored far below them,
    E −1.46 to −4.06, stop 45), and even without the pairs, half-data runs vary so much from run to run (their
    subsets differ) that the null spread of E, measured, left the samples check uninformative (leave-one-out spread
    0.70 against doing nothing's 3.45 on tuning seed 0), and a full-data θ′ is not one of them (README "Stop 46")."""
    gone = {int(p) for p in erased_positions}
    remaining = remaining_clients(shadows, clients, gone)
    keep = ~np.isin(shadows.row_ids, np.asarray(sorted(gone), dtype=np.int64))
    sizes = [len(c) for c in remaining]
    if sum(sizes) != int(keep.sum()) or sum(sizes) == 0:
        raise ValueError("the clients do not hold the pool's remaining pairs")
    fed = FedSettings(**shadows.fed_settings)
    rounds = int(rounds or shadows.settings.rounds or fed.rounds)
    n = int(shadows.settings.n_shadows)  # the model's setting: its stored set may be the untrained pool
    runs = [dataclasses.replace(fed, seed=fed.seed + REFERENCE_SEED_STRIDE * j) for j in range(n)]
    mask = np.ones((n, sum(sizes)), dtype=bool)
    thetas, seconds = _train_runs(model, theta_init, remaining, mask, runs, rounds, progress)
    erased_cols = np.flatnonzero(~keep)
    generation = shadows.generation + 1
    result = ClipShadowSet(
        thetas, mask, shadows.row_ids[keep], sizes, shadows.settings, shadows.fed_settings, generation, seconds, rounds
    )
    counts = {
        "dropped": shadows.n_shadows,
        "saw_erased_pairs": int(shadows.in_mask[:, erased_cols].any(axis=1).sum()),
        "kept": 0,
        "trained": n,
        "recipe_run": 0,  # the run with the recipe's own data order: exact retraining's θ (recipe_run)
        "rounds": rounds,
        "pairs": int(sum(sizes)),
        "seconds": round(sum(seconds), 3),
    }
    return result, counts


def recipe_run(reference: ClipShadowSet, fed_settings: FedSettings, rounds: int) -> torch.Tensor | None:
    """Run 0 of a deletion's reference (:func:`shadows_without`) where it is the recipe itself — the same settings,
    seed included, and as many rounds as the model trained (the worker trains the reference to that count since stop
    48; a reference of another length is not) —, else None. It is then bit for bit what exact retraining on the
    remaining pairs gives (FedAvg is deterministic: measured on CPU, tests/unit/test_clip_audit.py), trained by the
    verifier independently of the method's own run."""
    same = reference.fed_settings == dataclasses.asdict(fed_settings)
    trained = int(reference.rounds or reference.settings.rounds or fed_settings.rounds)
    if not same or trained != int(rounds) or reference.generation < 1 or not reference.in_mask.all():
        return None
    return reference.thetas[0]


REPLAY_SOURCES = {
    True: "the audit reference's run 0 (the recipe in its own data order, trained by the verifier)",
    False: "the recipe run again (the reference's run 0 is not the model's recipe: its schedule differs)",
}


def reference_replay(reference: ClipShadowSet, problem: FederatedProblem) -> tuple[Callable[[], torch.Tensor], str]:
    """The ``replay`` of an exact method's verdict (clip_evidence.replay_check) and where it comes from: the
    reference's :func:`recipe_run` where it is the recipe, else the recipe run again (clip_evidence.replay_of: one more
    federated retraining)."""
    theta = recipe_run(reference, problem.fed_settings, int(problem.n_rounds or problem.fed_settings.rounds))
    if theta is None:
        return replay_of(problem), REPLAY_SOURCES[False]
    return (lambda: theta), REPLAY_SOURCES[True]


def clip_shadows_to_bytes(shadows: ClipShadowSet) -> bytes:
    meta = {
        "format": CLIP_SHADOW_FORMAT,
        "client_sizes": json.dumps([int(s) for s in shadows.client_sizes]),
        "settings": json.dumps(asdict(shadows.settings), sort_keys=True),
        "fed_settings": json.dumps(shadows.fed_settings, sort_keys=True),
        "generation": str(shadows.generation),
        **({"rounds": str(int(shadows.rounds))} if shadows.rounds is not None else {}),
    }
    return pack_shadows(shadows.thetas, shadows.in_mask, shadows.row_ids, meta)


def clip_shadows_from_bytes(data: bytes) -> ClipShadowSet:
    thetas, in_mask, row_ids, meta = unpack_shadows(data, CLIP_SHADOW_FORMAT)
    return ClipShadowSet(
        thetas,
        in_mask,
        row_ids,
        json.loads(meta["client_sizes"]),
        ClipShadowSettings(**json.loads(meta["settings"])),
        json.loads(meta["fed_settings"]),
        int(meta["generation"]),
        rounds=int(meta["rounds"]) if "rounds" in meta else None,
    )


# ---------------------------------------------------------------------------------------------- the audit
def pair_phi(model: ClipLoRA, theta: torch.Tensor, pairs: CaptionDataset) -> np.ndarray:
    """φ of each pair under θ over the gallery of ``pairs`` itself (both directions averaged; float64 [n])."""
    model.set_theta(theta)
    with torch.no_grad():
        img, txt = model.embed(pairs)
        scale = float(model.model.logit_scale.exp())
    return clip_pair_confidence(img, txt, scale, captions=pairs.captions)["mean"]


def audit_clip_deletion(
    shadows: ClipShadowSet,
    model: ClipLoRA,
    forget: CaptionDataset,
    forget_positions: Sequence[int] | np.ndarray,
    nonmembers: CaptionDataset,
    theta_original: torch.Tensor,
    theta_unlearned: torch.Tensor,
    theta_retrained: torch.Tensor | None = None,
    trained_on_forget: bool = True,
    policy: VerdictPolicy | None = None,
    variance: str = "auto",
    center: str = "mean",
    shadow_phi: np.ndarray | None = None,
) -> tuple[dict[str, Any], AuditScores]:
    """Offline LiRA on the forget pairs against matched non-member pairs, for the original, unlearned (and
    retrained) LoRA vectors; the report has audit.audit_forget_set's keys (so policy.decide reads it) plus
    "gallery_size" and "shadow_generation". ``forget_positions`` are the forget pairs' data-set positions (they pick
    the shadows' membership columns; where the pool holds none of them — a reference set from
    :func:`shadows_without` — every forget pair is OUT for every shadow); ``nonmembers`` must be pairs no shadow and
    no audited model trained on.
    ``shadow_phi``: the shadows' φ on these audited pairs when the caller judges several θ′ of one deletion (the
    impostor panel), else computed here."""
    if len(forget) == 0 or len(nonmembers) == 0:
        raise ValueError("the audit needs at least one forget pair and one non-member pair")
    positions = np.asarray(forget_positions, dtype=np.int64).reshape(-1)
    if len(positions) != len(forget):
        raise ValueError("forget_positions must name every forget pair")
    if shadows.n_shadows < MIN_OUT_SHADOWS:
        raise ValueError(
            f"the set holds {shadows.n_shadows} trained runs (a registration pool is audited through "
            "shadows_without's reference)"
        )
    k = len(forget)
    pooled = np.isin(positions, shadows.row_ids)
    if not pooled.any():  # a reference set (shadows_without): no shadow saw a forget pair, all are OUT everywhere
        forget_mask = np.zeros((shadows.n_shadows, k), bool)
    elif pooled.all():
        forget_mask = shadows.in_mask[:, shadows.columns_of(positions)]
    else:
        raise ValueError(
            "the shadows' pool holds some forget pairs and not others: neither the registration set nor a "
            "reference trained without them"
        )
    audited = CaptionDataset.concat([forget, nonmembers])
    mask = np.concatenate([forget_mask, np.zeros((shadows.n_shadows, len(nonmembers)), bool)], axis=1)
    if shadow_phi is None:
        shadow_phi = np.stack([pair_phi(model, th, audited) for th in shadows.thetas])
    thetas = {"original": theta_original, "unlearned": theta_unlearned}
    if theta_retrained is not None:
        thetas["retrained"] = theta_retrained
    phis = {name: pair_phi(model, th, audited) for name, th in thetas.items()}
    reference = not pooled.any()  # a deletion's reference: forget pairs and non-members each get their own σ
    groups = forget_groups(len(audited), k) if reference else None
    scores = scores_from_phi(shadow_phi, mask, phis, k, "offline", variance, center, predictive=True, groups=groups)
    attack_scores, group_shift = scores, {}
    if reference and shadows.n_shadows >= 3:  # its runs' own null draws of the excess
        scores.null_excess = null_excess(shadow_phi, k, variance, center)
        attack_scores, group_shift = net_of_group_shift(scores)
    report = report_from_scores(
        attack_scores,
        k,
        len(nonmembers),
        policy,
        center,
        theta=theta_facts(theta_original, theta_unlearned, trained_on_forget),
        statistic=STATISTIC,
    )
    if group_shift:
        report["attack"]["group_shift"] = {
            **group_shift,
            "what": "the forget-set attack counts each model's forget pairs net of their common shift, up to what "
            "the reference runs allow (clip_evidence.net_of_group_shift); the forget excess judges the shift",
        }
    report["gallery_size"] = len(audited)
    report["shadow_generation"] = int(shadows.generation)
    return report, scores

"""Shadow models for LiRA on tabular models: N copies of the model's own recipe trained on random subsets of a pool.

Why this shape (Carlini et al. 2022, Alg. 1; notes §2.1 [CODE] train.py): every pool row must be IN for about half of
the shadows and OUT for the rest, so the per-example IN and OUT distributions of φ can both be fitted. As in the
released code, the membership matrix is drawn so that each row is IN for exactly round(keep_fraction · N) shadows
(``order = rand(N, n).argsort(0); keep = order < k``), rather than independent coin flips.

The pool should hold the model's training rows AND held-out rows from the same distribution: the audit scores
held-out rows as the non-member negatives, and online LiRA needs IN shadows for them too. Set ``keep_fraction`` so a
shadow trains on about as many rows as the audited model did (n_train / n_pool); 0.5 is LiRA's own choice.

Shadows are trained on personal data: a shadow whose subset held a row that is later erased is a copy of it
(ARCHITECTURE "Erasure is complete"). ``shadows_containing`` names them, ``drop_shadows`` removes them with the
erasure, and ``refill_shadows`` trains as many on the remaining rows once the request is certified (issue 21).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import torch

from app.ml import tabular
from app.ml.verification.signals import logit_scaled_confidence, phi_from_proba

DEFAULT_N_SHADOWS = 64
"""LiRA's benefit tapers after about 64 shadows (Carlini et al. 2022, Fig. 9), and 64 is where per-example variance
starts to pay (§VI-B); each shadow is one full training run of the model, so this is the main cost of an audit."""
DEFAULT_KEEP_FRACTION = 0.5
SEED_MODES = ("recipe", "vary")

ProgressFn = Callable[[int, int], None]


@dataclass
class ShadowSettings:
    """How shadows are drawn and trained.

    ``seed_mode`` [INFERENCE]: "recipe" trains every shadow with the audited recipe's own seed, so the only randomness
    between shadows is the data subset, exactly the randomness of the service's (deterministic) training and retrain;
    "vary" gives shadow i the seed recipe.seed + 1 + i (LiRA's setting, where initialisation is random too). For
    convex models (LR) the two agree; for the MLP "recipe" gives tighter Gaussians, hence a more powerful audit.
    """

    n_shadows: int = DEFAULT_N_SHADOWS
    keep_fraction: float = DEFAULT_KEEP_FRACTION
    seed: int = 0
    seed_mode: str = "recipe"

    def __post_init__(self) -> None:
        if int(self.n_shadows) < 2:
            raise ValueError("n_shadows must be at least 2")
        if not 0.0 < self.keep_fraction < 1.0:
            raise ValueError("keep_fraction must lie in (0, 1)")
        if self.seed_mode not in SEED_MODES:
            raise ValueError(f"unknown seed_mode {self.seed_mode!r}; expected one of {SEED_MODES}")


@dataclass
class Scored:
    """Every shadow's φ on some pool rows, computed when the shadows were trained (``score_rows``): the rows every
    audit of the model scores as non-members, so an audit reads their φ instead of scoring them again with every
    shadow (issue 21: most of an idle deletion's audit). ``row_ids`` sorted, ``phi`` float64 [N, len(row_ids)]."""

    row_ids: np.ndarray
    phi: np.ndarray


@dataclass
class ShadowSet:
    """Shadow parameter vectors [N, P] (float32) and the membership matrix ``in_mask`` [N, n_pool] (bool).

    ``row_ids`` names the pool rows (the caller's sample ids, or 0..n−1) so the mask survives row deletions.
    ``generation`` counts replacement rounds; it enters the random stream so replacements never reuse a subset draw.
    """

    recipe: tabular.TabularRecipe
    n_classes: int
    thetas: torch.Tensor
    in_mask: np.ndarray
    row_ids: np.ndarray
    settings: ShadowSettings = field(default_factory=ShadowSettings)
    generation: int = 0
    scored: Scored | None = None

    def __post_init__(self) -> None:
        if self.thetas.ndim != 2 or self.in_mask.ndim != 2 or self.thetas.shape[0] != self.in_mask.shape[0]:
            raise ValueError("thetas [N, P] and in_mask [N, n] must have the same number of shadows")
        if self.in_mask.shape[1] != len(self.row_ids):
            raise ValueError("row_ids must name every column of in_mask")
        if self.scored is not None and self.scored.phi.shape != (self.thetas.shape[0], len(self.scored.row_ids)):
            raise ValueError("scored φ must hold one row per shadow and one column per scored row id")

    @property
    def n_shadows(self) -> int:
        return int(self.thetas.shape[0])


def balanced_in_mask(n_shadows: int, n_rows: int, keep_fraction: float, rng: np.random.Generator) -> np.ndarray:
    """[N, n] bool with keep_fraction · N True per column (LiRA's train.py draw: ``argsort(rand) < k``).

    When keep_fraction · N is not an integer (an odd number of replacements, say) each column takes the floor or the
    ceiling at random with the fractional part as probability, so every row is IN with probability keep_fraction.
    """
    target = keep_fraction * n_shadows
    base = int(np.floor(target))
    k = base + (rng.random(n_rows) < target - base).astype(np.int64)
    order = rng.random((n_shadows, n_rows)).argsort(axis=0)
    return order < k[None, :]


def _shadow_recipe(recipe: tabular.TabularRecipe, settings: ShadowSettings, index: int) -> tabular.TabularRecipe:
    if settings.seed_mode == "recipe":
        return recipe
    return tabular.TabularRecipe.from_dict({**recipe.to_dict(), "seed": int(recipe.seed) + 1 + int(index)})


def _train_many(
    recipe: tabular.TabularRecipe,
    X: np.ndarray,
    y: np.ndarray,
    n_classes: int,
    mask: np.ndarray,
    settings: ShadowSettings,
    first_index: int,
    progress: ProgressFn | None,
    init: torch.Tensor | None = None,
) -> torch.Tensor:
    """One shadow per mask row. ``init`` (a strictly convex recipe only: the optimum does not depend on it) starts
    every fit there, on one sparse design sliced per shadow."""
    thetas = []
    design = tabular.sparse_design(X) if init is not None else None
    for i, row in enumerate(mask):
        if not row.any():
            raise ValueError("a shadow subset is empty: the pool is too small for this keep_fraction")
        shadow_recipe = _shadow_recipe(recipe, settings, first_index + i)
        if init is None:
            thetas.append(tabular.train(shadow_recipe, X[row], y[row], n_classes))
        else:
            own = design[np.flatnonzero(row)] if design is not None else None
            thetas.append(tabular.fit(shadow_recipe, X[row], y[row], n_classes, init, design=own)[0])
        if progress is not None:
            progress(i + 1, len(mask))
    return torch.stack(thetas)


def train_shadows(
    recipe: tabular.TabularRecipe,
    X: np.ndarray,
    y: np.ndarray,
    n_classes: int,
    settings: ShadowSettings | None = None,
    row_ids: np.ndarray | None = None,
    progress: ProgressFn | None = None,
) -> ShadowSet:
    """Train ``settings.n_shadows`` models of ``recipe`` on random subsets of the pool (X, y); seedable.

    ``progress(done, total)`` is called after each shadow.
    """
    settings = settings or ShadowSettings()
    X, y = np.asarray(X), np.asarray(y)
    n = len(X)
    if len(y) != n or n < 2:
        raise ValueError("X and y must hold the same (at least two) pool rows")
    ids = np.arange(n) if row_ids is None else np.asarray(row_ids)
    if len(ids) != n or len(np.unique(ids)) != n:
        raise ValueError("row_ids must be unique and name every pool row")
    rng = np.random.default_rng([int(settings.seed), 0])
    mask = balanced_in_mask(int(settings.n_shadows), n, settings.keep_fraction, rng)
    thetas = _train_many(recipe, X, y, n_classes, mask, settings, 0, progress)
    return ShadowSet(recipe, int(n_classes), thetas, mask, ids, settings, generation=0)


def shadow_phi(shadows: ShadowSet, X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """φ of every shadow on the given rows: float64 [N, n_rows] (signals.logit_scaled_confidence)."""
    return _phi_stacked(shadows.recipe, shadows.thetas, X, y, shadows.n_classes)


def _phi_stacked(recipe: tabular.TabularRecipe, thetas: torch.Tensor, X: np.ndarray, y: np.ndarray, n_classes: int):
    X, y = np.asarray(X), np.asarray(y)
    Z = tabular.predict_logits_stacked(recipe, thetas, X, n_classes)  # [N, n, C]
    N, n = Z.shape[0], Z.shape[1]
    if N == 0 or n == 0:
        return np.empty((N, n))
    return logit_scaled_confidence(Z.reshape(N * n, -1), np.tile(y, N)).reshape(N, n)  # φ is per row: all at once


def score_rows(shadows: ShadowSet, X_pool: np.ndarray, y_pool: np.ndarray, positions: np.ndarray) -> ShadowSet:
    """The set with every shadow's φ on the pool rows at ``positions`` kept (``Scored``); ``X_pool``/``y_pool``: the
    pool's rows in ``row_ids`` order. Drops and refills keep it (``drop_shadows``, ``refill_shadows``)."""
    positions = np.unique(np.asarray(positions, dtype=np.int64))
    X_pool, y_pool = np.asarray(X_pool), np.asarray(y_pool)
    phi = shadow_phi(shadows, X_pool[positions], y_pool[positions])
    ids = np.asarray(shadows.row_ids)[positions]
    order = np.argsort(ids, kind="stable")
    return replace(shadows, scored=Scored(ids[order], phi[:, order]))


def scored_phi(shadows: ShadowSet, columns: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For the pool ``columns`` asked: which have their φ kept (a bool mask) and those φ [N, hits]."""
    columns = np.asarray(columns, dtype=np.int64)
    scored = shadows.scored
    if scored is None or columns.size == 0 or scored.row_ids.size == 0:
        return np.zeros(columns.size, bool), np.empty((shadows.n_shadows, 0))
    wanted = np.asarray(shadows.row_ids)[columns]
    at = np.clip(np.searchsorted(scored.row_ids, wanted), 0, scored.row_ids.size - 1)
    hit = scored.row_ids[at] == wanted
    return hit, scored.phi[:, at[hit]]


def model_phi(
    recipe: tabular.TabularRecipe, theta: torch.Tensor, X: np.ndarray, y: np.ndarray, n_classes: int
) -> np.ndarray:
    """φ of one (target) model on the given rows, float64 [n_rows]; an ensemble θ (SISA) goes through probabilities."""
    X, y = np.asarray(X), np.asarray(y)
    theta = torch.as_tensor(theta)
    if tabular.ensemble_size(recipe, theta, X.shape[1], n_classes) > 1:
        return phi_from_proba(tabular.predict_proba(recipe, theta, X, n_classes), y)
    return logit_scaled_confidence(tabular.predict_logits(recipe, theta, X, n_classes), y)


def positions_of(shadows: ShadowSet, row_ids: np.ndarray) -> np.ndarray:
    """Pool column positions of the given row ids (raises on an unknown id). A sorted search, not a dict of the
    pool: a 1M-row pool took 0.8 s per audit to index in Python."""
    pool, wanted = np.asarray(shadows.row_ids), np.asarray(row_ids).reshape(-1)
    order = np.argsort(pool, kind="stable")
    at = np.clip(np.searchsorted(pool[order], wanted), 0, max(len(pool) - 1, 0))
    missing = np.flatnonzero(pool[order][at] != wanted) if len(pool) else np.arange(wanted.size)
    if missing.size:
        raise ValueError(f"row id {wanted[missing[0]].item()!r} is not in the shadow pool")
    return order[at].astype(np.int64)


def shadows_containing(shadows: ShadowSet, positions: np.ndarray) -> np.ndarray:
    """Indices of the shadows whose training subset held any of the given pool positions (sorted)."""
    pos = np.asarray(positions, dtype=np.int64).reshape(-1)
    if pos.size == 0:
        return np.zeros(0, dtype=np.int64)
    return np.flatnonzero(shadows.in_mask[:, pos].any(axis=1))


def strictly_convex(recipe: tabular.TabularRecipe) -> bool:
    """Logistic regression with l2 > 0: one optimum per training set, whatever the solver's start."""
    return recipe.family == "logistic_regression" and recipe.l2 > 0


def drop_shadows(shadows: ShadowSet, erased_positions: np.ndarray) -> tuple[ShadowSet, dict[str, int]]:
    """The erasure's part of the shadow upkeep (issue 21): every shadow that trained on an erased row is a copy of
    it and goes now, with the erased rows' pool columns; ``refill_shadows`` restores the pool later, after the
    request is certified. Returns the smaller set and counts {"dropped", "kept"}."""
    erased = np.unique(np.asarray(erased_positions, dtype=np.int64).reshape(-1))
    keep_cols = np.ones(shadows.in_mask.shape[1], bool)  # masks, not set differences over a 1M-column pool
    keep_cols[erased] = False
    holders = shadows_containing(shadows, erased) if erased.size else np.zeros(0, np.int64)
    kept = np.flatnonzero(~np.isin(np.arange(shadows.n_shadows), holders))
    scored = shadows.scored
    if scored is not None:  # the kept shadows' φ, without the erased rows' columns
        still = np.isin(scored.row_ids, shadows.row_ids[erased], invert=True)
        scored = Scored(scored.row_ids[still], scored.phi[kept][:, still])
    result = ShadowSet(
        shadows.recipe,
        shadows.n_classes,
        shadows.thetas[torch.as_tensor(kept, dtype=torch.long)],
        shadows.in_mask[kept][:, keep_cols],
        shadows.row_ids[keep_cols],
        shadows.settings,
        generation=shadows.generation,
        scored=scored,
    )
    return result, {"dropped": int(holders.size), "kept": int(kept.size)}


def out_counts(shadows: ShadowSet) -> np.ndarray:
    """Per pool row, how many shadows did NOT train on it (its OUT shadows: what offline LiRA scores it against)."""
    return shadows.n_shadows - shadows.in_mask.sum(axis=0)


def meets_minimum(shadows: ShadowSet, min_out: int) -> bool:
    """Whether every pool row has at least ``min_out`` OUT shadows: any row may be audited (a forget row, or a
    held-out row scored as a non-member), and LiRA's offline test needs only the shadows that did not see it."""
    return shadows.in_mask.shape[1] == 0 or int(out_counts(shadows).min(initial=shadows.n_shadows)) >= int(min_out)


def refill_block(settings: ShadowSettings) -> int:
    """The fewest shadows whose balanced draw leaves every row OUT of at least one (5 at keep 0.8, 2 at 0.5): a
    refill trains in blocks of this size, so each block adds one OUT shadow to every row of the pool."""
    return max(1, math.ceil(1.0 / (1.0 - float(settings.keep_fraction)) - 1e-9))


def refill_shadows(
    shadows: ShadowSet,
    X_pool: np.ndarray,
    y_pool: np.ndarray,
    init: torch.Tensor | None = None,
    progress: ProgressFn | None = None,
    count: int | None = None,
) -> tuple[ShadowSet, dict[str, int]]:
    """Train shadows until the set holds ``settings.n_shadows`` again (or ``count`` of them, at most that many), each
    on a fresh balanced draw over the pool (``X_pool``/``y_pool``: the pool's rows in ``row_ids`` order), seeded by
    (seed, generation + 1) so no draw is reused. ``init``: the served θ, for a strictly convex recipe (its optimum is
    unique, a nearby start converges in a few steps). Returns the set and {"trained"}."""
    missing = int(shadows.settings.n_shadows) - shadows.n_shadows
    if count is not None:
        missing = min(missing, int(count))
    if missing <= 0:
        return shadows, {"trained": 0}
    X_pool, y_pool = np.asarray(X_pool), np.asarray(y_pool)
    if len(X_pool) != len(shadows.row_ids) or len(y_pool) != len(X_pool):
        raise ValueError("X_pool / y_pool must hold the shadow pool's rows")
    generation = shadows.generation + 1
    rng = np.random.default_rng([int(shadows.settings.seed), generation])
    mask = balanced_in_mask(missing, len(X_pool), shadows.settings.keep_fraction, rng)
    start = None if init is None or not strictly_convex(shadows.recipe) else init
    new = _train_many(
        shadows.recipe, X_pool, y_pool, shadows.n_classes, mask, shadows.settings, generation * 1_000_003,
        progress, init=start,
    )  # fmt: skip
    scored = shadows.scored
    if scored is not None:  # the new shadows scored on the same rows as the others
        rows = positions_of(shadows, scored.row_ids)
        fresh = _phi_stacked(shadows.recipe, new, X_pool[rows], y_pool[rows], shadows.n_classes)
        scored = Scored(scored.row_ids, np.concatenate([scored.phi, fresh], axis=0))
    result = ShadowSet(
        shadows.recipe,
        shadows.n_classes,
        torch.cat([shadows.thetas, new], dim=0),
        np.concatenate([shadows.in_mask, mask], axis=0),
        shadows.row_ids,
        shadows.settings,
        generation=generation,
        scored=scored,
    )
    return result, {"trained": missing}


@dataclass
class ReplacementPlan:
    """Which shadows survive an erasure (``kept``), which go (``dropped``: they trained on an erased row), the pool
    columns that remain (``keep_cols``), and the membership rows of the replacements over the remaining pool."""

    kept: np.ndarray
    dropped: np.ndarray
    keep_cols: np.ndarray
    replacement_mask: np.ndarray
    generation: int


def replacement_plan(
    in_mask: np.ndarray, erased_positions: np.ndarray, settings: Any, generation: int, n_remaining: int
) -> ReplacementPlan:
    """The model-independent part of replacing shadows after an erasure (tabular and CLIP shadows alike).

    ``settings`` needs ``seed`` and ``keep_fraction``. Replacements get a fresh balanced draw over the remaining rows,
    seeded by (seed, generation) so a later generation never reuses an earlier subset draw.
    """
    erased = np.unique(np.asarray(erased_positions, dtype=np.int64).reshape(-1))
    n_old = in_mask.shape[1]
    if erased.size and (erased.min() < 0 or erased.max() >= n_old):
        raise ValueError("erased_positions must index the shadow pool")
    keep_cols = np.ones(n_old, dtype=bool)
    keep_cols[erased] = False
    if int(n_remaining) != int(keep_cols.sum()):
        raise ValueError(f"the remaining pool must hold the {int(keep_cols.sum())} rows left after erasure")
    dropped = np.flatnonzero(in_mask[:, erased].any(axis=1)) if erased.size else np.zeros(0, dtype=np.int64)
    kept = np.setdiff1d(np.arange(in_mask.shape[0]), dropped)
    nxt = int(generation) + 1
    repl = np.zeros((0, int(n_remaining)), dtype=bool)
    if dropped.size:
        rng = np.random.default_rng([int(settings.seed), nxt])
        repl = balanced_in_mask(len(dropped), int(n_remaining), settings.keep_fraction, rng)
    return ReplacementPlan(kept, dropped, keep_cols, repl, nxt)


SHADOW_FORMAT = "lethe-shadows/1"


def pack_shadows(
    thetas: torch.Tensor,
    in_mask: np.ndarray,
    row_ids: np.ndarray,
    meta: dict[str, str],
    extra: dict[str, np.ndarray] | None = None,
) -> bytes:
    """Shadow parameters, membership matrix and pool row ids as safetensors, with string metadata (any family);
    ``extra``: further arrays stored as they are (a tabular set's scored rows)."""
    from safetensors.torch import save

    tensors = {
        "thetas": thetas.detach().float().contiguous(),
        "in_mask_bits": torch.from_numpy(np.ascontiguousarray(np.packbits(np.asarray(in_mask, bool), axis=1))),
        "row_ids": torch.from_numpy(np.ascontiguousarray(np.asarray(row_ids, dtype=np.int64))),
        **{name: torch.from_numpy(np.ascontiguousarray(array)) for name, array in (extra or {}).items()},
    }
    return save(tensors, metadata=meta)


def _unpacked(data: bytes, fmt: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    from safetensors.torch import load

    header_len = int.from_bytes(data[:8], "little")  # safetensors: u64 header length, then the JSON header
    meta = json.loads(data[8 : 8 + header_len]).get("__metadata__") or {}
    if meta.get("format") != fmt:
        raise ValueError("not a Lethe shadow set" if not str(meta.get("format", "")).startswith("lethe") else
                         f"a {meta.get('format')} shadow set, not {fmt}")  # fmt: skip
    return load(data), meta


def unpack_shadows(data: bytes, fmt: str) -> tuple[torch.Tensor, np.ndarray, np.ndarray, dict[str, str]]:
    """(thetas, in_mask, row_ids, metadata) of ``pack_shadows`` bytes whose metadata "format" is ``fmt``."""
    tensors, meta = _unpacked(data, fmt)
    return tensors["thetas"], _in_mask(tensors), tensors["row_ids"].numpy(), meta


def _in_mask(tensors: dict[str, torch.Tensor]) -> np.ndarray:
    """The membership matrix: one bit per entry (sets stored before: one byte, ``in_mask``)."""
    if "in_mask_bits" in tensors:
        n = len(tensors["row_ids"])
        return np.unpackbits(tensors["in_mask_bits"].numpy(), axis=1, count=n).astype(bool)
    return tensors["in_mask"].numpy().astype(bool)


def shadows_to_bytes(shadows: ShadowSet) -> bytes:
    """The shadow set as safetensors (θs, membership matrix, pool row ids) with its recipe and settings as metadata.

    Pool row ids should be positions, not sample ids: the stored set must not become a copy of identifiers."""
    meta = {
        "format": SHADOW_FORMAT,
        "recipe": json.dumps(shadows.recipe.to_dict(), sort_keys=True),
        "n_classes": str(shadows.n_classes),
        "settings": json.dumps(asdict(shadows.settings), sort_keys=True),
        "generation": str(shadows.generation),
    }
    scored = shadows.scored
    extra = None if scored is None else {"scored_ids": scored.row_ids.astype(np.int64), "scored_phi": scored.phi}
    return pack_shadows(shadows.thetas, shadows.in_mask, shadows.row_ids, meta, extra)


def shadows_from_bytes(data: bytes) -> ShadowSet:
    tensors, meta = _unpacked(data, SHADOW_FORMAT)
    scored = None
    if "scored_ids" in tensors:  # sets stored before scored rows have none: their audits score every row
        scored = Scored(tensors["scored_ids"].numpy(), tensors["scored_phi"].numpy())
    return ShadowSet(
        tabular.TabularRecipe.from_dict(json.loads(meta["recipe"])),
        int(meta["n_classes"]),
        tensors["thetas"],
        _in_mask(tensors),
        tensors["row_ids"].numpy(),
        ShadowSettings(**json.loads(meta["settings"])),
        generation=int(meta["generation"]),
        scored=scored,
    )

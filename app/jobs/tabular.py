"""The tabular wing: version 1 of a registered table model (and its methods' one-off preparation), and the load and
unlearn steps of a tabular deletion. Thin glue between the registry (app/registry/versions.py) and app/ml.
"""

from __future__ import annotations

import io
import json
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from app.audit.service import append_event
from app.db import session_scope
from app.jobs.lease import JobContext, finish
from app.jobs.outbox import PermanentJobError
from app.jobs.tables import Job
from app.jobs.work import DeletionWork, ErasurePlan, Unlearned, Verification, build, weights
from app.ml import tabular
from app.ml.data.tabular import TableEncoder, load_table
from app.ml.unlearning.base import TabularProblem, UnlearningResult, get_method
from app.ml.verification.audit import run_audit
from app.ml.verification.bounds import gradient_norm_bound
from app.ml.verification.plots import audit_plots
from app.ml.verification.policy import VerdictPolicy, decide, theta_unchanged
from app.ml.verification.shadows import (
    ShadowSettings,
    positions_of,
    replace_shadows,
    shadows_from_bytes,
    shadows_to_bytes,
    train_shadows,
)
from app.registry import versions as registry
from app.registry.tables import Dataset, Model
from app.storage import get_store

DEFAULT_SHADOWS = 64
"""LiRA shadows per model unless the registration says otherwise (Carlini et al. use 64 for per-example variance)."""
HOLDOUT_SEED_OFFSET = 7919
"""The held-out split's random stream is the recipe's seed plus this (kept apart from the training seed's)."""
ENCODED_CACHE_SIZE = 4
"""Encoded tables a worker keeps in memory (keyed by data-set digest and encoder)."""
NONE_NEEDED = "none-needed"
POSITION_COLUMN = "__lethe_position"
"""Column of a rewritten table: each remaining row's position at registration."""
ERASED_CATEGORY = "<erased:"
"""Prefix of the placeholder that replaces a category only erased rows carried (a category can be personal data)."""
"""The 'method' of a version whose deleted rows were never trained on (held out): parameters unchanged."""


# ------------------------------------------------------------------------------------------------------ data
@dataclass
class TabularData:
    """The table in registry order, one slot per position at registration: an erased row's slot is all zeros, its
    id empty and ``present`` False (positions, holdout split and method state keep their meaning after erasure)."""

    X: np.ndarray
    y: np.ndarray
    row_ids: np.ndarray
    encoder: TableEncoder
    present: np.ndarray


@lru_cache(maxsize=ENCODED_CACHE_SIZE)
def _load_encoded(
    dataset_digest: str, encoder_json: str | None, label_column: str, row_id_column: str, n_positions: int | None
) -> TabularData:
    df = load_table(io.BytesIO(get_store().get_bytes(dataset_digest)))
    if encoder_json is None:
        encoder = TableEncoder.fit(df, label_column, exclude=[row_id_column, POSITION_COLUMN])
    else:
        encoder = TableEncoder.from_dict(json.loads(encoder_json))
    X, y, ids = encoder.transform(df), encoder.encode_labels(df[label_column]), df[row_id_column].astype(str).to_numpy()
    if POSITION_COLUMN not in df.columns:
        return TabularData(X, y, ids, encoder, np.ones(len(df), bool))
    positions = df[POSITION_COLUMN].to_numpy(dtype=np.int64)
    n = int(n_positions or (positions.max() + 1 if len(positions) else 0))
    full = TabularData(
        np.zeros((n, X.shape[1]), np.float32), np.zeros(n, np.int64), np.full(n, "", object), encoder, np.zeros(n, bool)
    )
    full.X[positions], full.y[positions], full.row_ids[positions], full.present[positions] = X, y, ids, True
    return full


def load_tabular(dataset: Dataset, model: Model) -> TabularData:
    encoder = model.state.get("encoder")
    return _load_encoded(
        dataset.digest,
        json.dumps(encoder, sort_keys=True) if encoder else None,
        dataset.label_column,
        dataset.row_id_column,
        dataset.n_positions,
    )


def rewrite_table(dataset: Dataset, erased: np.ndarray) -> bytes:
    """The stored table without the erased positions (same format), each remaining row keeping its position."""
    df = load_table(io.BytesIO(get_store().get_bytes(dataset.digest)))
    positions = df[POSITION_COLUMN].to_numpy() if POSITION_COLUMN in df.columns else np.arange(len(df))
    keep = ~np.isin(positions, erased)
    out = df.loc[keep].copy()
    out[POSITION_COLUMN] = positions[keep]
    buffer = io.BytesIO()
    if dataset.format == "parquet":
        out.to_parquet(buffer, index=False)
    else:
        out.to_csv(buffer, index=False)
    return buffer.getvalue()


def scrub_encoder(encoder: TableEncoder, data: TabularData, erased: np.ndarray) -> dict[str, Any] | None:
    """The encoder with every category that only erased rows carried renamed to a placeholder (the one-hot layout,
    and so θ's, is unchanged). Means and standard deviations are aggregates over the registration data and stay."""
    remaining = data.present.copy()
    remaining[erased] = False
    scrubbed, changed, j = encoder.to_dict(), False, 0
    for col in encoder.feature_columns:
        if col not in encoder.categories:
            j += 1
            continue
        cats = encoder.categories[col]
        used = data.X[remaining, j : j + len(cats)].any(axis=0)
        for k, cat in enumerate(cats):
            if not used[k] and not cat.startswith(ERASED_CATEGORY):
                scrubbed["categories"][col][k] = f"{ERASED_CATEGORY}{j + k}>"
                changed = True
        j += len(cats)
    return scrubbed if changed else None


def holdout_mask(n: int, fraction: float, seed: int) -> np.ndarray:
    """Rows never trained on, for test accuracy; fixed per model by its recipe's seed."""
    mask = np.zeros(n, dtype=bool)
    if fraction > 0:
        rng = np.random.default_rng(seed + HOLDOUT_SEED_OFFSET)
        mask[rng.permutation(n)[: int(round(n * fraction))]] = True
    return mask


def _evaluate(recipe, theta, data: TabularData, n_classes: int, masks: dict[str, np.ndarray]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, mask in masks.items():
        if mask.any():
            out[f"accuracy_{name}"] = round(tabular.accuracy(recipe, theta, data.X[mask], data.y[mask], n_classes), 6)
            out[f"rows_{name}"] = int(mask.sum())
    return out


# ------------------------------------------------------------------------------------------------------ version 1
def train(job: Job, ctx: JobContext) -> None:
    """Train version 1 of a registered tabular model, then run the one-off preparation of its unlearning methods."""
    with session_scope() as session:
        model, dataset, _ = registry.load_model(session, job.model_id)
        existing = registry.version_for_job(session, job.id)
        session.expunge_all()
    ctx.progress(0.02, "loading the data set")
    try:
        data = load_tabular(dataset, model)
    except (ValueError, KeyError) as exc:
        raise PermanentJobError(f"the data set cannot be used: {exc}", "invalid-dataset") from exc
    if len(set(data.row_ids.tolist())) != len(data.row_ids):
        raise PermanentJobError(f"row-id column {dataset.row_id_column!r} has duplicates", "invalid-dataset")
    recipe = tabular.TabularRecipe.from_dict(model.spec["recipe"])
    holdout = holdout_mask(len(data.y), model.spec.get("holdout_fraction", 0.2), recipe.seed)

    if existing is None:
        ctx.progress(0.1, f"training {recipe.family} on {int((~holdout).sum())} rows")
        started = time.perf_counter()
        theta = tabular.train(recipe, data.X[~holdout], data.y[~holdout], data.encoder.n_classes)
        metrics = _evaluate(recipe, theta, data, data.encoder.n_classes, {"train": ~holdout, "holdout": holdout})
        metrics["train_seconds"] = round(time.perf_counter() - started, 4)
        draft = registry.VersionDraft(
            model_id=model.id,
            number=1,
            digest=registry.put_weights(theta),
            method="train",
            job_id=job.id,
            metrics=metrics,
        )
        with session_scope() as session:
            ctx.assert_lease(session)
            registry.index_rows(session, dataset.id, data.row_ids.tolist(), data.encoder.decode_labels(data.y))
            version = registry.add_version(
                session,
                draft,
                state_update={
                    "encoder": data.encoder.to_dict(),
                    "classes": data.encoder.classes,
                    "n_features": data.encoder.n_features,
                },
            )
            append_event(
                session,
                actor="worker",
                action="model_version.created",
                entity_type="model",
                entity_id=model.id,
                payload={"version": 1, "digest": draft.digest, "method": "train", "job_id": job.id},
            )
            version_id = version.id
    else:
        theta, version_id = weights(existing.digest), existing.id
    with session_scope() as session:
        model, _, _ = registry.load_model(session, job.model_id)
    if "verification" not in model.state:
        train_verification_shadows(ctx, model, recipe, data)
    with session_scope() as session:  # ready once every deletion can be verified; methods prepare after
        registry.mark_ready(session, job.model_id)
        model, _, _ = registry.load_model(session, job.model_id)
    preparations = prepare_methods(ctx, model, recipe, data, theta, holdout)
    finish(job.id, ctx.owner, {"version_id": version_id, "preparations": preparations})


def train_verification_shadows(ctx: JobContext, model: Model, recipe, data: TabularData) -> None:
    """LiRA's shadow models for this model (issue 9; notes Part 2): the model's own recipe on random halves of the
    rows it holds (training and held-out alike), so every row is IN about half the shadows and OUT of the rest. Pool
    columns are positions, never sample ids. Stored with the model; replaced when rows are erased."""
    settings = ShadowSettings(n_shadows=int(model.spec.get("verification", {}).get("shadows", DEFAULT_SHADOWS)))
    pool = np.flatnonzero(data.present)
    started = time.perf_counter()
    shadows = train_shadows(
        recipe,
        data.X[pool],
        data.y[pool],
        data.encoder.n_classes,
        settings,
        row_ids=pool,
        progress=lambda done, total: ctx.progress(0.2 + 0.1 * done / total, f"verification shadows {done}/{total}"),
    )
    entry = {
        "shadows": get_store().put_bytes(shadows_to_bytes(shadows)),
        "n_shadows": shadows.n_shadows,
        "generation": shadows.generation,
        "train_seconds": round(time.perf_counter() - started, 3),
    }
    with session_scope() as session:
        ctx.assert_lease(session)
        registry.set_state(session, model.id, {"verification": entry})


def prepare_methods(ctx: JobContext, model: Model, recipe, data: TabularData, theta, holdout) -> dict[str, Any]:
    """The one-off preparation of every method the registration asked for that has one (e.g. a learned unlearner's
    meta-training); each is recorded as soon as it is done, so a retried job resumes with the next."""
    preparations: dict[str, Any] = {}
    prepared = registry.prepared_methods(model)
    for name in model.spec.get("unlearning", []):
        spec = get_method(name)
        if not spec.needs_preparation or name in prepared:
            continue
        ctx.progress(0.3, f"preparing {name}")
        method = build(spec, model.spec.get("method_settings", {}).get(name, {}))
        started = time.perf_counter()
        n = len(data.y)
        problem = TabularProblem(
            recipe=recipe,
            X=data.X,
            y=data.y,
            n_classes=data.encoder.n_classes,
            theta=theta,
            retain_mask=~holdout,
            forget_mask=np.zeros(n, bool),
            tombstone_mask=np.zeros(n, bool),
            progress=ctx.scaled(0.3, 0.68, name),
        )
        result = method.prepare(problem)
        info = {**result.info, "prepare_seconds": round(time.perf_counter() - started, 3)}
        preparations[name] = info
        with session_scope() as session:
            ctx.assert_lease(session)
            registry.store_method_state(session, model.id, name, result.artifacts, info)
            append_event(
                session,
                actor="worker",
                action="method.prepared",
                entity_type="model",
                entity_id=model.id,
                payload={"method": name, "info": info},
            )
    return preparations


# ------------------------------------------------------------------------------------------------------ deletion
@dataclass
class TabularInputs:
    data: TabularData
    recipe: tabular.TabularRecipe
    positions: list[int]
    holdout: np.ndarray
    forget: np.ndarray
    tombstone: np.ndarray

    @property
    def retain(self) -> np.ndarray:
        """Rows the new version may learn from: trained on before, not deleted now or earlier."""
        return ~self.holdout & ~self.forget & ~self.tombstone


class Deletion:
    """A tabular deletion: rows of the registered table, by sample ids or by label."""

    def load(self, work: DeletionWork, ctx: JobContext) -> TabularInputs:
        with session_scope() as session:
            try:
                positions = registry.positions_of(session, work.dataset.id, work.request.scope)
            except ValueError as exc:
                raise PermanentJobError(str(exc), "scope-not-supported") from exc
            flagged = [p for p, _ in registry.tombstones(session, work.dataset.id, except_request=work.request.id)]
        if not positions:  # every row was erased by an earlier request meanwhile: never a second version
            raise PermanentJobError("every row of this request was already erased by an earlier one", "already-deleted")
        data = load_tabular(work.dataset, work.model)
        recipe = tabular.TabularRecipe.from_dict(work.model.spec["recipe"])
        n = len(data.y)
        forget, tombstone = np.zeros(n, bool), np.zeros(n, bool)
        forget[positions] = True
        tombstone[flagged] = True
        tombstone |= ~data.present  # erased by earlier requests: their slots are empty
        holdout = holdout_mask(n, work.model.spec.get("holdout_fraction", 0.2), recipe.seed)
        return TabularInputs(data, recipe, positions, holdout, forget, tombstone)

    def erase(self, work: DeletionWork, unlearned: Unlearned, ctx: JobContext) -> ErasurePlan:
        return erase_copies(work, unlearned, ctx)

    def verify(self, work: DeletionWork, unlearned: Unlearned, ctx: JobContext) -> Verification:
        return verify_deletion(work, unlearned)

    def unlearn(self, work: DeletionWork, ctx: JobContext) -> Unlearned:
        inputs: TabularInputs = work.inputs
        data, recipe, holdout, forget, tombstone = (
            inputs.data,
            inputs.recipe,
            inputs.holdout,
            inputs.forget,
            inputs.tombstone,
        )
        n_classes = len(work.model.state["classes"])
        theta_parent = weights(work.parent.digest)
        name = work.method_name
        trained_forget = forget & ~holdout & ~tombstone
        started = time.perf_counter()
        parent_saw_rows = bool(trained_forget.any())
        if not parent_saw_rows:
            # every row to forget is one the model never trained on (held out for testing): the parameters carry no
            # trace of them, so the new version keeps them and only the tombstones change.
            name = NONE_NEEDED
            result = UnlearningResult(theta=theta_parent, info={"reason": "the rows were held out of training"})
        else:
            problem = TabularProblem(
                recipe=recipe,
                X=data.X,
                y=data.y,
                n_classes=n_classes,
                theta=theta_parent,
                retain_mask=inputs.retain,
                forget_mask=forget & ~holdout,
                tombstone_mask=tombstone,
                artifacts=registry.method_artifacts(work.model, name) if work.spec.needs_preparation else {},
                progress=ctx.scaled(0.1, 0.75, name),
            )
            ctx.progress(0.1, f"unlearning {int(trained_forget.sum())} rows with {name}")
            try:
                result = work.method.unlearn(problem)
            except ValueError as exc:  # the method refuses this input: retrying cannot help
                raise PermanentJobError(f"{name} cannot do this deletion: {exc}", "unlearning-refused") from exc
        unlearn_seconds = time.perf_counter() - started
        ctx.progress(0.9, "evaluating")
        masks = {"retain": inputs.retain, "forget": forget, "holdout": holdout & ~forget & ~tombstone}
        metrics = {
            "method": name,
            "unlearn_seconds": round(unlearn_seconds, 4),
            "before": _evaluate(recipe, theta_parent, data, n_classes, masks),
            "after": _evaluate(recipe, result.theta, data, n_classes, masks),
            "method_info": result.info,
        }
        return Unlearned(
            theta=result.theta,
            method=name,
            metrics=metrics,
            positions=inputs.positions,
            method_artifacts=dict(result.artifacts),
            parent_saw_rows=parent_saw_rows,
        )


# ------------------------------------------------------------------------------------------------------ erasure
def erase_copies(work: DeletionWork, unlearned: Unlearned, ctx: JobContext) -> ErasurePlan:
    """Replacements for every stored copy of the erased rows: the table rewritten without them, the encoder without
    categories only they carried, and the state of every other prepared method purged (or dropped when the method
    cannot purge: it must be prepared again before it serves)."""
    inputs: TabularInputs = work.inputs
    erased = np.asarray(sorted(unlearned.positions), dtype=np.int64)
    ctx.progress(0.92, f"erasing {len(erased)} rows from the stored table and method state")
    new_digest = get_store().put_bytes(rewrite_table(work.dataset, erased))
    encoder = scrub_encoder(inputs.data.encoder, inputs.data, erased)
    purged: dict[str, dict[str, bytes]] = {}
    invalidated: dict[str, str] = {}
    if unlearned.method_artifacts:
        purged[unlearned.method] = unlearned.method_artifacts
    for name in sorted(registry.prepared_methods(work.model) - {unlearned.method}):
        method = build(get_method(name), work.model.spec.get("method_settings", {}).get(name, {}))
        if not hasattr(method, "purge"):
            invalidated[name] = f"{name} cannot purge rows erased by another method"
            continue
        forget = np.zeros(len(inputs.data.y), bool)
        forget[erased] = True
        problem = TabularProblem(
            recipe=inputs.recipe,
            X=inputs.data.X,
            y=inputs.data.y,
            n_classes=inputs.data.encoder.n_classes,
            theta=weights(work.parent.digest),
            retain_mask=inputs.retain,
            forget_mask=forget,
            tombstone_mask=inputs.tombstone,
            artifacts=registry.method_artifacts(work.model, name),
            progress=ctx.scaled(0.92, 0.05, f"purging {name}"),
        )
        purged[name] = dict(method.purge(problem).artifacts)
    state_update: dict[str, Any] = {"encoder": encoder} if encoder else {}
    if "verification" in work.model.state:
        state_update["verification"] = _replace_shadows(work.model.state["verification"], inputs.data, erased, ctx)
    return ErasurePlan(
        dataset_digest=new_digest,
        state_update=state_update,
        purged=purged,
        invalidated=invalidated,
    )


# ------------------------------------------------------------------------------------------------------ verification
def verify_deletion(work: DeletionWork, unlearned: Unlearned) -> Verification:
    """LiRA on the forget rows against the original and the new parameters (matched non-members: held-out rows),
    the audit's power, test accuracy against the original, and — for L2-regularised LR — the proven distance to the
    retrained optimum; the model's verdict policy decides (app/ml/verification, issue 9)."""
    inputs: TabularInputs = work.inputs
    data, recipe = inputs.data, inputs.recipe
    policy = VerdictPolicy.from_dict(work.model.spec.get("verification", {}).get("policy"))
    theta_parent = weights(work.parent.digest)
    trained = np.flatnonzero(inputs.forget & ~inputs.holdout & ~inputs.tombstone)
    if len(trained) == 0:
        report = {"n_forget": 0, "informative": False, "informative_detail": "the rows were held out of training"}
        verdict = {
            "verdict": "pass",
            "reasons": ["every deleted row was held out of training: no version carries a trace of it"],
            "checks": [],
            "notes": [],
            "policy": policy.to_dict(),
        }
        return Verification(report, verdict)
    test = inputs.holdout & data.present & ~inputs.forget
    proven = _proven_distance(recipe, unlearned.theta, data, inputs.retain)
    if "verification" not in work.model.state:  # registered before verification existed
        return _verify_without_attack(policy, theta_parent, unlearned.theta, len(trained), proven, "no shadow models")
    shadows = shadows_from_bytes(get_store().get_bytes(work.model.state["verification"]["shadows"]))
    pool = np.asarray(shadows.row_ids, dtype=np.int64)
    nonmembers = np.flatnonzero(np.isin(pool, np.flatnonzero(test)))
    if len(nonmembers) == 0:
        reason = "no held-out rows to serve as non-members"
        return _verify_without_attack(policy, theta_parent, unlearned.theta, len(trained), proven, reason)
    try:
        report, scores = run_audit(
            shadows,
            data.X[pool],
            data.y[pool],
            positions_of(shadows, trained),
            nonmembers,
            theta_parent,
            unlearned.theta,
            theta_retrained=unlearned.theta if work.spec.exact else None,
            X_test=data.X[test],
            y_test=data.y[test],
            trained_on_forget=True,
            policy=policy,
        )
    except ValueError as exc:  # e.g. too few shadows on one side of a row: say so instead of failing the job
        return _verify_without_attack(policy, theta_parent, unlearned.theta, len(trained), proven, str(exc))
    report["proven"] = proven
    verdict = decide(report, policy, proven_distance=proven.get("bound") if proven else None, exact=work.spec.exact)
    return Verification(report, verdict, audit_plots(scores))


def _proven_distance(recipe, theta, data: TabularData, retain: np.ndarray) -> dict[str, Any] | None:
    """‖∇L_retained(θ′)‖ and, for L2-regularised LR, the proven bound on ‖θ′ − θ_retrain‖ (bounds.py); None for an
    ensemble (SISA), whose parameters are not one model's."""
    if tabular.ensemble_size(recipe, theta, data.X.shape[1], data.encoder.n_classes) > 1:
        return None
    return gradient_norm_bound(recipe, theta, data.X, data.y, data.encoder.n_classes, retain)


def _verify_without_attack(policy, theta, theta_new, k: int, proven, reason: str) -> Verification:
    """The attack cannot run (no held-out rows to serve as non-members, or no shadows), and the report says so; the
    verdict rests on the parameters having changed and on a proven bound where one exists."""
    unchanged = theta_unchanged(theta, theta_new, policy.unchanged_atol)
    checks = [
        {
            "name": "parameters_changed",
            "figure": None,
            "threshold": policy.unchanged_atol,
            "passed": not unchanged,
            "message": "the model was returned unchanged" if unchanged else "the parameters changed",
        }
    ]
    bound = proven.get("bound") if proven else None
    if bound is not None and policy.max_proven_distance is not None:
        ok = bound <= policy.max_proven_distance
        checks.append(
            {
                "name": "proven_distance",
                "figure": bound,
                "threshold": policy.max_proven_distance,
                "passed": ok,
                "message": f"proven ‖θ′ − θ_retrain‖ ≤ {bound:.3g}",
            }
        )
    failed = [c["message"] for c in checks if c["passed"] is False]
    report = {
        "n_forget": k,
        "n_nonmembers": 0,
        "informative": False,
        "informative_detail": f"{reason}: the membership attack could not run",
        "proven": proven,
    }
    verdict = {
        "verdict": "fail" if failed else "pass",
        "reasons": failed or [c["message"] for c in checks],
        "checks": checks,
        "notes": [report["informative_detail"]],
        "policy": policy.to_dict(),
    }
    return Verification(report, verdict)


def _replace_shadows(entry: dict[str, Any], data: TabularData, erased: np.ndarray, ctx: JobContext) -> dict[str, Any]:
    """Shadows that trained on an erased row are copies of it: drop them and train as many on the remaining rows."""
    shadows = shadows_from_bytes(get_store().get_bytes(entry["shadows"]))
    pool = np.asarray(shadows.row_ids, dtype=np.int64)
    gone = np.flatnonzero(np.isin(pool, erased))
    remaining = pool[~np.isin(pool, erased)]
    ctx.progress(0.97, "replacing verification shadows that saw the erased rows")
    new, counts = replace_shadows(shadows, gone, data.X[remaining], data.y[remaining])
    return {
        **entry,
        "shadows": get_store().put_bytes(shadows_to_bytes(new)),
        "generation": new.generation,
        "last_replacement": counts,
    }

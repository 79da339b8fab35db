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
from app.jobs.work import DeletionWork, ErasurePlan, Unlearned, build, weights
from app.ml import tabular
from app.ml.data.tabular import TableEncoder, load_table
from app.ml.unlearning.base import TabularProblem, UnlearningResult, get_method
from app.registry import versions as registry
from app.registry.tables import Dataset, Model
from app.storage import get_store

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
            registry.mark_ready(session, model.id)
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
    preparations = prepare_methods(ctx, model, recipe, data, theta, holdout)
    finish(job.id, ctx.owner, {"version_id": version_id, "preparations": preparations})


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
    return ErasurePlan(
        dataset_digest=new_digest,
        state_update={"encoder": encoder} if encoder else {},
        purged=purged,
        invalidated=invalidated,
    )

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
from app.jobs.work import DeletionWork, Unlearned, build, weights
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
"""The 'method' of a version whose deleted rows were never trained on (held out): parameters unchanged."""


# ------------------------------------------------------------------------------------------------------ data
@dataclass
class TabularData:
    X: np.ndarray
    y: np.ndarray
    row_ids: np.ndarray
    encoder: TableEncoder


@lru_cache(maxsize=ENCODED_CACHE_SIZE)
def _load_encoded(dataset_digest: str, encoder_json: str | None, label_column: str, row_id_column: str) -> TabularData:
    df = load_table(io.BytesIO(get_store().get_bytes(dataset_digest)))
    if encoder_json is None:
        encoder = TableEncoder.fit(df, label_column, exclude=[row_id_column])
    else:
        encoder = TableEncoder.from_dict(json.loads(encoder_json))
    return TabularData(
        encoder.transform(df),
        encoder.encode_labels(df[label_column]),
        df[row_id_column].astype(str).to_numpy(),
        encoder,
    )


def load_tabular(dataset: Dataset, model: Model) -> TabularData:
    encoder = model.state.get("encoder")
    return _load_encoded(
        dataset.digest,
        json.dumps(encoder, sort_keys=True) if encoder else None,
        dataset.label_column,
        dataset.row_id_column,
    )


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
            earlier = [p for p, _ in registry.tombstones(session, work.dataset.id, except_request=work.request.id)]
        data = load_tabular(work.dataset, work.model)
        recipe = tabular.TabularRecipe.from_dict(work.model.spec["recipe"])
        n = len(data.y)
        forget, tombstone = np.zeros(n, bool), np.zeros(n, bool)
        forget[positions] = True
        tombstone[earlier] = True
        holdout = holdout_mask(n, work.model.spec.get("holdout_fraction", 0.2), recipe.seed)
        return TabularInputs(data, recipe, positions, holdout, forget, tombstone)

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
        if not trained_forget.any():
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
        )

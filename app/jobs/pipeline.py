"""What a worker does with a job (ARCHITECTURE.md, "worker"): load, unlearn, store, verify, publish.

Every step is idempotent. Artifacts are content-addressed (a re-run writes the same blob), a model version is unique
per job (a re-run after a crash finds it and goes straight to publishing), and the finishing transaction checks that
this worker still holds the lease, so a worker that lost its lease writes nothing.
"""

from __future__ import annotations

import io
import logging
import threading
import time
import traceback
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors
from sqlalchemy import insert, select, update

from app.audit.service import append_event
from app.config import get_settings
from app.db import session_scope, utcnow
from app.jobs import service as jobs
from app.jobs.service import PermanentJobError
from app.jobs.tables import Job
from app.ml import tabular
from app.ml.data.tabular import TableEncoder, load_table
from app.ml.unlearning.base import InvalidMethodSettingsError, TabularProblem, UnlearningResult, get_method
from app.registry.tables import Dataset, DatasetRow, Model, ModelVersion
from app.requests.tables import DeletionRequest
from app.storage import get_store
from app.webhooks.service import deliver_webhook

log = logging.getLogger("lethe.pipeline")


class JobContext:
    """Progress reporting and the lease heartbeat of one running job.

    A background thread renews the lease (every ``lease_seconds / 3``, at least once a second) whatever the ML code
    is doing, so an expired lease means a dead worker, never a slow step. Progress is written at most twice a second
    from the caller; a report that comes sooner is kept and written by the next beat, so the latest message is never
    lost. If the lease is lost (another worker took the job), ``lost`` is set and the finishing transaction refuses
    to write.
    """

    def __init__(self, job_id: str, owner: str):
        self.job_id, self.owner = job_id, owner
        self._last_report = 0.0
        self._pending: tuple[float, str] | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.lost = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"lease-{job_id[:8]}", daemon=True)

    def __enter__(self) -> JobContext:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _beat(self) -> None:
        interval = min(1.0, max(0.2, get_settings().lease_seconds / 3))
        lease_every = max(0.2, get_settings().lease_seconds / 3)
        last_lease = time.monotonic()
        while not self._stop.wait(interval):
            with self._lock:
                pending, self._pending = self._pending, None
            if pending is None and time.monotonic() - last_lease < lease_every:
                continue
            try:
                jobs.heartbeat(self.job_id, self.owner, *(pending or (None, None)))
                last_lease = time.monotonic()
            except jobs.LeaseLostError:
                self.lost.set()
                return
            except Exception:  # a database hiccup: the next beat retries, the lease has slack for it
                log.warning("heartbeat for job %s failed", self.job_id, exc_info=True)

    def progress(self, fraction: float, message: str) -> None:
        """Record progress on the job and its request (now, or with the next beat if the last write was < 0.5 s ago)."""
        if self.lost.is_set():
            raise jobs.LeaseLostError(self.job_id)
        now = time.monotonic()
        with self._lock:
            if now - self._last_report < 0.5 and fraction < 1.0:
                self._pending = (fraction, message)
                return
            self._pending = None
            self._last_report = now
        jobs.heartbeat(self.job_id, self.owner, fraction, message)


def execute_job(job_id: str, owner: str) -> str:
    """Entry point for Celery tasks and the in-process executor. Returns the job's final status."""
    job = jobs.claim(job_id, owner)
    if job is None:
        log.info("job %s not claimable (done, taken, or out of attempts)", job_id)
        return "skipped"
    try:
        with JobContext(job_id, owner) as ctx:
            HANDLERS[job.kind](job, ctx)
        return "succeeded"
    except jobs.LeaseLostError:
        log.warning("job %s: lease lost to another worker; stopping without writing", job_id)
        return "lease-lost"
    except (PermanentJobError, InvalidMethodSettingsError) as exc:
        problem = getattr(
            exc,
            "problem_type",
            "invalid-method-settings" if isinstance(exc, InvalidMethodSettingsError) else "unprocessable",
        )
        jobs.fail(job_id, owner, str(exc), permanent=True, request_status="rejected", problem_type=problem)
        return "rejected"
    except Exception as exc:
        log.exception("job %s failed", job_id)
        jobs.fail(job_id, owner, f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}", permanent=False)
        return "failed"


# --------------------------------------------------------------------------------------------------- data
@dataclass
class TabularData:
    X: np.ndarray
    y: np.ndarray
    row_ids: np.ndarray
    encoder: TableEncoder


@lru_cache(maxsize=4)
def _load_encoded(dataset_digest: str, encoder_json: str | None, label_column: str, row_id_column: str):
    import json

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
    import json

    encoder = model.state.get("encoder")
    return _load_encoded(
        dataset.digest,
        json.dumps(encoder, sort_keys=True) if encoder else None,
        dataset.label_column,
        dataset.row_id_column,
    )


def holdout_mask(n: int, fraction: float, seed: int) -> np.ndarray:
    """Rows never trained on, for test accuracy; fixed per model by its seed."""
    mask = np.zeros(n, dtype=bool)
    if fraction > 0:
        rng = np.random.default_rng(seed + 7919)
        mask[rng.permutation(n)[: int(round(n * fraction))]] = True
    return mask


def theta_to_bytes(theta: torch.Tensor) -> bytes:
    return save_tensors({"theta": theta.detach().to("cpu", torch.float32).contiguous()})


def theta_from_bytes(data: bytes) -> torch.Tensor:
    return load_tensors(data)["theta"]


def _evaluate(recipe, theta, data: TabularData, n_classes: int, masks: dict[str, np.ndarray]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, mask in masks.items():
        if mask.any():
            out[f"accuracy_{name}"] = round(tabular.accuracy(recipe, theta, data.X[mask], data.y[mask], n_classes), 6)
            out[f"rows_{name}"] = int(mask.sum())
    return out


def _method_artifacts(model: Model, method: str) -> dict[str, bytes]:
    digests = model.state.get("methods", {}).get(method, {}).get("artifacts", {})
    store = get_store()
    return {name: store.get_bytes(digest) for name, digest in digests.items()}


def _store_method_artifacts(state: dict[str, Any], method: str, artifacts: dict[str, bytes], info: dict) -> dict:
    store = get_store()
    methods = dict(state.get("methods", {}))
    entry = dict(methods.get(method, {}))
    entry["artifacts"] = {**entry.get("artifacts", {}), **{k: store.put_bytes(v) for k, v in artifacts.items()}}
    entry["status"] = "ready"
    entry["info"] = info
    methods[method] = entry
    return {**state, "methods": methods}


# --------------------------------------------------------------------------------------------------- train
def run_train_model(job: Job, ctx: JobContext) -> None:
    """Train version 1 of a registered tabular model, then run the one-off preparation of its unlearning methods."""
    with session_scope() as session:
        kind = session.get(Model, job.model_id).kind
    if kind == "clip_federated":
        from app.jobs.federated import run_train_clip

        return run_train_clip(job, ctx)
    with session_scope() as session:
        model = session.get(Model, job.model_id)
        dataset = session.get(Dataset, model.dataset_id)
        session.expunge_all()
    ctx.progress(0.02, "loading the data set")
    try:
        data = load_tabular(dataset, model)
    except (ValueError, KeyError) as exc:
        raise PermanentJobError(f"the data set cannot be used: {exc}", "invalid-dataset") from exc
    if len(set(data.row_ids.tolist())) != len(data.row_ids):
        raise PermanentJobError(f"row-id column {dataset.row_id_column!r} has duplicates", "invalid-dataset")
    recipe = tabular.TabularRecipe.from_dict(model.spec["recipe"])
    n_classes = data.encoder.n_classes
    holdout = holdout_mask(len(data.y), model.spec.get("holdout_fraction", 0.2), recipe.seed)

    with session_scope() as session:
        version = session.execute(select(ModelVersion).where(ModelVersion.job_id == job.id)).scalar_one_or_none()
    if version is None:
        ctx.progress(0.1, f"training {recipe.family} on {int((~holdout).sum())} rows")
        started = time.perf_counter()
        theta = tabular.train(recipe, data.X[~holdout], data.y[~holdout], n_classes)
        train_seconds = time.perf_counter() - started
        digest = get_store().put_bytes(theta_to_bytes(theta))
        metrics = _evaluate(recipe, theta, data, n_classes, {"train": ~holdout, "holdout": holdout})
        metrics["train_seconds"] = round(train_seconds, 4)
        with session_scope() as session:
            jobs.assert_lease(session, job.id, ctx.owner)
            _ensure_rows(session, dataset, data)
            version = ModelVersion(
                model_id=model.id, number=1, digest=digest, method="train", job_id=job.id, metrics=metrics
            )
            session.add(version)
            session.flush()
            row = session.get(Model, model.id)
            row.current_version_id = version.id
            row.state = {
                **row.state,
                "encoder": data.encoder.to_dict(),
                "classes": data.encoder.classes,
                "n_features": data.encoder.n_features,
                "holdout_positions_seed": recipe.seed,
            }
            row.status = "ready"
            append_event(
                session,
                actor="worker",
                action="model_version.created",
                entity_type="model",
                entity_id=model.id,
                payload={"version": 1, "digest": digest, "method": "train", "job_id": job.id},
            )
            model = row
            session.expunge_all()
    else:
        theta = theta_from_bytes(get_store().get_bytes(version.digest))
        with session_scope() as session:
            model = session.get(Model, job.model_id)
            session.expunge_all()

    preparations = {}
    for name in model.spec.get("unlearning", []):
        spec = get_method(name)
        if not spec.needs_preparation or model.state.get("methods", {}).get(name, {}).get("status") == "ready":
            continue
        ctx.progress(0.3, f"preparing {name}")
        method = spec.build(model.spec.get("method_settings", {}).get(name, {}))
        started = time.perf_counter()
        problem = TabularProblem(
            recipe=recipe,
            X=data.X,
            y=data.y,
            n_classes=n_classes,
            theta=theta,
            retain_mask=~holdout,
            forget_mask=np.zeros(len(data.y), bool),
            tombstone_mask=np.zeros(len(data.y), bool),
            progress=lambda f, m, n=name: ctx.progress(0.3 + 0.68 * f, f"{n}: {m}"),
        )
        result = method.prepare(problem)
        info = {**result.info, "prepare_seconds": round(time.perf_counter() - started, 3)}
        preparations[name] = info
        with session_scope() as session:
            jobs.assert_lease(session, job.id, ctx.owner)
            row = session.get(Model, model.id)
            row.state = _store_method_artifacts(row.state, name, result.artifacts, info)
            append_event(
                session,
                actor="worker",
                action="method.prepared",
                entity_type="model",
                entity_id=model.id,
                payload={"method": name, "info": info},
            )
            model = row
            session.expunge_all()

    with session_scope() as session:
        job_row = jobs.assert_lease(session, job.id, ctx.owner)
        jobs.finish(session, job_row, {"version_id": version.id, "preparations": preparations})


def _ensure_rows(session, dataset: Dataset, data: TabularData) -> None:
    """Index every row id (positions and labels) so the API can validate sample ids without touching the data."""
    exists = session.execute(select(DatasetRow.id).where(DatasetRow.dataset_id == dataset.id).limit(1)).first()
    if exists:
        return
    labels = data.encoder.decode_labels(data.y)
    rows = [
        {"dataset_id": dataset.id, "row_id": rid, "position": i, "label": labels[i]}
        for i, rid in enumerate(data.row_ids.tolist())
    ]
    for start in range(0, len(rows), 5000):
        session.execute(insert(DatasetRow), rows[start : start + 5000])
    session.execute(update(Dataset).where(Dataset.id == dataset.id).values(n_rows=len(rows)))


# --------------------------------------------------------------------------------------------------- delete
def resolve_method(requested: str, model: Model) -> str:
    """``auto``: L2UL when the model has a trained unlearner, else exact retraining."""
    if requested != "auto":
        return requested
    if model.state.get("methods", {}).get("l2ul", {}).get("status") == "ready":
        return "l2ul"
    return "retrain"


def run_deletion(job: Job, ctx: JobContext) -> None:
    with session_scope() as session:
        request = session.get(DeletionRequest, job.request_id)
        model = session.get(Model, job.model_id)
        federated = model.kind == "clip_federated"
        if federated:
            parent = session.get(ModelVersion, model.current_version_id)
            session.expunge_all()
    if federated:  # outside the transaction: SQLite would hold its write lock for the whole unlearning
        return _run_federated_deletion(job, ctx, request, model, parent)
    with session_scope() as session:
        request = session.get(DeletionRequest, job.request_id)
        model = session.get(Model, job.model_id)
        dataset = session.get(Dataset, model.dataset_id)
        parent = session.get(ModelVersion, model.current_version_id)
        existing = session.execute(select(ModelVersion).where(ModelVersion.job_id == job.id)).scalar_one_or_none()
        positions = _forget_positions(session, dataset.id, request)
        deleted_before = (
            session.execute(
                select(DatasetRow.position).where(
                    DatasetRow.dataset_id == dataset.id,
                    DatasetRow.deleted_by.is_not(None),
                    DatasetRow.deleted_by != request.id,
                )
            )
            .scalars()
            .all()
        )
        session.expunge_all()
    method_name = resolve_method(request.method, model)
    ctx.progress(0.05, f"loading data and version {parent.number}")
    data = load_tabular(dataset, model)
    recipe = tabular.TabularRecipe.from_dict(model.spec["recipe"])
    n = len(data.y)
    holdout = holdout_mask(n, model.spec.get("holdout_fraction", 0.2), recipe.seed)
    forget = np.zeros(n, bool)
    forget[positions] = True
    tombstone = np.zeros(n, bool)
    tombstone[list(deleted_before)] = True
    retain = ~holdout & ~forget & ~tombstone
    theta_parent = theta_from_bytes(get_store().get_bytes(parent.digest))

    if existing is None:
        spec = get_method(method_name)
        if model.kind not in spec.model_kinds or request.scope["kind"] not in spec.scopes:
            raise PermanentJobError(
                f"method {method_name!r} cannot take a {request.scope['kind']!r} scope on a {model.kind} model",
                "method-not-supported",
            )
        # the model's registered settings for the method (e.g. L2UL's meta-training sizes), then the request's own
        method = spec.build({**model.spec.get("method_settings", {}).get(method_name, {}), **request.method_settings})
        problem = TabularProblem(
            recipe=recipe,
            X=data.X,
            y=data.y,
            n_classes=len(model.state["classes"]),
            theta=theta_parent,
            retain_mask=retain,
            forget_mask=forget & ~holdout,
            tombstone_mask=tombstone,
            artifacts=_method_artifacts(model, method_name) if spec.needs_preparation else {},
            progress=lambda f, m: ctx.progress(0.1 + 0.75 * f, f"{method_name}: {m}"),
        )
        trained_forget = forget & ~holdout & ~tombstone
        started = time.perf_counter()
        if not trained_forget.any():
            # every row to forget is one the model never trained on (held out for testing): the parameters carry no
            # trace of them, so the new version keeps them and only the tombstones change.
            method_name = "none-needed"
            result = UnlearningResult(theta=theta_parent, info={"reason": "the rows were held out of training"})
        else:
            ctx.progress(0.1, f"unlearning {int(trained_forget.sum())} rows with {method_name}")
            try:
                result = method.unlearn(problem)
            except ValueError as exc:  # the method refuses this input: retrying cannot help
                raise PermanentJobError(f"{method_name} cannot do this deletion: {exc}", "unlearning-refused") from exc
        unlearn_seconds = time.perf_counter() - started
        digest = get_store().put_bytes(theta_to_bytes(result.theta))
        ctx.progress(0.9, "evaluating")
        n_classes = len(model.state["classes"])
        masks = {"retain": retain, "forget": forget, "holdout": holdout & ~forget & ~tombstone}
        metrics = {
            "method": method_name,
            "unlearn_seconds": round(unlearn_seconds, 4),
            "before": _evaluate(recipe, theta_parent, data, n_classes, masks),
            "after": _evaluate(recipe, result.theta, data, n_classes, masks),
            "method_info": result.info,
        }
        with session_scope() as session:
            jobs.assert_lease(session, job.id, ctx.owner)
            row = session.get(Model, model.id)
            if row.current_version_id != parent.id:
                raise RuntimeError("the model moved to a newer version while this job ran; retrying on it")
            version = ModelVersion(
                model_id=model.id,
                number=parent.number + 1,
                parent_id=parent.id,
                digest=digest,
                method=method_name,
                job_id=job.id,
                request_id=request.id,
                metrics=metrics,
            )
            session.add(version)
            session.flush()
            if result.artifacts:
                row.state = _store_method_artifacts(
                    row.state,
                    method_name,
                    result.artifacts,
                    row.state.get("methods", {}).get(method_name, {}).get("info", {}),
                )
            _publish(session, job, request, row, version, positions)
    else:
        with session_scope() as session:
            jobs.assert_lease(session, job.id, ctx.owner)
            row = session.get(Model, model.id)
            version = session.get(ModelVersion, existing.id)
            _publish(session, job, request, row, version, positions)
    _notify(job.request_id)


def _run_federated_deletion(
    job: Job, ctx: JobContext, request: DeletionRequest, model: Model, parent: ModelVersion
) -> None:
    from app.jobs.federated import run_federated_deletion

    method_name = "ease" if request.method == "auto" else request.method

    def publish(version: ModelVersion, positions: list[int], state_update: dict[str, Any]) -> None:
        with session_scope() as session:
            jobs.assert_lease(session, job.id, ctx.owner)
            row = session.get(Model, model.id)
            if version.id is None or session.get(ModelVersion, version.id) is None:
                if row.current_version_id != parent.id:
                    raise RuntimeError("the model moved to a newer version while this job ran; retrying on it")
                session.add(version)
                session.flush()
                if "forget_lock" in state_update:
                    state_update["forget_lock"] = {**state_update["forget_lock"], "version_id": version.id}
                row.state = {**row.state, **state_update}
            else:
                version = session.get(ModelVersion, version.id)
            _publish(session, job, request, row, version, positions)
        _notify(job.request_id)

    run_federated_deletion(job, ctx, request, model, parent, method_name, publish)


def _publish(session, job: Job, request: DeletionRequest, model: Model, version: ModelVersion, positions) -> None:
    """One transaction: new current version, tombstones, request completed, audit event, job finished."""
    now = utcnow()
    model.current_version_id = version.id
    session.execute(
        update(DatasetRow)
        .where(
            DatasetRow.dataset_id == model.dataset_id,
            DatasetRow.position.in_([int(p) for p in positions]),
            DatasetRow.deleted_by.is_(None),
        )
        .values(deleted_by=request.id, deleted_at=now)
    )
    req = session.get(DeletionRequest, request.id)
    req.status, req.progress, req.result_version_id = "completed", 1.0, version.id
    req.completed_at = req.updated_at = now
    req.message = f"version {version.number} without {len(positions)} rows ({version.method})"
    append_event(
        session,
        actor="worker",
        action="deletion_request.completed",
        entity_type="deletion_request",
        entity_id=request.id,
        payload={
            "model_id": model.id,
            "version": version.number,
            "digest": version.digest,
            "parent_id": version.parent_id,
            "method": version.method,
            "rows_deleted": len(positions),
            "job_id": job.id,
        },
    )
    jobs.finish(session, session.get(Job, job.id), {"version_id": version.id, "digest": version.digest})


def _forget_positions(session, dataset_id: str, request: DeletionRequest) -> list[int]:
    scope = request.scope
    query = select(DatasetRow.position).where(DatasetRow.dataset_id == dataset_id)
    if scope["kind"] == "samples":
        ids = [str(s) for s in scope["sample_ids"]]
        positions: list[int] = []
        for start in range(0, len(ids), 5000):
            positions += session.execute(query.where(DatasetRow.row_id.in_(ids[start : start + 5000]))).scalars().all()
        return sorted(positions)
    if scope["kind"] == "class":
        return sorted(session.execute(query.where(DatasetRow.label == str(scope["label"]))).scalars().all())
    raise PermanentJobError(f"scope {scope['kind']!r} is not supported for tabular models", "scope-not-supported")


def _notify(request_id: str) -> None:
    with session_scope() as session:
        request = session.get(DeletionRequest, request_id)
        if not request.callback_url:
            return
        body = {"id": request.id, "status": request.status, "result_version_id": request.result_version_id}
        url = request.callback_url
    deliver_webhook(url, body)


def run_aggregate_round(job: Job, ctx: JobContext) -> None:
    from app.jobs.federated import run_aggregate_round as aggregate

    aggregate(job, ctx)


HANDLERS = {"train_model": run_train_model, "deletion": run_deletion, "aggregate_round": run_aggregate_round}

"""The registry's worker-side writes: versions, row index and tombstones, model state, method state, weights.

The worker (app/jobs/) never writes a registry row itself; it calls these functions inside its transaction. A model
version is built in exactly one place (:func:`add_version`), which also holds the "model moved to a newer version"
guard: a version is a child of the version the job started from, or nothing.

Weights are stored as safetensors (one float32 tensor ``theta``), content-addressed by sha256. They are written with
``safetensors.numpy`` — the same file format as ``safetensors.torch`` — so that the registry, which the API imports,
never loads torch; the worker turns the array into a tensor with ``torch.from_numpy``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from safetensors.numpy import load as load_arrays
from safetensors.numpy import save as save_arrays
from sqlalchemy import insert, select, update
from sqlalchemy.orm import Session

from app.audit.service import append_event
from app.db import new_id, utcnow
from app.registry.tables import Dataset, DatasetRow, Model, ModelVersion
from app.storage import get_store

WEIGHTS_KEY = "theta"
ROW_INSERT_CHUNK = 5000
"""Rows per multi-row INSERT when indexing a data set (bounded statement size on both databases)."""
ID_QUERY_CHUNK = 5000
"""Ids per ``IN (...)`` list (SQLite's bound-parameter limit is 32,766)."""


class ModelMovedError(RuntimeError):
    """Another job published a newer version while this one ran: retry on the new current version (transient)."""


# ------------------------------------------------------------------------------------------------------ weights
def weights_to_bytes(theta: Any) -> bytes:
    """A float32 parameter vector (torch tensor or array) as safetensors bytes."""
    if hasattr(theta, "detach"):  # a torch tensor: to a CPU float32 array without importing torch here
        theta = theta.detach().to("cpu").float().numpy()
    return save_arrays({WEIGHTS_KEY: np.ascontiguousarray(theta, dtype=np.float32)})


def weights_from_bytes(data: bytes) -> np.ndarray:
    return load_arrays(data)[WEIGHTS_KEY]


def put_weights(theta: Any) -> str:
    """Store a parameter vector; returns its digest (idempotent: the same weights give the same blob)."""
    return get_store().put_bytes(weights_to_bytes(theta))


def load_weights(digest: str) -> np.ndarray:
    return weights_from_bytes(get_store().get_bytes(digest))


# ------------------------------------------------------------------------------------------------------ versions
@dataclass
class VersionDraft:
    """A version the worker has computed and stored the weights of, not yet written (publish writes it)."""

    model_id: str
    number: int
    digest: str
    method: str
    job_id: str
    parent_id: str | None = None
    request_id: str | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    id: str = field(default_factory=new_id)


def version_for_job(session: Session, job_id: str) -> ModelVersion | None:
    """The version a job already wrote (a job writes at most one, whatever its retries)."""
    return session.execute(select(ModelVersion).where(ModelVersion.job_id == job_id)).scalar_one_or_none()


def add_version(
    session: Session,
    draft: VersionDraft,
    *,
    state_update: Mapping[str, Any] | None = None,
    method_state: tuple[str, Mapping[str, bytes]] | None = None,
) -> ModelVersion:
    """Write ``draft`` as the model's new current version, with the model-state changes it carries.

    Idempotent per job: if the job already wrote its version, that version is returned unchanged. Raises
    :class:`ModelMovedError` if the model's current version is no longer the draft's parent.
    """
    existing = version_for_job(session, draft.job_id)
    if existing is not None:
        return existing
    model = session.get(Model, draft.model_id)
    if model.current_version_id != draft.parent_id:
        raise ModelMovedError("the model moved to a newer version while this job ran; retrying on it")
    version = ModelVersion(
        id=draft.id,
        model_id=draft.model_id,
        number=draft.number,
        parent_id=draft.parent_id,
        digest=draft.digest,
        method=draft.method,
        job_id=draft.job_id,
        request_id=draft.request_id,
        metrics=draft.metrics,
    )
    session.add(version)
    session.flush()
    model.current_version_id = version.id
    if state_update:
        model.state = {**model.state, **state_update}
    if method_state and method_state[1]:
        name, artifacts = method_state
        model.state = _with_method_state(model.state, name, artifacts, info=None)
    return version


def child_draft(parent: ModelVersion, **fields: Any) -> VersionDraft:
    """A draft numbered after ``parent`` and linked to it."""
    return VersionDraft(model_id=parent.model_id, number=parent.number + 1, parent_id=parent.id, **fields)


# ------------------------------------------------------------------------------------------------------ models
def load_model(session: Session, model_id: str) -> tuple[Model, Dataset | None, ModelVersion | None]:
    """The model, its data set and its current version, detached (safe to read after the session closes)."""
    model = session.get(Model, model_id)
    dataset = session.get(Dataset, model.dataset_id) if model.dataset_id else None
    current = session.get(ModelVersion, model.current_version_id) if model.current_version_id else None
    session.expunge_all()
    return model, dataset, current


def model_kind(session: Session, model_id: str) -> str:
    return session.execute(select(Model.kind).where(Model.id == model_id)).scalar_one()


def mark_ready(session: Session, model_id: str, *, dataset_id: str | None = None) -> None:
    model = session.get(Model, model_id)
    model.status = "ready"
    if dataset_id is not None:
        model.dataset_id = dataset_id


def mark_failed(session: Session, model_id: str, job_id: str, error: str) -> None:
    """A registration whose training job failed for good."""
    model = session.get(Model, model_id)
    model.status, model.error = "failed", error[:4000]
    append_event(
        session,
        actor="worker",
        action="model.failed",
        entity_type="model",
        entity_id=model_id,
        payload={"job_id": job_id, "error": error.split("\n", 1)[0][:500]},
    )


# ------------------------------------------------------------------------------------------------------ method state
def method_artifacts(model: Model, method: str) -> dict[str, bytes]:
    """The prepared state of ``method`` on ``model`` (e.g. L2UL's unlearner), as the method stored it."""
    digests = model.state.get("methods", {}).get(method, {}).get("artifacts", {})
    store = get_store()
    return {name: store.get_bytes(digest) for name, digest in digests.items()}


def prepared_methods(model: Model) -> set[str]:
    return {name for name, entry in model.state.get("methods", {}).items() if entry.get("status") == "ready"}


def store_method_state(
    session: Session, model_id: str, method: str, artifacts: Mapping[str, bytes], info: dict
) -> None:
    """Record a method's one-off preparation (its artifacts and facts) on the model."""
    model = session.get(Model, model_id)
    model.state = _with_method_state(model.state, method, artifacts, info=info)


def _with_method_state(
    state: dict[str, Any], method: str, artifacts: Mapping[str, bytes], info: dict | None
) -> dict[str, Any]:
    store = get_store()
    methods = dict(state.get("methods", {}))
    entry = dict(methods.get(method, {}))
    entry["artifacts"] = {**entry.get("artifacts", {}), **{k: store.put_bytes(v) for k, v in artifacts.items()}}
    entry["status"] = "ready"
    entry["info"] = info if info is not None else entry.get("info", {})
    methods[method] = entry
    return {**state, "methods": methods}


# ------------------------------------------------------------------------------------------------------ rows
def create_dataset(session: Session, **fields: Any) -> Dataset:
    dataset = Dataset(**fields)
    session.add(dataset)
    session.flush()
    return dataset


def index_rows(session: Session, dataset_id: str, row_ids: Iterable[str], labels: Iterable[str]) -> None:
    """Index every row id (position and label) so the API validates sample ids without touching the data.

    Once per data set: a retried job finds the index there and leaves it."""
    exists = session.execute(select(DatasetRow.id).where(DatasetRow.dataset_id == dataset_id).limit(1)).first()
    if exists:
        return
    rows = [
        {"dataset_id": dataset_id, "row_id": rid, "position": i, "label": label}
        for i, (rid, label) in enumerate(zip(row_ids, labels, strict=True))
    ]
    for start in range(0, len(rows), ROW_INSERT_CHUNK):
        session.execute(insert(DatasetRow), rows[start : start + ROW_INSERT_CHUNK])
    session.execute(update(Dataset).where(Dataset.id == dataset_id).values(n_rows=len(rows)))


def positions_of(session: Session, dataset_id: str, scope: Mapping[str, Any]) -> list[int]:
    """Row positions a ``samples`` or ``class`` scope names (sorted). Raises ValueError for another scope kind."""
    query = select(DatasetRow.position).where(DatasetRow.dataset_id == dataset_id)
    if scope["kind"] == "samples":
        ids = [str(s) for s in scope["sample_ids"]]
        positions: list[int] = []
        for start in range(0, len(ids), ID_QUERY_CHUNK):
            chunk = ids[start : start + ID_QUERY_CHUNK]
            positions += session.execute(query.where(DatasetRow.row_id.in_(chunk))).scalars().all()
        return sorted(positions)
    if scope["kind"] == "class":
        return sorted(session.execute(query.where(DatasetRow.label == str(scope["label"]))).scalars().all())
    raise ValueError(f"scope {scope['kind']!r} names no rows of a table")


def tombstones(session: Session, dataset_id: str, except_request: str | None = None) -> list[tuple[int, str]]:
    """(position, row id) of every row deleted by an earlier request (never trained on again)."""
    query = select(DatasetRow.position, DatasetRow.row_id).where(
        DatasetRow.dataset_id == dataset_id, DatasetRow.deleted_by.is_not(None)
    )
    if except_request is not None:
        query = query.where(DatasetRow.deleted_by != except_request)
    return [(int(p), str(r)) for p, r in session.execute(query).all()]


def tombstone(session: Session, dataset_id: str, positions: Iterable[int], request_id: str) -> None:
    session.execute(
        update(DatasetRow)
        .where(
            DatasetRow.dataset_id == dataset_id,
            DatasetRow.position.in_([int(p) for p in positions]),
            DatasetRow.deleted_by.is_(None),
        )
        .values(deleted_by=request_id, deleted_at=utcnow())
    )

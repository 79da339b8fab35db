"""Model registry: register a tabular model (data set stored content-addressed, version 1 trained by a job)."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.audit.service import append_event
from app.auth.service import Principal
from app.config import get_settings
from app.jobs.outbox import new_job
from app.jobs.tables import Job
from app.ml.unlearning.base import UnknownMethodError, get_method
from app.problems import Problem
from app.registry.schemas import ClipModelCreate, ModelCreate, ModelOut, VersionOut
from app.registry.tables import Dataset, DatasetRow, Model, ModelVersion
from app.storage import get_store


def read_columns(data: bytes, fmt: str) -> list[str]:
    """The header only: the API checks columns without parsing the table (the job does that)."""
    if fmt == "parquet":
        import pyarrow.parquet as pq

        try:
            return list(pq.read_schema(io.BytesIO(data)).names)
        except Exception as exc:  # pyarrow raises several types for a broken file
            raise Problem(422, "invalid-dataset", "The Parquet file cannot be read", str(exc)) from None
    try:
        first = data.split(b"\n", 1)[0].decode("utf-8-sig")
    except UnicodeDecodeError:
        raise Problem(422, "invalid-dataset", "The CSV file is not UTF-8") from None
    header = next(csv.reader([first], skipinitialspace=True), [])
    if not header:
        raise Problem(422, "invalid-dataset", "The CSV file has no header row")
    return [h.strip() for h in header]


def detect_format(name: str | None, declared: str | None, data: bytes) -> str:
    if declared:
        return declared
    if data[:4] == b"PAR1" or (name or "").lower().endswith((".parquet", ".pq")):
        return "parquet"
    return "csv"


def read_allowed_path(path: str, check_only: bool = False) -> bytes:
    settings = get_settings()
    resolved = Path(path).expanduser().resolve()
    roots = [Path(r).expanduser().resolve() for r in settings.data_roots]
    if not any(resolved.is_relative_to(root) for root in roots):
        raise Problem(
            422,
            "dataset-path-not-allowed",
            "The data set path is outside the allowed roots",
            f"Allowed roots: {[str(r) for r in roots]} (LETHE_DATA_ROOTS).",
        )
    if not resolved.is_file():
        raise Problem(422, "dataset-not-found", "The data set path is not a readable file", str(path))
    if not check_only and resolved.stat().st_size > settings.max_upload_bytes:
        raise Problem(
            413,
            "payload-too-large",
            "The data set is larger than the limit",
            f"limit {settings.max_upload_bytes} bytes",
        )
    return b"" if check_only else resolved.read_bytes()


def check_methods(kind: str, names: list[str]) -> None:
    """Every method a registration asks to prepare must exist and support the model kind."""
    for name in names:
        try:
            spec = get_method(name)
        except UnknownMethodError:
            raise Problem(422, "unknown-method", "Unknown unlearning method", name) from None
        if kind not in spec.model_kinds:
            raise Problem(
                422,
                "method-not-supported",
                "The method does not support this model kind",
                f"{name} supports {sorted(spec.model_kinds)}",
            )


def _add_with_training_job(session: Session, principal: Principal, model: Model, payload) -> None:
    """The registration's one transaction: the model row, its version-1 job (the outbox) and the audit event."""
    session.add(model)
    session.flush()
    job = new_job(session, kind="train_model", model_id=model.id, model_kind=model.kind)
    append_event(
        session,
        actor=principal.actor,
        action="model.registered",
        entity_type="model",
        entity_id=model.id,
        payload=payload(job.id),
    )


def register_model(
    session: Session, principal: Principal, body: ModelCreate, data: bytes, filename: str | None
) -> Model:
    fmt = detect_format(filename, body.dataset.format, data)
    columns = read_columns(data, fmt)
    for role, column in (("row-id", body.dataset.row_id_column), ("label", body.dataset.label_column)):
        if column not in columns:
            raise Problem(
                422,
                "unknown-column",
                f"The {role} column is not in the data set",
                f"{column!r} is not one of {columns}",
                column=column,
                columns=columns,
            )
    check_methods(body.kind, body.unlearning)
    digest = get_store().put_bytes(data)
    dataset = Dataset(
        name=filename or body.dataset.path or body.name,
        format=fmt,
        digest=digest,
        row_id_column=body.dataset.row_id_column,
        label_column=body.dataset.label_column,
        columns=columns,
    )
    session.add(dataset)
    session.flush()
    spec: dict[str, Any] = {
        "family": body.family,
        "recipe": {"family": body.family, **body.recipe.model_dump()},
        "unlearning": list(dict.fromkeys(body.unlearning)),
        "method_settings": body.method_settings,
        "holdout_fraction": body.holdout_fraction,
    }
    model = Model(name=body.name, kind=body.kind, dataset_id=dataset.id, spec=spec, state={})
    _add_with_training_job(
        session,
        principal,
        model,
        lambda job_id: {
            "name": body.name,
            "kind": body.kind,
            "dataset_digest": digest,
            "job_id": job_id,
            "family": body.family,
            "unlearning": spec["unlearning"],
        },
    )
    return model


def spool_upload(stream, limit: int) -> bytes:
    """Read an upload with a hard size cap (413 past it)."""
    buffer = io.BytesIO()
    while chunk := stream.read(1 << 20):
        buffer.write(chunk)
        if buffer.tell() > limit:
            raise Problem(413, "payload-too-large", "The upload is larger than the limit", f"limit {limit} bytes")
    return buffer.getvalue()


def version_out(version: ModelVersion | None) -> VersionOut | None:
    if version is None:
        return None
    return VersionOut(
        id=version.id,
        number=version.number,
        parent_id=version.parent_id,
        digest=version.digest,
        method=version.method,
        request_id=version.request_id,
        metrics=version.metrics,
        created_at=version.created_at,
        retired_at=version.retired_at,
        retired_by=version.retired_by,
    )


def _method_status(model: Model, name: str) -> str:
    try:
        needs_preparation = get_method(name).needs_preparation
    except UnknownMethodError:
        return "unknown"
    if not needs_preparation:
        return "ready" if model.status == "ready" else model.status
    return "failed" if model.status == "failed" else "preparing"


def model_out(session: Session, model: Model) -> ModelOut:
    current = session.get(ModelVersion, model.current_version_id) if model.current_version_id else None
    methods = {
        name: {"status": entry.get("status"), "info": entry.get("info", {})}
        for name, entry in model.state.get("methods", {}).items()
    }
    for name in model.spec.get("unlearning", []):
        methods.setdefault(name, {"status": _method_status(model, name)})
    links = {"self": f"/v1/models/{model.id}", "versions": f"/v1/models/{model.id}/versions"}
    federation = None
    if model.kind == "clip_federated":
        links["rounds"] = f"/v1/models/{model.id}/rounds"
        links["pairs"] = f"/v1/models/{model.id}/pairs"
        if model.state.get("forget_lock"):
            links["forget_lock"] = f"/v1/models/{model.id}/forget-lock"
        federation = {
            "clients": model.state.get("clients", []),
            "removed_clients": model.state.get("removed", []),
            "rounds": len(model.state.get("rounds", [])),
            "n_params": model.state.get("n_params"),
            "forget_lock_active": bool(model.state.get("forget_lock")),
            "spec": model.state.get("spec"),
            "data": model.spec.get("data"),
            "fed_settings": model.spec.get("fed_settings", {}),
        }
    return ModelOut(
        id=model.id,
        name=model.name,
        kind=model.kind,
        status=model.status,
        family=model.spec.get("family"),
        dataset_id=model.dataset_id,
        current_version=version_out(current),
        unlearning=methods,
        error=model.error,
        created_at=model.created_at,
        links=links,
        federation=federation,
    )


def get_model_or_404(session: Session, model_id: str) -> Model:
    model = session.get(Model, model_id)
    if model is None:
        raise Problem(404, "model-not-found", "No such model", model_id)
    return model


def live_pairs(session: Session, model: Model) -> dict[str, list[str]]:
    """A federated model's pairs that may still be trained on, by client: every pair of its data set that no
    deletion has taken (erased pairs have no index entry any more; ``deleted_by`` marks those of older databases).
    Clients train on these only — how the tombstones of class and samples deletions reach them."""
    if model.kind != "clip_federated" or model.dataset_id is None:
        raise Problem(404, "not-federated", "The model is not a registered federated model", model.id)
    rows = session.execute(
        select(DatasetRow.label, DatasetRow.row_id)
        .where(DatasetRow.dataset_id == model.dataset_id, DatasetRow.deleted_by.is_(None))
        .order_by(DatasetRow.position)
    ).all()
    out: dict[str, list[str]] = {c: [] for c in model.state.get("clients", [])}
    for label, row_id in rows:
        out.setdefault(label, []).append(row_id)
    return out


def list_versions(session: Session, model_id: str) -> list[ModelVersion]:
    return list(
        session.execute(
            select(ModelVersion).where(ModelVersion.model_id == model_id).order_by(ModelVersion.number)
        ).scalars()
    )


def register_clip_model(session: Session, principal: Principal, body: ClipModelCreate) -> Model:
    """A federated CLIP + LoRA model: version 1 is the LoRA initialisation (built by a job); rounds come later."""
    if body.clip.checkpoint_path:
        read_allowed_path(body.clip.checkpoint_path, check_only=True)
    check_methods(body.kind, body.unlearning)
    spec_json: dict[str, Any] = {
        "clip": body.clip.model_dump(),
        "data": body.data.model_dump(),
        "fed_settings": body.fed_settings,
        "unlearning": list(dict.fromkeys(body.unlearning)),
        "method_settings": body.method_settings,
    }
    model = Model(name=body.name, kind=body.kind, spec=spec_json, state={})
    _add_with_training_job(
        session,
        principal,
        model,
        lambda job_id: {"name": body.name, "kind": body.kind, "arch": body.clip.arch, "job_id": job_id},
    )
    return model


def parse_safetensors_header(data: bytes) -> dict[str, Any]:
    """Shapes and dtypes of a safetensors file from its JSON header, without loading tensors (the API has no torch)."""
    if len(data) < 8:
        raise Problem(422, "invalid-round", "Not a safetensors file", "too short")
    size = int.from_bytes(data[:8], "little")
    if size <= 0 or 8 + size > len(data):
        raise Problem(422, "invalid-round", "Not a safetensors file", "bad header length")
    try:
        header = json.loads(data[8 : 8 + size])
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise Problem(422, "invalid-round", "Not a safetensors file", "header is not JSON") from None
    if not isinstance(header, dict):
        raise Problem(422, "invalid-round", "Not a safetensors file", "header is not an object")
    header.pop("__metadata__", None)
    return header


def submit_round(session: Session, principal: Principal, model: Model, data: bytes) -> Job:
    """Validate one round of client updates (shapes only) and queue its aggregation as a job."""
    if model.kind != "clip_federated":
        raise Problem(422, "scope-not-supported", "Only federated models take rounds", f"model kind {model.kind}")
    if model.status != "ready":
        raise Problem(409, "model-not-ready", "The model is not ready", f"status is {model.status!r}")
    header = parse_safetensors_header(data)
    n_clients, p = len(model.state["clients"]), model.state["n_params"]
    updates = header.get("updates")
    if not updates or updates.get("dtype") != "F32" or updates.get("shape") != [n_clients, p]:
        raise Problem(
            422,
            "invalid-round",
            "`updates` must be float32 [clients, params]",
            f"expected F32 {[n_clients, p]}, got {updates and (updates.get('dtype'), updates.get('shape'))}",
        )
    weights = header.get("weights")
    if weights is not None and (weights.get("dtype") != "F32" or weights.get("shape") != [n_clients]):
        raise Problem(422, "invalid-round", "`weights` must be float32 [clients]")
    digest = get_store().put_bytes(data)
    job = new_job(
        session, kind="aggregate_round", model_id=model.id, model_kind=model.kind, payload={"updates_digest": digest}
    )
    append_event(
        session,
        actor=principal.actor,
        action="round.received",
        entity_type="model",
        entity_id=model.id,
        payload={"digest": digest, "job_id": job.id},
    )
    return job

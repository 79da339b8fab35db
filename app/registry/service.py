"""Model registry: register a tabular model (data set stored content-addressed, version 1 trained by a job)."""

from __future__ import annotations

import csv
import hashlib
import io
import json
import re
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from app.audit.service import append_event
from app.auth.service import Principal
from app.config import get_settings
from app.jobs.outbox import new_job
from app.jobs.tables import Job
from app.ml import export
from app.ml.unlearning.base import UnknownMethodError, get_method
from app.paging import keyset_page
from app.problems import Problem
from app.registry import identifier_guard
from app.registry.caption_files import check_caption_files
from app.registry.schemas import (
    MAX_PREDICT_ROWS,
    PREDICT_MAX_WORK,
    CaptionFilesFederationIn,
    ClipModelCreate,
    ModelCreate,
    ModelOut,
    ModelPatch,
    PredictedVersion,
    PredictIn,
    PredictOut,
    VersionOut,
    VersionQuality,
)
from app.registry.settings import TINY_ARCH
from app.registry.tables import Dataset, DatasetRow, Model, ModelTag, ModelVersion, first_line
from app.storage import get_store

_BAD_NAME = re.compile(r"[\x00-\x1f\x7f]")


def read_columns(data: bytes, fmt: str, from_path: bool = False) -> list[str]:
    """The header only: the API checks columns without parsing the table (the job does that).

    ``from_path``: the bytes are a server-side file, not the caller's upload. Nothing read from such a file is ever
    echoed (no parser message, no header), and its header must look like a table's (two or more plain column names)
    or the file is refused as not a data set.
    """
    not_a_table = Problem(
        422, "invalid-dataset", f"The file is not a {fmt.upper()} table with a header row", "Nothing of it is shown."
    )
    if fmt == "parquet":
        import pyarrow.parquet as pq

        try:
            columns = list(pq.read_schema(io.BytesIO(data)).names)
        except Exception as exc:  # pyarrow raises several types for a broken file
            if from_path:
                raise not_a_table from None
            raise Problem(422, "invalid-dataset", "The Parquet file cannot be read", str(exc)) from None
    else:
        try:
            first = data.split(b"\n", 1)[0].decode("utf-8-sig")
        except UnicodeDecodeError:
            if from_path:
                raise not_a_table from None
            raise Problem(422, "invalid-dataset", "The CSV file is not UTF-8") from None
        header = next(csv.reader([first], skipinitialspace=True), [])
        if not header:
            if from_path:
                raise not_a_table
            raise Problem(422, "invalid-dataset", "The CSV file has no header row")
        columns = [h.strip() for h in header]
    if from_path and (len(columns) < 2 or any(not c or len(c) > 200 or _BAD_NAME.search(c) for c in columns)):
        raise not_a_table
    return [c or f"Unnamed: {i}" for i, c in enumerate(columns)]  # a blank header cell: pandas' name for it


def check_table_size(data: bytes, fmt: str, n_columns: int) -> None:
    """Rows x columns within ``max_table_cells``, and the decoded table within ``max_table_bytes``: a small compressed
    Parquet file can hold a huge table (parquet_decoded_bytes)."""
    settings = get_settings()
    limit = settings.max_table_cells
    if fmt == "parquet":
        import pyarrow.parquet as pq

        try:
            meta = pq.read_metadata(io.BytesIO(data))
        except Exception:
            raise Problem(422, "invalid-dataset", "The Parquet file cannot be read") from None
        rows, columns = meta.num_rows, meta.num_columns
        decoded = parquet_decoded_bytes(data, meta, settings.max_table_bytes) if rows * columns <= limit else 0
    else:
        rows, columns, decoded = data.count(b"\n") + 1, n_columns, len(data)
    if decoded > settings.max_table_bytes:
        raise Problem(
            413,
            "table-too-large",
            "The table is too large once decoded",
            f"it holds more than {settings.max_table_bytes} bytes once decompressed and decoded "
            "(LETHE_MAX_TABLE_BYTES)",
            limit_bytes=settings.max_table_bytes,
        )
    if rows * columns > limit:
        raise Problem(
            413,
            "table-too-large",
            "The table has too many cells",
            f"{rows} rows x {columns} columns is more than the limit of {limit} cells (LETHE_MAX_TABLE_CELLS)",
            limit_cells=limit,
        )


def parquet_decoded_bytes(data: bytes, meta, limit: int) -> int:
    """The bytes a Parquet table takes once read, known before it is expanded (issue 22: a 7,850-byte file of
    dictionary-encoded 1 MB strings, zstd, took a worker from 1.3 to 3.7 GB). First the column chunks' uncompressed
    sizes from the footer (a compression bomb stops here, nothing read); then the file is read with every string and
    binary column kept dictionary-encoded (at most those uncompressed bytes) and each dictionary column's decoded size
    is the sum of its values' lengths over the indices, computed without building the strings."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    stored = sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
    if stored > limit:
        return stored
    kinds = (pa.types.is_string, pa.types.is_binary, pa.types.is_large_string, pa.types.is_large_binary)
    try:
        schema = pq.ParquetFile(io.BytesIO(data)).schema_arrow
        texts = [f.name for f in schema if pa.types.is_dictionary(f.type) or any(k(f.type) for k in kinds)]
        table = pq.ParquetFile(io.BytesIO(data), read_dictionary=texts).read()
    except Exception:
        raise Problem(422, "invalid-dataset", "The Parquet file cannot be read") from None
    total = 0
    for column in table.columns:
        for chunk in column.chunks:
            if isinstance(chunk, pa.DictionaryArray) and len(chunk):
                lengths = pc.binary_length(chunk.dictionary).fill_null(0)
                total += int(pc.sum(pc.take(lengths, chunk.indices.fill_null(0))).as_py() or 0)
            else:
                total += chunk.nbytes
    return total


def detect_format(name: str | None, declared: str | None, data: bytes) -> str:
    if declared:
        return declared
    if data[:4] == b"PAR1" or (name or "").lower().endswith((".parquet", ".pq")):
        return "parquet"
    return "csv"


def is_service_file(resolved: Path) -> bool:
    """The service's own secrets and stores, refused even under a data root (defence in depth: the settings already
    refuse a root that contains the home, the artifact store or a .env)."""
    settings = get_settings()
    if resolved.name == ".env" or resolved == (settings.home / "secret.key").expanduser().resolve():
        return True
    artifacts, database = settings.local_artifact_path, settings.local_database_path
    if artifacts is not None and resolved.is_relative_to(artifacts):
        return True
    return database is not None and resolved.parent == database.parent and resolved.name.startswith(database.name)


def read_allowed_path(path: str, check_only: bool = False) -> bytes:
    """A server-side file under one of the configured data roots (none by default: uploads only)."""
    settings = get_settings()
    resolved = Path(path).expanduser().resolve()
    roots = [Path(r).expanduser().resolve() for r in settings.data_roots]
    if not roots:
        raise Problem(
            422,
            "dataset-path-not-allowed",
            "Data sets cannot be read from server paths here",
            "No data roots are configured (LETHE_DATA_ROOTS): upload the file as multipart/form-data.",
        )
    if not any(resolved.is_relative_to(root) for root in roots) or is_service_file(resolved):
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


def _add_with_training_job(
    session: Session, principal: Principal, model: Model, payload, tags: list[str] | None = None
) -> None:
    """The registration's one transaction: the model row, its tags, its version-1 job (the outbox) and the audit
    event."""
    session.add(model)
    session.flush()
    tags = list(dict.fromkeys(tags or []))
    session.add_all(ModelTag(model_id=model.id, tag=t) for t in tags)
    job = new_job(session, kind="train_model", model_id=model.id, model_kind=model.kind)
    append_event(
        session,
        actor=principal.actor,
        action="model.registered",
        entity_type="model",
        entity_id=model.id,
        payload={**payload(job.id), **({"tags": tags} if tags else {})},
    )


def tags_of(session: Session, model_ids: list[str]) -> dict[str, list[str]]:
    """Each model's tags, sorted (one query for a page of models)."""
    out: dict[str, list[str]] = {}
    if model_ids:
        rows = session.execute(
            select(ModelTag.model_id, ModelTag.tag).where(ModelTag.model_id.in_(model_ids)).order_by(ModelTag.tag)
        )
        for model_id, tag in rows:
            out.setdefault(model_id, []).append(tag)
    return out


def set_tags(session: Session, principal: Principal, model: Model, tags: list[str]) -> Model:
    """Replace a model's tags (admin, audited)."""
    tags = sorted(dict.fromkeys(tags))
    before = tags_of(session, [model.id]).get(model.id, [])
    if before != tags:
        session.execute(delete(ModelTag).where(ModelTag.model_id == model.id))
        session.add_all(ModelTag(model_id=model.id, tag=t) for t in tags)
        append_event(
            session,
            actor=principal.actor,
            action="model.updated",
            entity_type="model",
            entity_id=model.id,
            payload={"tags": tags, "tags_before": before},
        )
    return model


def register_model(
    session: Session, principal: Principal, body: ModelCreate, data: bytes, filename: str | None
) -> Model:
    fmt = detect_format(filename, body.dataset.format, data)
    from_path = bool(body.dataset.path)  # a server-side file: never echo what is in it
    columns = read_columns(data, fmt, from_path=from_path)
    roles = [("row-id", body.dataset.row_id_column), ("label", body.dataset.label_column)]
    if body.dataset.subject_column is not None:
        roles.append(("subject", body.dataset.subject_column))
        if body.dataset.subject_column in (body.dataset.row_id_column, body.dataset.label_column):
            raise Problem(
                422,
                "invalid-subject-column",
                "The subject column must be a column of its own",
                "it may be neither the row-id column nor the label column",
                column=body.dataset.subject_column,
            )
    for role, column in roles:
        if column not in columns:
            if from_path:
                raise Problem(422, "unknown-column", f"The {role} column is not in the data set", column=column)
            raise Problem(
                422,
                "unknown-column",
                f"The {role} column is not in the data set",
                f"{column!r} is not one of {columns}",
                column=column,
                columns=columns,
            )
    roles = {body.dataset.row_id_column, body.dataset.label_column, body.dataset.subject_column}
    for field in ("exclude_columns", "allow_identifier_columns"):
        for column in getattr(body.dataset, field):
            if column not in columns:
                detail = None if from_path else f"{column!r} (in dataset.{field}) is not one of {columns}"
                raise Problem(422, "unknown-column", "A listed column is not in the data set", detail, column=column)
            if column in roles:
                raise Problem(
                    422,
                    "validation-error",
                    "The request is not valid",
                    f"{column!r} is the row-id, label or subject column: it is never a feature",
                    errors=[
                        {"location": ["body", "dataset", field], "message": "a role column", "type": "value_error"}
                    ],
                )
    excluded = set(body.dataset.exclude_columns)
    features = [c for c in columns if c not in roles and c not in excluded]
    if not features:
        raise Problem(422, "validation-error", "The request is not valid", "no column is left to be a feature")
    check_table_size(data, fmt, len(columns))
    allowed = set(body.dataset.allow_identifier_columns)
    identifier_guard.check(data, fmt, [c for c in features if c not in allowed], from_path)
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
        "verification": body.verification.model_dump(),
        "batch": body.batch.model_dump(),
    }
    if body.dataset.subject_column is not None:
        spec["subject_column"] = body.dataset.subject_column
    if body.dataset.exclude_columns:
        spec["exclude_columns"] = list(dict.fromkeys(body.dataset.exclude_columns))
    # the worker checks the whole table again before version 1 (a registration from before the guard has no entry)
    spec["identifier_guard"] = {"allow": sorted(allowed)}
    model = Model(
        name=body.name,
        kind=body.kind,
        dataset_id=dataset.id,
        spec=spec,
        state={},
        requires_approval=body.requires_approval,
    )
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
            "requires_approval": body.requires_approval,
            **({"subject_column": spec["subject_column"]} if "subject_column" in spec else {}),
        },
        tags=body.tags,
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


def _accuracy(metrics: dict[str, Any], name: str) -> tuple[float | None, int]:
    rows = int(metrics.get(f"rows_{name}") or 0)
    value = metrics.get(f"accuracy_{name}")
    return (float(value) if rows and value is not None else None), rows


def version_quality(version: ModelVersion) -> VersionQuality | None:
    """The accuracy summary of a tabular version's metrics: version 1's train/holdout figures, a deletion's
    ``after`` (retained rows, erased rows, held-out rows). None for a version without them (federated)."""
    metrics = version.metrics or {}
    if "accuracy_train" in metrics or "accuracy_holdout" in metrics:  # version 1
        holdout, trained = _accuracy(metrics, "holdout"), _accuracy(metrics, "train")
        return VersionQuality(
            holdout_accuracy=holdout[0], holdout_rows=holdout[1], trained_accuracy=trained[0], trained_rows=trained[1]
        )
    after = metrics.get("after")
    if isinstance(after, dict) and any(k.startswith("accuracy_") for k in after):
        holdout, trained, forget = (_accuracy(after, n) for n in ("holdout", "retain", "forget"))
        return VersionQuality(
            holdout_accuracy=holdout[0],
            holdout_rows=holdout[1],
            trained_accuracy=trained[0],
            trained_rows=trained[1],
            forget_accuracy=forget[0],
            forget_rows=forget[1],
        )
    return None


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
        quality=version_quality(version),
    )


def _method_status(model: Model, name: str) -> str:
    try:
        needs_preparation = get_method(name).needs_preparation
    except UnknownMethodError:
        return "unknown"
    if not needs_preparation:
        return "ready" if model.status == "ready" else model.status
    return "failed" if model.status == "failed" else "preparing"


def model_out(session: Session, model: Model, tags: list[str] | None = None) -> ModelOut:
    """``tags``: the model's tags when the caller read a page's at once (``tags_of``); else one query."""
    current = session.get(ModelVersion, model.current_version_id) if model.current_version_id else None
    methods = {
        name: {"status": entry.get("status"), "info": entry.get("info", {})}
        | ({"reason": entry["reason"]} if entry.get("reason") else {})
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
        error=first_line(model.error),
        created_at=model.created_at,
        links=links,
        federation=federation,
        requires_approval=bool(model.requires_approval),
        subject_column=model.spec.get("subject_column"),
        batch=model.spec.get("batch"),
        tags=tags_of(session, [model.id]).get(model.id, []) if tags is None else tags,
        inputs=_inputs(model),
    )


def _inputs(model: Model) -> dict[str, str] | None:
    encoder = (model.state or {}).get("encoder") if model.kind == "tabular" else None
    if not encoder:
        return None
    return {c: "text" if c in encoder["categories"] else "number" for c in encoder["feature_columns"]}


def list_models(
    session: Session,
    name: str | None = None,
    name_contains: str | None = None,
    kind: str | None = None,
    status: str | None = None,
    limit: int = 50,
    cursor: str | None = None,
    tags: list[str] | None = None,
) -> tuple[list[Model], str | None]:
    """Models newest first, keyset-paged like the deletion-request list. Filters: the name (exact, or a
    case-insensitive substring), the kind, the status, and tags (a model must carry every one given)."""
    query = select(Model)
    for tag in dict.fromkeys(tags or []):
        query = query.where(select(ModelTag.tag).where(ModelTag.model_id == Model.id, ModelTag.tag == tag).exists())
    if name is not None:
        query = query.where(Model.name == name)
    if name_contains:
        pattern = "%" + name_contains.lower().replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
        query = query.where(func.lower(Model.name).like(pattern, escape="\\"))
    if kind is not None:
        query = query.where(Model.kind == kind)
    if status is not None:
        query = query.where(Model.status == status)
    rows, next_cursor = keyset_page(session, query, Model, limit, cursor)
    current = [m.current_version_id for m in rows if m.current_version_id]
    if current:  # one query for the page's current versions (model_out finds them in the identity map)
        session.execute(select(ModelVersion).where(ModelVersion.id.in_(current))).scalars().all()
    return rows, next_cursor


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


def models_overview(session: Session, limit: int = 200) -> list[Model]:
    """Every model, newest first (the dashboard's model page; the API pages through them)."""
    return list(session.execute(select(Model).order_by(Model.created_at.desc()).limit(limit)).scalars())


def register_clip_model(session: Session, principal: Principal, body: ClipModelCreate) -> Model:
    """A federated CLIP + LoRA model: version 1 is the LoRA initialisation (built by a job); rounds come later. A
    caption-file federation (``data.kind == "karpathy"``) is checked here, file by file (app/registry/caption_files);
    its summary and the files' sha256 go into the spec."""
    if body.clip.checkpoint_path:
        read_allowed_path(body.clip.checkpoint_path, check_only=True)
    elif body.clip.arch != TINY_ARCH:
        raise Problem(
            422,
            "checkpoint-required",
            "This architecture needs a local checkpoint",
            f"{body.clip.arch!r}: give clip.checkpoint_path (under LETHE_DATA_ROOTS); nothing is downloaded here",
        )
    check_methods(body.kind, body.unlearning)
    data_files = check_caption_files(body.data) if isinstance(body.data, CaptionFilesFederationIn) else None
    spec_json: dict[str, Any] = {
        "clip": body.clip.model_dump(),
        "data": body.data.model_dump(exclude_none=True),
        "fed_settings": body.fed_settings,
        "unlearning": list(dict.fromkeys(body.unlearning)),
        "method_settings": body.method_settings,
        "verification": body.verification.model_dump(),
    }
    if data_files is not None:
        spec_json["data_files"] = data_files
    model = Model(name=body.name, kind=body.kind, spec=spec_json, state={}, requires_approval=body.requires_approval)
    _add_with_training_job(
        session,
        principal,
        model,
        lambda job_id: {"name": body.name, "kind": body.kind, "arch": body.clip.arch, "job_id": job_id},
        tags=body.tags,
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
    end = 0
    for name, entry in header.items():
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (
            isinstance(entry.get("dtype") if isinstance(entry, dict) else None, str)
            and isinstance(entry.get("shape"), list)
            and all(isinstance(d, int) and d >= 0 for d in entry["shape"])
            and isinstance(offsets, list)
            and len(offsets) == 2
            and all(isinstance(o, int) for o in offsets)
            and 0 <= offsets[0] <= offsets[1]
        ):
            raise Problem(
                422,
                "invalid-round",
                "Not a safetensors file",
                f"tensor {str(name)[:100]!r}: an entry is an object with dtype, shape and data_offsets",
            )
        end = max(end, offsets[1])
    if 8 + size + end != len(data):
        raise Problem(422, "invalid-round", "Not a safetensors file", "the tensors do not fill the file")
    return header


def check_round_values(data: bytes, model: Model, principal: Principal) -> None:
    """A round's values, not only its shapes (issue 22: a client key could upload other clients' rows and any
    ``weights`` — NaN, negative, 1e30 — so the aggregate became NaN or one client's): every update finite; a key bound
    to a client may send only its own row (every other row zero) and its own weight; a weight is finite, >= 0 and at
    most the client's registered pair count (its FedAvg weight at registration)."""
    from safetensors.numpy import load as load_numpy

    try:
        tensors = load_numpy(data)
    except Exception:
        raise Problem(422, "invalid-round", "Not a safetensors file", "the tensors cannot be read") from None
    updates, weights = tensors["updates"], tensors.get("weights")
    if not np.isfinite(updates).all():
        raise Problem(422, "invalid-round", "`updates` must be finite", "NaN or infinity in the updates")
    clients = model.state["clients"]
    own = None
    if principal.client_id is not None:
        if principal.client_id not in clients:
            raise Problem(403, "forbidden", "The key's client is not in this federation", principal.client_id)
        own = clients.index(principal.client_id)
        if np.any(np.delete(updates, own, axis=0) != 0):
            raise Problem(
                403,
                "forbidden",
                "A client's key may send only its own row",
                f"client {principal.client_id} is row {own}: every other row of `updates` must be zero",
            )
    if weights is None:
        return
    sizes = model.state.get("client_sizes")
    if not np.isfinite(weights).all() or (weights < 0).any():
        raise Problem(422, "invalid-round", "`weights` must be finite and non-negative")
    if sizes is not None and (weights > np.asarray(sizes, dtype=np.float64)).any():
        raise Problem(
            422, "invalid-round", "A client's weight exceeds its pair count", f"at most {list(sizes)} (per client)"
        )
    if own is not None and np.any(np.delete(weights, own) != 0):
        raise Problem(403, "forbidden", "A client's key may set only its own weight", f"client row {own}")


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
    check_round_values(data, model, principal)
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


def _updated(session: Session, principal: Principal, model: Model, change: dict[str, Any]) -> Model:
    append_event(
        session, actor=principal.actor, action="model.updated", entity_type="model", entity_id=model.id, payload=change
    )
    return model


def update_model(session: Session, principal: Principal, model: Model, body: ModelPatch) -> Model:
    """``PATCH /v1/models/{id}`` (and the dashboard's settings form): the settings given, each change audited as
    ``model.updated`` (a value equal to the current one changes and records nothing); at least one is needed."""
    if body.requires_approval is None and body.tags is None and body.batch is None:
        raise Problem(422, "validation-error", "The request is not valid", "Give requires_approval, tags or batch.")
    if body.batch is not None:
        set_batch(session, principal, model, body.batch.model_dump())
    if body.requires_approval is not None:
        set_requires_approval(session, principal, model, body.requires_approval)
    if body.tags is not None:
        set_tags(session, principal, model, body.tags)
    return model


def set_batch(session: Session, principal: Principal, model: Model, batch: dict[str, int]) -> Model:
    """New batch bounds for the model's next batches (audited); a batch already running keeps its members."""
    if (model.spec or {}).get("batch") == batch:
        return model
    model.spec = {**(model.spec or {}), "batch": batch}
    return _updated(session, principal, model, {"batch": batch})


def set_requires_approval(session: Session, principal: Principal, model: Model, required: bool) -> Model:
    """Turn approval on or off for a model's future deletion requests (audited). Requests already waiting stay
    waiting until approved or rejected; the intake's model snapshot sees the change within a second."""
    if bool(model.requires_approval) == required:
        return model
    model.requires_approval = required
    return _updated(session, principal, model, {"requires_approval": required})


# ------------------------------------------------------------------------------------------------------ take-out
def get_version_or_problem(session: Session, model: Model, number: int | None = None) -> ModelVersion:
    """A version by number (the current one when ``number`` is None) that may still be used: 404 when there is
    none, 410 when it is retired (trained on rows since erased), 409 while the model has no version yet."""
    if number is None:
        version = session.get(ModelVersion, model.current_version_id) if model.current_version_id else None
        if version is None:
            raise Problem(409, "model-not-ready", "The model is not ready", f"status is {model.status!r}")
    else:
        version = session.execute(
            select(ModelVersion).where(ModelVersion.model_id == model.id, ModelVersion.number == number)
        ).scalar_one_or_none()
        if version is None:
            raise Problem(404, "version-not-found", "No such version", f"model {model.id} has no version {number}")
    if version.retired_at is not None:
        raise Problem(
            410,
            "version-retired",
            "This version was trained on erased rows and is retired",
            f"retired at {version.retired_at.isoformat()} by deletion request {version.retired_by}; "
            "its lineage stays listed under /versions",
            retired_by=version.retired_by,
        )
    return version


def _recipe(session: Session, model: Model) -> dict[str, Any]:
    """The recipe as version 1 trained it (defaults resolved: its metrics keep it), else as registered."""
    first = session.execute(
        select(ModelVersion.metrics).where(ModelVersion.model_id == model.id, ModelVersion.number == 1)
    ).scalar_one_or_none()
    recipe = (first or {}).get("recipe") or {}
    return dict(recipe) if recipe.get("family") else dict(model.spec.get("recipe") or {"family": model.spec["family"]})


def export_card(session: Session, model: Model, version: ModelVersion, theta: np.ndarray) -> dict[str, Any]:
    """The model card a tabular version's download carries (app/ml/export.py)."""
    parent = session.get(ModelVersion, version.parent_id) if version.parent_id else None
    quality = version_quality(version)
    return export.make_card(
        model={"id": model.id, "name": model.name, "kind": model.kind, "family": model.spec.get("family")},
        version={
            "id": version.id,
            "number": version.number,
            "parent_id": version.parent_id,
            "parent_number": parent.number if parent is not None else None,
            "method": version.method,
            "request_id": version.request_id,
            "created_at": version.created_at.isoformat(),
            "digest": version.digest,
        },
        recipe=_recipe(session, model),
        encoder=model.state["encoder"],
        theta=theta,
        quality=quality.model_dump() if quality is not None else None,
    )


def _theta(digest: str) -> np.ndarray:
    from safetensors.numpy import load as load_arrays

    return load_arrays(get_store().get_bytes(digest))[export.WEIGHTS_KEY]


def weights_file(session: Session, model: Model, version: ModelVersion) -> bytes:
    """What ``GET …/versions/{n}/weights`` sends: a tabular version as an exported file (theta and its card), a
    federated one as stored (the LoRA vector its clients load each round)."""
    if model.kind != "tabular" or not (model.state or {}).get("encoder"):
        return get_store().get_bytes(version.digest)
    theta = _theta(version.digest)
    return export.export_bytes(theta, export_card(session, model, version, theta))


class _Predictors:
    """Predictors the API process keeps (a few, by version and encoder): a version's weights are read and unpacked
    once, not per call. Content never goes stale: an erasure makes a new version (and may scrub the encoder)."""

    def __init__(self, size: int = 16):
        self.size, self._lock, self._entries = size, threading.Lock(), OrderedDict()

    def get(self, session: Session, model: Model, version: ModelVersion) -> export.Predictor:
        encoder = json.dumps(model.state["encoder"], sort_keys=True)
        key = (version.id, version.digest, hashlib.sha256(encoder.encode()).hexdigest())
        with self._lock:
            found = self._entries.get(key)
            if found is not None:
                self._entries.move_to_end(key)
                return found
        theta = _theta(version.digest)
        predictor = export.Predictor(export_card(session, model, version, theta), theta)
        with self._lock:
            self._entries[key] = predictor
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)
        return predictor

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


PREDICTORS = _Predictors()


def predict(session: Session, model: Model, body: PredictIn) -> PredictOut:
    """Class probabilities for rows of a tabular model's version. Runs in the API process on purpose: a forward
    pass of a logistic regression or small MLP in numpy (app/ml/export.py, no torch), bounded by MAX_PREDICT_ROWS
    rows and PREDICT_MAX_WORK rows x parameters (milliseconds), is cheaper than queueing a job for it."""
    if model.kind != "tabular":
        raise Problem(
            422,
            "prediction-not-supported",
            "This model kind has no predict endpoint",
            f"{model.kind} models are not served for prediction here; download their weights instead",
        )
    if model.status != "ready" or not (model.state or {}).get("encoder"):
        raise Problem(409, "model-not-ready", "The model is not ready", f"status is {model.status!r}")
    version = get_version_or_problem(session, model, body.version)
    predictor = PREDICTORS.get(session, model, version)
    most = max(1, min(MAX_PREDICT_ROWS, PREDICT_MAX_WORK // max(1, predictor.n_params)))
    if len(body.rows) > most:
        raise Problem(
            413,
            "too-many-rows",
            "Too many rows in one call",
            f"{len(body.rows)} rows; this model ({predictor.n_params} parameters) takes at most {most} per call "
            f"(at most {MAX_PREDICT_ROWS} rows and {PREDICT_MAX_WORK} rows x parameters)",
            max_rows=most,
        )
    try:
        probabilities = predictor.predict_proba(body.rows)
    except export.RowsError as exc:
        raise Problem(
            422,
            "invalid-rows",
            "Some rows do not fit the model's feature columns",
            str(exc),
            unknown_columns=exc.unknown_columns,
            missing_columns=exc.missing_columns,
            row_errors=exc.errors,
            feature_columns=predictor.feature_columns,
        ) from None
    return PredictOut(
        model_id=model.id,
        version=PredictedVersion(id=version.id, number=version.number, digest=version.digest),
        classes=predictor.classes,
        labels=[predictor.classes[int(k)] for k in probabilities.argmax(axis=1)],
        probabilities=probabilities.tolist(),
    )

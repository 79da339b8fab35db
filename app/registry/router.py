from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from sqlalchemy.orm import Session
from starlette.datastructures import FormData
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.auth.service import Principal, require_scope
from app.config import get_settings
from app.db import get_session
from app.openapi import accepted, binary
from app.problems import Problem
from app.registry import service
from app.registry.schemas import (
    MODEL_KINDS,
    MODEL_STATUSES,
    ClipModelCreate,
    ForgetLockOut,
    LivePairsOut,
    ModelCreate,
    ModelOut,
    ModelPage,
    ModelPatch,
    PredictIn,
    PredictOut,
    RoundAccepted,
    Tag,
    VersionOut,
)
from app.storage import get_store
from app.validation import load_json

router = APIRouter(prefix="/v1/models", tags=["models"])

MAX_FILENAME = 200  # the datasets.name column
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


async def read_form(request: Request) -> FormData:
    """Multipart with a small limit on non-file fields (``max_form_field_bytes``; files have their own limits)."""
    limit = get_settings().max_form_field_bytes
    try:
        return await request.form(max_part_size=limit)
    except StarletteHTTPException as exc:
        if exc.status_code == 400 and "exceeded maximum size" in str(exc.detail):
            raise Problem(
                413,
                "payload-too-large",
                "A form field is larger than the limit",
                f"non-file fields may hold at most {limit} bytes (LETHE_MAX_FORM_FIELD_BYTES)",
                limit_bytes=limit,
            ) from None
        raise


def _upload_name(filename: str | None) -> str | None:
    if filename is not None and (len(filename) > MAX_FILENAME or _CONTROL.search(filename)):
        raise Problem(
            422,
            "validation-error",
            "The request is not valid",
            errors=[
                {
                    "location": ["body", "file", "filename"],
                    "message": f"the file name must be at most {MAX_FILENAME} characters, without control characters",
                    "type": "filename_invalid",
                }
            ],
        )
    return filename


async def _parse_registration(request: Request) -> tuple[ModelCreate | ClipModelCreate, bytes, str | None]:
    """JSON with a server-side ``dataset.path``, or multipart with ``metadata`` (JSON) and ``file`` (CSV/Parquet)."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    settings = get_settings()
    if content_type == "application/json":
        payload = load_json(await request.body())
        if isinstance(payload, dict) and payload.get("kind") == "clip_federated":
            return _validate(payload, ClipModelCreate), b"", None
        body = _validate(payload)
        if not body.dataset.path:
            raise Problem(
                422,
                "validation-error",
                "A data set is needed",
                "Give `dataset.path`, or upload the file as multipart/form-data (`metadata` + `file`).",
            )
        name = Path(body.dataset.path).name[-MAX_FILENAME:] or None
        return body, service.read_allowed_path(body.dataset.path), name
    if content_type == "multipart/form-data":
        form = await read_form(request)
        metadata, upload = form.get("metadata"), form.get("file")
        if not isinstance(metadata, str) or upload is None or isinstance(upload, str):
            raise Problem(422, "validation-error", "Multipart registration needs `metadata` (JSON) and `file`")
        payload = load_json(metadata, "`metadata`")
        body = _validate(payload)
        filename = _upload_name(upload.filename)
        data = service.spool_upload(upload.file, settings.max_upload_bytes)
        return body, data, filename
    raise Problem(
        415, "unsupported-media-type", "Unsupported media type", "Send application/json or multipart/form-data."
    )


def _validate(payload, schema=ModelCreate):
    try:
        return schema.model_validate(payload)
    except ValidationError as exc:
        errors = [
            {"location": [str(p) for p in e["loc"]], "message": e["msg"], "type": e["type"]} for e in exc.errors()
        ]
        raise Problem(422, "validation-error", "The request is not valid", errors=errors) from None


@router.post(
    "",
    status_code=202,
    response_model=ModelOut,
    responses=accepted("Registered; version 1 is being trained (poll the Location)."),
)
async def register_model(
    request: Request,
    principal: Principal = Depends(require_scope("models:write")),
    session: Session = Depends(get_session),
):
    body, data, filename = await _parse_registration(request)
    if isinstance(body, ClipModelCreate):
        model = service.register_clip_model(session, principal, body)
    else:
        model = service.register_model(session, principal, body, data, filename)
    session.commit()
    out = service.model_out(session, model)
    return JSONResponse(
        out.model_dump(mode="json"),
        status_code=202,
        headers={"Location": f"/v1/models/{model.id}", "Retry-After": str(get_settings().retry_after_seconds)},
    )


@router.get("", response_model=ModelPage)
def list_models(
    _: Principal = Depends(require_scope("requests:read", "models:read")),
    session: Session = Depends(get_session),
    name: str | None = Query(None, max_length=200, description="Exact name."),
    name_contains: str | None = Query(None, max_length=200, description="Case-insensitive part of the name."),
    kind: Literal[MODEL_KINDS] | None = Query(None),  # type: ignore[valid-type]
    status: Literal[MODEL_STATUSES] | None = Query(None),  # type: ignore[valid-type]
    limit: int = Query(50, ge=1, le=500),
    cursor: str | None = Query(None, max_length=1000, description="`next_cursor` from the previous page."),
    tag: list[Tag] = Query([], max_length=16, description="Repeat for several: models carrying every one."),
):
    """Registered models, newest first, keyset-paged (the deletion-request list's cursor); filter by name, kind,
    status and tags."""
    rows, next_cursor = service.list_models(session, name, name_contains, kind, status, limit, cursor, tags=tag)
    tags = service.tags_of(session, [m.id for m in rows])
    return ModelPage(items=[service.model_out(session, m, tags.get(m.id, [])) for m in rows], next_cursor=next_cursor)


@router.get("/{model_id}", response_model=ModelOut)
def get_model(
    model_id: str,
    _: Principal = Depends(require_scope("requests:read", "models:read")),
    session: Session = Depends(get_session),
):
    return service.model_out(session, service.get_model_or_404(session, model_id))


@router.patch("/{model_id}", response_model=ModelOut)
def patch_model(
    model_id: str,
    body: ModelPatch,
    principal: Principal = Depends(require_scope("admin")),
    session: Session = Depends(get_session),
):
    """Change a model's settings an admin owns: ``requires_approval``, ``tags`` and ``batch`` (each change
    audited)."""
    model = service.update_model(session, principal, service.get_model_or_404(session, model_id), body)
    session.commit()
    return service.model_out(session, model)


@router.get("/{model_id}/versions", response_model=list[VersionOut])
def get_versions(
    model_id: str,
    _: Principal = Depends(require_scope("requests:read", "models:read")),
    session: Session = Depends(get_session),
):
    service.get_model_or_404(session, model_id)
    return [service.version_out(v) for v in service.list_versions(session, model_id)]


@router.post(
    "/{model_id}/rounds",
    status_code=202,
    response_model=RoundAccepted,
    responses=accepted("The round is queued for aggregation into a new version (poll the job or the model)."),
)
async def submit_round(
    model_id: str,
    request: Request,
    principal: Principal = Depends(require_scope("rounds:write")),
    session: Session = Depends(get_session),
):
    """One FedAvg round of a federated model: a safetensors file with ``updates`` [clients, params] (float32) and,
    optionally, ``weights`` [clients]. Sent raw (application/octet-stream) or as multipart field ``file``. After an
    EASE unlearning, the aggregated update is projected off the forget-exclusive directions before it is applied."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    settings = get_settings()
    if content_type == "application/octet-stream":
        data = await request.body()
    elif content_type == "multipart/form-data":
        form = await read_form(request)
        upload = form.get("file")
        if upload is None or isinstance(upload, str):
            raise Problem(422, "validation-error", "Multipart round upload needs a `file` field")
        data = service.spool_upload(upload.file, settings.max_round_bytes)
    else:
        raise Problem(
            415,
            "unsupported-media-type",
            "Unsupported media type",
            "Send application/octet-stream or multipart/form-data.",
        )
    model = service.get_model_or_404(session, model_id)
    if principal.client_id is not None and principal.client_id in model.state.get("removed", []):
        raise Problem(
            403,
            "client-removed",
            "The client was forgotten and may not send updates",
            f"client {principal.client_id} left the federation",
        )
    job = service.submit_round(session, principal, model, data)
    session.commit()
    return JSONResponse(
        {"job_id": job.id, "model_id": model.id, "status": "queued"},
        status_code=202,
        headers={"Location": f"/v1/models/{model.id}", "Retry-After": "2"},
    )


def _lock_entry(model) -> dict:
    lock = model.state.get("forget_lock")
    if not lock:
        raise Problem(
            404,
            "no-forget-lock",
            "The model has no forget lock",
            "A forget lock exists after an EASE unlearning of a federated model.",
        )
    return lock


@router.get("/{model_id}/forget-lock", response_model=ForgetLockOut)
def get_forget_lock(
    model_id: str,
    _: Principal = Depends(require_scope("models:read", "requests:read")),
    session: Session = Depends(get_session),
):
    """U_mu and alpha for federated clients (EASE, Projection with Forget Lock)."""
    model = service.get_model_or_404(session, model_id)
    lock = _lock_entry(model)
    return ForgetLockOut(
        model_id=model.id,
        request_id=lock["request_id"],
        version_id=lock["version_id"],
        alpha=lock["alpha"],
        rank=lock["rank"],
        n_params=lock["n_params"],
        digest=lock["digest"],
        links={"tensors": f"/v1/models/{model.id}/forget-lock.safetensors"},
    )


@router.get(
    "/{model_id}/forget-lock.safetensors",
    response_class=Response,
    responses=binary("application/octet-stream", "safetensors: the basis U_mu [p, k] and theta_unl [p].", "ETag"),
)
def get_forget_lock_tensors(
    model_id: str, _: Principal = Depends(require_scope("models:read")), session: Session = Depends(get_session)
):
    """The lock's tensors (basis U_mu and theta_unl) are model parameters: ``models:read``."""
    lock = _lock_entry(service.get_model_or_404(session, model_id))
    return Response(
        get_store().get_bytes(lock["digest"]),
        media_type="application/octet-stream",
        headers={"ETag": f'"{lock["digest"]}"'},
    )


@router.get("/{model_id}/pairs", response_model=LivePairsOut)
def get_live_pairs(
    model_id: str, _: Principal = Depends(require_scope("requests:read")), session: Session = Depends(get_session)
):
    """The pairs each client may still train on (a federated model's tombstones, published as what is left)."""
    model = service.get_model_or_404(session, model_id)
    clients = service.live_pairs(session, model)
    return LivePairsOut(model_id=model.id, n_pairs=sum(len(v) for v in clients.values()), clients=clients)


@router.get(
    "/{model_id}/versions/{number}/weights",
    response_class=Response,
    responses=binary(
        "application/octet-stream",
        "safetensors: the version's parameters (key ``theta``, float32); a tabular version's header metadata holds "
        "its model card (``format`` = ``lethe.tabular/1``, ``lethe.card``: JSON).",
        "ETag",
    ),
)
def get_version_weights(
    model_id: str,
    number: int,
    _: Principal = Depends(require_scope("models:read")),
    session: Session = Depends(get_session),
):
    """A version's parameters (safetensors, key ``theta``). A tabular version comes out usable on its own: the
    header's metadata carries its model card (recipe, feature order, encoder, label classes, parameter layout,
    lineage, digest and measured accuracy; app/ml/export.py reads it back with numpy alone). A federated version is
    the LoRA vector its clients download each round. Weights can leak training data (membership inference), so this
    needs ``models:read``, not ``requests:read``; a retired version is 410."""
    model = service.get_model_or_404(session, model_id)
    version = service.get_version_or_problem(session, model, number)
    data = service.weights_file(session, model, version)
    return Response(
        data,
        media_type="application/octet-stream",
        headers={"ETag": f'"{hashlib.sha256(data).hexdigest()}"'},
    )


@router.post("/{model_id}/predict", response_model=PredictOut)
def predict(
    model_id: str,
    body: PredictIn,
    _: Principal = Depends(require_scope("models:read")),
    session: Session = Depends(get_session),
):
    """Predicted labels and class probabilities for rows (JSON objects naming the model's feature columns: its
    ``inputs``) of a tabular model's current version, or of ``version``. At most 1,000 rows per call (fewer for a
    large model); a retired version is 410; a federated model is ``prediction-not-supported``."""
    return service.predict(session, service.get_model_or_404(session, model_id), body)

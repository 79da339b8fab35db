from __future__ import annotations

import json

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from sqlalchemy.orm import Session

from app.auth.service import Principal, require_scope
from app.config import get_settings
from app.db import get_session
from app.problems import Problem
from app.registry import service
from app.registry.schemas import ModelCreate, ModelOut, VersionOut

router = APIRouter(prefix="/v1/models", tags=["models"])


async def _parse_registration(request: Request) -> tuple[ModelCreate, bytes, str | None]:
    """JSON with a server-side ``dataset.path``, or multipart with ``metadata`` (JSON) and ``file`` (CSV/Parquet)."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    settings = get_settings()
    if content_type == "application/json":
        raw = await request.body()
        try:
            payload = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise Problem(400, "malformed-json", "The body is not valid JSON", str(exc)) from None
        body = _validate(payload)
        if not body.dataset.path:
            raise Problem(
                422,
                "validation-error",
                "A data set is needed",
                "Give `dataset.path`, or upload the file as multipart/form-data (`metadata` + `file`).",
            )
        return body, service.read_allowed_path(body.dataset.path), body.dataset.path
    if content_type == "multipart/form-data":
        form = await request.form(max_part_size=settings.max_upload_bytes)
        metadata, upload = form.get("metadata"), form.get("file")
        if not isinstance(metadata, str) or upload is None or isinstance(upload, str):
            raise Problem(422, "validation-error", "Multipart registration needs `metadata` (JSON) and `file`")
        try:
            payload = json.loads(metadata)
        except json.JSONDecodeError as exc:
            raise Problem(400, "malformed-json", "`metadata` is not valid JSON", str(exc)) from None
        body = _validate(payload)
        data = service.spool_upload(upload.file, settings.max_upload_bytes)
        return body, data, upload.filename
    raise Problem(
        415, "unsupported-media-type", "Unsupported media type", "Send application/json or multipart/form-data."
    )


def _validate(payload) -> ModelCreate:
    try:
        return ModelCreate.model_validate(payload)
    except ValidationError as exc:
        errors = [
            {"location": [str(p) for p in e["loc"]], "message": e["msg"], "type": e["type"]} for e in exc.errors()
        ]
        raise Problem(422, "validation-error", "The request is not valid", errors=errors) from None


@router.post(
    "",
    status_code=202,
    response_model=ModelOut,
    responses={202: {"description": "Registered; version 1 is being trained (poll the Location)."}},
)
async def register_model(
    request: Request,
    principal: Principal = Depends(require_scope("models:write")),
    session: Session = Depends(get_session),
):
    body, data, filename = await _parse_registration(request)
    model = service.register_model(session, principal, body, data, filename)
    session.commit()
    out = service.model_out(session, model)
    return JSONResponse(
        out.model_dump(mode="json"),
        status_code=202,
        headers={"Location": f"/v1/models/{model.id}", "Retry-After": str(get_settings().retry_after_seconds)},
    )


@router.get("/{model_id}", response_model=ModelOut)
def get_model(
    model_id: str, _: Principal = Depends(require_scope("requests:read")), session: Session = Depends(get_session)
):
    return service.model_out(session, service.get_model_or_404(session, model_id))


@router.get("/{model_id}/versions", response_model=list[VersionOut])
def get_versions(
    model_id: str, _: Principal = Depends(require_scope("requests:read")), session: Session = Depends(get_session)
):
    service.get_model_or_404(session, model_id)
    return [service.version_out(v) for v in service.list_versions(session, model_id)]

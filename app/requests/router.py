from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Body, Depends, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from pydantic import ConfigDict, Field, ValidationError
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from app.auth.service import (
    Principal,
    batch_authenticated,
    hash_key,
    lookup_key,
    presented_key,
    require_scope,
    scope_problem,
    unknown_key_problem,
)
from app.config import get_settings
from app.db import get_session
from app.openapi import accepted
from app.problems import Problem
from app.registry.schemas import MethodName
from app.requests import bulk, service
from app.requests.intake import get_batcher, unavailable
from app.requests.policy import check_request_settings
from app.requests.schemas import DeletionRequestCreate, DeletionRequestOut, DeletionRequestPage
from app.requests.tables import REQUEST_STATUSES
from app.validation import NoNulModel

router = APIRouter(prefix="/v1/deletion-requests", tags=["deletion requests"])


def add_body_schemas(openapi: dict) -> dict:
    """Put the intake body's schema in the OpenAPI components (the route validates its body itself, so FastAPI does
    not list it); the route's ``openapi_extra`` refers to it."""
    schemas = openapi.setdefault("components", {}).setdefault("schemas", {})
    if "DeletionRequestCreate" not in schemas:
        schema = DeletionRequestCreate.model_json_schema(ref_template="#/components/schemas/{model}")
        for name, definition in schema.pop("$defs", {}).items():
            schemas.setdefault(name, definition)
        schemas["DeletionRequestCreate"] = schema
    return openapi


def _bad_idempotency_key(idempotency_key: str | None) -> Problem | None:
    if idempotency_key is None:
        return None
    if len(idempotency_key) > 200:
        message, kind = "at most 200 characters", "string_too_long"
    elif any(ord(c) < 0x20 or c == "\x7f" for c in idempotency_key):
        message, kind = "control characters (NUL included) are not allowed", "bad_character"
    else:
        return None
    return Problem(
        422,
        "validation-error",
        "The request is not valid",
        errors=[{"location": ["header", "Idempotency-Key"], "message": message, "type": kind}],
    )


async def require_json(request: Request) -> None:
    """415 unless the body is declared JSON (intake checks it in ``_parse``, after the key)."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type != "application/json":
        raise Problem(415, "unsupported-media-type", "Unsupported media type", "Send application/json.")


def json_caller(scope: str):
    """A dependency: the caller's principal holding ``scope``, then 415 unless the body is JSON. The key comes first
    (issue 22): an anonymous caller was told 415 about the bulk and subject-erasure routes before 401."""

    async def dependency(request: Request, principal: Principal = Depends(require_scope(scope))) -> Principal:
        await require_json(request)
        return principal

    return dependency


async def _parse(request: Request, idempotency_key: str | None) -> DeletionRequestCreate:
    """Content type, Idempotency-Key, body and method settings, in the order a client would fix them."""
    await require_json(request)
    problem = _bad_idempotency_key(idempotency_key)
    if problem is not None:
        raise problem
    try:
        body = DeletionRequestCreate.model_validate_json(await request.body())
    except ValidationError as exc:  # the same problem document as FastAPI's own body validation
        raise RequestValidationError(
            [{**e, "loc": ("body", *e.get("loc", ()))} for e in exc.errors(include_url=False, include_input=False)]
        ) from None
    check_request_settings(body.method, body.method_settings)
    return body


def _refusal(api_key: str) -> Problem | None:
    """401/403 for a key that may not create requests (one database read: only on the error path)."""
    principal = lookup_key(hash_key(api_key))
    return unknown_key_problem() if principal is None else scope_problem(principal, "requests:write")


IDEMPOTENCY_KEY_PARAMETER = {
    "name": "Idempotency-Key",
    "in": "header",
    "required": False,
    "schema": {
        "anyOf": [{"type": "string"}, {"type": "null"}],
        "description": "At most 200 characters.",
        "title": "Idempotency-Key",
    },
    "description": "At most 200 characters.",
}
"""The intake's one header parameter, documented as FastAPI documents a declared ``Header``: the route reads it
itself (no per-request dependency resolution)."""


@router.post(
    "",
    status_code=202,
    response_model=DeletionRequestOut,
    openapi_extra={
        "parameters": [IDEMPOTENCY_KEY_PARAMETER],
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/DeletionRequestCreate"}}},
        },
    },
    responses=accepted("Accepted; poll the Location for progress."),
)
@batch_authenticated("requests:write")
async def create_deletion_request(request: Request):
    """Validated and made durable (request, job and audit event in one commit) before the 202 is sent. The API key
    (scope ``requests:write``) is checked by the intake batcher, one query per batch, not one per request.

    Authentication comes first: a request that fails validation is answered 401/403 when its key would be refused
    (the key is then read on its own), so a caller without a valid key learns nothing about the schema. The body is
    validated here rather than by FastAPI for that reason (and because ``model_validate_json`` is the fast path)."""
    api_key = presented_key(request)
    idempotency_key = request.headers.get("idempotency-key")
    try:
        body = await _parse(request, idempotency_key)
    except (Problem, RequestValidationError):
        refusal = await run_in_threadpool(_refusal, api_key)
        if refusal is not None:
            raise refusal from None
        raise
    out = await accept(api_key, body, idempotency_key, request.scope.get("client"))
    return Response(
        out.model_dump_json(), status_code=202, media_type="application/json", headers=accepted_headers(out)
    )


async def accept(
    api_key: str, body: DeletionRequestCreate, idempotency_key: str | None, client: tuple[str, int] | None = None
) -> DeletionRequestOut:
    """A validated request made durable by the intake batcher (this route and app/requests/fastpath.py): raises the
    batch's Problem (a refused key, the registry), or 503 past ``intake_timeout_seconds``. ``client``: the
    connection's (host, port), which lets a batch be cut once every sending connection is in it."""
    try:
        out, _created = await get_batcher().submit_async(hash_key(api_key), body, idempotency_key, client)
    except TimeoutError:  # the commit may still land: the same Idempotency-Key then answers with that request
        raise unavailable() from None
    return out


def accepted_headers(out: DeletionRequestOut) -> dict[str, str]:
    return {"Location": f"/v1/deletion-requests/{out.id}", "Retry-After": str(get_settings().retry_after_seconds)}


@router.get("/{request_id}", response_model=DeletionRequestOut)
def get_deletion_request(
    request_id: str, _: Principal = Depends(require_scope("requests:read")), session: Session = Depends(get_session)
):
    return service.to_out(service.get_request_or_404(session, request_id))


@router.get("", response_model=DeletionRequestPage)
def list_deletion_requests(
    _: Principal = Depends(require_scope("requests:read")),
    session: Session = Depends(get_session),
    status: Literal[REQUEST_STATUSES] | None = Query(None),  # type: ignore[valid-type]
    model_id: str | None = Query(None),
    limit: int = Query(50, ge=1, le=500),
    cursor: str | None = Query(None),
    stuck: bool = Query(False, description="Only requests still waiting for a worker after LETHE_STUCK_AFTER_SECONDS."),
    overdue: bool = Query(False, description="Only unanswered requests past their deadline."),
):
    rows, next_cursor = service.list_requests(session, status, model_id, limit, cursor, stuck, overdue)
    return DeletionRequestPage(items=[service.to_out(r) for r in rows], next_cursor=next_cursor)


class ExtensionIn(NoNulModel):
    model_config = ConfigDict(extra="forbid")
    months: int = Field(..., ge=1, le=2)
    reason: str = Field(..., min_length=3, max_length=2000, description="Told to the data subject (Art. 12(3)).")


@router.post("/{request_id}/extend", response_model=DeletionRequestOut)
def extend_deadline(
    request_id: str,
    body: ExtensionIn,
    principal: Principal = Depends(require_scope("admin")),
    session: Session = Depends(get_session),
):
    """Extend the deadline by one or two months in all, with a reason (audited)."""
    request = service.extend_deadline(session, principal, request_id, body.months, body.reason)
    session.commit()
    return service.to_out(request)


@router.post("/{request_id}/cancel", response_model=DeletionRequestOut)
def cancel_deletion_request(
    request_id: str, principal: Principal = Depends(require_scope("admin")), session: Session = Depends(get_session)
):
    """Cancel a request no worker has started, or withdraw a failed one (audited); its rows are released."""
    request = service.cancel_request(session, principal, request_id)
    session.commit()
    return service.to_out(request)


class RetryIn(NoNulModel):
    model_config = ConfigDict(extra="forbid")
    method: MethodName | None = Field(
        None,
        description="Run it with this method instead of its own (e.g. `retrain` after an approximate method failed "
        "its verdict); the method settings it had are dropped. Checked as at submission.",
    )


@router.post("/{request_id}/retry", response_model=DeletionRequestOut, status_code=202)
def retry_deletion_request(
    request_id: str,
    body: RetryIn | None = Body(None),
    principal: Principal = Depends(require_scope("admin")),
    session: Session = Depends(get_session),
):
    """Run a failed request again (a new job; audited), with its own method or the one the body names. 409 when
    another request now holds some of its rows."""
    try:
        request = service.retry_request(session, principal, request_id, body.method if body else None)
        session.commit()
    except IntegrityError:
        session.rollback()
        raise Problem(
            409, "deletion-in-progress", "Another unfinished request now holds some of these rows", request_id
        ) from None
    return service.to_out(request)


class ApprovalIn(NoNulModel):
    model_config = ConfigDict(extra="forbid")
    note: str | None = Field(None, max_length=2000, description="Recorded in the audit log.")


class RejectionIn(NoNulModel):
    model_config = ConfigDict(extra="forbid")
    reason: str = Field(..., min_length=3, max_length=2000, description="Told to the data subject and audited.")


@router.post("/{request_id}/approve", response_model=DeletionRequestOut, status_code=202)
def approve_deletion_request(
    request_id: str,
    body: ApprovalIn | None = None,
    principal: Principal = Depends(require_scope("admin")),
    session: Session = Depends(get_session),
):
    """Approve a request waiting for approval (its model ``requires_approval``): only now is its job created, so no
    worker can have started it before (audited)."""
    request = service.approve_request(session, principal, request_id, body.note if body else None)
    session.commit()
    return service.to_out(request)


@router.post("/{request_id}/reject", response_model=DeletionRequestOut)
def reject_deletion_request(
    request_id: str,
    body: RejectionIn,
    principal: Principal = Depends(require_scope("admin")),
    session: Session = Depends(get_session),
):
    """Refuse a request waiting for approval, with a reason (audited; its callback gets ``deletion.rejected``)."""
    request = service.reject_request(session, principal, request_id, body.reason)
    session.commit()
    return service.to_out(request)


@router.post("/bulk", response_model=bulk.BulkOut)
def bulk_action(
    body: bulk.BulkIn,
    principal: Principal = Depends(json_caller("admin")),
    session: Session = Depends(get_session),
):
    """One operator action (cancel, retry, approve, reject, extend) over explicit ``ids`` or the list endpoint's
    ``filter``. Each request is acted on and audited on its own; one that cannot take the action is skipped with the
    reason. An empty selection, or one larger than ``LETHE_BULK_MAX_REQUESTS``, is refused as a whole (422)."""
    out = bulk.run(session, principal, body)
    session.commit()
    return out

"""Bulk operator actions (scope ``admin``): one action over explicit ids or over the list endpoint's filter.

Each request is acted on in its own SAVEPOINT through the same service function the single-request route uses, so
each is audited on its own and a refusal (a request that has started, one not waiting for approval) skips that
request only, with its problem's type and detail as the reason. The selection is refused as a whole when it is empty
or larger than ``LETHE_BULK_MAX_REQUESTS`` (problem+json): a bulk action never touches more than an operator saw.
"""

from __future__ import annotations

from typing import Literal

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, model_validator
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from app.audit.service import forget_head
from app.auth.service import Principal
from app.config import get_settings
from app.problems import PROBLEM_BASE, Problem
from app.requests import service
from app.requests.tables import REQUEST_STATUSES, DeletionRequest
from app.validation import NoNulModel

BulkAction = Literal["cancel", "retry", "approve", "reject", "extend"]


class BulkFilter(NoNulModel):
    """The list endpoint's filter (``GET /v1/deletion-requests``), plus a creation-date window."""

    model_config = ConfigDict(extra="forbid")
    status: Literal[REQUEST_STATUSES] | None = None  # type: ignore[valid-type]
    model_id: str | None = Field(None, max_length=64)
    overdue: bool = False
    stuck: bool = False
    created_after: AwareDatetime | None = None
    created_before: AwareDatetime | None = None


class BulkIn(NoNulModel):
    model_config = ConfigDict(extra="forbid")
    action: BulkAction
    ids: list[str] | None = Field(None, max_length=10_000, description="Explicit request ids (or give `filter`).")
    filter: BulkFilter | None = Field(None, description="The list endpoint's filter (or give `ids`).")
    months: int | None = Field(None, ge=1, le=2, description="extend: one or two months.")
    reason: str | None = Field(
        None, min_length=3, max_length=2000, description="extend and reject: told to the data subject."
    )

    @model_validator(mode="after")
    def _one_selection(self) -> BulkIn:
        if (self.ids is None) == (self.filter is None):
            raise ValueError("give exactly one of `ids` and `filter`")
        if self.action == "extend" and (self.months is None or self.reason is None):
            raise ValueError("extend needs `months` and `reason`")
        if self.action == "reject" and self.reason is None:
            raise ValueError("reject needs `reason`")
        return self


class BulkResult(BaseModel):
    id: str
    outcome: Literal["done", "skipped"]
    status: Literal[REQUEST_STATUSES] | None = None  # type: ignore[valid-type]  # the request's status after it
    reason: str | None = None  # skipped: why
    problem_type: str | None = None


class BulkOut(BaseModel):
    action: BulkAction
    selected: int
    done: int
    skipped: int
    results: list[BulkResult]


def _too_many(count: str, limit: int) -> Problem:
    return Problem(
        422,
        "bulk-selection-too-large",
        "The selection is larger than a bulk action may touch",
        f"{count} requests selected; at most {limit} (LETHE_BULK_MAX_REQUESTS). Narrow the filter.",
        limit=limit,
    )


def select_ids(session: Session, body: BulkIn) -> list[str]:
    """The selected request ids (oldest first for a filter), refused when empty or above the limit."""
    limit = get_settings().bulk_max_requests
    if body.ids is not None:
        ids = list(dict.fromkeys(body.ids))
        if len(ids) > limit:
            raise _too_many(str(len(ids)), limit)
    else:
        f = body.filter
        query = service.filter_requests(
            select(DeletionRequest.id),
            status=f.status,
            model_id=f.model_id,
            overdue=f.overdue,
            stuck=f.stuck,
            created_from=f.created_after,
            created_before=f.created_before,
        )
        ids = list(
            session.execute(query.order_by(DeletionRequest.created_at, DeletionRequest.id).limit(limit + 1)).scalars()
        )
        if len(ids) > limit:
            raise _too_many(f"more than {limit}", limit)
    if not ids:
        raise Problem(
            422, "bulk-selection-empty", "The selection is empty", "No deletion request matches; nothing was done."
        )
    return ids


def _act(session: Session, principal: Principal, body: BulkIn, request_id: str) -> DeletionRequest:
    if body.action == "cancel":
        return service.cancel_request(session, principal, request_id)
    if body.action == "retry":
        return service.retry_request(session, principal, request_id)
    if body.action == "approve":
        return service.approve_request(session, principal, request_id)
    if body.action == "reject":
        return service.reject_request(session, principal, request_id, body.reason)
    return service.extend_deadline(session, principal, request_id, body.months, body.reason)


def run(session: Session, principal: Principal, body: BulkIn) -> BulkOut:
    """Act on every selected request, each in its own SAVEPOINT; the caller commits once."""
    ids = select_ids(session, body)
    results: list[BulkResult] = []
    for request_id in ids:
        savepoint = session.begin_nested()
        try:
            request = _act(session, principal, body, request_id)
            session.flush()
            savepoint.commit()
            results.append(BulkResult(id=request_id, outcome="done", status=request.status))
        except Problem as exc:
            savepoint.rollback()
            forget_head(session)
            results.append(_skipped(request_id, exc.slug, exc.detail or exc.title))
        except IntegrityError:  # retry: another unfinished request now holds some of its rows
            savepoint.rollback()
            forget_head(session)
            results.append(
                _skipped(request_id, "deletion-in-progress", "another unfinished request now holds some of its rows")
            )
    done = sum(r.outcome == "done" for r in results)
    return BulkOut(action=body.action, selected=len(ids), done=done, skipped=len(ids) - done, results=results)


def _skipped(request_id: str, slug: str, reason: str) -> BulkResult:
    return BulkResult(id=request_id, outcome="skipped", reason=reason, problem_type=PROBLEM_BASE + slug)

"""Deletion-request intake: validate against the registry, then ONE transaction writes the request, its job (the
outbox) and the audit event. Idempotency-Key: the same key and body answers the same request; another body is 422."""

from __future__ import annotations

import calendar
import hashlib
import hmac
import json
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

from sqlalchemy import and_, delete, func, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from app.audit.service import append_event, append_events, forget_head, hash_subject
from app.auth.service import Principal
from app.config import get_settings, hmac_hex
from app.db import new_id, utcnow
from app.jobs.outbox import cancel as cancel_job
from app.jobs.outbox import job_insert, new_job
from app.jobs.outbox import job_row as new_job_row
from app.jobs.tables import Job
from app.ml.unlearning.base import AUTO, UnknownMethodError, get_method
from app.paging import decode_cursor, encode_cursor
from app.problems import Problem
from app.registry.schemas import SCOPES_BY_KIND
from app.registry.tables import DatasetRow, Model, ModelVersion
from app.registry.versions import (
    ID_QUERY_CHUNK,
    erased_hashes,
    hash_row_id,
    hash_row_ids,
    positions_by_request,
    rows_with_hashes,
)
from app.requests.schemas import DeletionRequestCreate, DeletionRequestOut
from app.requests.tables import ANSWERED_STATUSES, TERMINAL_STATUSES, DeletionRequest, InflightRow
from app.requests.tables import REQUEST_STATUSES as REQUEST_STATUSES  # re-exported: the dashboard reads no tables
from app.webhooks import service as webhooks

META_METHODS = {AUTO}
APPROVAL_STATUS = "pending-approval"
"""A request on a model that ``requires_approval`` waits here, with no job, until an admin approves it (its deadline
keeps running); approval creates its job and moves it to ``received``."""


def body_fingerprint(body: DeletionRequestCreate) -> str:
    """Keyed (HMAC, request-fingerprint key): the body holds the subject reference, so a plain hash stored in the
    database would let anyone holding the database test guesses of a subject."""
    canonical = json.dumps(body.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    key = get_settings().derived_key("request-fingerprint")
    return hmac_hex(key, canonical)


@dataclass(frozen=True)
class Prepared:
    """What a request's rows need that no database read decides (its fingerprint, the subject's and the sample ids'
    keyed hashes): the intake computes it on the API's event loop before the request joins a batch, while the intake
    thread waits on the database, so the batch's serial chain of round trips and Python is shorter (issue 21)."""

    fingerprint: str
    subject_hash: str
    id_hashes: list[str] | None  # a samples scope: the unique ids' hashes, in the ids' order


def prepare(body: DeletionRequestCreate) -> Prepared:
    ids = list(dict.fromkeys(body.scope.sample_ids)) if body.scope.kind == "samples" else None
    return Prepared(
        body_fingerprint(body),
        hash_subject(get_settings().derived_key("subject-hash"), body.subject_ref),
        hash_row_ids(ids) if ids is not None else None,
    )


def to_out(request: DeletionRequest) -> DeletionRequestOut:
    return DeletionRequestOut(
        id=request.id,
        model_id=request.model_id,
        subject_hash=request.subject_hash,
        scope={k: v for k, v in request.scope.items() if k != "positions"},
        method=request.method,
        status=request.status,
        progress=request.progress,
        message=request.message,
        attempts=request.attempts,
        error=request.error,
        erasure=request.erasure,
        stuck=is_stuck(request),
        received_at=request.received_at,
        due_at=request.due_at,
        days_left=round((request.due_at - utcnow()).total_seconds() / 86400, 2) if request.due_at else None,
        overdue=is_overdue(request),
        answered_late=answered_late(request),
        extensions=request.extensions or [],
        notes=request.notes or [],
        result_version_id=request.result_version_id,
        created_at=request.created_at,
        updated_at=request.updated_at,
        started_at=request.started_at,
        completed_at=request.completed_at,
        links={
            "self": f"/v1/deletion-requests/{request.id}",
            "model": f"/v1/models/{request.model_id}",
            "reports": f"/v1/reports?request_id={request.id}",
            "webhooks": f"/v1/deletion-requests/{request.id}/webhooks",
            **({"certificate": f"/v1/certificates/{request.certificate_id}"} if request.certificate_id else {}),
        },
    )


def _raise_if_in_flight(session: Session, body: DeletionRequestCreate) -> None:
    """409 naming the unfinished request that already holds some of these rows (the in-flight index's conflict)."""
    if body.scope.kind != "samples":
        return
    hashes = hash_row_ids(dict.fromkeys(body.scope.sample_ids))
    holders: dict[str, int] = {}
    for start in range(0, len(hashes), ID_QUERY_CHUNK):
        chunk = hashes[start : start + ID_QUERY_CHUNK]
        for (holder,) in session.execute(
            select(InflightRow.request_id).where(InflightRow.model_id == body.model_id, InflightRow.id_hash.in_(chunk))
        ).all():
            holders[holder] = holders.get(holder, 0) + 1
    if holders:
        earlier = max(holders, key=holders.get)
        raise Problem(
            409,
            "deletion-in-progress",
            "Some samples are already being deleted by an earlier request",
            f"{sum(holders.values())} of the ids are held by unfinished request(s); follow {earlier}",
            request_id=earlier,
            location=f"/v1/deletion-requests/{earlier}",
        )


def release_rows(session: Session, *request_ids: str) -> None:
    """The requests ended (certified, failed, rejected): their rows may be asked for again (erased ones answer 409
    already-deleted from the registry's erased-row hashes). A batch's in one statement."""
    session.execute(
        delete(InflightRow).where(InflightRow.request_id.in_(request_ids)).execution_options(synchronize_session=False)
    )


def find_idempotent(session: Session, principal: Principal, key: str) -> DeletionRequest | None:
    return session.execute(
        select(DeletionRequest).where(
            DeletionRequest.api_key_id == principal.key_id, DeletionRequest.idempotency_key == key
        )
    ).scalar_one_or_none()


def replay(existing: DeletionRequest, fingerprint: str) -> DeletionRequest:
    if existing.body_hash != fingerprint:
        raise Problem(
            422,
            "idempotency-key-reused",
            "The Idempotency-Key was used with another body",
            "Use a new key for a new request.",
            request_id=existing.id,
        )
    return existing


def validate_against_registry(
    session: Session,
    body: DeletionRequestCreate,
    model: Model | None = None,
    rows: dict[str, tuple[str | None, int]] | None = None,
) -> Model:
    """``model``: a recent snapshot of the row (the intake batcher caches them for a second). ``rows``: the data set's
    rows for these sample ids (``lookup_rows``: row id → (deleted_by, position)), read for a whole
    batch in one query."""
    model = model or session.get(Model, body.model_id)
    if model is None:
        raise Problem(404, "model-not-found", "No such model", body.model_id, model_id=body.model_id)
    if model.status != "ready":
        raise Problem(
            409,
            "model-not-ready",
            "The model is not ready for deletions",
            f"status is {model.status!r}",
            model_status=model.status,
        )
    scope_kind = body.scope.kind
    if scope_kind not in SCOPES_BY_KIND.get(model.kind, ()):
        raise Problem(
            422,
            "scope-not-supported",
            "This model kind cannot take that scope",
            f"a {model.kind} model takes {list(SCOPES_BY_KIND.get(model.kind, ()))}, not {scope_kind!r}",
        )
    check_method(model, body.method, scope_kind)
    if model.kind == "tabular" or body.scope.kind == "samples":
        _validate_rows(session, model, body, rows)
    elif body.scope.kind == "client":
        if body.scope.client_id not in model.state.get("clients", []):
            raise Problem(
                422, "unknown-client", "No such client in the federation", f"clients: {model.state.get('clients', [])}"
            )
        if body.scope.client_id in model.state.get("removed", []):
            raise Problem(409, "already-deleted", "The client was already forgotten", body.scope.client_id)
    elif body.scope.kind == "class" and body.scope.label not in model.state.get("vocabulary", []):
        raise Problem(
            422,
            "unknown-label",
            "No caption holds that word",
            f"class scope names a caption word (an attribute value), one of {model.state.get('vocabulary', [])}",
        )
    return model


def check_method(model: Model, method: str, scope_kind: str) -> None:
    """422/409 unless ``method`` can do a ``scope_kind`` deletion on this model now (known, supported, prepared)."""
    if method not in META_METHODS:
        try:
            spec = get_method(method)
        except UnknownMethodError:
            raise Problem(422, "unknown-method", "Unknown unlearning method", method) from None
        if model.kind not in spec.model_kinds or scope_kind not in spec.scopes:
            raise Problem(
                422,
                "method-not-supported",
                "The method cannot do this deletion",
                f"{method} supports kinds {sorted(spec.model_kinds)} and scopes {sorted(spec.scopes)}",
            )
        entry = model.state.get("methods", {}).get(method, {})
        if spec.needs_preparation and entry.get("status") == "refused":
            raise Problem(
                409,
                "method-refused",
                "The method was refused for this model at preparation",
                f'{method}: {entry.get("reason", "no reason recorded")}. Use method "retrain" or "auto".',
            )
        if spec.needs_preparation and entry.get("status") != "ready":
            raise Problem(
                409,
                "method-not-prepared",
                "The method is not prepared for this model",
                f'register the model with "unlearning": ["{method}"] and wait for it to be ready, or use method "auto"',
            )


def lookup_rows(session: Session, dataset_id: str, ids: list[str]) -> dict[str, tuple[str | None, int]]:
    """Row id → (``deleted_by``, position) for those of ``ids`` the data set holds (one query per ``ID_QUERY_CHUNK``
    ids): validation reads the first, the request row keeps the second instead of the id."""
    found: dict[str, tuple[str | None, int]] = {}
    for start in range(0, len(ids), ID_QUERY_CHUNK):
        chunk = ids[start : start + ID_QUERY_CHUNK]
        found.update(
            (row_id, (deleted_by, position))
            for row_id, deleted_by, position in session.execute(
                select(DatasetRow.row_id, DatasetRow.deleted_by, DatasetRow.position).where(
                    DatasetRow.dataset_id == dataset_id, DatasetRow.row_id.in_(chunk)
                )
            ).all()
        )
    return found


def _validate_rows(
    session: Session, model: Model, body: DeletionRequestCreate, rows: dict[str, tuple[str | None, int]] | None = None
) -> None:
    scope = body.scope
    if scope.kind == "samples":
        ids = list(dict.fromkeys(scope.sample_ids))
        if len(ids) > get_settings().max_sample_ids:
            raise Problem(
                422,
                "too-many-sample-ids",
                "Too many sample ids in one request",
                f"at most {get_settings().max_sample_ids}",
            )
        found = lookup_rows(session, model.dataset_id, ids) if rows is None else {i: rows[i] for i in ids if i in rows}
        unknown = [i for i in ids if i not in found]
        if unknown:
            erased = erased_hashes(session, model.dataset_id, {hash_row_id(i): i for i in unknown})
            gone = [i for i in unknown if hash_row_id(i) in erased]
            if gone:
                raise Problem(
                    409,
                    "already-deleted",
                    "Some samples were already deleted",
                    f"{len(gone)} ids were erased by earlier requests",
                    deleted_sample_ids=gone[:1000],
                )
            raise Problem(
                422,
                "unknown-sample-ids",
                "Some sample ids do not exist in the model's data set",
                f"{len(unknown)} of {len(ids)} ids are unknown",
                unknown_sample_ids=unknown[:1000],
            )
        deleted = [i for i in ids if found[i][0] is not None]
        if deleted:
            raise Problem(
                409,
                "already-deleted",
                "Some samples were already deleted",
                f"{len(deleted)} ids are tombstones",
                deleted_sample_ids=deleted[:1000],
            )
    elif scope.kind == "class":
        hit = session.execute(
            select(DatasetRow.id)
            .where(
                DatasetRow.dataset_id == model.dataset_id,
                DatasetRow.label == scope.label,
                DatasetRow.deleted_by.is_(None),
            )
            .limit(1)
        ).first()
        if hit is None:
            raise Problem(
                422,
                "unknown-label",
                "No remaining rows carry that label",
                f"known classes: {model.state.get('classes', [])}",
            )


_UNSET_AT_INTAKE = (
    "message", "error", "extensions", "notes", "overdue_at", "certificate_id", "erasure", "result_version_id",
)  # fmt: skip
_UNSET_AT_INTAKE += ("started_at", "completed_at")


def request_rows(
    principal: Principal,
    body: DeletionRequestCreate,
    idempotency_key: str | None,
    model: Model,
    fingerprint: str,
    rows: dict[str, tuple[str | None, int]] | None = None,
    prepared: Prepared | None = None,
) -> dict[str, Any]:
    """What intake writes for one validated request, as plain values: ``request`` (every column of the
    deletion_requests row), ``job`` (its outbox row), ``inflight`` (the rows it holds) and ``event`` (its audit
    event). ``add_request`` turns them into ORM objects; the intake batch inserts a whole batch of them with one
    statement per table (``insert_requests``).

    A ``samples`` scope is written as the ids' keyed hashes and the rows' positions (``rows``: id → (deleted_by,
    position), from ``lookup_rows``), never the ids: a request row outlives the rows it erases, and on PostgreSQL an
    updated row's old version stays in the heap until vacuumed, so ids written at intake and hashed at the end
    would outlive the erasure (issue 22). The worker finds the rows by position, a federation's pairs by hash."""
    received = body.received_at.astimezone(UTC) if body.received_at else utcnow()
    request_id = new_id()
    held = bool(model.requires_approval)  # no job until an admin approves: nothing can be dispatched or claimed
    job = (
        None if held else new_job_row(kind="deletion", model_id=model.id, model_kind=model.kind, request_id=request_id)
    )
    now = utcnow()
    request = {
        "id": request_id,
        "model_id": model.id,
        "subject_hash": prepared.subject_hash
        if prepared
        else hash_subject(get_settings().derived_key("subject-hash"), body.subject_ref),
        "scope": _stored_scope(body, rows, prepared.id_hashes if prepared else None),
        "method": body.method,
        "method_settings": body.method_settings,
        "callback_url": str(body.callback_url) if body.callback_url else None,
        "status": APPROVAL_STATUS if held else "received",
        "progress": 0.0,
        "attempts": 0,
        "api_key_id": principal.key_id,
        "idempotency_key": idempotency_key,
        "body_hash": fingerprint,
        "received_at": received,
        "due_at": add_months(received, get_settings().deadline_months),
        "job_id": job["id"] if job else None,
        "created_at": now,
        "updated_at": now,
        **dict.fromkeys(_UNSET_AT_INTAKE),
    }
    inflight = [  # hold the rows: a second request for one of them is answered with this one
        {"model_id": model.id, "id_hash": h, "request_id": request_id}
        for h in request["scope"].get("sample_id_hashes", ())
    ]
    scope_summary = {k: v for k, v in request["scope"].items() if k not in ("sample_id_hashes", "positions")}
    event = {
        "actor": principal.actor,
        "action": "deletion_request.received",
        "entity_type": "deletion_request",
        "entity_id": request_id,
        "payload": {
            "model_id": model.id,
            "subject_hash": request["subject_hash"],
            "scope": scope_summary,
            "method": body.method,
            "job_id": job["id"] if job else None,
            **({"awaiting_approval": True} if held else {}),
        },
    }
    return {"request": request, "job": job, "inflight": inflight, "event": event}


def _stored_scope(
    body: DeletionRequestCreate, rows: dict[str, tuple[str | None, int]] | None, hashes: list[str] | None = None
) -> dict[str, Any]:
    scope = body.scope.model_dump(exclude_none=True)
    if "sample_ids" not in scope:
        return scope
    if rows is None:
        raise ValueError("a samples scope is written with its rows' positions: look them up first (lookup_rows)")
    ids = list(dict.fromkeys(str(s) for s in scope.pop("sample_ids")))
    hashes = hash_row_ids(ids) if hashes is None else hashes
    return {**scope, "sample_id_hashes": hashes, "n_samples": len(hashes), "positions": [rows[i][1] for i in ids]}


def _rows_of(session: Session, model: Model, body: DeletionRequestCreate) -> dict[str, tuple[str | None, int]] | None:
    if body.scope.kind != "samples":
        return None
    return lookup_rows(session, model.dataset_id, list(dict.fromkeys(body.scope.sample_ids)))


def add_request(
    session: Session,
    principal: Principal,
    body: DeletionRequestCreate,
    idempotency_key: str | None,
    model: Model,
    fingerprint: str,
) -> DeletionRequest:
    """Add request + job + audit event to the session (validated already; nothing is flushed here)."""
    rows = request_rows(principal, body, idempotency_key, model, fingerprint, _rows_of(session, model, body))
    if rows["job"] is not None:
        session.add(Job(**rows["job"]))
    request = DeletionRequest(**rows["request"])
    session.add(request)
    session.add_all(InflightRow(**row) for row in rows["inflight"])
    append_event(session, **rows["event"], flush=False)
    return request


def add_refused_request(
    session: Session, principal: Principal, body: DeletionRequestCreate, model: Model, problem: Problem
) -> DeletionRequest:
    """A per-person erasure's child that cannot start now (its model not ready, the method not prepared there, its
    rows held by another unfinished request): written ``failed`` with the problem, its ids hashed, no job and no
    rows held, so the erasure is recorded and audited like any other. Refusing the whole erasure instead, only when
    a model holds the person's rows, told a caller — with nothing written — that the person is there (issue 22,
    subject oracle). ``retry`` runs it once the cause is gone; ``cancel`` withdraws it."""
    rows = request_rows(principal, body, None, model, body_fingerprint(body), _rows_of(session, model, body))
    request = DeletionRequest(**{**rows["request"], "job_id": None, "status": "failed"})
    request.completed_at = request.updated_at
    request.error = {"type": f"https://lethe.dev/problems/{problem.slug}", "detail": problem.detail, "attempts": 0}
    _hash_sample_ids(request)
    session.add(request)
    event = rows["event"]
    append_event(session, **{**event, "payload": {**event["payload"], "job_id": None}}, flush=False)
    append_event(
        session,
        actor=principal.actor,
        action="deletion_request.failed",
        entity_type="deletion_request",
        entity_id=request.id,
        payload={"job_id": None, "error": problem.slug, "attempts": 0},
        flush=False,
    )
    return request


class StagedRequest(SimpleNamespace):
    """A request the intake batch inserted without an ORM object: the same attributes as a DeletionRequest row, for
    ``to_out`` and ``replay``."""


def insert_requests(session: Session, staged: list[dict[str, Any]], commit: bool = False) -> list[StagedRequest]:
    """Insert a batch of ``request_rows``: requests, jobs and held rows, then their audit events (PostgreSQL: two
    round trips, the audit log's lock held only for the second, which carries the COMMIT when ``commit``; see
    ``append_events``). A twin Idempotency-Key or a row another request holds raises IntegrityError (the caller falls
    back to one SAVEPOINT per request)."""
    append_events(
        session,
        [rows["event"] for rows in staged],
        commit=commit,
        together_with=[
            job_insert([rows["job"] for rows in staged if rows["job"] is not None]),
            (
                DeletionRequest.__table__,
                [{k: v for k, v in rows["request"].items() if k not in _UNSET_AT_INTAKE} for rows in staged],
            ),
            # in key order: two batches holding rows of each other's wait for one another in the same order
            (InflightRow.__table__, sorted((row for rows in staged for row in rows["inflight"]), key=_inflight_key)),
        ],
    )
    return [StagedRequest(**rows["request"]) for rows in staged]


def _inflight_key(row: dict[str, Any]) -> tuple[str, str]:
    return row["model_id"], row["id_hash"]


def stage_request(
    session: Session, principal: Principal, body: DeletionRequestCreate, idempotency_key: str | None
) -> tuple[DeletionRequest, bool]:
    """Validate and write request + job + audit event inside a SAVEPOINT of the caller's transaction (no commit).

    Returns (request, created). A replay is found by the unique (api key, Idempotency-Key) constraint at insert time,
    the only check that is right under concurrency. A Problem leaves the outer transaction untouched, so a batch can
    go on with the next request. (intake.py's fast path validates a whole batch first and uses this as fallback.)
    """
    fingerprint = body_fingerprint(body)
    savepoint = session.begin_nested()
    try:
        model = validate_against_registry(session, body)
        request = add_request(session, principal, body, idempotency_key, model, fingerprint)
        session.flush()  # a twin with the same Idempotency-Key fails here
        savepoint.commit()
        return request, True
    except (Problem, IntegrityError) as exc:
        savepoint.rollback()
        forget_head(session)
        existing = find_idempotent(session, principal, idempotency_key) if idempotency_key else None
        if existing is None:
            if isinstance(exc, IntegrityError):
                _raise_if_in_flight(session, body)
            raise
        return replay(existing, fingerprint), False
    except Exception:  # any other database error belongs to this request alone: undo it, keep the transaction
        savepoint.rollback()
        forget_head(session)
        raise


def get_request_or_404(session: Session, request_id: str) -> DeletionRequest:
    request = session.get(DeletionRequest, request_id)
    if request is None:
        raise Problem(404, "request-not-found", "No such deletion request", request_id)
    return request


WAITING_STATUSES = ("received", "queued")
CANCELLABLE_STATUSES = (APPROVAL_STATUS, *WAITING_STATUSES, "failed")
"""Not started yet, or failed (withdrawn instead of retried: it still holds its rows)."""


def is_stuck(request: DeletionRequest) -> bool:
    """Still waiting for a worker after ``stuck_after_seconds`` (no worker listens, or the queue is backed up)."""
    age = (utcnow() - request.created_at).total_seconds()
    return request.status in WAITING_STATUSES and age > get_settings().stuck_after_seconds


def filter_requests(
    query,
    *,
    status: str | None = None,
    model_id: str | None = None,
    overdue: bool = False,
    stuck: bool = False,
    created_from: datetime | None = None,
    created_before: datetime | None = None,
):
    """The list's filter on a query of deletion requests: the one the list endpoint, the dashboard's list and the
    bulk action's ``filter`` all apply, so "every request matching this filter" is what the list showed. Overdue:
    past its deadline and not answered (a failed request still owes the erasure)."""
    if created_from is not None:
        query = query.where(DeletionRequest.created_at >= created_from)
    if created_before is not None:
        query = query.where(DeletionRequest.created_at < created_before)
    if status:
        query = query.where(DeletionRequest.status == status)
    if overdue:
        query = query.where(DeletionRequest.status.notin_(ANSWERED_STATUSES), DeletionRequest.due_at < utcnow())
    if stuck:
        before = utcnow() - timedelta(seconds=get_settings().stuck_after_seconds)
        query = query.where(DeletionRequest.status.in_(WAITING_STATUSES), DeletionRequest.created_at < before)
    if model_id:
        query = query.where(DeletionRequest.model_id == model_id)
    return query


def count_requests(session: Session, at_most: int | None = None, **filters: Any) -> int:
    """How many requests the list's filter (:func:`filter_requests`) matches; counted no further than ``at_most``
    (a page that only needs to know "more than the bulk limit" does not count a large table whole)."""
    matching = filter_requests(select(DeletionRequest.id), **filters)
    if at_most is not None:
        matching = matching.limit(at_most)
    return session.execute(select(func.count()).select_from(matching.subquery())).scalar_one()


def list_requests(
    session: Session,
    status: str | None,
    model_id: str | None,
    limit: int,
    cursor: str | None,
    stuck: bool = False,
    overdue: bool = False,
    created_from: datetime | None = None,
    created_before: datetime | None = None,
) -> tuple[list[DeletionRequest], str | None]:
    """Newest first, keyset-paged on (created_at, id) so pages stay stable while requests arrive."""
    query = filter_requests(
        select(DeletionRequest),
        status=status,
        model_id=model_id,
        overdue=overdue,
        stuck=stuck,
        created_from=created_from,
        created_before=created_before,
    )
    if cursor:
        created, request_id = decode_cursor(cursor)
        query = query.where(
            or_(
                DeletionRequest.created_at < created,
                and_(DeletionRequest.created_at == created, DeletionRequest.id < request_id),
            )
        )
    rows = list(
        session.execute(
            query.order_by(DeletionRequest.created_at.desc(), DeletionRequest.id.desc()).limit(limit + 1)
        ).scalars()
    )
    next_cursor = encode_cursor(rows[limit - 1].created_at, rows[limit - 1].id) if len(rows) > limit else None
    return rows[:limit], next_cursor


# ------------------------------------------------------------------------------------ status changes (the worker's)
# A request's lifecycle is written here only; the outbox (app/jobs/outbox.py) knows jobs, not requests. Each function
# runs inside the caller's transaction, next to the job-row change it mirrors.


def mark_queued(session: Session, request_id: str, job_id: str, queue: str) -> None:
    """received → queued when the dispatcher hands its job to a worker queue."""
    queued = session.execute(
        update(DeletionRequest)
        .where(DeletionRequest.id == request_id, DeletionRequest.status == "received")
        .values(status="queued", updated_at=utcnow())
    )
    if queued.rowcount:
        append_event(
            session,
            actor="dispatcher",
            action="deletion_request.queued",
            entity_type="deletion_request",
            entity_id=request_id,
            payload={"job_id": job_id, "queue": queue},
        )


def mark_running(session: Session, request_id: str, job_id: str, attempt: int, owner: str) -> None:
    """A worker took the request's job. A request that has ended stays as it is: its job may be re-taken after the
    certificate only to finish the upkeep (app/jobs/pipeline.py)."""
    request = session.get(DeletionRequest, request_id)
    if request.status not in TERMINAL_STATUSES:
        mark_running_many(session, [(request, job_id, attempt)], owner)


def mark_running_many(session: Session, claimed: list[tuple[DeletionRequest, str, int]], owner: str) -> None:
    """``mark_running`` for requests loaded in this session (a batch's joined ones; each with its job and attempt):
    their rows and one insert of their events."""
    now, events = utcnow(), []
    for request, job_id, attempt in claimed:
        request.status, request.attempts, request.updated_at = "running", attempt, now
        request.started_at = request.started_at or now
        payload = {"job_id": job_id, "attempt": attempt}
        events.append({"actor": f"worker:{owner}", "action": "deletion_request.running",
                       "entity_type": "deletion_request", "entity_id": request.id, "payload": payload})  # fmt: skip
    append_events(session, events)


def by_ids(session: Session, request_ids: list[str]) -> dict[str, DeletionRequest]:
    if not request_ids:
        return {}
    rows = session.execute(select(DeletionRequest).where(DeletionRequest.id.in_(request_ids))).scalars()
    return {r.id: r for r in rows}


def rows_named(request: DeletionRequest) -> int:
    """How many rows a request names by id (a batch's row bound counts these)."""
    return len(request.scope.get("sample_ids") or ()) or int(request.scope.get("n_samples") or 1)


def mark_split_off(session: Session, request_id: str, job_id: str, reason: str) -> None:
    """running → queued: a batch gave the request back to run alone (its own verdict failed in the batch, or the
    batch could not be done as a whole); its rows stay held."""
    now = utcnow()
    request = session.get(DeletionRequest, request_id)
    request.status, request.updated_at, request.progress, request.message = "queued", now, 0.0, reason[:2000]
    append_event(
        session,
        actor="worker",
        action="deletion_request.split_off",
        entity_type="deletion_request",
        entity_id=request_id,
        payload={"job_id": job_id, "reason": reason[:500]},
    )


def record_progress(session: Session, request_ids: list[str], progress: float, message: str | None) -> None:
    """The progress of the job (or batch) serving these requests, on each of them (one statement)."""
    session.execute(
        update(DeletionRequest)
        .where(DeletionRequest.id.in_(request_ids))
        .values(progress=progress, message=message, updated_at=utcnow())
        .execution_options(synchronize_session=False)
    )


def _hash_sample_ids(request: DeletionRequest) -> None:
    """A request an older release wrote with its raw sample ids keeps only their keyed hashes once it ends (intake
    now writes the hashes and positions from the start: ``request_rows``)."""
    scope = request.scope
    if "sample_ids" in scope:
        hashes = [hash_row_id(s) for s in scope["sample_ids"]]
        request.scope = {
            **{k: v for k, v in scope.items() if k != "sample_ids"},
            "sample_id_hashes": hashes,
            "n_samples": len(hashes),
        }


def mark_failed(
    session: Session, request_id: str, job_id: str, attempts: int, error: str, status: str, problem_type: str
) -> None:
    """A terminal failure (``failed``) or refusal (``rejected``); the first line of the error only: tracebacks stay in
    the worker's log and the job row."""
    now = utcnow()
    request = session.get(DeletionRequest, request_id)
    if request.status in TERMINAL_STATUSES:  # a certified request's job may fail only in its upkeep: it stays so
        return
    request.status, request.updated_at, request.completed_at = status, now, now
    _hash_sample_ids(request)  # a failed request too: its rows stay held by keyed hash, a retry finds them by it
    request.error = {
        "type": f"https://lethe.dev/problems/{problem_type}",
        "detail": error.split("\n", 1)[0][:2000],
        "attempts": attempts,
    }
    append_event(
        session,
        actor="worker",
        action=f"deletion_request.{status}",
        entity_type="deletion_request",
        entity_id=request_id,
        payload={"job_id": job_id, "error": error.split("\n", 1)[0][:500], "attempts": attempts},
    )
    if status != "failed":  # a failed request still owes the erasure: its rows stay held until retried or cancelled
        release_rows(session, request_id)
    _queue_callback(session, request, f"deletion.{status}")


def mark_verifying(session: Session, request_ids: list[str], method: str, attempt: int) -> None:
    """running → verifying: the new parameters exist and are being audited (nothing is published yet); a batch's
    requests in one statement and one insert of their events."""
    session.execute(
        update(DeletionRequest)
        .where(DeletionRequest.id.in_(request_ids))
        .values(status="verifying", updated_at=utcnow(), message=f"verifying the {method} result (attempt {attempt})")
        .execution_options(synchronize_session=False)
    )
    event = {"actor": "worker", "action": "deletion_request.verifying", "entity_type": "deletion_request"}
    append_events(session, [{**event, "entity_id": rid, "payload": {"method": method, "attempt": attempt}}
                            for rid in request_ids])  # fmt: skip


def record_verdict(session: Session, request_id: str, report_id: str, method: str, verdict: str, etag: str) -> None:
    """The audit log records every verdict (a failed approximate attempt escalated by ``auto`` included)."""
    append_event(
        session,
        actor="worker",
        action="deletion_request.verified",
        entity_type="deletion_request",
        entity_id=request_id,
        payload={"report_id": report_id, "method": method, "verdict": verdict, "report_etag": etag},
        flush=False,  # one flush for the transaction (a batch writes hundreds)
    )


def mark_certified(
    session: Session,
    request_id: str,
    job_id: str,
    version: ModelVersion,
    model_id: str,
    rows_deleted: int,
    erasure: dict,
    certificate_id: str,
    certificate_digest: str,
) -> None:
    """Certified: the verified version is current, every stored copy is erased (``erasure``, the manifest) and the
    signed certificate is issued; the audit log records its digest; the callback (if any) is queued. The caller
    releases its held rows (``release_rows``: a batch's at once, after every certificate)."""
    now = utcnow()
    request = session.get(DeletionRequest, request_id)
    request.erasure, request.certificate_id = erasure, certificate_id
    _hash_sample_ids(request)
    request.status, request.progress, request.result_version_id = "certified", 1.0, version.id
    request.completed_at = request.updated_at = now
    request.message = f"version {version.number} without {rows_deleted} rows ({version.method}), certified"
    append_event(
        session,
        actor="worker",
        action="deletion_request.certified",
        entity_type="deletion_request",
        entity_id=request_id,
        payload={
            "model_id": model_id,
            "version": version.number,
            "digest": version.digest,
            "parent_id": version.parent_id,
            "method": version.method,
            "rows_deleted": rows_deleted,
            "job_id": job_id,
            "certificate_id": certificate_id,
            "certificate_digest": certificate_digest,
        },
        flush=False,  # one flush for the transaction (a batch writes hundreds)
    )
    _queue_callback(session, request, "deletion.certified")


def _queue_callback(session: Session, request: DeletionRequest, event: str) -> None:
    if not request.callback_url:
        return
    data = {"id": request.id, "status": request.status, "result_version_id": request.result_version_id}
    data["links"] = {"self": f"/v1/deletion-requests/{request.id}"}
    if request.certificate_id:
        data["links"]["certificate"] = f"/v1/certificates/{request.certificate_id}"
    if request.error:
        data["error"] = request.error
    webhooks.enqueue(session, request.id, request.callback_url, event, data, request.api_key_id)


# ------------------------------------------------------------------------------------ deadlines and operator controls


def add_months(moment: datetime, months: int) -> datetime:
    """The same day ``months`` calendar months later (the last day of a shorter month): GDPR Art. 12(3) counts in
    months, not days."""
    index = moment.month - 1 + months
    year, month = moment.year + index // 12, index % 12 + 1
    return moment.replace(year=year, month=month, day=min(moment.day, calendar.monthrange(year, month)[1]))


def is_overdue(request: DeletionRequest) -> bool:
    """Its deadline passed and the erasure is still owed: a failed or pending-approval request too (the obligation,
    not the job, decides)."""
    return request.due_at is not None and request.status not in ANSWERED_STATUSES and request.due_at < utcnow()


def answered_late(request: DeletionRequest) -> bool:
    """Erased or refused after its deadline (a withdrawal is no answer): what a DPO reports, kept once answered."""
    done = request.completed_at
    return request.status in ("certified", "rejected") and None not in (done, request.due_at) and done > request.due_at


def flag_overdue(session: Session) -> int:
    """Record, once per request, that its deadline passed before it was answered (an audit event)."""
    now = utcnow()
    late = (
        session.execute(
            select(DeletionRequest)
            .where(
                DeletionRequest.status.notin_(ANSWERED_STATUSES),
                DeletionRequest.due_at < now,
                DeletionRequest.overdue_at.is_(None),
            )
            .with_for_update(skip_locked=True)
        )
        .scalars()
        .all()
    )
    for request in late:
        request.overdue_at = now
        append_event(
            session,
            actor="dispatcher",
            action="deletion_request.overdue",
            entity_type="deletion_request",
            entity_id=request.id,
            payload={"due_at": request.due_at.isoformat(), "status": request.status},
        )
    return len(late)


def operator_texts(request: DeletionRequest) -> dict[str, str]:
    """The free text operators typed on a request (approval notes, extension reasons, a rejection's reason), by the
    keyed digest its audit event carries: what a timeline shows beside the event."""
    texts = [n.get("note") for n in request.notes or []] + [e.get("reason") for e in request.extensions or []]
    if request.status == "rejected" and request.error:
        texts.append(request.error.get("detail"))
    return {text_digest(t): t for t in texts if isinstance(t, str)}


def text_digest(text: str) -> str:
    """What the append-only log keeps of free text an operator typed (a reason, a note), which may name a person: a
    keyed digest (``audit-text`` key) that proves the text on the request row unaltered and cannot be erased with
    it; the text itself lives on the row, where it can be erased without breaking the chain (issue 22)."""
    return hmac.new(get_settings().derived_key("audit-text"), text.encode(), hashlib.sha256).hexdigest()


def extend_deadline(session: Session, principal: Principal, request_id: str, months: int, reason: str):
    """Art. 12(3): extend by up to two further months in all, with a reason (told to the data subject)."""
    request = get_request_or_404(session, request_id)
    if request.status in TERMINAL_STATUSES:
        raise Problem(409, "request-finished", "The request has already ended", f"status is {request.status!r}")
    used = sum(int(e["months"]) for e in request.extensions or [])
    allowed = get_settings().max_extension_months
    if used + months > allowed:
        raise Problem(
            422, "extension-too-long", "The deadline may be extended by at most two further months",
            f"{used} month(s) already granted; at most {allowed} in all",
        )  # fmt: skip
    request.due_at = add_months(request.due_at or add_months(request.created_at, 1), months)
    entry = {"months": months, "reason": reason, "by": principal.actor, "at": utcnow().isoformat()}
    request.extensions = [*(request.extensions or []), entry]
    request.overdue_at = None
    append_event(
        session,
        actor=principal.actor,
        action="deletion_request.extended",
        entity_type="deletion_request",
        entity_id=request.id,
        payload={"months": months, "reason_digest": text_digest(reason), "due_at": request.due_at.isoformat()},
    )
    return request


def _leave_approval(session: Session, request: DeletionRequest, status: str) -> bool:
    """Compare-and-set out of ``pending-approval`` (two admins acting at once: exactly one wins)."""
    now = utcnow()
    moved = session.execute(
        update(DeletionRequest)
        .where(DeletionRequest.id == request.id, DeletionRequest.status == APPROVAL_STATUS)
        .values(status=status, updated_at=now)
        .execution_options(synchronize_session=False)
    )
    if moved.rowcount != 1:
        return False
    request.status, request.updated_at = status, now
    return True


def cancel_request(session: Session, principal: Principal, request_id: str):
    """Cancel a request no worker has started, one still waiting for approval, or a failed one (withdrawn instead of
    retried); its rows are released."""
    request = get_request_or_404(session, request_id)
    ended = request.status == "failed"  # its job has ended: nothing to stop
    waiting = not ended and request.status == APPROVAL_STATUS and _leave_approval(session, request, "cancelled")
    if (
        not ended
        and not waiting
        and (request.status not in WAITING_STATUSES or not request.job_id or not cancel_job(session, request.job_id))
    ):
        raise Problem(
            409, "request-started", "Only a request no worker has started can be cancelled",
            f"status is {request.status!r}",
        )  # fmt: skip
    request.status, request.updated_at, request.completed_at = "cancelled", utcnow(), utcnow()
    _hash_sample_ids(request)
    release_rows(session, request.id)
    append_event(
        session,
        actor=principal.actor,
        action="deletion_request.cancelled",
        entity_type="deletion_request",
        entity_id=request.id,
        payload={"job_id": request.job_id},
    )
    return request


def retry_request(session: Session, principal: Principal, request_id: str, method: str | None = None):
    """Run a failed request again with a new job (its rows are held again; a clash is 409). ``method``: run it with
    another method this time (an approximate method failed its verdict: ``retrain``), checked as intake checks one;
    the request's method settings belonged to the method it had and are dropped."""
    request = get_request_or_404(session, request_id)
    if request.status != "failed":
        raise Problem(409, "not-failed", "Only a failed request can be retried", f"status is {request.status!r}")
    model = session.get(Model, request.model_id)
    previous_method = request.method
    method_changed = method is not None and method != request.method
    if method_changed:
        check_method(model, method, request.scope["kind"])
        request.method, request.method_settings = method, {}
    if request.scope["kind"] == "samples":
        if "positions" not in request.scope:  # written by an older release: ids hashed at the end, no positions
            request.scope = _positions_from_hashes(session, model, request.scope)
        live = positions_by_request(session, model.dataset_id, {request.id: request.scope})[request.id]
        if len(live) < (n := len(request.scope["sample_id_hashes"])):
            raise Problem(
                409, "already-deleted", "Some samples were already deleted",
                f"{n - len(live)} of this request's {n} rows were erased by other requests since it failed; cancel "
                "it, or submit the remaining ids anew",
            )  # fmt: skip
        held = set(session.execute(select(InflightRow.id_hash).where(InflightRow.request_id == request.id)).scalars())
        for h in dict.fromkeys(request.scope["sample_id_hashes"]):
            if h not in held:  # a request that failed before failed requests kept their holds
                session.add(InflightRow(model_id=request.model_id, id_hash=h, request_id=request.id))
    job = new_job(session, kind="deletion", model_id=model.id, model_kind=model.kind, request_id=request.id)
    previous = request.job_id
    request.job_id, request.status, request.error = job.id, "received", None
    request.progress, request.message, request.completed_at, request.updated_at = 0.0, None, None, utcnow()
    append_event(
        session,
        actor=principal.actor,
        action="deletion_request.retried",
        entity_type="deletion_request",
        entity_id=request.id,
        payload={
            "job_id": job.id,
            "previous_job_id": previous,
            **(
                {"method": request.method, "previous_method": previous_method}
                if request.method != previous_method
                else {}
            ),
        },
    )
    return request


def _positions_from_hashes(session: Session, model: Model, scope: dict[str, Any]) -> dict[str, Any]:
    """A request written by an older release kept only keyed hashes of its ids once it failed: a retry finds the
    rows again by hashing the table's row ids (one pass over the index; a rare operator action). Rows erased
    meanwhile by another request are missing from the positions, which the caller answers with 409."""
    found = rows_with_hashes(session, model.dataset_id, set(scope["sample_id_hashes"]))
    return {**scope, "positions": [found[h] for h in scope["sample_id_hashes"] if h in found]}


def approve_request(session: Session, principal: Principal, request_id: str, note: str | None = None):
    """Approve a request waiting for approval: its job is created now, so the dispatcher can hand it to a worker.
    Four eyes: never by the key that submitted it (issue 22, LOW: one admin key both submitted and approved)."""
    request = get_request_or_404(session, request_id)
    if request.api_key_id is not None and request.api_key_id == principal.key_id:
        raise Problem(
            403, "approval-by-submitter", "A request cannot be approved by the key that submitted it",
            "approval takes a second admin's key (four eyes)",
        )  # fmt: skip
    if not _leave_approval(session, request, "received"):
        raise Problem(
            409, "not-awaiting-approval", "Only a request waiting for approval can be approved",
            f"status is {request.status!r}",
        )  # fmt: skip
    model = session.get(Model, request.model_id)
    job = new_job(session, kind="deletion", model_id=model.id, model_kind=model.kind, request_id=request.id)
    request.job_id = job.id
    if note:
        entry = {"action": "approved", "note": note, "by": principal.actor, "at": utcnow().isoformat()}
        request.notes = [*(request.notes or []), entry]
    append_event(
        session,
        actor=principal.actor,
        action="deletion_request.approved",
        entity_type="deletion_request",
        entity_id=request.id,
        payload={"job_id": job.id, **({"note_digest": text_digest(note)} if note else {})},
    )
    return request


def reject_request(session: Session, principal: Principal, request_id: str, reason: str):
    """Refuse a request waiting for approval (``rejected``, with the reason; its rows are released, its callback
    told). Nothing was run, so nothing is erased."""
    request = get_request_or_404(session, request_id)
    if not _leave_approval(session, request, "rejected"):
        raise Problem(
            409, "not-awaiting-approval", "Only a request waiting for approval can be rejected",
            f"status is {request.status!r}",
        )  # fmt: skip
    now = utcnow()
    request.completed_at = now
    request.error = {"type": "https://lethe.dev/problems/rejected-by-operator", "detail": reason, "attempts": 0}
    _hash_sample_ids(request)
    release_rows(session, request.id)
    append_event(
        session,
        actor=principal.actor,
        action="deletion_request.rejected",
        entity_type="deletion_request",
        entity_id=request.id,
        payload={"reason_digest": text_digest(reason)},
    )
    _queue_callback(session, request, "deletion.rejected")
    return request

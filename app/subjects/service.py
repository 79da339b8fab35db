"""Per-person erasure across models (the subjects domain, the only writer of its tables).

A tabular registration may name a ``subject_column``. When its version 1 is trained, the worker hands each row's
value here and only its keyed hash is stored (HMAC-SHA256 with the derived ``subject-hash`` key: the same hash a
deletion request keeps of its ``subject_ref``), next to the row's index entry; the entry is deleted with the row.

``POST /v1/subjects/erasures`` looks the subject's hash up, and in ONE transaction writes one ordinary deletion
request per model holding live rows of the subject (samples scope, those rows' ids; the same validation, in-flight
hold and approval gate as any request) and a parent that reports them together. When the last child is certified,
the parent gets one combined certificate over the children's certificates: in the publishing transaction when it can
(:func:`on_requests_certified`, called by app/jobs/publish.py) and otherwise by the dispatcher's sweep
(:func:`settle_due`), which catches the children certified concurrently on two models.

A subject no model holds live rows of is answered the same way (202, the same body), and the erasure is completed
in that transaction with zero children: audited (``subject_erasure.no_data_found``, keyed hash only) and certified
by a combined certificate that says ``no_data_found`` with the models searched (:func:`_certify_no_data`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from datetime import UTC, datetime

from sqlalchemy import and_, exists, insert, select
from sqlalchemy.orm import Session

from app.audit.service import append_event, chain_head, hash_subject, latest_anchor
from app.auth.service import Principal
from app.certificates import service as certificates
from app.config import get_settings
from app.db import new_id, utcnow
from app.ml.unlearning.base import AUTO, UnknownMethodError, get_method
from app.problems import Problem
from app.registry.tables import DatasetRow, Model
from app.registry.versions import ROW_INSERT_CHUNK
from app.requests import service as requests
from app.requests.schemas import DeletionRequestCreate
from app.requests.tables import TERMINAL_STATUSES, DeletionRequest
from app.subjects.schemas import ErasureChildOut, ErasureCreate, ErasureOut
from app.subjects.tables import SubjectErasure, SubjectErasureChild, SubjectRow

SUBJECT_HASH = re.compile(r"[0-9a-f]{64}")
SWEEP_BATCH = 100


def subject_hash(subject_ref: str) -> str:
    """The keyed hash a subject is known by (equal to a deletion request's ``subject_hash`` for the same ref)."""
    return hash_subject(get_settings().derived_key("subject-hash"), subject_ref)


def _as_ref(value: object) -> str | None:
    """A table cell as the subject reference it stands for (None when empty): integral floats lose their ``.0`` (a
    numeric column with a gap reads as floats), so ``123`` matches ``"123"``."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    text = str(value)
    return text if text.strip() else None


# ------------------------------------------------------------------------------------------------------ the index
def index_rows(session: Session, dataset_id: str, values: Iterable[tuple[int, object]]) -> int:
    """Index (row position, subject value) pairs of a data set as keyed hashes; once per data set (a retried
    training job finds the index there). Runs in the transaction that indexes the rows themselves."""
    if session.execute(select(SubjectRow.id).where(SubjectRow.dataset_id == dataset_id).limit(1)).first():
        return 0
    row_pks = dict(
        session.execute(select(DatasetRow.position, DatasetRow.id).where(DatasetRow.dataset_id == dataset_id)).all()
    )
    key = get_settings().derived_key("subject-hash")
    entries = []
    for position, value in values:
        ref, pk = _as_ref(value), row_pks.get(int(position))
        if ref is not None and pk is not None:
            entries.append({"subject_hash": hash_subject(key, ref), "dataset_id": dataset_id, "row_pk": pk})
    for start in range(0, len(entries), ROW_INSERT_CHUNK):
        session.execute(insert(SubjectRow), entries[start : start + ROW_INSERT_CHUNK])
    return len(entries)


def rows_held(session: Session, hashed: str) -> list[tuple[Model, list[str]]]:
    """Every model holding live rows of the subject, with those rows' ids (oldest model first, rows in order)."""
    found = session.execute(
        select(Model, DatasetRow.row_id)
        .select_from(SubjectRow)
        .join(DatasetRow, DatasetRow.id == SubjectRow.row_pk)
        .join(Model, Model.dataset_id == SubjectRow.dataset_id)
        .where(SubjectRow.subject_hash == hashed, DatasetRow.deleted_by.is_(None))
        .order_by(Model.created_at, Model.id, DatasetRow.position)
    ).all()
    held: dict[str, tuple[Model, list[str]]] = {}
    for model, row_id in found:
        held.setdefault(model.id, (model, []))[1].append(row_id)
    return list(held.values())


def models_searchable(session: Session) -> tuple[list[str], list[dict[str, str]]]:
    """The models a subject search covers (registered with a ``subject_column`` and trained, so their subject index
    exists) and those it cannot cover yet (registered with one but not trained: no index to search), oldest first."""
    searched: list[str] = []
    not_searched: list[dict[str, str]] = []
    query = select(Model.id, Model.status, Model.spec, Model.current_version_id).where(Model.kind == "tabular")
    for model_id, status, spec, version_id in session.execute(query.order_by(Model.created_at, Model.id)).all():
        if not (spec or {}).get("subject_column"):
            continue
        if version_id is not None:
            searched.append(model_id)
        else:
            reason = "not trained yet: its subject index does not exist" if status != "failed" else "training failed"
            not_searched.append({"model_id": model_id, "status": status, "reason": reason})
    return searched, not_searched


# ------------------------------------------------------------------------------------------------------ erasures
def _check_method(method: str) -> None:
    """Refuse a method no model could run for a subject's rows (a tabular samples deletion) before looking the
    subject up, so that the refusal is the same whether or not anyone holds the subject's rows."""
    if method == AUTO:
        return
    try:
        spec = get_method(method)
    except UnknownMethodError:
        raise Problem(422, "unknown-method", "Unknown unlearning method", method) from None
    if "tabular" not in spec.model_kinds or "samples" not in spec.scopes:
        raise Problem(
            422,
            "method-not-supported",
            "The method cannot do this deletion",
            f"a per-person erasure deletes a tabular model's rows; {method} supports kinds "
            f"{sorted(spec.model_kinds)} and scopes {sorted(spec.scopes)}",
        )


def create_erasure(session: Session, principal: Principal, body: ErasureCreate) -> SubjectErasure:
    """Fan out: one deletion request per model holding the subject's rows, and the parent, in the caller's
    transaction. A child that cannot start now (a model not ready, the method not prepared there, rows already
    held by an unfinished request) is written ``failed`` with its problem (``requests.add_refused_request``): the
    erasure is accepted, recorded and audited all the same, and ends ``failed`` naming that model.

    A subject with no live rows anywhere is accepted like any other (the router answers the same 202 with the same
    body keys) and completed at once with zero children and a certificate that says no data was found
    (:func:`_certify_no_data`). So the status code no longer tells a caller whether a person is in the training
    data, and every lookup is an audited erasure: a probe for a person who is there erases them. What the body's
    values say (``children``, ``status``, ``no_data_found``) and the certificate's statement differ, as they must:
    the caller is authorised to learn what was erased for the person they act for. The only refusals left are
    those that do not depend on the person (the key, the body, the method's name): no answer differs by whether
    the person is there without an audited erasure being written."""
    _check_method(body.method)
    hashed = subject_hash(body.subject_ref)
    searched_at = utcnow()
    searched, not_searched = models_searchable(session)  # before the rows: a model indexed meanwhile is "not searched"
    held = rows_held(session, hashed)
    erasure = SubjectErasure(
        id=new_id(), subject_hash=hashed, method=body.method, api_key_id=principal.key_id, created_at=utcnow()
    )
    session.add(erasure)
    children = []
    for model, row_ids in held:
        child = DeletionRequestCreate(
            subject_ref=body.subject_ref,
            model_id=model.id,
            scope={"kind": "samples", "sample_ids": row_ids},
            method=body.method,
            received_at=body.received_at,
        )
        try:
            requests.validate_against_registry(session, child, model)
            requests._raise_if_in_flight(session, child)
        except Problem as exc:
            exc.detail = f"model {model.id}: {exc.detail or exc.title}"
            request = requests.add_refused_request(session, principal, child, model, exc)
        else:
            request = requests.add_request(session, principal, child, None, model, requests.body_fingerprint(child))
        session.add(SubjectErasureChild(request_id=request.id, erasure_id=erasure.id, model_id=model.id))
        children.append({"request_id": request.id, "model_id": model.id, "n_samples": len(row_ids)})
    append_event(
        session,
        actor=principal.actor,
        action="subject_erasure.received",
        entity_type="subject_erasure",
        entity_id=erasure.id,
        payload={"subject_hash": hashed, "method": body.method, "children": children},
    )
    if not held:
        _certify_no_data(session, erasure, body, searched_at, searched, not_searched)
    session.flush()
    return erasure


def _certify_no_data(
    session: Session,
    erasure: SubjectErasure,
    body: ErasureCreate,
    searched_at: datetime,
    searched: list[str],
    not_searched: list[dict[str, str]],
) -> None:
    """Complete an erasure that found no live rows: audit that no data was found (keyed hash, the models searched),
    then sign the combined certificate that says so, bound to that audit head, and audit its digest. Its deadline
    is the one a child would have had (``received_at`` or now, plus ``deadline_months``); answered now, it is
    answered on time unless the subject's request reached the controller longer ago than that."""
    received = body.received_at.astimezone(UTC) if body.received_at else erasure.created_at
    due = requests.add_months(received, get_settings().deadline_months)
    append_event(
        session,
        actor="lethe",
        action="subject_erasure.no_data_found",
        entity_type="subject_erasure",
        entity_id=erasure.id,
        payload={
            "subject_hash": erasure.subject_hash,
            "searched_at": searched_at.isoformat(),
            "models_searched": searched,
            "models_not_searched": not_searched,
            "due_at": due.isoformat(),
        },
    )
    now = utcnow()
    envelope, digest = certificates.sign_subject_no_data(
        erasure_id=erasure.id,
        subject_hash=erasure.subject_hash,
        searched_at=searched_at,
        models_searched=searched,
        models_not_searched=not_searched,
        received_at=received,
        due_at=due,
        audit_head=chain_head(session),
        audit_anchor=latest_anchor(session),
        requested_at=erasure.created_at,
        completed_at=now,
    )
    _certified(session, erasure, envelope, digest, now, {"children": [], "no_data_found": True})


def get_erasure_or_404(session: Session, erasure_id: str) -> SubjectErasure:
    erasure = session.get(SubjectErasure, erasure_id)
    if erasure is None:
        raise Problem(404, "erasure-not-found", "No such subject erasure", erasure_id)
    return erasure


def _children(session: Session, erasure_id: str) -> list[DeletionRequest]:
    return list(
        session.execute(
            select(DeletionRequest)
            .join(SubjectErasureChild, SubjectErasureChild.request_id == DeletionRequest.id)
            .where(SubjectErasureChild.erasure_id == erasure_id)
            .order_by(DeletionRequest.created_at, DeletionRequest.id)
        ).scalars()
    )


def aggregate_status(erasure: SubjectErasure, statuses: list[str]) -> str:
    """certified only once every child is certified and the combined certificate exists; failed once every child
    has ended and one did not end certified; in-progress otherwise."""
    if erasure.certificate_digest is not None:
        return "certified"
    if statuses and all(s in TERMINAL_STATUSES for s in statuses) and any(s != "certified" for s in statuses):
        return "failed"
    return "in-progress"


def erasure_out(session: Session, erasure: SubjectErasure) -> ErasureOut:
    children = _children(session, erasure.id)
    certs = certificates.by_ids(session, [c.certificate_id for c in children if c.certificate_id])
    counts: dict[str, int] = {}
    for child in children:
        counts[child.status] = counts.get(child.status, 0) + 1
    links = {"self": f"/v1/subjects/erasures/{erasure.id}", "requests": f"/v1/subjects/{erasure.subject_hash}/requests"}
    if erasure.certificate_digest:
        links["certificate"] = f"/v1/subjects/erasures/{erasure.id}/certificate"
    return ErasureOut(
        id=erasure.id,
        subject_hash=erasure.subject_hash,
        method=erasure.method,
        status=aggregate_status(erasure, [c.status for c in children]),
        no_data_found=not children,  # a fan-out that found rows writes its children in the parent's transaction
        children_by_status=counts,
        children=[
            ErasureChildOut(
                request_id=c.id,
                model_id=c.model_id,
                status=c.status,
                n_samples=len(c.scope.get("sample_ids") or c.scope.get("sample_id_hashes") or []),
                error=c.error,
                certificate_id=c.certificate_id,
                certificate_digest=certs[c.certificate_id].digest if c.certificate_id in certs else None,
                links={
                    "self": f"/v1/deletion-requests/{c.id}",
                    **({"certificate": f"/v1/certificates/{c.certificate_id}"} if c.certificate_id else {}),
                },
            )
            for c in children
        ],
        certificate_digest=erasure.certificate_digest,
        created_at=erasure.created_at,
        completed_at=erasure.completed_at,
        links=links,
    )


def requests_of(session: Session, hashed: str, limit: int = 500) -> tuple[list[DeletionRequest], list[SubjectErasure]]:
    """A subject's deletion requests and erasures, newest first, found by its keyed hash only."""
    if not SUBJECT_HASH.fullmatch(hashed):
        raise Problem(
            422, "invalid-subject-hash", "Not a subject hash", "A subject hash is 64 lowercase hex characters."
        )
    found = list(
        session.execute(
            select(DeletionRequest)
            .where(DeletionRequest.subject_hash == hashed)
            .order_by(DeletionRequest.created_at.desc(), DeletionRequest.id.desc())
            .limit(limit)
        ).scalars()
    )
    erasures = list(
        session.execute(
            select(SubjectErasure)
            .where(SubjectErasure.subject_hash == hashed)
            .order_by(SubjectErasure.created_at.desc())
            .limit(limit)
        ).scalars()
    )
    return found, erasures


# ------------------------------------------------------------------------------------------------------ certificate
def settle(session: Session, erasure_id: str) -> bool:
    """Issue the combined certificate if every child is certified and none was issued yet. The parent row is
    locked without waiting (``SKIP LOCKED``): if another transaction holds it, that one or the next sweep settles it,
    and a publishing transaction never waits on (or deadlocks with) the sweep."""
    erasure = session.execute(
        select(SubjectErasure).where(SubjectErasure.id == erasure_id).with_for_update(skip_locked=True)
    ).scalar_one_or_none()
    if erasure is None or erasure.certificate_digest is not None:
        return False
    children = _children(session, erasure_id)
    if not children or any(c.status != "certified" or not c.certificate_id for c in children):
        return False
    certs = certificates.by_ids(session, [c.certificate_id for c in children])
    if len(certs) != len(children):
        return False
    now = utcnow()
    envelope, digest = certificates.sign_subject_erasure(
        erasure_id=erasure.id,
        subject_hash=erasure.subject_hash,
        children=[(c.id, c.model_id, certs[c.certificate_id]) for c in children],
        audit_head=chain_head(session),
        audit_anchor=latest_anchor(session),
        requested_at=erasure.created_at,
        completed_at=max(c.completed_at or now for c in children),
    )
    children_out = [{"request_id": c.id, "certificate_digest": certs[c.certificate_id].digest} for c in children]
    _certified(session, erasure, envelope, digest, now, {"children": children_out})
    return True


def _certified(session: Session, erasure: SubjectErasure, envelope: dict, digest: str, now, payload: dict) -> None:
    """The parent's combined certificate recorded, and audited as ``subject_erasure.certified``."""
    erasure.certificate, erasure.certificate_digest, erasure.completed_at = envelope, digest, now
    append_event(
        session,
        actor="lethe",
        action="subject_erasure.certified",
        entity_type="subject_erasure",
        entity_id=erasure.id,
        payload={"certificate_digest": digest, **payload},
    )


def on_requests_certified(session: Session, request_ids: list[str]) -> None:
    """The publishing transaction's hook, once its requests are all certified: the per-person erasures whose children
    they are try to settle (one query for the parents)."""
    query = select(SubjectErasureChild.erasure_id).where(SubjectErasureChild.request_id.in_(request_ids)).distinct()
    for erasure_id in session.execute(query).scalars().all():
        settle(session, erasure_id)


def settle_due(session: Session, limit: int = SWEEP_BATCH) -> int:
    """The dispatcher's sweep: settle every erasure whose children are all certified but which has no combined
    certificate yet (children certified at the same moment on two models, each seeing the other unfinished). An
    erasure without children (no data found) is certified in the transaction that creates it, never here."""
    unfinished_child = exists().where(
        and_(
            SubjectErasureChild.erasure_id == SubjectErasure.id,
            DeletionRequest.id == SubjectErasureChild.request_id,
            DeletionRequest.status != "certified",
        )
    )
    due = (
        session.execute(
            select(SubjectErasure.id)
            .where(SubjectErasure.certificate_digest.is_(None), ~unfinished_child)
            .order_by(SubjectErasure.created_at)
            .limit(limit)
        )
        .scalars()
        .all()
    )
    return sum(settle(session, erasure_id) for erasure_id in due)

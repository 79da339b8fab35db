"""Per-person erasure across models: ``POST /v1/subjects/erasures``, and a subject's requests by keyed hash or, through
``POST /v1/subjects/lookup``, by their reference."""

from __future__ import annotations

import math
import time

from fastapi import APIRouter, Depends, Query
from fastapi.responses import JSONResponse
from limits import RateLimitItemPerMinute
from limits.storage import MemoryStorage
from limits.strategies import MovingWindowRateLimiter
from sqlalchemy.orm import Session

from app.auth.service import Principal, require_scope
from app.certificates.schemas import CertificateEnvelope
from app.config import get_settings
from app.db import get_session
from app.openapi import accepted, headers
from app.problems import Problem
from app.requests.router import json_caller
from app.requests.service import to_out
from app.subjects import service
from app.subjects.schemas import ErasureCreate, ErasureOut, ErasureSummary, SubjectLookup, SubjectRequestsOut

_LIMITER = MovingWindowRateLimiter(MemoryStorage())


def rate_limited(scope: str):
    """``json_caller(scope)``, then at most ``LETHE_SUBJECT_CALLS_PER_MINUTE`` calls per key per minute across the
    routes that take a person's reference (a moving window, per API process; the ``limits`` library): each answer is
    about one named person, so a key cannot sweep through guesses (issue 22, subject oracle)."""
    caller = json_caller(scope)

    async def dependency(principal: Principal = Depends(caller)) -> Principal:
        item = RateLimitItemPerMinute(get_settings().subject_calls_per_minute)
        if not _LIMITER.hit(item, "subjects", principal.key_id):
            reset_at, _ = _LIMITER.get_window_stats(item, "subjects", principal.key_id)
            problem = Problem(
                429, "rate-limited", "Too many calls about data subjects",
                f"at most {item.amount} per minute for one API key",
            )  # fmt: skip
            problem.headers["Retry-After"] = str(max(1, math.ceil(reset_at - time.time())))
            raise problem
        return principal

    return dependency


router = APIRouter(prefix="/v1/subjects", tags=["subjects"])


@router.post(
    "/erasures",
    status_code=202,
    response_model=ErasureOut,
    responses=accepted(
        "One deletion request per model holding the subject's rows; poll the Location. No rows anywhere: the same "
        "answer, already certified with no children and a certificate that says no data was found."
    ),
)
def create_erasure(
    body: ErasureCreate,
    principal: Principal = Depends(rate_limited("requests:write")),
    session: Session = Depends(get_session),
):
    """Erase one data subject from every model registered with a ``subject_column`` that holds rows of theirs. The
    subject reference is used only to compute its keyed hash; each child is a normal deletion request (validated,
    audited, approval-gated like any other). The parent is ``certified`` once every child is, with one combined
    certificate listing each child's. A subject no model holds rows of gets the same answer (202, the same keys),
    completed at once: ``certified`` with no children, ``no_data_found`` true, audited, and a combined certificate
    stating that no model held rows of the subject when searched (and which models were searched)."""
    erasure = service.create_erasure(session, principal, body)
    session.commit()
    out = service.erasure_out(session, erasure)
    return JSONResponse(
        out.model_dump(mode="json"),
        status_code=202,
        headers={
            "Location": f"/v1/subjects/erasures/{erasure.id}",
            "Retry-After": str(get_settings().retry_after_seconds),
        },
    )


@router.get("/erasures/{erasure_id}", response_model=ErasureOut)
def get_erasure(
    erasure_id: str, _: Principal = Depends(require_scope("requests:read")), session: Session = Depends(get_session)
):
    return service.erasure_out(session, service.get_erasure_or_404(session, erasure_id))


@router.get(
    "/erasures/{erasure_id}/certificate",
    summary="The combined certificate (DSSE envelope)",
    response_model=CertificateEnvelope,
    responses={200: {"headers": headers("ETag", "Content-Disposition")}},
)
def get_erasure_certificate(
    erasure_id: str, _: Principal = Depends(require_scope("requests:read")), session: Session = Depends(get_session)
) -> JSONResponse:
    """The combined certificate as signed; check it offline with ``lethe verify-certificate FILE --keys ...``."""
    erasure = service.get_erasure_or_404(session, erasure_id)
    if erasure.certificate is None:
        raise Problem(
            404,
            "certificate-not-issued",
            "The combined certificate is not issued yet",
            "It is issued once every child deletion request is certified.",
        )
    return JSONResponse(
        erasure.certificate,
        headers={
            "ETag": f'"{erasure.certificate_digest}"',
            "Content-Disposition": f'inline; filename="erasure-{erasure.id}.json"',
        },
    )


@router.get("/{subject_hash}/requests", response_model=SubjectRequestsOut)
def subject_requests(
    subject_hash: str,
    _: Principal = Depends(require_scope("requests:read")),
    session: Session = Depends(get_session),
    limit: int = Query(100, ge=1, le=500),
):
    """A data subject's deletion requests and erasures, by the keyed hash every request reports as
    ``subject_hash`` (the raw reference is never stored, so it cannot be searched for)."""
    return _requests_out(session, subject_hash, limit)


@router.post("/lookup", response_model=SubjectRequestsOut)
def lookup_subject(
    body: SubjectLookup,
    _: Principal = Depends(rate_limited("requests:read")),
    session: Session = Depends(get_session),
):
    """A data subject's deletion requests and erasures by their reference: the server computes the keyed hash (only
    it holds the key). A POST, so the reference stays out of URLs, access logs and proxies; nothing is written."""
    return _requests_out(session, service.subject_hash(body.subject_ref), body.limit)


def _requests_out(session: Session, subject_hash: str, limit: int) -> SubjectRequestsOut:
    found, erasures = service.requests_of(session, subject_hash, limit)
    return SubjectRequestsOut(
        subject_hash=subject_hash,
        requests=[to_out(r) for r in found],
        erasures=[
            ErasureSummary(
                id=e.id,
                created_at=e.created_at,
                certificate_digest=e.certificate_digest,
                links={"self": f"/v1/subjects/erasures/{e.id}"},
            )
            for e in erasures
        ],
    )

"""Deletion certificates: issued in the transaction that publishes a verified deletion, never for a failed verdict.
The certificates domain is the only writer of its table."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.audit.service import latest_anchor
from app.certificates.signing import (
    build_deletion_predicate,
    build_no_data_predicate,
    build_subject_erasure_predicate,
    issue_certificate,
    issue_subject_erasure_certificate,
)
from app.certificates.tables import Certificate
from app.db import new_id
from app.problems import Problem


def issue(
    session: Session,
    *,
    request: Any,
    version: Any,
    parent_digest: str,
    method: str,
    method_settings: dict[str, Any],
    manifest: dict[str, Any],
    figures: dict[str, Any],
    verdict: str,
    audit_head: dict[str, Any],
    completed_at: Any,
) -> Certificate:
    """Sign an in-toto Statement (subject: the new version's sha256) in a DSSE envelope and record it. The predicate
    carries the latest signed audit checkpoint (``audit_anchor``, null before the first): the certificate's holder
    can later check the served log against it (``lethe verify-certificate --audit-log``)."""
    if verdict != "pass":
        raise ValueError("a certificate is never issued for a failed verdict")
    predicate = build_deletion_predicate(
        request_id=request.id,
        subject_hash=request.subject_hash,
        model_id=version.model_id,
        parent_version_digest=parent_digest,
        new_version_digest=version.digest,
        method=method,
        method_settings=method_settings,
        erasure_manifest=manifest,
        verification_figures=figures,
        verdict=verdict,
        audit_chain_head=audit_head,
        requested_at=request.created_at,
        completed_at=completed_at,
    )
    envelope = issue_certificate(version.digest, {**predicate, "audit_anchor": latest_anchor(session)})
    certificate = Certificate(
        id=new_id(),  # set here, not at flush: a batch's certificates are flushed together
        request_id=request.id,
        model_id=version.model_id,
        version_id=version.id,
        subject_digest=version.digest,
        key_id=envelope["signatures"][0]["keyid"],
        digest=envelope_digest(envelope),
        envelope=envelope,
    )
    session.add(certificate)
    return certificate


def envelope_digest(envelope: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(envelope, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def get_certificate_or_404(session: Session, certificate_id: str) -> Certificate:
    certificate = session.get(Certificate, certificate_id)
    if certificate is None:
        raise Problem(404, "certificate-not-found", "No such certificate", certificate_id)
    return certificate


def by_ids(session: Session, certificate_ids: list[str]) -> dict[str, Certificate]:
    rows = session.execute(select(Certificate).where(Certificate.id.in_(certificate_ids))).scalars()
    return {c.id: c for c in rows}


def sign_subject_erasure(
    *,
    erasure_id: str,
    subject_hash: str,
    children: list[tuple[str, str, Certificate]],
    audit_head: dict[str, Any],
    requested_at: Any,
    completed_at: Any,
    audit_anchor: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], str]:
    """The combined certificate of a per-person erasure, over its children's certificates ``(request id, model id,
    certificate)``: returns the DSSE envelope and its digest (the subjects domain stores it with the erasure)."""
    predicate = build_subject_erasure_predicate(
        erasure_id=erasure_id,
        subject_hash=subject_hash,
        children=[
            {
                "request_id": request_id,
                "model_id": model_id,
                "certificate_id": certificate.id,
                "certificate_digest": certificate.digest,
                "new_version_digest": certificate.subject_digest,
            }
            for request_id, model_id, certificate in children
        ],
        audit_chain_head=audit_head,
        requested_at=requested_at,
        completed_at=completed_at,
    )
    envelope = issue_subject_erasure_certificate({**predicate, "audit_anchor": audit_anchor})
    return envelope, envelope_digest(envelope)


def sign_subject_no_data(
    *,
    erasure_id: str,
    subject_hash: str,
    searched_at: Any,
    models_searched: list[str],
    models_not_searched: list[dict[str, Any]],
    received_at: Any,
    due_at: Any,
    audit_head: dict[str, Any],
    requested_at: Any,
    completed_at: Any,
    audit_anchor: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], str]:
    """The combined certificate of a per-person erasure that found no live rows of the subject: it says so
    (``no_data_found``), with the models searched and when; returns the DSSE envelope and its digest."""
    predicate = build_no_data_predicate(
        erasure_id=erasure_id,
        subject_hash=subject_hash,
        searched_at=searched_at,
        models_searched=models_searched,
        models_not_searched=models_not_searched,
        received_at=received_at,
        due_at=due_at,
        audit_chain_head=audit_head,
        requested_at=requested_at,
        completed_at=completed_at,
    )
    envelope = issue_subject_erasure_certificate({**predicate, "audit_anchor": audit_anchor})
    return envelope, envelope_digest(envelope)

"""The deletion path's writing steps (the hall, pipeline.py, calls them): publish a verified deletion with its
erasure and certificate, or record a failed verdict. Each is ONE transaction, checked against the lease."""

from __future__ import annotations

from app.audit.service import chain_head
from app.certificates import service as certificates
from app.config import get_settings
from app.db import release_freed_pages, session_scope, utcnow
from app.jobs import outbox
from app.jobs.lease import JobContext
from app.jobs.work import Attempt, DeletionWork, ErasurePlan
from app.registry import versions as registry
from app.reports import service as reports_service
from app.requests import service as requests
from app.subjects import service as subjects


def _record_reports(session, work: DeletionWork, attempts: list[Attempt]) -> list:
    reports = []
    for n, attempt in enumerate(attempts, start=1):
        body = {"attempt": n, "method": attempt.method, **attempt.verification.report, **attempt.verification.verdict}
        report = reports_service.add_report(
            session, work.request.id, work.model.id, body, attempt.verification.verdict["verdict"],
            attempt.verification.plots,
        )  # fmt: skip
        requests.record_verdict(session, work.request.id, report.id, attempt.method, report.verdict, report.etag)
        reports.append(report)
    return reports


def reject(work: DeletionWork, attempts: list[Attempt], ctx: JobContext) -> None:
    """The verdict failed and there is nowhere to escalate: the request ends ``failed`` (verification-failed) with
    its report; no version is published, nothing is erased, no certificate is issued."""
    with session_scope() as session:
        job_row = ctx.assert_lease(session)
        reports = _record_reports(session, work, attempts)
        reasons = "; ".join(attempts[-1].verification.verdict["reasons"])
        requests.mark_failed(
            session,
            work.request.id,
            work.job.id,
            job_row.attempts,
            f"verification failed ({attempts[-1].method}): {reasons}",
            "failed",
            "verification-failed",
        )
        outbox.finish(session, job_row, {"verdict": "fail", "reports": [r.id for r in reports]})


def publish(
    work: DeletionWork, attempts: list[Attempt], draft: registry.VersionDraft, erasure: ErasurePlan, ctx: JobContext
) -> None:
    """ONE transaction: the verified version becomes current; every stored copy of the rows is swapped for its
    erased replacement and earlier versions are retired (the manifest); the reports are recorded; the certificate is
    signed over all of it and the audit chain's head; the request is certified (its callback queued); job finished."""
    model_id, request_id = work.model.id, work.request.id
    unlearned, verification = attempts[-1].unlearned, attempts[-1].verification
    grace = get_settings().retired_version_grace_seconds
    with session_scope() as session:
        job_row = ctx.assert_lease(session)
        version = registry.add_version(session, draft, state_update=unlearned.state_update)
        manifest = registry.erase_rows(
            session,
            work.model.dataset_id,
            unlearned.positions,
            request_id,
            new_digest=erasure.dataset_digest,
            state_update=erasure.state_update,
            model_id=model_id,
        )
        manifest["method_state"] = registry.update_method_state(session, model_id, erasure.purged, erasure.invalidated)
        manifest["versions_retired"] = (
            registry.retire_versions(session, model_id, version.id, request_id, grace)
            if unlearned.parent_saw_rows  # held-out rows: no earlier version was trained on them
            else []
        )
        manifest["retired_weights_shredded_after_s"] = grace
        manifest.update(erasure.notes)
        reports = _record_reports(session, work, attempts)
        certificate = certificates.issue(
            session,
            request=work.request,
            version=version,
            parent_digest=work.parent.digest,
            method=unlearned.method,
            method_settings=work.request.method_settings,
            manifest=manifest,
            figures={**verification.figures(), "reports": [r.id for r in reports], "attempts": len(attempts)},
            verdict=verification.verdict["verdict"],
            audit_head=chain_head(session),
            completed_at=utcnow(),
        )
        requests.mark_certified(
            session,
            request_id,
            work.job.id,
            version,
            model_id,
            len(unlearned.positions),
            manifest,
            certificate.id,
            certificate.digest,
        )
        subjects.on_request_certified(session, request_id)  # a per-person erasure's last child: combined certificate
        outbox.finish(session, job_row, {"version_id": version.id, "digest": version.digest})
    release_freed_pages()

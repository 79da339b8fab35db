"""The deletion path's writing steps (the hall, pipeline.py, calls them): publish a verified deletion with its
erasure and certificate, or record a failed verdict. Each is ONE transaction, checked against the lease."""

from __future__ import annotations

from datetime import timedelta

from app.audit.service import chain_head
from app.certificates import service as certificates
from app.config import get_settings
from app.db import release_freed_pages, session_scope, utcnow
from app.jobs import blobs, faults, lease, outbox
from app.jobs.lease import JobContext
from app.jobs.work import Attempt, DeletionWork, ErasurePlan, Member
from app.registry import versions as registry
from app.reports import service as reports_service
from app.requests import service as requests
from app.subjects import service as subjects


def _record_reports(session, work: DeletionWork, attempts: list[Attempt], request_id: str) -> list:
    """Every attempt's verdict on this request (its own rows), as reports and audit events."""
    reports = []
    for n, attempt in enumerate(attempts, start=1):
        verification = attempt.verifications[request_id]
        body = {"attempt": n, "method": attempt.method, **verification.report, **verification.verdict}
        if attempt.requests > 1:
            body["batch"] = {"requests": attempt.requests}
        if id(verification.plots) not in attempt.stored_plots:  # a batch's requests share one audit's plots
            attempt.stored_plots[id(verification.plots)] = reports_service.store_plots(verification.plots)
        plots = attempt.stored_plots[id(verification.plots)]
        report = reports_service.add_report(
            session, request_id, work.model.id, body, verification.verdict["verdict"], plots
        )
        requests.record_verdict(session, request_id, report.id, attempt.method, report.verdict, report.etag)
        reports.append(report)
    return reports


def reject(work: DeletionWork, attempts: list[Attempt], ctx: JobContext) -> None:
    """The verdict failed and there is nowhere to escalate: the request ends ``failed`` (verification-failed) with
    its report; no version is published, nothing is erased, no certificate is issued."""
    request_id = work.request.id
    with session_scope() as session:
        job_row = ctx.assert_lease(session)
        reports = _record_reports(session, work, attempts, request_id)
        reasons = "; ".join(attempts[-1].verifications[request_id].verdict["reasons"])
        requests.mark_failed(
            session,
            request_id,
            work.job.id,
            job_row.attempts,
            f"verification failed ({attempts[-1].method}): {reasons}",
            "failed",
            "verification-failed",
        )
        outbox.finish(session, job_row, {"verdict": "fail", "reports": [r.id for r in reports]})


def split_off(work: DeletionWork, failing: list[Member], attempts: list[Attempt], ctx: JobContext) -> None:
    """Batch members whose own verdict failed (a named method, or the exact one: nowhere to escalate) go back to the
    outbox to run alone, each with its reports so far: a request is never certified on a failed verdict and never
    holds the others hostage; the batch goes on without them. One transaction."""

    def record(session) -> None:  # outbox.release checks each job is still ours
        for member in failing:
            _record_reports(session, work, attempts, member.request.id)

    reason = f"its own verdict failed in a batch of {len(work.members)} ({attempts[-1].method}); retried alone"
    with ctx.finishing():  # the beat renews neither the old member list nor the new one until both are written
        for member in failing:
            ctx.leave(member.job.id)
            work.members.remove(member)
        lease.release([m.job.id for m in failing], ctx.owner, reason, settle=record)


def publish(
    work: DeletionWork, attempts: list[Attempt], draft: registry.VersionDraft, erasure: ErasurePlan, ctx: JobContext
) -> dict:
    """ONE transaction: the verified version becomes current; every stored copy of the rows is swapped for its
    erased replacement and earlier versions are retired (the manifest); then for each request served (a batch:
    each on its own rows) its reports are recorded, its certificate is signed over the shared version, its own rows'
    erasure and verdict, and the audit chain's head; it is certified (its callback queued) and its job finished —
    all but one: the job that keeps holding the model for the upkeep (``ctx.hold_only``). Returns that job's
    result."""
    model_id = work.model.id
    unlearned = attempts[-1].unlearned
    grace = get_settings().retired_version_grace_seconds
    with ctx.finishing(), session_scope() as session:
        job_rows = {j.id: j for j in ctx.assert_leases(session)}
        faults.point("publishing")  # the job rows are locked: the heartbeat must not wait on them
        version = registry.add_version(session, draft, state_update=unlearned.state_update)
        method_state = registry.update_method_state(session, model_id, erasure.purged, erasure.invalidated)
        shared, own = registry.erase_rows(
            session,
            work.model.dataset_id,
            {member.request.id: member.positions for member in work.members},
            new_digest=erasure.dataset_digest,
            new_chunks=erasure.dataset_chunks,
            superseded=erasure.superseded,
            state_update=erasure.state_update,
            model_id=model_id,
        )
        shared["method_state"] = method_state
        shared["versions_retired"] = (
            registry.retire_versions(session, model_id, version.id, work.request.id, grace)
            if unlearned.parent_saw_rows  # held-out rows: no earlier version was trained on them
            else []
        )
        shared["retired_weights_shredded_after_s"] = grace
        shared.update(erasure.notes)
        if len(work.members) > 1:
            shared["batch"] = {
                "version_id": version.id,
                "requests": len(work.members),
                "rows": len(unlearned.positions),
            }
        keep = ctx.members[0]
        result = {"version_id": version.id, "digest": version.digest}
        loaded = requests.by_ids(session, [m.request.id for m in work.members])  # once, not a query each
        for member in work.members:
            manifest = {**own[member.request.id], **shared}
            job_row = job_rows[member.job.id] if member.job.id != keep else None
            _certify(session, work, attempts, member, manifest, version, job_row, result)
        requests.release_rows(session, *loaded)  # (the session's identity map holds `loaded` weakly until here)
        subjects.on_requests_certified(session, [m.request.id for m in work.members])  # per-person erasures settle
        blobs.clear(session, ctx.owner)  # what the attempt wrote is referenced now: no longer its to shred
        # the kept job's lease starts afresh for the upkeep, however long this transaction took (its row is locked)
        job_rows[keep].lease_expires_at = utcnow() + timedelta(seconds=get_settings().lease_seconds)
        ctx.hold_only(keep)  # before the beat may run again (``finishing``); a rollback leaves the members held
    release_freed_pages()
    return result


def _certify(session, work: DeletionWork, attempts, member: Member, manifest: dict, version, job_row, result) -> None:
    """One request of a published version: its reports, its own certificate (naming the shared version's digest,
    its subject and its rows' erasure), certified, its job finished."""
    unlearned, verification = attempts[-1].unlearned, attempts[-1].verifications[member.request.id]
    reports = _record_reports(session, work, attempts, member.request.id)
    certificate = certificates.issue(
        session,
        request=member.request,
        version=version,
        parent_digest=work.parent.digest,
        method=unlearned.method,
        method_settings=member.request.method_settings,
        manifest=manifest,
        figures={**verification.figures(), "reports": [r.id for r in reports], "attempts": len(attempts)},
        verdict=verification.verdict["verdict"],
        audit_head=chain_head(session),
        completed_at=utcnow(),
    )
    requests.mark_certified(
        session,
        member.request.id,
        member.job.id,
        version,
        work.model.id,
        len(member.positions),
        manifest,
        certificate.id,
        certificate.digest,
    )
    if job_row is not None:
        outbox.finish(session, job_row, result)

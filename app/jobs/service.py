"""The outbox and the lease (ARCHITECTURE.md: dispatcher, worker, reconciler).

A job row is written in the same transaction as what it works for. A worker *claims* it with a compare-and-set
UPDATE that bumps the attempt counter and sets a lease; it renews the lease while it reports progress, and only the
lease holder can finish the job. The reconciler re-offers jobs whose lease expired (a killed worker) and fails them
for good after ``max_attempts``, with a clear error on the request.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

from sqlalchemy import or_, select, update
from sqlalchemy.orm import Session

from app.audit.service import append_event
from app.config import get_settings
from app.db import new_id, session_scope, utcnow
from app.jobs.tables import Job
from app.requests.tables import DeletionRequest

log = logging.getLogger("lethe.jobs")
GPU_KINDS = {"clip_federated"}


class PermanentJobError(Exception):
    """Bad input or an impossible request: retrying will not help, so the request is rejected at once."""

    def __init__(self, message: str, problem_type: str = "unprocessable"):
        super().__init__(message)
        self.problem_type = problem_type


class LeaseLostError(RuntimeError):
    """Another worker holds the job now (our lease expired): stop without writing anything."""


def queue_for(model_kind: str) -> str:
    return "gpu" if model_kind in GPU_KINDS else "cpu"


def new_job(
    session: Session,
    *,
    kind: str,
    model_id: str,
    model_kind: str,
    request_id: str | None = None,
    payload: dict[str, Any] | None = None,
    flush: bool = True,
) -> Job:
    job = Job(
        id=new_id(),
        kind=kind,
        model_id=model_id,
        request_id=request_id,
        payload=payload or {},
        queue=queue_for(model_kind),
        max_attempts=get_settings().max_attempts,
    )
    session.add(job)
    if flush:
        session.flush()
    return job


def mark_dispatched(session: Session, limit: int = 100) -> list[Job]:
    """Move due pending jobs to ``dispatched`` (compare-and-set, so several dispatchers never send one job twice)."""
    now = utcnow()
    candidates = (
        session.execute(
            select(Job.id).where(Job.status == "pending", Job.available_at <= now).order_by(Job.created_at).limit(limit)
        )
        .scalars()
        .all()
    )
    taken: list[Job] = []
    for job_id in candidates:
        result = session.execute(
            update(Job)
            .where(Job.id == job_id, Job.status == "pending")
            .values(status="dispatched", dispatched_at=now, updated_at=now)
        )
        if result.rowcount == 1:
            job = session.get(Job, job_id)
            taken.append(job)
            if job.request_id:
                queued = session.execute(
                    update(DeletionRequest)
                    .where(DeletionRequest.id == job.request_id, DeletionRequest.status == "received")
                    .values(status="queued", updated_at=now)
                )
                if queued.rowcount:
                    append_event(
                        session,
                        actor="dispatcher",
                        action="deletion_request.queued",
                        entity_type="deletion_request",
                        entity_id=job.request_id,
                        payload={"job_id": job.id, "queue": job.queue},
                    )
    return taken


def claim(job_id: str, owner: str) -> Job | None:
    """Take the lease: succeeds for a pending/dispatched job, or a running one whose lease has expired."""
    settings = get_settings()
    now = utcnow()
    with session_scope() as session:
        result = session.execute(
            update(Job)
            .where(
                Job.id == job_id,
                Job.attempts < Job.max_attempts,
                or_(
                    Job.status.in_(("pending", "dispatched")), (Job.status == "running") & (Job.lease_expires_at < now)
                ),
            )
            .values(
                status="running",
                lease_owner=owner,
                attempts=Job.attempts + 1,
                lease_expires_at=now + timedelta(seconds=settings.lease_seconds),
                started_at=now,
                updated_at=now,
                message="started",
            )
        )
        if result.rowcount != 1:
            return None
        job = session.get(Job, job_id)
        if job.request_id:
            request = session.get(DeletionRequest, job.request_id)
            request.status, request.attempts, request.updated_at = "running", job.attempts, now
            request.started_at = request.started_at or now
            append_event(
                session,
                actor=f"worker:{owner}",
                action="deletion_request.running",
                entity_type="deletion_request",
                entity_id=request.id,
                payload={"job_id": job.id, "attempt": job.attempts},
            )
        session.expunge(job)
        return job


def heartbeat(job_id: str, owner: str, progress: float | None = None, message: str | None = None) -> None:
    """Renew the lease and record progress; raises LeaseLostError if another worker has taken the job."""
    settings = get_settings()
    now = utcnow()
    values: dict[str, Any] = {"lease_expires_at": now + timedelta(seconds=settings.lease_seconds), "updated_at": now}
    if progress is not None:
        values["progress"] = max(0.0, min(1.0, progress))
    if message is not None:
        values["message"] = message[:2000]
    with session_scope() as session:
        result = session.execute(
            update(Job).where(Job.id == job_id, Job.lease_owner == owner, Job.status == "running").values(**values)
        )
        if result.rowcount != 1:
            raise LeaseLostError(job_id)
        job = session.get(Job, job_id)
        if job.request_id and progress is not None:
            session.execute(
                update(DeletionRequest)
                .where(DeletionRequest.id == job.request_id)
                .values(progress=values["progress"], message=values.get("message"), updated_at=now)
            )


def assert_lease(session: Session, job_id: str, owner: str) -> Job:
    """Inside the finishing transaction: lock the job row and check we still hold it."""
    job = session.execute(select(Job).where(Job.id == job_id).with_for_update()).scalar_one()
    if job.lease_owner != owner or job.status != "running":
        raise LeaseLostError(job_id)
    return job


def finish(session: Session, job: Job, result: dict[str, Any]) -> None:
    now = utcnow()
    job.status, job.result, job.progress, job.finished_at, job.updated_at = "succeeded", result, 1.0, now, now
    job.message, job.lease_expires_at = "done", None


def fail(
    job_id: str,
    owner: str | None,
    error: str,
    *,
    permanent: bool,
    request_status: str = "failed",
    problem_type: str = "job-failed",
) -> None:
    """Record a failure: a permanent one (bad input, a bug) ends the job; a transient one re-offers it with backoff."""
    now = utcnow()
    with session_scope() as session:
        job = session.execute(select(Job).where(Job.id == job_id).with_for_update()).scalar_one()
        if owner is not None and (job.lease_owner != owner or job.status != "running"):
            return
        final = permanent or job.attempts >= job.max_attempts
        job.error, job.updated_at = error[:4000], now
        if final:
            job.status, job.finished_at, job.lease_expires_at = "failed", now, None
            _fail_request(session, job, error, request_status, problem_type)
        else:
            job.status, job.lease_owner, job.lease_expires_at = "pending", None, None
            job.available_at = now + timedelta(seconds=min(60.0, 2.0**job.attempts))


def _fail_request(session: Session, job: Job, error: str, status: str, problem_type: str) -> None:
    now = utcnow()
    from app.registry.tables import Model  # local: registry imports jobs

    if job.request_id:
        request = session.get(DeletionRequest, job.request_id)
        request.status, request.updated_at, request.completed_at = status, now, now
        request.error = {  # the first line only: tracebacks stay in the worker's log and the job row
            "type": f"https://lethe.dev/problems/{problem_type}",
            "detail": error.split("\n", 1)[0][:2000],
            "attempts": job.attempts,
        }
        append_event(
            session,
            actor="worker",
            action=f"deletion_request.{status}",
            entity_type="deletion_request",
            entity_id=request.id,
            payload={"job_id": job.id, "error": error.split("\n", 1)[0][:500], "attempts": job.attempts},
        )
    elif job.kind == "train_model":
        model = session.get(Model, job.model_id)
        model.status, model.error = "failed", error[:4000]
        append_event(
            session,
            actor="worker",
            action="model.failed",
            entity_type="model",
            entity_id=model.id,
            payload={"job_id": job.id, "error": error.split("\n", 1)[0][:500]},
        )


def reconcile(session: Session) -> dict[str, int]:
    """Re-offer jobs whose lease expired or whose dispatch was never taken; fail those out of attempts."""
    settings = get_settings()
    now = utcnow()
    reoffered = failed = 0
    expired = (
        session.execute(
            select(Job).where(Job.status == "running", Job.lease_expires_at < now).with_for_update(skip_locked=True)
        )
        .scalars()
        .all()
    )
    for job in expired:
        if job.attempts >= job.max_attempts:
            job.status, job.finished_at, job.updated_at = "failed", now, now
            job.error = f"the worker's lease expired {job.attempts} times (worker killed or stuck); gave up"
            _fail_request(session, job, job.error, "failed", "attempts-exhausted")
            failed += 1
        else:
            job.status, job.lease_owner, job.lease_expires_at, job.updated_at = "pending", None, None, now
            job.message = f"lease expired after attempt {job.attempts}; re-offered"
            reoffered += 1
    stale = now - timedelta(seconds=settings.dispatch_timeout_seconds)
    result = session.execute(
        update(Job)
        .where(Job.status == "dispatched", Job.dispatched_at < stale)
        .values(status="pending", updated_at=now, message="dispatch not taken; re-offered")
    )
    return {"reoffered": reoffered + (result.rowcount or 0), "failed": failed}

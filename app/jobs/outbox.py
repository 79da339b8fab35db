"""The outbox: the ``jobs`` table, its compare-and-set claim and lease, and lease expiry (ARCHITECTURE.md).

A job row is written in the same transaction as what it works for. A worker *claims* it with a compare-and-set
UPDATE that bumps the attempt counter and sets a lease; it renews the lease while it reports progress, and only the
lease holder can finish the job. Expired leases are re-offered (a killed worker) and failed for good after
``max_attempts``.

This module knows jobs only: it imports no domain it serves. What a job's status means for a deletion request or a
model is written by the requests and registry domains (app/jobs/lease.py and the dispatcher call them in the same
transaction), so registry and requests import the outbox and never the other way round.
"""

from __future__ import annotations

import errno
import threading
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Table, func, or_, select, text, update
from sqlalchemy.orm import Session

from app.config import get_settings
from app.db import is_unavailable, new_id, utcnow
from app.jobs.tables import Job

NEW_JOBS = threading.Event()
"""Set when this process has just committed due jobs (the intake): a dispatcher in the same process dispatches at
once instead of at its next poll (issue 21: the poll interval was up to half a second of an idle request's latency)."""


def nudge() -> None:
    """Call after the commit that made new jobs due."""
    NEW_JOBS.set()


GPU_KINDS = {"clip_federated"}
"""Model kinds whose jobs go to the "gpu" queue (one worker process per GPU); every other kind goes to "cpu"."""
DISPATCH_BATCH = 100
"""Most jobs one dispatcher pass moves from pending to dispatched."""
MAX_BACKOFF_SECONDS = 60.0
DEFAULT_MAX_RUNTIME_SECONDS = 24 * 3600.0
"""A transient failure re-offers the job after 2^attempts seconds, at most this."""


class PermanentJobError(Exception):
    """Bad input or an impossible request: retrying will not help, so the request is rejected at once."""

    def __init__(self, message: str, problem_type: str = "unprocessable"):
        super().__init__(message)
        self.problem_type = problem_type


INFRASTRUCTURE_ERRNOS = frozenset(
    {
        errno.ENOSPC,  # disk full
        errno.EDQUOT,  # quota exceeded
        errno.EFBIG,  # file size limit
        errno.EIO,
        errno.EROFS,  # remounted read-only
        errno.EACCES,  # the store's folder lost its permissions
        errno.ESTALE,
        errno.ETIMEDOUT,
        errno.ECONNREFUSED,
        errno.ECONNRESET,
        errno.EHOSTUNREACH,
        errno.ENETUNREACH,
    }
)
"""OS errors that say the machine or a service is unavailable, not that the job's data or method is wrong."""


def infrastructure_error(exc: BaseException) -> bool:
    """Whether a job failed because a resource was away (issue 22: a full artifact disk spent the request's three
    attempts in 6 s): an OS error of :data:`INFRASTRUCTURE_ERRNOS` (the artifact store), the database unavailable
    (``app.db.is_unavailable``), a broker or network connection error. Such a failure waits with a growing delay and
    spends no attempt (``fail(..., infrastructure=True)``); only the method's or the data's own errors count."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if is_unavailable(current):
            return True
        if isinstance(current, OSError) and current.errno in INFRASTRUCTURE_ERRNOS:
            return True
        if isinstance(current, ConnectionError | TimeoutError):
            return True
        module = type(current).__module__.split(".")[0]
        if module in ("redis", "kombu", "amqp") and type(current).__name__ in (
            "ConnectionError",
            "TimeoutError",
            "OperationalError",
        ):
            return True
        current = current.__cause__ or current.__context__
    return False


class LeaseLostError(RuntimeError):
    """Another worker holds the job now (our lease expired): stop without writing anything."""


def queue_for(model_kind: str) -> str:
    return "gpu" if model_kind in GPU_KINDS else "cpu"


def job_row(
    *, kind: str, model_id: str, model_kind: str, request_id: str | None = None, payload: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Every column of a new pending job, for a bulk insert (``insert_jobs``): the intake batch writes its jobs with
    one statement instead of one ORM object each."""
    now = utcnow()
    return {
        "id": new_id(),
        "kind": kind,
        "queue": queue_for(model_kind),
        "model_id": model_id,
        "request_id": request_id,
        "payload": payload or {},
        "status": "pending",
        "attempts": 0,
        "max_attempts": get_settings().max_attempts,
        "available_at": now,
        "progress": 0.0,
        "created_at": now,
        "updated_at": now,
    }


def job_insert(rows: list[dict[str, Any]]) -> tuple[Table, list[dict[str, Any]]]:
    """New job rows (``job_row``) as a part of a bulk insert (``app.db.insert_many``)."""
    return Job.__table__, rows


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


def mark_dispatched(session: Session, limit: int = DISPATCH_BATCH) -> list[Job]:
    """Move due pending jobs to ``dispatched`` (compare-and-set, so several dispatchers never send one job twice):
    at most one per model, and none for a model that another job holds now or whose job is already on its way.

    Jobs on one model run one at a time, and the job that takes the model joins the deletions waiting there (its
    batch), so a second message for a model would only bounce off it (issue 22: 30 jobs on one model made 529 broker
    deliveries, 498 of them deferrals). A job waiting on a busy model stays pending in the outbox, costing nothing,
    and is offered when the model's lease ends."""
    now = utcnow()
    held = select(Job.model_id).where(
        or_((Job.status == "running") & (Job.lease_expires_at >= now), Job.status == "dispatched")
    )
    first = (
        select(
            Job.id,
            Job.created_at,
            func.row_number().over(partition_by=Job.model_id, order_by=(Job.created_at, Job.id)).label("place"),
        )
        .where(Job.status == "pending", Job.available_at <= now, Job.model_id.not_in(held))
        .subquery()
    )
    candidates = (
        session.execute(select(first.c.id).where(first.c.place == 1).order_by(first.c.created_at).limit(limit))
        .scalars()
        .all()
    )
    taken: list[Job] = []
    for job_id in candidates:
        result = session.execute(
            update(Job)
            .where(Job.id == job_id, Job.status == "pending")
            .values(status="dispatched", dispatched_at=now, updated_at=now)
            .execution_options(synchronize_session=False)
        )
        if result.rowcount == 1:
            taken.append(session.get(Job, job_id, populate_existing=True))
    return taken


def undispatch(session: Session, job_ids: list[str], reason: str) -> int:
    """Jobs marked dispatched whose message never reached the broker (the send failed): pending again at once, so
    the next pass sends them, instead of after the dispatch timeout."""
    if not job_ids:
        return 0
    now = utcnow()
    result = session.execute(
        update(Job)
        .where(Job.id.in_(job_ids), Job.status == "dispatched")
        .values(status="pending", updated_at=now, message=reason[:2000])
        .execution_options(synchronize_session=False)
    )
    return result.rowcount or 0


def reoffer_dispatched(session: Session, reason: str) -> int:
    """Every dispatched job back to pending, to be sent again: after an outage of the broker or the database, any of
    their messages may be lost (a broker restarted without persistence, a message a worker consumed while it could
    not claim). A message that was not lost is then delivered twice, which is harmless: the claim is a
    compare-and-set, and the second delivery finds the job taken."""
    now = utcnow()
    result = session.execute(
        update(Job)
        .where(Job.status == "dispatched")
        .values(status="pending", updated_at=now, message=reason[:2000])
        .execution_options(synchronize_session=False)
    )
    return result.rowcount or 0


def max_runtime(kind: str) -> float:
    """The longest one attempt of this job kind may run (``LETHE_MAX_JOB_SECONDS``; a day if the kind is unlisted)."""
    return float(get_settings().max_job_seconds.get(kind, DEFAULT_MAX_RUNTIME_SECONDS))


def model_busy(session: Session, job_id: str) -> bool:
    """Whether another job on this job's model holds a live lease. Jobs on one model run one at a time; the check and
    the claim that follows are serialised per model (an advisory lock on PostgreSQL; SQLite's writers serialise on
    BEGIN IMMEDIATE)."""
    model_id = session.execute(select(Job.model_id).where(Job.id == job_id)).scalar_one_or_none()
    if model_id is None:
        return False
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SELECT pg_advisory_xact_lock(hashtext(:m))"), {"m": f"lethe-model:{model_id}"})
    running = session.execute(
        select(Job.id).where(
            Job.model_id == model_id, Job.id != job_id, Job.status == "running", Job.lease_expires_at >= utcnow()
        )
    ).first()
    return running is not None


def wait_for_model(session: Session, job_id: str, reason: str) -> None:
    """Put a job back in the outbox without spending an attempt (losing the per-model race is no failure): pending,
    and ``mark_dispatched`` offers it again once the model's lease ends, not on a timer that bounces it through the
    broker while the model stays busy."""
    session.execute(
        update(Job)
        .where(Job.id == job_id, Job.status.in_(("pending", "dispatched")))
        .values(status="pending", updated_at=utcnow(), message=reason[:2000])
    )


def cancel(session: Session, job_id: str) -> bool:
    """Cancel a job no worker has started (compare-and-set: a worker's claim and this cannot both win)."""
    now = utcnow()
    result = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.status.in_(("pending", "dispatched")))
        .values(status="cancelled", finished_at=now, updated_at=now, message="cancelled by an operator")
    )
    return result.rowcount == 1


def _free(now):
    """No worker holds the job: pending, dispatched, or running under a lease that has expired (its worker died)."""
    return or_(Job.status.in_(("pending", "dispatched")), (Job.status == "running") & (Job.lease_expires_at < now))


def claim(session: Session, job_id: str, owner: str) -> Job | None:
    """Take the lease: succeeds for a pending/dispatched job, or a running one whose lease has expired."""
    taken = claim_many(session, [job_id], owner)
    return taken[0] if taken else None


def claim_many(session: Session, job_ids: list[str], owner: str) -> list[Job]:
    """Take the leases of the jobs among ``job_ids`` still free (pending, dispatched, or running under a lease that
    ran out) in one compare-and-set statement, so a cancel or another worker wins or loses each cleanly; a batch's
    members are claimed together. Returns those taken."""
    if not job_ids:
        return []
    now = utcnow()
    taken = (
        session.execute(
            update(Job)
            .where(Job.id.in_(job_ids), Job.attempts < Job.max_attempts, _free(now))
            .values(
                status="running",
                lease_owner=owner,
                attempts=Job.attempts + 1,
                lease_expires_at=now + timedelta(seconds=get_settings().lease_seconds),
                started_at=now,
                updated_at=now,
                message="started",
            )
            .returning(Job.id)
            .execution_options(synchronize_session=False)
        )
        .scalars()
        .all()
    )
    if not taken:
        return []
    query = select(Job).where(Job.id.in_(taken)).execution_options(populate_existing=True)
    return list(session.execute(query).scalars())


def jobs_waiting(session: Session, model_id: str, kind: str, exclude: str) -> bool:
    """Whether a job of this kind waits on this model that no worker holds (``_free``), other than ``exclude``: the
    upkeep of the job holding the model then stops at what the next one needs (tabular.refill_verification)."""
    return session.execute(select(Job.id).where(*_waiting(model_id, kind, exclude)).limit(1)).first() is not None


def _waiting(model_id: str, kind: str, exclude: str) -> tuple:
    """Jobs of this kind on this model, other than ``exclude``, that no worker holds and that may still run."""
    return (
        Job.model_id == model_id,
        Job.kind == kind,
        Job.id != exclude,
        _free(utcnow()),
        Job.attempts < Job.max_attempts,
    )


def waiting_on_model(session: Session, model_id: str, kind: str, exclude: str, limit: int) -> list[Job]:
    """Jobs of this kind on this model that no worker holds (oldest first): what a batch leader may join — waiting
    ones, and those whose worker died (lease expired; ``claim`` takes them the same way). A job released from a batch
    to run alone (payload ``solo``) is never joined again."""
    jobs = (
        session.execute(select(Job).where(*_waiting(model_id, kind, exclude)).order_by(Job.created_at).limit(limit * 2))
        .scalars()
        .all()
    )
    return [j for j in jobs if not (j.payload or {}).get("solo")][:limit]


def release(session: Session, job_id: str, owner: str, reason: str, payload: dict[str, Any]) -> None:
    """Give a held job back to the outbox without spending its attempt (a batch split it off to run alone):
    pending again at once, with ``payload`` merged into its own."""
    job = session.execute(select(Job).where(Job.id == job_id).with_for_update()).scalar_one()
    if job.lease_owner != owner or job.status != "running":
        raise LeaseLostError(job_id)
    now = utcnow()
    job.status, job.lease_owner, job.lease_expires_at, job.available_at = "pending", None, None, now
    job.attempts, job.payload = max(0, job.attempts - 1), {**(job.payload or {}), **payload}
    job.message, job.updated_at = reason[:2000], now


def renew_all(session: Session, job_ids: list[str], owner: str, progress: float | None, message: str | None) -> None:
    """``renew`` for every job a batch holds, in one statement; LeaseLostError unless this worker holds them all.
    A lease that has run out is not renewed (issue 22): ``model_busy`` already counts it free, so another worker may
    be running on the model; the worker that paused past it stops instead of racing it."""
    now = utcnow()
    values: dict[str, Any] = {
        "lease_expires_at": now + timedelta(seconds=get_settings().lease_seconds),
        "updated_at": now,
    }
    if progress is not None:
        values["progress"] = max(0.0, min(1.0, progress))
    if message is not None:
        values["message"] = message[:2000]
    result = session.execute(
        update(Job)
        .where(Job.id.in_(job_ids), Job.lease_owner == owner, Job.status == "running", Job.lease_expires_at >= now)
        .values(**values)
        .execution_options(synchronize_session=False)
    )
    if result.rowcount != len(job_ids):
        raise LeaseLostError(",".join(job_ids))


def assert_lease(session: Session, job_id: str, owner: str) -> Job:
    """Inside a finishing transaction: lock the job row and check we still hold it (a lease that ran out is held by
    nobody: another worker may have taken the model meanwhile)."""
    return assert_leases(session, [job_id], owner)[0]


def _held(job: Job, owner: str) -> bool:
    expires = job.lease_expires_at
    return job.lease_owner == owner and job.status == "running" and expires is not None and expires >= utcnow()


def assert_leases(session: Session, job_ids: list[str], owner: str) -> list[Job]:
    """``assert_lease`` for a batch's jobs in one statement (locked in id order, so two transactions that lock some
    of the same jobs cannot deadlock); returned in the order given."""
    query = select(Job).where(Job.id.in_(job_ids)).order_by(Job.id).with_for_update()
    jobs = {job.id: job for job in session.execute(query).scalars()}
    for job_id in job_ids:
        job = jobs.get(job_id)
        if job is None or not _held(job, owner):
            raise LeaseLostError(job_id)
    return [jobs[job_id] for job_id in job_ids]


def finish(session: Session, job: Job, result: dict[str, Any]) -> None:
    now = utcnow()
    job.status, job.result, job.progress, job.finished_at, job.updated_at = "succeeded", result, 1.0, now, now
    job.message, job.lease_expires_at = "done", None


def fail(
    session: Session, job_id: str, owner: str | None, error: str, *, permanent: bool, infrastructure: bool = False
) -> Job | None:
    """Record a failure: a permanent one (bad input, a bug) ends the job; a transient one re-offers it with backoff.
    An ``infrastructure`` one (``infrastructure_error``) gives the attempt back and waits longer each time (see
    ``_wait_for_infrastructure``).

    Returns the job when it failed for good (its request or model must be told), None otherwise (re-offered, or not
    ours to fail any more)."""
    now = utcnow()
    job = session.execute(select(Job).where(Job.id == job_id).with_for_update()).scalar_one()
    if owner is not None and (job.lease_owner != owner or job.status != "running"):
        return None
    job.error, job.updated_at = error[:4000], now
    if infrastructure and not permanent:
        return _wait_for_infrastructure(job, error, now)
    if permanent or job.attempts >= job.max_attempts:
        job.status, job.finished_at, job.lease_expires_at = "failed", now, None
        return job
    job.status, job.lease_owner, job.lease_expires_at = "pending", None, None
    job.available_at = now + timedelta(seconds=min(MAX_BACKOFF_SECONDS, 2.0**job.attempts))
    return None


def _wait_for_infrastructure(job: Job, error: str, now: datetime) -> Job | None:
    """The resource a job needs is away: no attempt is spent (the claim's is given back), and the job is re-offered
    after ``transient_backoff_seconds``, doubled at each further such failure up to ``transient_backoff_max_seconds``
    (minutes, so an outage is outwaited rather than raced), until ``transient_give_up_seconds`` since the first:
    then it fails for good. The count lives in the payload (``outage``), so no column is needed."""
    settings = get_settings()
    outage = dict((job.payload or {}).get("outage") or {})
    since = datetime.fromisoformat(outage["since"]) if outage.get("since") else now
    failures = int(outage.get("failures", 0)) + 1
    first_line = error.split("\n", 1)[0][:500]
    if (now - since).total_seconds() > settings.transient_give_up_seconds:
        job.status, job.finished_at, job.lease_expires_at = "failed", now, None
        job.error = f"the infrastructure was unavailable for {(now - since).total_seconds():.0f} s; gave up: {error}"
        job.error = job.error[:4000]
        return job
    delay = min(settings.transient_backoff_max_seconds, settings.transient_backoff_seconds * 2.0 ** (failures - 1))
    job.attempts = max(0, job.attempts - 1)
    job.payload = {**(job.payload or {}), "outage": {"since": since.isoformat(), "failures": failures}}
    job.status, job.lease_owner, job.lease_expires_at = "pending", None, None
    job.available_at = now + timedelta(seconds=delay)
    job.message = f"waiting {delay:.0f} s for the infrastructure (failure {failures}, no attempt spent): {first_line}"
    return None


@dataclass
class Expiry:
    """What one reconciler pass did: jobs re-offered, and jobs failed for good (their owners must be told)."""

    reoffered: int
    failed: list[Job]


def expire_leases(session: Session, after_outage: bool = False) -> Expiry:
    """Re-offer jobs whose lease expired or whose dispatch was never taken; fail those out of attempts.
    ``after_outage``: the first pass after the database was away — a lease that ran out meanwhile says nothing about
    its worker (no one could renew), so its attempt is given back."""
    now = utcnow()
    reoffered = 0
    failed: list[Job] = []
    expired = (
        session.execute(
            select(Job).where(Job.status == "running", Job.lease_expires_at < now).with_for_update(skip_locked=True)
        )
        .scalars()
        .all()
    )
    for job in expired:
        limit = max_runtime(job.kind)
        if after_outage:
            job.attempts = max(0, job.attempts - 1)
        if job.started_at is not None and (now - job.started_at).total_seconds() > limit:
            job.status, job.finished_at, job.updated_at = "failed", now, now
            job.error = f"the job ran longer than its maximum runtime ({limit:g} s for {job.kind}) and was stopped"
            failed.append(job)
        elif job.attempts >= job.max_attempts:
            job.status, job.finished_at, job.updated_at = "failed", now, now
            job.error = f"the worker's lease expired {job.attempts} times (worker killed or stuck); gave up"
            failed.append(job)
        else:
            job.status, job.lease_owner, job.lease_expires_at, job.updated_at = "pending", None, None, now
            job.message = (
                "lease expired while the database was unavailable; re-offered without spending an attempt"
                if after_outage
                else f"lease expired after attempt {job.attempts}; re-offered"
            )
            reoffered += 1
    stale = now - timedelta(seconds=get_settings().dispatch_timeout_seconds)
    result = session.execute(
        update(Job)
        .where(Job.status == "dispatched", Job.dispatched_at < stale)
        .values(status="pending", updated_at=now, message="dispatch not taken; re-offered")
    )
    return Expiry(reoffered + (result.rowcount or 0), failed)

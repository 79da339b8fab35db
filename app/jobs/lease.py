"""A worker's hold on one job: claim, heartbeat and progress, and how a job's end reaches its request or model.

The outbox (app/jobs/outbox.py) changes job rows only; this module pairs each job-row change with what it means for
the domain the job serves — a deletion request (app/requests/service.py) or a model (app/registry/versions.py) — in
the same transaction. Both wings import :class:`JobContext` from here.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from sqlalchemy.orm import Session

from app.config import get_settings
from app.db import session_scope
from app.jobs import faults, outbox
from app.jobs.outbox import LeaseLostError
from app.jobs.tables import Job
from app.registry import versions as registry
from app.requests import service as requests
from app.requests.tables import DeletionRequest

log = logging.getLogger("lethe.lease")

PROGRESS_MIN_INTERVAL = 0.5
"""Seconds between two progress writes; a report that comes sooner is written by the next beat."""
BEAT_MIN, BEAT_MAX = 0.2, 1.0
"""The heartbeat thread wakes every lease_seconds / 3, clamped to this range (seconds)."""


def claim(job_id: str, owner: str) -> Job | None:
    """Take the job's lease and mark its request running. None: done, taken, or out of attempts."""
    with session_scope() as session:
        if outbox.model_busy(session, job_id):
            wait = get_settings().model_busy_retry_seconds
            outbox.defer(session, job_id, wait, "waiting: another job on this model is running")
            return None
        faults.point("claim")  # the per-model check has passed; the claim has not been written yet
        job = outbox.claim(session, job_id, owner)
        if job is None:
            return None
        if job.request_id:
            requests.mark_running(session, job.request_id, job.id, job.attempts, owner)
        session.expunge(job)
        return job


JOINABLE = ("received", "queued", "running", "verifying")
"""A request's statuses while its job waits, or while a dead worker's lease on it runs out."""


def claim_waiting(
    leader: Job,
    owner: str,
    accept: Callable[[DeletionRequest], bool],
    max_requests: int,
    max_rows: int,
    rows: int,
) -> list[tuple[Job, DeletionRequest]]:
    """Group commit: claim the deletion jobs already waiting on the leader's model whose requests ``accept`` takes,
    oldest first, while the batch stays within ``max_requests`` requests and ``max_rows`` rows (``rows``: the
    leader's). Each is the same compare-and-set claim as a job's own (a cancel or another worker wins or loses it
    cleanly), and its request is marked running. No waiting: an empty queue makes a batch of one."""
    if max_requests <= 1:
        return []
    chosen: dict[str, DeletionRequest] = {}
    with session_scope() as session:
        waiting = outbox.waiting_on_model(session, leader.model_id, leader.kind, leader.id, max_requests - 1)
        by_id = requests.by_ids(session, [j.request_id for j in waiting if j.request_id])
        for candidate in waiting:
            request = by_id.get(candidate.request_id)
            if request is None or request.status not in JOINABLE or not accept(request):
                continue
            n = requests.rows_named(request)
            if rows + n > max_rows:
                continue
            rows += n  # counted before the claim: one lost to another worker leaves room unused, never too much
            chosen[candidate.id] = request
        taken = {job.id: job for job in outbox.claim_many(session, list(chosen), owner)}
        joined = [(taken[job_id], request) for job_id, request in chosen.items() if job_id in taken]  # oldest first
        requests.mark_running_many(session, [(request, job.id, job.attempts) for job, request in joined], owner)
        session.flush()
        session.expunge_all()
    return joined


def release(
    job_ids: list[str],
    owner: str,
    reason: str,
    settle: Callable[[Session], None] | None = None,
) -> None:
    """Give batch members back to the outbox to run alone (payload ``solo``), without spending an attempt; their
    requests wait again (``settle`` records anything else in the same transaction, e.g. their failed verdicts)."""
    with session_scope() as session:
        if settle is not None:
            settle(session)
        for job_id in job_ids:
            outbox.release(session, job_id, owner, reason, {"solo": True})
            job = session.get(Job, job_id)
            if job.request_id:
                requests.mark_split_off(session, job.request_id, job_id, reason)


def heartbeat(
    job_ids: list[str], request_ids: list[str], owner: str, progress: float | None = None, message: str | None = None
) -> None:
    """Renew the leases (the job's, or every job of a batch) and record progress on their requests; LeaseLostError
    if one of the jobs was taken."""
    with session_scope() as session:
        outbox.renew_all(session, job_ids, owner, progress, message)
        if request_ids and progress is not None:
            requests.record_progress(session, request_ids, max(0.0, min(1.0, progress)), message and message[:2000])


def tell_owner(session: Session, job: Job, error: str, status: str = "failed", problem_type: str = "job-failed"):
    """A job failed for good: its deletion request ends ``failed``/``rejected``, or its model registration fails."""
    if job.request_id:
        requests.mark_failed(session, job.request_id, job.id, job.attempts, error, status, problem_type)
    elif job.kind == "train_model":
        registry.mark_failed(session, job.model_id, job.id, error)


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
    with session_scope() as session:
        job = outbox.fail(session, job_id, owner, error, permanent=permanent)
        if job is not None:
            tell_owner(session, job, error, request_status, problem_type)


def reconcile(session: Session) -> dict[str, int]:
    """Re-offer jobs whose lease expired; those out of attempts fail, and their request or model is told."""
    expiry = outbox.expire_leases(session)
    for job in expiry.failed:
        tell_owner(session, job, job.error, "failed", "attempts-exhausted")
    return {"reoffered": expiry.reoffered, "failed": len(expiry.failed)}


def finish(job_id: str, owner: str, result: dict) -> None:
    """Finish a job that wrote its results in earlier transactions (checks the lease first)."""
    with session_scope() as session:
        outbox.finish(session, outbox.assert_lease(session, job_id, owner), result)


class JobContext:
    """Progress reporting and the lease heartbeat of one running job.

    A background thread renews the lease (every ``lease_seconds / 3``, at least once a second) whatever the ML code
    is doing, so an expired lease means a dead worker, never a slow step. Progress is written at most twice a second
    from the caller; a report that comes sooner is kept and written by the next beat, so the latest message is never
    lost. If the lease is lost (another worker took the job), ``lost`` is set and the finishing transaction refuses
    to write.
    """

    def __init__(self, job_id: str, owner: str, max_seconds: float | None = None, request_id: str | None = None):
        self.job_id, self.owner = job_id, owner
        self.members: list[str] = [job_id]  # the leader, then the jobs it joined into its batch
        self._requests: dict[str, str] = {job_id: request_id} if request_id else {}
        self._deadline = time.monotonic() + max_seconds if max_seconds else None
        self._last_report = 0.0
        self._pending: tuple[float, str] | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.lost = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"lease-{job_id[:8]}", daemon=True)

    def __enter__(self) -> JobContext:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _beat(self) -> None:
        lease_every = max(BEAT_MIN, get_settings().lease_seconds / 3)
        interval = min(BEAT_MAX, lease_every)
        last_lease = time.monotonic()
        while not self._stop.wait(interval):
            with self._lock:
                pending, self._pending = self._pending, None
            if self._deadline is not None and time.monotonic() > self._deadline:
                # past the kind's maximum runtime: stop renewing; the lease expires and the reconciler fails the job
                log.warning("job %s passed its maximum runtime; no longer renewing its lease", self.job_id)
                self.lost.set()
                return
            if pending is None and time.monotonic() - last_lease < lease_every:
                continue
            try:
                heartbeat(*self._held(), self.owner, *(pending or (None, None)))
                last_lease = time.monotonic()
            except LeaseLostError:
                self.lost.set()
                return
            except Exception:  # a database hiccup: the next beat retries, the lease has slack for it
                log.warning("heartbeat for job %s failed", self.job_id, exc_info=True)

    def progress(self, fraction: float, message: str) -> None:
        """Record progress on the job and its request (now, or with the next beat if the last write was recent)."""
        if self.lost.is_set():
            raise LeaseLostError(self.job_id)
        now = time.monotonic()
        with self._lock:
            if now - self._last_report < PROGRESS_MIN_INTERVAL and fraction < 1.0:
                self._pending = (fraction, message)
                return
            self._pending = None
            self._last_report = now
        heartbeat(*self._held(), self.owner, fraction, message)

    def assert_lease(self, session: Session) -> Job:
        """Inside a finishing transaction: lock the job rows (a batch's too) and check this worker holds them all.
        Returns the leader's."""
        return self.assert_leases(session)[0]

    def assert_leases(self, session: Session) -> list[Job]:
        """``assert_lease`` for every job this context holds (the leader's first)."""
        return outbox.assert_leases(session, list(self.members), self.owner)

    def join(self, jobs: list[Job]) -> None:
        """Jobs this worker claimed to serve in the same batch: their leases are renewed and their requests told
        the batch's progress from now on."""
        with self._lock:
            for job in jobs:
                self.members.append(job.id)
                if job.request_id:
                    self._requests[job.id] = job.request_id

    def hold_only(self, job_id: str) -> None:
        """After the certificates: keep renewing one job's lease (the model stays held for the upkeep), and write
        progress on no request any more (they are certified)."""
        with self._lock:
            self.members = [job_id]
            self._requests.clear()

    def leave(self, job_id: str) -> None:
        """A member given back to the outbox (split off from the batch): no longer renewed."""
        with self._lock:
            self.members.remove(job_id)
            self._requests.pop(job_id, None)

    def _held(self) -> tuple[list[str], list[str]]:
        with self._lock:
            return list(self.members), [self._requests[j] for j in self.members if j in self._requests]

    def scaled(self, start: float, span: float, prefix: str):
        """A progress sink for a sub-step: its [0, 1] maps to [start, start + span] of the job, messages prefixed."""
        return lambda f, m: self.progress(start + span * f, f"{prefix}: {m}")

"""A worker's hold on one job: claim, heartbeat and progress, and how a job's end reaches its request or model.

The outbox (app/jobs/outbox.py) changes job rows only; this module pairs each job-row change with what it means for
the domain the job serves — a deletion request (app/requests/service.py) or a model (app/registry/versions.py) — in
the same transaction. Both wings import :class:`JobContext` from here.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from sqlalchemy.orm import Session

from app.config import get_settings
from app.db import is_unavailable, session_scope
from app.ids import short_id
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
"""The heartbeat thread wakes at least once a second (at most every BEAT_MIN) to write pending progress."""
HARD_STOP_EXIT_CODE = 70
"""A worker process that ended an attempt past its maximum runtime exits with this (EX_SOFTWARE)."""
_HARD_STOP = False


def enable_hard_stop() -> None:
    """In a dedicated worker process (workers/celery_app.py): an attempt past its maximum runtime ends the process
    rather than run on beside the re-offered job (issue 22: the maximum runtime was not enforced on the worker)."""
    global _HARD_STOP
    _HARD_STOP = True


RENEWALS_PER_LEASE = 6
"""The lease is renewed every lease_seconds / 6 (5 s of the default 30 s): a short lease frees a killed worker's model
quickly (issue 22: one killed worker stopped its model for 300 s), and five missed renewals (a database hiccup) still
leave a live worker its lease."""


def claim(job_id: str, owner: str) -> Job | None:
    """Take the job's lease and mark its request running. None: done, taken, or out of attempts."""
    with session_scope() as session:
        if outbox.model_busy(session, job_id):  # offered again when the model's lease ends
            outbox.wait_for_model(session, job_id, "waiting: another job on this model is running")
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
    infrastructure: bool = False,
) -> None:
    """Record a failure: a permanent one (bad input, a bug) ends the job; a transient one re-offers it with backoff;
    an ``infrastructure`` one (a resource away) waits longer and spends no attempt (``outbox.fail``).

    The database may be away too: recording is retried (a growing pause, up to one lease) while it is unavailable;
    after that the reconciler re-offers the job when the lease runs out."""
    deadline = time.monotonic() + get_settings().lease_seconds
    pause = 0.5
    while True:
        try:
            with session_scope() as session:
                job = outbox.fail(session, job_id, owner, error, permanent=permanent, infrastructure=infrastructure)
                if job is not None:
                    tell_owner(session, job, job.error or error, request_status, problem_type)
            return
        except Exception as exc:
            if not is_unavailable(exc) or time.monotonic() + pause > deadline:
                raise
            log.warning("job %s: the failure could not be recorded (database unavailable); retrying", job_id)
            time.sleep(pause)
            pause = min(pause * 2, 5.0)


def reconcile(session: Session, after_outage: bool = False) -> dict[str, int]:
    """Re-offer jobs whose lease expired; those out of attempts fail, and their request or model is told.
    ``after_outage``: leases that ran out while the database was away spend no attempt (``outbox.expire_leases``)."""
    expiry = outbox.expire_leases(session, after_outage)
    for job in expiry.failed:
        tell_owner(session, job, job.error, "failed", "attempts-exhausted")
    return {"reoffered": expiry.reoffered, "failed": len(expiry.failed)}


def finish(job_id: str, owner: str, result: dict) -> None:
    """Finish a job that wrote its results in earlier transactions (checks the lease first)."""
    with session_scope() as session:
        outbox.finish(session, outbox.assert_lease(session, job_id, owner), result)


class JobContext:
    """Progress reporting and the lease heartbeat of one running job.

    A background thread renews the lease (every ``lease_seconds / 6``) whatever the ML code
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
        self._renewing = threading.RLock()  # held by the beat around a renewal, and by ``finishing``
        self._stop = threading.Event()
        self.lost = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"lease-{short_id(job_id)}", daemon=True)

    def __enter__(self) -> JobContext:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _beat(self) -> None:
        lease_every = max(BEAT_MIN, get_settings().lease_seconds / RENEWALS_PER_LEASE)
        interval = min(BEAT_MAX, lease_every)
        last_lease = time.monotonic()
        while not self._stop.wait(interval):
            with self._lock:
                pending, self._pending = self._pending, None
            if self._deadline is not None and time.monotonic() > self._deadline:
                # past the kind's maximum runtime: stop renewing; the lease expires and the reconciler fails the job
                log.warning("job %s passed its maximum runtime; no longer renewing its lease", self.job_id)
                self.lost.set()
                self._hard_stop(lease_every)
                return
            if pending is None and time.monotonic() - last_lease < lease_every:
                continue
            try:
                with self._renewing:
                    heartbeat(*self._held(), self.owner, *(pending or (None, None)))
                last_lease = time.monotonic()
            except LeaseLostError:
                self.lost.set()
                return
            except Exception:  # a database hiccup: the next beat retries, the lease has slack for it
                log.warning("heartbeat for job %s failed", self.job_id, exc_info=True)

    def _hard_stop(self, lease_every: float) -> None:
        """Past the maximum runtime the lease is no longer renewed, but the attempt's code may still be running (a
        step that never reports progress) when the reconciler re-offers the job: two workers on one model. In a
        worker process (``enable_hard_stop``), an attempt still running half a lease after its deadline ends the
        process — before the lease, renewed at most ``lease_every`` before the deadline, can run out; the process
        manager (Celery's pool, compose's restart policy) starts a fresh one. Never in the API's embedded executor."""
        if not _HARD_STOP:
            return
        grace = max(0.0, get_settings().lease_seconds / 2 - lease_every / 2)
        if self._stop.wait(grace):
            return  # the attempt ended by itself
        log.error("job %s still running %.1f s past its maximum runtime: ending this process", self.job_id, grace)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(HARD_STOP_EXIT_CODE)

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

    @contextmanager
    def finishing(self) -> Iterator[None]:
        """Around a transaction that ends some of the held jobs and the change of ``members`` that follows it: the
        beat renews no lease meanwhile. Otherwise its renewal of the old member list waits on the rows the
        transaction locked and, once it commits, finds jobs no longer running and takes the lease as lost (issue 21:
        every batch stopped its upkeep as "lease lost", and its model stayed held until the lease ran out, ~25 s a
        batch). The transaction checked the leases itself (``assert_leases``)."""
        with self._renewing:
            yield

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

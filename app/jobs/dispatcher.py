"""Hands due jobs from the outbox to workers, and runs the reconciler.

Production: jobs go to Celery (Redis broker) on the queue their model kind needs ("gpu", "cpu"); any number of
dispatchers may run (marking a job dispatched is a compare-and-set). Embedded default: the same loop hands them to an
in-process executor thread, so the demo needs no server.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable

from app.config import get_settings
from app.db import is_unavailable, session_scope
from app.jobs import blobs
from app.jobs.lease import reconcile
from app.jobs.outbox import NEW_JOBS, mark_dispatched, reoffer_dispatched, undispatch
from app.jobs.tables import Job
from app.registry.versions import shred_due
from app.requests.service import flag_overdue, mark_queued
from app.subjects.service import settle_due
from app.webhooks.sender import WebhookSender

log = logging.getLogger("lethe.dispatcher")

NUDGE_MIN_SECONDS = 0.02
"""Shortest time between two dispatcher passes: intake nudges arrive per committed batch."""


def worker_identity() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{threading.get_ident()}"


def celery_sender() -> Callable[[Job], None]:
    from workers.celery_app import celery_app  # imported here: the embedded default never loads Celery

    def send(job: Job) -> None:
        celery_app.send_task("workers.tasks.execute_job", args=[job.id], queue=job.queue)

    return send


class InProcessExecutor:
    """One worker thread running jobs one at a time (the ML uses every core)."""

    def __init__(self) -> None:
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="lethe-executor", daemon=True)
        self.idle = threading.Event()
        self.idle.set()

    def start(self) -> None:
        self._thread.start()

    def send(self, job: Job) -> None:
        self.idle.clear()
        self._queue.put(job.id)

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)

    def alive(self) -> bool:
        return self._thread.is_alive()

    def pending(self) -> int:
        return self._queue.qsize()

    def _run(self) -> None:
        from app.jobs.pipeline import execute_job  # the ML stack loads in the executor thread only

        while True:
            job_id = self._queue.get()
            if job_id is None:
                return
            try:
                execute_job(job_id, worker_identity())
            except Exception:  # the pipeline records failures itself; this keeps the thread alive
                log.exception("job %s crashed the executor loop", job_id)
            finally:
                if self._queue.empty():
                    self.idle.set()


class BrokerWatch:
    """Whether the Redis broker may have lost messages since the last look: it was unreachable, or it restarted (its
    ``run_id`` changed: a Redis without persistence comes back empty). One INFO call per housekeeping pass, with
    short socket timeouts; ``available`` pauses dispatching while the broker is away."""

    def __init__(self, url: str):
        import redis  # the embedded default has no broker

        self._client = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
        self._run_id: str | None = None
        self._missed = False
        self.available = True

    def look(self) -> bool:
        """Look at the broker; True when messages may have been lost since the last look."""
        try:
            run_id = self._client.info("server")["run_id"]
        except Exception as exc:
            if self.available:
                log.warning("the broker is unreachable (%s); dispatching paused", type(exc).__name__)
            self.available, self._missed = False, True
            return False
        lost = self._missed or (self._run_id is not None and run_id != self._run_id)
        self._run_id, self.available, self._missed = run_id, True, False
        return lost


def broker_watch(url: str | None) -> BrokerWatch | None:
    return BrokerWatch(url) if url and url.startswith(("redis://", "rediss://")) else None


class Dispatcher:
    """Marks due jobs dispatched and sends them, after the commit (the outbox pattern).

    Lost messages (issue 22: each waited the whole dispatch timeout, 600 s, before it was re-offered) are re-offered
    within a pass of the outage's end, by one rule: after any outage of the broker or the database, every job still
    marked dispatched is sent again (``outbox.reoffer_dispatched``). The broker may have lost its messages (a Redis
    restarted without persistence: its run_id changes), and a worker that consumed a message while the database was
    down could not claim the job (messages are acknowledged on receipt). A message that was not lost is delivered
    twice, which is harmless: the claim is a compare-and-set. A send that fails puts its job (and those after it)
    back to pending at once, and dispatching pauses until the broker answers again. ``dispatch_timeout_seconds``
    stays as the net for a loss nobody saw (a worker killed between receiving a message and claiming its job).
    """

    def __init__(self, send: Callable[[Job], None], broker: BrokerWatch | None = None):
        self.send = send
        self.broker = broker
        self._reoffer_due: str | None = None  # why every dispatched job must be sent again, at the next pass
        self._database_was_away = False  # the next pass's reconciler spares the attempts of leases that ran out
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.companions: list = []  # loops started with the dispatcher and stopped with it (the webhook sender)

    def tick(self, housekeeping: bool = True) -> int:
        """One pass: reconcile, then dispatch due jobs. Sending happens after the commit (the outbox pattern).
        ``housekeeping=False`` (a nudge between two polls): dispatch only."""
        if housekeeping and self.broker is not None and self.broker.look():
            self._reoffer_due = "the broker was unreachable or restarted"
        dispatching = self.broker is None or self.broker.available
        reoffer = self._reoffer_due if housekeeping else None
        with session_scope() as session:
            if housekeeping:
                if reoffer:
                    count = reoffer_dispatched(session, f"re-offered: {reoffer}, so its message may be lost")
                    if count:
                        log.warning("%s: %d dispatched jobs re-offered", reoffer, count)
                counts = reconcile(session, after_outage=self._database_was_away)
                shred_due(session)  # blobs whose retention grace period has passed
                flag_overdue(session)  # requests past their GDPR deadline: an audit event, once
                if counts["reoffered"] or counts["failed"]:
                    log.warning("reconciler: %s", counts)
            jobs = mark_dispatched(session) if dispatching else []
            for job in jobs:
                if job.request_id:
                    mark_queued(session, job.request_id, job.id, job.queue)
        if reoffer and self._reoffer_due == reoffer:
            self._reoffer_due = None
        if housekeeping:
            self._database_was_away = False
        if housekeeping:
            try:
                with session_scope() as session:  # its own transaction: a failure here never holds up dispatching
                    settle_due(session)  # per-person erasures whose last children were certified at the same moment
            except Exception:
                log.exception("settling subject erasures failed; retrying next tick")
            try:  # blobs of attempts that ended without publishing (a worker killed), then unreferenced ones
                with session_scope() as session:
                    blobs.settle_dead(session)
                blobs.sweep_if_due()
            except Exception:
                log.exception("shredding unpublished or unreferenced blobs failed; retrying next tick")
        return self._send(jobs)

    def _send(self, jobs: list[Job]) -> int:
        """Send each job; at the first failure the broker is taken as away: that job and the rest are pending again
        at once (not after the dispatch timeout), and dispatching pauses until the next look finds the broker."""
        for sent, job in enumerate(jobs):
            try:
                self.send(job)
            except Exception:
                log.exception("could not send job %s; it and %d more are pending again", job.id, len(jobs) - sent - 1)
                if self.broker is not None:
                    self.broker.available = False
                try:
                    with session_scope() as session:
                        undispatch(session, [j.id for j in jobs[sent:]], "the broker did not take the message")
                except Exception:
                    log.exception("could not put unsent jobs back; they are re-offered when the outage ends")
                    self._reoffer_due = "a send failed"
                return sent
        return len(jobs)

    def step(self, housekeeping: bool = True) -> None:
        """``tick``, never raising: a pass that met the database away makes the next good one re-offer every
        dispatched job (a worker may have consumed its message and failed to claim it meanwhile) and give back the
        attempts of the leases that ran out meanwhile (their workers could not renew them)."""
        try:
            self.tick(housekeeping=housekeeping)
        except Exception as exc:
            if is_unavailable(exc):
                log.warning("dispatcher: the database is unavailable (%s); retrying", type(exc).__name__)
                self._reoffer_due = "the database was unavailable"
                self._database_was_away = True
            else:
                log.exception("dispatcher tick failed; retrying")

    def run_forever(self) -> None:
        """A full tick every poll interval; in between, a nudge from this process's intake (``outbox.nudge``)
        dispatches new jobs at once (at most every NUDGE_MIN_SECONDS, so a stream of requests costs a bounded
        number of passes)."""
        interval = get_settings().poll_seconds
        last_full = 0.0
        while not self._stop.is_set():
            full = time.monotonic() - last_full >= interval
            self.step(housekeeping=full)
            if full:
                last_full = time.monotonic()
            NEW_JOBS.wait(max(0.0, interval - (time.monotonic() - last_full)))
            NEW_JOBS.clear()
            self._stop.wait(NUDGE_MIN_SECONDS)

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run_forever, name="lethe-dispatcher", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        NEW_JOBS.set()
        if self._thread:
            self._thread.join(timeout=10)
        for companion in self.companions:
            companion.stop()


def start_background(settings=None) -> tuple[Dispatcher, InProcessExecutor | None]:
    """Start the dispatcher loop (and, on the embedded default, the in-process executor)."""
    settings = settings or get_settings()
    executor = None
    if settings.embedded_executor:
        executor = InProcessExecutor()
        executor.start()
        dispatcher = Dispatcher(executor.send)
    else:
        dispatcher = Dispatcher(celery_sender(), broker_watch(settings.broker_url))
    sender = WebhookSender(settings.poll_seconds)  # the webhook outbox, never in a job worker
    sender.start()
    dispatcher.companions.append(sender)
    dispatcher.start()
    return dispatcher, executor

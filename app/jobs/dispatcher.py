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
from app.db import session_scope
from app.jobs import blobs
from app.jobs.lease import reconcile
from app.jobs.outbox import NEW_JOBS, mark_dispatched
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


class Dispatcher:
    def __init__(self, send: Callable[[Job], None]):
        self.send = send
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.companions: list = []  # loops started with the dispatcher and stopped with it (the webhook sender)

    def tick(self, housekeeping: bool = True) -> int:
        """One pass: reconcile, then dispatch due jobs. Sending happens after the commit (the outbox pattern).
        ``housekeeping=False`` (a nudge between two polls): dispatch only."""
        with session_scope() as session:
            if housekeeping:
                counts = reconcile(session)
                shred_due(session)  # blobs whose retention grace period has passed
                flag_overdue(session)  # requests past their GDPR deadline: an audit event, once
                if counts["reoffered"] or counts["failed"]:
                    log.warning("reconciler: %s", counts)
            jobs = mark_dispatched(session)
            for job in jobs:
                if job.request_id:
                    mark_queued(session, job.request_id, job.id, job.queue)
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
        sent = 0
        for job in jobs:
            try:
                self.send(job)
                sent += 1
            except Exception:
                log.exception("could not send job %s; it will be re-offered after the dispatch timeout", job.id)
        return sent

    def run_forever(self) -> None:
        """A full tick every poll interval; in between, a nudge from this process's intake (``outbox.nudge``)
        dispatches new jobs at once (at most every NUDGE_MIN_SECONDS, so a stream of requests costs a bounded
        number of passes)."""
        interval = get_settings().poll_seconds
        last_full = 0.0
        while not self._stop.is_set():
            full = time.monotonic() - last_full >= interval
            try:
                self.tick(housekeeping=full)
            except Exception:
                log.exception("dispatcher tick failed; retrying")
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
        dispatcher = Dispatcher(celery_sender())
    sender = WebhookSender(settings.poll_seconds)  # the webhook outbox, never in a job worker
    sender.start()
    dispatcher.companions.append(sender)
    dispatcher.start()
    return dispatcher, executor

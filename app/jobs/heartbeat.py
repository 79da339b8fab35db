"""Worker heartbeats (issue 23, item 2): each Celery worker process writes its row every ``HEARTBEAT_SECONDS`` from
a daemon thread and deletes it when it stops; ``/readyz`` and ``/metrics`` count the workers seen within
``FRESH_SECONDS`` per queue — one indexed read, never a broadcast that waits two seconds for replies and whose
replies overwrite each other when two workers share a node name."""

from __future__ import annotations

import logging
import threading
from datetime import timedelta

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from app.db import session_scope, utcnow
from app.jobs.tables import WorkerHeartbeat

log = logging.getLogger("lethe.heartbeat")
HEARTBEAT_SECONDS = 10.0
QUEUES = ("cpu", "gpu")
"""The queues jobs are sent to (workers/celery_app.py): tabular models on cpu, federated CLIP on gpu."""
FRESH_SECONDS = 3 * HEARTBEAT_SECONDS
"""A worker not seen for this long counts as gone (three missed beats: a busy worker's thread still beats)."""


def beat(session: Session, name: str, queues: list[str]) -> None:
    """Record that the worker ``name`` lives and consumes ``queues`` (insert or refresh its row)."""
    row = session.get(WorkerHeartbeat, name)
    if row is None:
        session.add(WorkerHeartbeat(name=name, queues=list(queues), started_at=utcnow(), seen_at=utcnow()))
    else:
        row.queues, row.seen_at = list(queues), utcnow()


def gone(session: Session, name: str) -> None:
    session.execute(delete(WorkerHeartbeat).where(WorkerHeartbeat.name == name))


def listening(session: Session, fresh_seconds: float = FRESH_SECONDS) -> dict[str, int]:
    """Workers seen within ``fresh_seconds``, per queue they consume (the service's queues always named, 0 when
    none listens)."""
    since = utcnow() - timedelta(seconds=fresh_seconds)
    counts: dict[str, int] = dict.fromkeys(QUEUES, 0)
    for queues in session.execute(select(WorkerHeartbeat.queues).where(WorkerHeartbeat.seen_at >= since)).scalars():
        for queue in queues or []:
            counts[queue] = counts.get(queue, 0) + 1
    return counts


class Heartbeat:
    """The worker process's beating thread: beats at once, then every ``every`` seconds until ``stop``."""

    def __init__(self, name: str, queues: list[str], every: float = HEARTBEAT_SECONDS):
        self.name, self.queues, self.every = name, queues, every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lethe-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                with session_scope() as session:
                    beat(session, self.name, self.queues)
            except Exception:  # the database is away for a moment: the next beat tries again
                log.warning("heartbeat of %s not written", self.name, exc_info=True)
            self._stop.wait(self.every)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        try:
            with session_scope() as session:
                gone(session, self.name)
        except Exception:
            log.warning("heartbeat of %s not removed (it expires after %.0f s)", self.name, FRESH_SECONDS)

"""Operations endpoints: ``/metrics`` (Prometheus text format) and ``/readyz`` (database, broker, workers)."""

from __future__ import annotations

import threading
import time

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from sqlalchemy import text

from app.config import get_settings
from app.db import get_engine
from app.ops.metrics import LetheCollector

router = APIRouter(tags=["operations"])
READY_TIMEOUT_SECONDS = 2.0
"""How long /readyz waits for the broker and for workers to answer a ping."""
READY_CACHE_SECONDS = 2.0
"""How long one probe's answer serves every /readyz caller."""


class _Readiness:
    """One app's readiness probe: a lock (one probe at a time) and the last answer with its time."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.last: tuple[float, dict[str, object]] | None = None


_creating = threading.Lock()


def _readiness(request: Request) -> _Readiness:
    with _creating:
        if getattr(request.app.state, "readiness", None) is None:
            request.app.state.readiness = _Readiness()
        return request.app.state.readiness


_registry = CollectorRegistry()
_registry.register(LetheCollector())


@router.get("/metrics", include_in_schema=False)
def metrics() -> Response:
    """Deletion requests by status, job durations by kind, verdicts, queue depth, the oldest waiting request's age,
    failing webhook deliveries — for Prometheus (no key: scrape it from inside the network)."""
    return Response(generate_latest(_registry), media_type=CONTENT_TYPE_LATEST)


def _workers_by_queue() -> dict[str, int]:
    """Celery workers answering a ping, per queue they consume (``celery inspect active_queues``)."""
    from workers.celery_app import celery_app  # here: the embedded default never loads Celery

    replies = celery_app.control.inspect(timeout=READY_TIMEOUT_SECONDS).active_queues() or {}
    counts: dict[str, int] = {}
    for queues in replies.values():
        for queue in queues:
            counts[queue["name"]] = counts.get(queue["name"], 0) + 1
    return counts


@router.get("/readyz")
def readyz(request: Request) -> JSONResponse:
    """Ready when the database answers and, with a broker, the broker answers and a worker listens on each queue;
    on the embedded default, when the in-process executor runs. 503 names what is missing.

    One probe at a time, its answer shared for READY_CACHE_SECONDS (issue 22, HIGH): each probe takes a database
    connection and a Celery ``inspect`` broadcast takes one of kombu's broker connections and waits for replies, so
    unauthenticated callers in parallel used to exhaust both pools and hang the API (and the dispatcher's sends).
    A caller arriving while a probe runs gets the last answer, or 503 "checking" before the first one."""
    state = _readiness(request)
    last = state.last
    if last is not None and time.monotonic() - last[0] < READY_CACHE_SECONDS:
        return _answer(last[1])
    if not state.lock.acquire(blocking=False):
        return _answer(last[1] if last is not None else {"probe": "checking"})
    try:
        checks = _probe(request)
        state.last = (time.monotonic(), checks)
    finally:
        state.lock.release()
    return _answer(checks)


def _answer(checks: dict[str, object]) -> JSONResponse:
    ready = all(v == "ok" or (isinstance(v, int) and v > 0) for v in checks.values())
    return JSONResponse({"ready": ready, "checks": checks}, status_code=200 if ready else 503)


def _probe(request: Request) -> dict[str, object]:
    settings = get_settings()
    checks: dict[str, object] = {}
    try:
        with get_engine().connect() as connection:
            connection.execute(text("SELECT 1"))
        checks["database"] = "ok"
    except Exception as exc:  # any driver error means not ready
        checks["database"] = f"down: {type(exc).__name__}"
    if settings.embedded_executor:
        executor = getattr(request.app.state, "executor", None)
        checks["executor"] = "ok" if executor is not None and executor.alive() else "not running"
    else:
        try:
            workers = _workers_by_queue()
            checks["broker"] = "ok"
            for queue in ("cpu", "gpu"):
                checks[f"workers:{queue}"] = workers.get(queue, 0) or "none listening"
        except Exception as exc:
            checks["broker"] = f"down: {type(exc).__name__}"
    return checks

"""Operations endpoints: ``/metrics`` (Prometheus text format) and ``/readyz`` (what this process needs to serve:
the database, and on the embedded default the in-process executor; the workers' heartbeats are reported, not
required).

Who may read them (issue 22, LOW: both answered anyone): ``/metrics`` needs a key with ``metrics:read`` (Prometheus
sends it as a bearer token; the figures name models, queues, failure rates); ``/readyz`` answers anyone whether the
process is ready (a load balancer sends no key) but names what is missing, and the workers, only to a
``metrics:read`` key. ``/healthz`` (app/main.py) stays open: liveness, it says only that the process answers."""

from __future__ import annotations

import threading
import time

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import text

from app.auth.service import Principal, optional_principal, require_scope
from app.config import get_settings
from app.db import get_engine, session_scope
from app.jobs.heartbeat import listening
from app.ops.metrics import build_registry
from app.ops.schemas import ReadinessOut

router = APIRouter(tags=["operations"])
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


_registry = build_registry()


@router.get("/metrics", include_in_schema=False)
def metrics(_: Principal = Depends(require_scope("metrics:read"))) -> Response:
    """Deletion requests by status, job durations and outcomes by kind, verdicts, queue depth, workers, the oldest
    waiting request's age, overdue requests, failing webhook deliveries, and HTTP requests by route — for Prometheus,
    with a ``metrics:read`` key as its bearer token (docs/monitoring/prometheus.yml)."""
    return Response(generate_latest(_registry), media_type=CONTENT_TYPE_LATEST)


@router.get(
    "/readyz", response_model=ReadinessOut, responses={503: {"model": ReadinessOut, "description": "Not ready"}}
)
def readyz(request: Request, principal: Principal | None = Depends(optional_principal)) -> JSONResponse:
    """Ready when what this process needs answers: the database, and on the embedded default the in-process
    executor. 503 names what is missing. The Celery workers are reported (``workers``: per queue, those whose
    heartbeat is fresh, app/jobs/heartbeat.py) but never required: intake needs only the database, and a GPU
    worker's outage must not take every API replica out of a load balancer (issue 23); alert on
    ``lethe_workers{queue}`` instead.

    One probe at a time, its answer shared for READY_CACHE_SECONDS (issue 22, HIGH): each probe takes a database
    connection, and unauthenticated callers in parallel once exhausted the pools (then with a Celery broadcast per
    probe) and hung the API. A caller arriving while a probe runs gets the last answer, or 503 "checking" before the
    first one.

    Without a ``metrics:read`` key the answer is ``ready`` alone (issue 22, LOW): which component is down, and how
    many workers listen, is for operators."""
    detailed = principal is not None and principal.has("metrics:read")
    state = _readiness(request)
    last = state.last
    if last is not None and time.monotonic() - last[0] < READY_CACHE_SECONDS:
        return _answer(last[1], detailed)
    if not state.lock.acquire(blocking=False):
        return _answer(last[1] if last is not None else {"probe": "checking"}, detailed)
    try:
        checks = _probe(request)
        state.last = (time.monotonic(), checks)
    finally:
        state.lock.release()
    return _answer(checks, detailed)


def _answer(checks: dict[str, object], detailed: bool) -> JSONResponse:
    workers = checks.get("workers")
    gate = {k: v for k, v in checks.items() if k != "workers"}
    ready = all(v == "ok" for v in gate.values())
    body: dict[str, object] = {"ready": ready}
    if detailed:
        body |= {"checks": gate, **({"workers": workers} if workers is not None else {})}
    return JSONResponse(body, status_code=200 if ready else 503)


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
    elif checks["database"] == "ok":
        with session_scope() as session:
            checks["workers"] = listening(session)
    return checks

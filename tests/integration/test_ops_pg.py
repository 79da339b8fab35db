"""/readyz on PostgreSQL + Redis + Celery: ready on what the API needs (the database), the workers reported from
their heartbeats — a stopped worker leaves the count, and the API stays ready (issue 23, item 2)."""

from __future__ import annotations

import signal
import time

from tests.helpers import wait_for


def test_readyz_reports_workers_from_heartbeats_and_does_not_need_them(stack):
    ready = wait_for(
        lambda: (r := stack.client.get("/readyz")).status_code == 200 and r.json()["workers"]["cpu"] >= 1 and r.json(),
        timeout=60,
        what="a worker's heartbeat",
    )
    assert ready["checks"] == {"database": "ok"} and ready["workers"]["gpu"] >= 1  # the stack's worker takes both
    started = time.monotonic()
    stack.kill(stack.worker, signal.SIGTERM)  # a worker that stops removes its heartbeat: counted out at once
    try:
        gone = wait_for(
            lambda: (r := stack.client.get("/readyz")).json()["workers"]["cpu"] == 0 and r, timeout=15, what="gone"
        )
        assert gone.status_code == 200 and gone.json()["ready"] is True  # intake needs no worker
        assert time.monotonic() - started < 15
        assert 'lethe_workers{queue="cpu"} 0.0' in stack.client.get("/metrics").text
    finally:
        stack.worker = stack.start_worker("w-after-readyz")


def test_many_unauthenticated_readiness_probes_do_not_hang_the_api(stack):
    """Issue 22, HIGH: every /readyz call ran a Celery inspect broadcast; 120 callers at once took kombu's broker
    pool and hung the API for everyone. Now one probe runs at a time and its answer is shared: 120 concurrent calls
    are all answered, and an authenticated call and /healthz answer right after."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    def probe(_: int) -> int:
        with httpx.Client(base_url=stack.base_url, timeout=30) as client:
            return client.get("/readyz").status_code

    with ThreadPoolExecutor(max_workers=120) as pool:
        statuses = list(pool.map(probe, range(120)))
    assert set(statuses) <= {200, 503} and len(statuses) == 120
    assert stack.client.get("/healthz", timeout=10).status_code == 200
    assert stack.client.get("/v1/models", timeout=10).status_code == 200

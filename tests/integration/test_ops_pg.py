"""/readyz on PostgreSQL + Redis + Celery: ready while a worker listens on the queues, 503 once none does."""

from __future__ import annotations

from tests.helpers import wait_for


def test_readyz_fails_when_no_worker_listens(stack):
    ready = wait_for(
        lambda: (r := stack.client.get("/readyz")).status_code == 200 and r.json(), timeout=60, what="readiness"
    )
    assert ready["checks"]["database"] == "ok" and ready["checks"]["workers:cpu"] >= 1
    stack.kill(stack.worker)
    try:  # one probe's answer serves callers for READY_CACHE_SECONDS
        down = wait_for(lambda: (r := stack.client.get("/readyz")).status_code == 503 and r, timeout=15, what="503")
        assert down.json()["checks"]["workers:cpu"] == "none listening"
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

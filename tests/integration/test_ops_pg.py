"""/readyz on PostgreSQL + Redis + Celery: ready while a worker listens on the queues, 503 once none does."""

from __future__ import annotations

from tests.helpers import wait_for


def test_readyz_fails_when_no_worker_listens(stack):
    ready = wait_for(
        lambda: (r := stack.client.get("/readyz")).status_code == 200 and r.json(), timeout=60, what="readiness"
    )
    assert ready["checks"]["database"] == "ok" and ready["checks"]["workers:cpu"] >= 1
    stack.kill(stack.worker)
    try:
        down = stack.client.get("/readyz")
        assert down.status_code == 503
        assert down.json()["checks"]["workers:cpu"] == "none listening"
    finally:
        stack.worker = stack.start_worker("w-after-readyz")

"""Operator's view, item 7: /metrics is scraped and its figures move when a request is certified; /readyz."""

from __future__ import annotations

import json
import re

from fastapi.testclient import TestClient

from app.main import create_app
from tests.helpers import configure, make_key, wait_for, wait_request, write_table


def _value(text: str, name: str, labels: str = "") -> float:
    match = re.search(rf"^{re.escape(name)}{re.escape(labels)} ([0-9.e+-]+)$", text, flags=re.M)
    return float(match.group(1)) if match else 0.0


def test_metrics_move_when_a_request_is_certified_and_readyz_answers(tmp_path):
    configure(tmp_path / "home", poll_seconds="0.05")
    key = make_key()
    source = tmp_path / "t.csv"
    write_table(source, n=200, seed=6)
    metadata = {
        "name": "ops",
        "verification": {"shadows": 8},
        "dataset": {"row_id_column": "row_id", "label_column": "label"},
    }
    with TestClient(create_app(run_background=True), headers={"authorization": f"Bearer {key}"}) as client:
        ready = client.get("/readyz")
        assert ready.status_code == 200 and ready.json()["checks"] == {"database": "ok", "executor": "ok"}
        before = client.get("/metrics").text
        assert _value(before, "lethe_deletion_requests", '{status="certified"}') == 0
        with source.open("rb") as handle:
            model_id = client.post(
                "/v1/models", data={"metadata": json.dumps(metadata)}, files={"file": ("t.csv", handle, "text/csv")}
            ).json()["id"]
        wait_for(lambda: client.get(f"/v1/models/{model_id}").json()["status"] == "ready", timeout=120, what="ready")
        response = client.post(
            "/v1/deletion-requests",
            json={"subject_ref": "m", "model_id": model_id, "scope": {"kind": "samples", "sample_ids": ["r1"]}},
        )
        assert wait_request(client, response.json()["id"], timeout=120)["status"] == "certified"
        after = client.get("/metrics").text
        assert _value(after, "lethe_deletion_requests", '{status="certified"}') == 1
        assert _value(after, "lethe_verdicts_total", '{verdict="pass"}') == 1
        after = wait_for(  # the job ends after its upkeep, which runs once the request is certified
            lambda: (
                (text := client.get("/metrics").text)
                and _value(text, "lethe_job_duration_seconds_count", '{kind="deletion"}') == 1
                and text
            ),
            timeout=60,
            what="the deletion job to finish its upkeep",
        )
        assert _value(after, "lethe_job_duration_seconds_sum", '{kind="deletion"}') > 0
        assert "lethe_oldest_pending_request_age_seconds 0.0" in after
    with TestClient(create_app(run_background=False)) as client:  # no executor: not ready, and it says why
        ready = client.get("/readyz", headers={"authorization": f"Bearer {key}"})
        assert ready.status_code == 503 and ready.json()["checks"]["executor"] == "not running"


def test_readyz_details_and_metrics_need_a_metrics_key(tmp_path):
    """Issue 22, LOW: /readyz and /metrics answered anyone in full. Now a load balancer (no key) still learns ready or
    not, and only that; what is missing, and the figures, need a key with ``metrics:read`` (or ``admin``)."""
    configure(tmp_path / "home")
    metrics_key, admin, other = make_key(["metrics:read"]), make_key(["admin"]), make_key(["requests:read"])
    with TestClient(create_app(run_background=False)) as client:  # no executor: not ready
        for headers in ({}, {"authorization": f"Bearer {other}"}, {"authorization": "Bearer lethe_x_y"}):
            bare = client.get("/readyz", headers=headers)
            assert bare.status_code == 503 and bare.json() == {"ready": False}, headers
        for key in (metrics_key, admin):
            detailed = client.get("/readyz", headers={"authorization": f"Bearer {key}"})
            assert detailed.status_code == 503
            assert detailed.json()["checks"] == {"database": "ok", "executor": "not running"}
        assert client.get("/metrics").status_code == 401
        refused = client.get("/metrics", headers={"authorization": f"Bearer {other}"})
        assert refused.status_code == 403 and refused.json()["required_scope"] == "metrics:read"
        for key in (metrics_key, admin):
            scraped = client.get("/metrics", headers={"authorization": f"Bearer {key}"})
            assert scraped.status_code == 200 and "lethe_deletion_requests" in scraped.text


def test_readiness_probes_run_one_at_a_time_and_share_their_answer(tmp_path, monkeypatch):
    """Issue 22, HIGH: each /readyz call took a database connection and (with a broker) a Celery inspect broadcast;
    callers in parallel exhausted both pools. Now at most one probe runs at a time per app, and callers meanwhile
    and for READY_CACHE_SECONDS after get its answer (a slow probe is made slower here to widen the window)."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    from app.ops import router as ops

    configure(tmp_path / "home", poll_seconds="0.05")
    running, most, calls, lock = [0], [0], [0], threading.Lock()
    real = ops._probe

    def slow_probe(request):
        with lock:
            running[0] += 1
            calls[0] += 1
            most[0] = max(most[0], running[0])
        try:
            time.sleep(0.3)
            return real(request)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(ops, "_probe", slow_probe)
    headers = {"authorization": f"Bearer {make_key(['metrics:read'])}"}  # the details show which answer was shared
    with TestClient(create_app(run_background=True), headers=headers) as client:
        with ThreadPoolExecutor(max_workers=40) as pool:
            responses = list(pool.map(lambda _: client.get("/readyz"), range(40)))
        assert most[0] == 1 and calls[0] <= 2  # one probe (a second only if the first answer aged meanwhile)
        assert all(r.status_code in (200, 503) for r in responses)
        assert any(
            r.status_code == 200 and r.json()["checks"] == {"database": "ok", "executor": "ok"} for r in responses
        )
        assert all(
            r.json()["checks"] in ({"probe": "checking"}, {"database": "ok", "executor": "ok"}) for r in responses
        )
        before = calls[0]
        assert client.get("/readyz").status_code == 200 and calls[0] == before  # within READY_CACHE_SECONDS: shared


def test_worker_heartbeats_count_fresh_workers_per_queue(tmp_path):
    """Issue 23, item 2: workers are counted from their heartbeat rows (no broadcast): a worker counts on each queue
    it consumes while its last beat is fresh, not after, and not once it said it is gone."""
    from datetime import timedelta

    from app.db import session_scope
    from app.jobs import heartbeat
    from app.jobs.tables import WorkerHeartbeat

    configure(tmp_path / "home")
    with session_scope() as session:
        heartbeat.beat(session, "a@host:1", ["cpu", "gpu"])
        heartbeat.beat(session, "b@host:2", ["cpu"])
        heartbeat.beat(session, "c@host:3", ["gpu"])
    with session_scope() as session:
        assert heartbeat.listening(session) == {"cpu": 2, "gpu": 2}
        stale = session.get(WorkerHeartbeat, "c@host:3")
        stale.seen_at = stale.seen_at - timedelta(seconds=heartbeat.FRESH_SECONDS + 1)  # three beats missed
        heartbeat.gone(session, "b@host:2")  # stopped: removed its row
    with session_scope() as session:
        assert heartbeat.listening(session) == {"cpu": 1, "gpu": 1}
        heartbeat.beat(session, "c@host:3", ["gpu"])  # beats again
    with session_scope() as session:
        assert heartbeat.listening(session) == {"cpu": 1, "gpu": 2}
    headers = {"authorization": f"Bearer {make_key(['metrics:read'])}"}
    with TestClient(create_app(run_background=True), headers=headers) as client:  # embedded: no workers reported
        body = client.get("/readyz").json()
        assert body["checks"] == {"database": "ok", "executor": "ok"} and "workers" not in body

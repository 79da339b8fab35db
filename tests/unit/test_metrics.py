"""Issue 23, metrics: HTTP requests by route template, job durations as a histogram of the jobs table, and the HTTP
metrics of several API processes summed in multiprocess mode."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from datetime import timedelta
from pathlib import Path

from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from app.db import session_scope, utcnow
from app.jobs.tables import JOB_KINDS, Job
from app.main import create_app
from app.ops.metrics import JOB_DURATION_BUCKETS
from tests.helpers import configure, make_key

ROOT = Path(__file__).resolve().parents[2]


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """Every sample of a scrape: (name, sorted labels) → value."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def http_count(scrape: dict, method: str, route: str, status: str) -> float:
    labels = tuple(sorted({"method": method, "route": route, "status": status}.items()))
    return scrape.get(("lethe_http_requests_total", labels), 0.0)


def scrape_metrics(client, key: str) -> str:
    """A Prometheus scrape: /metrics needs a key with ``metrics:read`` (issue 22, LOW)."""
    response = client.get("/metrics", headers={"authorization": f"Bearer {key}"})
    assert response.status_code == 200, response.text
    return response.text


def test_http_requests_are_counted_by_method_route_template_and_status(tmp_path):
    configure(tmp_path / "home")
    key = make_key(["metrics:read"])
    with TestClient(create_app(run_background=False)) as client:
        before = samples(scrape_metrics(client, key))
        client.get("/v1/models/m-1")  # no key: 401, under the route's template, never the raw path
        client.get("/v1/models/m-2")
        client.post("/v1/deletion-requests", json={})
        client.get("/no/such/path/12345")  # no route: one label for all of them
        client.request("BREW", "/healthz")  # a method nobody serves: "other"
        client.get("/healthz")
        after = samples(scrape_metrics(client, key))

    def delta(method, route, status):
        return http_count(after, method, route, status) - http_count(before, method, route, status)

    assert delta("GET", "/v1/models/{model_id}", "401") == 2
    assert delta("POST", "/v1/deletion-requests", "401") == 1
    assert delta("GET", "unmatched", "404") == 1
    assert delta("other", "/healthz", "405") == 1
    assert delta("GET", "/healthz", "200") == 1
    assert delta("GET", "/metrics", "200") == 1  # the scrape before
    assert not any("m-1" in str(labels) or "12345" in str(labels) for _, labels in after)  # no raw path anywhere
    count = ("lethe_http_request_duration_seconds_count", (("method", "GET"), ("route", "/healthz"), ("status", "200")))
    inf = (
        "lethe_http_request_duration_seconds_bucket",
        (("le", "+Inf"), ("method", "GET"), ("route", "/healthz"), ("status", "200")),
    )
    assert after[count] - before.get(count, 0.0) == 1 and after[inf] == after[count]


def _job(kind: str, status: str, seconds: float | None, now) -> Job:
    started = None if seconds is None else now - timedelta(seconds=seconds)
    return Job(kind=kind, model_id="m", status=status, started_at=started, finished_at=now)


def test_job_durations_are_a_cumulative_histogram_of_the_jobs_table(tmp_path):
    configure(tmp_path / "home")
    assert_job_metrics_from_the_table()  # on PostgreSQL: tests/integration/test_metrics_pg.py


def assert_job_metrics_from_the_table() -> None:
    """Succeeded jobs' durations in fixed buckets (a bound is inclusive), a count per terminal status; every kind
    named from the start; adding jobs only ever raises the counts (rate() needs that). On a configured, empty
    database."""
    now = utcnow()
    with session_scope() as session:
        session.add_all(
            [
                _job("deletion", "succeeded", 0.01, now),
                _job("deletion", "succeeded", 0.05, now),  # on a bound: counted under it
                _job("deletion", "succeeded", 3.0, now),
                _job("deletion", "succeeded", 7200.0, now),  # beyond the last bound: +Inf only
                _job("deletion", "failed", 1.0, now),  # failed: counted as finished, not in the histogram
                _job("deletion", "cancelled", None, now),  # cancelled before it started: no duration
                _job("deletion", "running", None, now),  # not finished: nowhere
                _job("train_model", "succeeded", 42.0, now),
            ]
        )
    key = make_key(["metrics:read"])
    with TestClient(create_app(run_background=False)) as client:
        first = samples(scrape_metrics(client, key))

        def bucket(scrape, kind, le):
            return scrape[("lethe_job_duration_seconds_bucket", (("kind", kind), ("le", le)))]

        les = ("0.05", "0.1", "2.5", "5.0", "3600.0", "+Inf")
        assert [bucket(first, "deletion", le) for le in les] == [2, 2, 2, 3, 3, 4]
        assert first[("lethe_job_duration_seconds_count", (("kind", "deletion"),))] == 4
        assert abs(first[("lethe_job_duration_seconds_sum", (("kind", "deletion"),))] - 7203.06) < 0.01
        assert bucket(first, "train_model", "30.0") == 0 and bucket(first, "train_model", "60.0") == 1
        assert bucket(first, "aggregate_round", "+Inf") == 0  # named before its first job
        finished = {
            (dict(labels)["kind"], dict(labels)["status"]): value
            for (name, labels), value in first.items()
            if name == "lethe_jobs_finished_total"
        }
        assert finished[("deletion", "succeeded")] == 4 and finished[("deletion", "failed")] == 1
        assert finished[("deletion", "cancelled")] == 1 and finished[("aggregate_round", "failed")] == 0
        assert set(finished) == {(k, s) for k in JOB_KINDS for s in ("succeeded", "failed", "cancelled")}
        les = {dict(labels)["le"] for name, labels in first if name == "lethe_job_duration_seconds_bucket"}
        assert len(les) == len(JOB_DURATION_BUCKETS) + 1

        with session_scope() as session:
            session.add(_job("deletion", "succeeded", 0.2, utcnow()))
        second = samples(scrape_metrics(client, key))
        grown = [k for k in first if k[0].startswith(("lethe_job_duration", "lethe_jobs_finished"))]
        assert all(second[k] >= first[k] for k in grown)
        assert bucket(second, "deletion", "0.25") == bucket(first, "deletion", "0.25") + 1


def test_the_job_kinds_named_in_the_metrics_are_those_the_hall_handles():
    from app.jobs.pipeline import HANDLERS

    assert {kind for kind, _ in HANDLERS} == set(JOB_KINDS)


_CHILD = """
import sys
from pathlib import Path
from fastapi.testclient import TestClient
from tests.helpers import configure, make_key

configure(Path(sys.argv[1]))
from app.main import create_app

with TestClient(create_app(run_background=False)) as client:
    for _ in range(int(sys.argv[2])):
        assert client.get("/healthz").status_code == 200
    if sys.argv[3] == "scrape":
        print(client.get("/metrics", headers={"authorization": f"Bearer {make_key(['metrics:read'])}"}).text)
"""


def test_api_processes_sharing_a_port_report_each_others_http_requests(tmp_path):
    """``lethe serve --workers N``: a scrape reaches one of the processes, which must count every process's
    requests (prometheus_client's multiprocess mode); a process that has exited still counts."""
    from app.cli import shared_metrics

    configure(tmp_path / "home")  # migrated here, once
    directory = tmp_path / "prometheus"
    directory.mkdir()
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(directory), "PYTHONPATH": str(ROOT)}

    def child(requests: int, action: str) -> str:
        return subprocess.run(
            [sys.executable, "-c", textwrap.dedent(_CHILD), str(tmp_path / "home"), str(requests), action],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        ).stdout

    child(3, "exit")
    scrape = samples(child(2, "scrape"))
    assert http_count(scrape, "GET", "/healthz", "200") == 5
    assert ("lethe_deletion_requests", (("status", "certified"),)) in scrape  # the database's metrics as well

    assert "PROMETHEUS_MULTIPROC_DIR" not in os.environ
    with shared_metrics(workers=1):
        assert "PROMETHEUS_MULTIPROC_DIR" not in os.environ  # one process: its own counters
    with shared_metrics(workers=2):
        made = Path(os.environ["PROMETHEUS_MULTIPROC_DIR"])
        assert made.is_dir() and not any(made.iterdir())
    assert "PROMETHEUS_MULTIPROC_DIR" not in os.environ and not made.exists()

"""Issue 23, metrics: HTTP requests by route template, and the HTTP metrics of several API processes summed in
multiprocess mode."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from app.main import create_app
from tests.helpers import configure

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


def test_http_requests_are_counted_by_method_route_template_and_status(tmp_path):
    configure(tmp_path / "home")
    with TestClient(create_app(run_background=False)) as client:
        before = samples(client.get("/metrics").text)
        client.get("/v1/models/m-1")  # no key: 401, under the route's template, never the raw path
        client.get("/v1/models/m-2")
        client.post("/v1/deletion-requests", json={})
        client.get("/no/such/path/12345")  # no route: one label for all of them
        client.request("BREW", "/healthz")  # a method nobody serves: "other"
        client.get("/healthz")
        after = samples(client.get("/metrics").text)

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


_CHILD = """
import sys
from pathlib import Path
from fastapi.testclient import TestClient
from tests.helpers import configure

configure(Path(sys.argv[1]))
from app.main import create_app

with TestClient(create_app(run_background=False)) as client:
    for _ in range(int(sys.argv[2])):
        assert client.get("/healthz").status_code == 200
    if sys.argv[3] == "scrape":
        print(client.get("/metrics").text)
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

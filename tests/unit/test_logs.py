"""Structured JSON logs with a request id (issue 12 item 7): each HTTP request's line is JSON and carries the id the
response's ``X-Request-ID`` header names; a sane incoming id is kept, anything else replaced; a job's lines carry the
job's and the deletion request's ids. SQL parameters and API keys never reach a line."""

from __future__ import annotations

import io
import json
import logging

import pytest
import structlog
from fastapi.testclient import TestClient

from app.logs import configure_logging
from app.main import create_app
from tests.helpers import configure, make_key


@pytest.fixture
def logged(tmp_path):
    """The API (no background executor) with its logs captured as text lines, at DEBUG (a success's access line is
    at DEBUG, so that at INFO the hot path writes nothing)."""
    configure(tmp_path)
    key = make_key()
    app = create_app(run_background=False)  # configures logging from the settings (INFO) ...
    stream = io.StringIO()
    configure_logging("DEBUG", stream=stream)  # ... so capture after it, before the first request builds the stack
    with TestClient(app) as client:
        client.headers["authorization"] = f"Bearer {key}"
        client.key = key
        client.lines = lambda: [json.loads(line) for line in stream.getvalue().splitlines() if line.strip()]
        yield client
    configure_logging("INFO")


def _access(lines: list[dict], request_id: str) -> dict:
    found = [line for line in lines if line.get("event") == "request" and line.get("request_id") == request_id]
    assert len(found) == 1, lines
    return found[0]


def test_a_request_logs_one_json_line_with_its_generated_request_id(logged):
    response = logged.get("/v1/deletion-requests", params={"model_id": "secret-looking-query"})
    assert response.status_code == 200
    request_id = response.headers["X-Request-ID"]
    assert len(request_id) == 32 and int(request_id, 16) >= 0  # generated: 32 hex digits
    line = _access(logged.lines(), request_id)
    assert line["method"] == "GET" and line["path"] == "/v1/deletion-requests" and line["status"] == 200
    assert line["level"] == "debug" and "timestamp" in line and line["duration_ms"] >= 0
    assert line["logger"] == "lethe.access"
    text = json.dumps([line for line in logged.lines() if not line.get("logger", "").startswith("httpx")])
    assert "secret-looking-query" not in text  # no query string (the test client's own httpx line has it)
    assert logged.key not in text  # no header, no API key


def test_a_sane_incoming_request_id_is_kept_and_a_bad_one_replaced(logged):
    kept = logged.get("/v1/deletion-requests", headers={"X-Request-ID": "edge-42.a:b"})
    assert kept.headers["X-Request-ID"] == "edge-42.a:b"
    _access(logged.lines(), "edge-42.a:b")
    for bad in ["has space", "x" * 200, 'quote"d', "-leading-dash", ""]:
        response = logged.get("/v1/deletion-requests", headers={"X-Request-ID": bad})
        assert response.headers["X-Request-ID"] != bad and len(response.headers["X-Request-ID"]) == 32


def test_problems_and_refusals_carry_the_request_id_too(logged):
    response = logged.post("/v1/deletion-requests", json={}, headers={"authorization": "Bearer lethe_x_y"})
    assert response.status_code == 401
    line = _access(logged.lines(), response.headers["X-Request-ID"])
    assert line["status"] == 401 and line["level"] == "info"


def test_at_info_a_success_writes_no_line(tmp_path):
    configure(tmp_path)
    key = make_key()
    app = create_app(run_background=False)
    stream = io.StringIO()
    configure_logging("INFO", stream=stream)
    with TestClient(app) as client:
        response = client.get("/v1/deletion-requests", headers={"authorization": f"Bearer {key}"})
        assert response.status_code == 200 and response.headers["X-Request-ID"]
        refused = client.get("/v1/deletion-requests")
        assert refused.status_code == 401
    configure_logging("INFO")
    lines = [json.loads(line) for line in stream.getvalue().splitlines() if line.strip()]
    access = [line for line in lines if line.get("logger") == "lethe.access"]
    assert [line["request_id"] for line in access] == [refused.headers["X-Request-ID"]]


def test_lines_from_the_standard_library_inside_a_request_are_json_with_its_id(logged):
    """Code that logs with ``logging.getLogger`` while a request is served gets the request id in its line."""

    seen = []

    @logged.app.get("/__log_probe")
    def probe():  # a plain def: FastAPI runs it in its thread pool (the context goes with it)
        logging.getLogger("lethe.probe").warning("probe %s", "here")
        seen.append(True)
        return {}

    response = logged.get("/__log_probe", headers={"X-Request-ID": "probe-1"})
    assert response.status_code == 200 and seen
    probe_lines = [line for line in logged.lines() if line.get("logger") == "lethe.probe"]
    assert probe_lines and probe_lines[0]["event"] == "probe here" and probe_lines[0]["request_id"] == "probe-1"
    assert probe_lines[0]["level"] == "warning"


def test_a_job_binds_its_ids_and_leaves_no_trace_after(tmp_path):
    """execute_job binds job_id (and, once claimed, the deletion request's id) for its lines only."""
    from app.jobs.pipeline import execute_job

    configure(tmp_path)
    stream = io.StringIO()
    configure_logging("DEBUG", stream=stream)  # the "not claimable" line is a debug line (issue 22)
    try:
        assert execute_job("no-such-job", "test-worker") == "skipped"
        lines = [json.loads(line) for line in stream.getvalue().splitlines() if line.strip()]
        skipped = [line for line in lines if "not claimable" in line.get("event", "")]
        assert skipped and skipped[0]["job_id"] == "no-such-job"
        assert "job_id" not in structlog.contextvars.get_contextvars()
    finally:
        configure_logging("INFO")


def test_sql_parameters_stay_hidden_in_logged_database_errors(tmp_path):
    from sqlalchemy import text

    from app.db import get_engine

    configure(tmp_path)
    stream = io.StringIO()
    configure_logging("INFO", stream=stream)
    secret = "-".join(["subject", "secret", "123"])  # not literally in this file: the traceback quotes source lines
    try:
        with get_engine().connect() as connection:
            try:
                connection.execute(text("SELECT * FROM no_such_table WHERE x = :v"), {"v": secret})
            except Exception:
                logging.getLogger("lethe.test").exception("database error")
        assert "database error" in stream.getvalue()
        assert "parameters hidden" in stream.getvalue() and secret not in stream.getvalue()
    finally:
        configure_logging("INFO")


def test_httpx_request_lines_stay_out_at_info():
    """The client's polls (httpx logs one INFO line per call) would bury a CLI's or the demo's output."""
    import io
    import logging

    from app.logs import configure_logging

    stream = io.StringIO()
    configure_logging("INFO", stream=stream)
    for name in ("httpx", "httpx2"):  # httpx2: Starlette's TestClient (the benchmarks' and tests' in-process client)
        logging.getLogger(name).info("HTTP Request: GET http://127.0.0.1/x")
        logging.getLogger(name).warning(f"a retry by {name}")
    out = stream.getvalue()
    assert "HTTP Request" not in out and "a retry by httpx" in out and "a retry by httpx2" in out

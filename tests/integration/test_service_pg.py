"""The service on PostgreSQL + Redis + a real Celery worker: intake errors, idempotency under concurrency, the
audit log's triggers and tamper detection, and a full deletion."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import psycopg
import pytest
from sqlalchemy import func, select, text

from app.db import session_scope
from app.requests.tables import DeletionRequest
from tests.helpers import make_key, wait_model, wait_request, write_table

PROBLEM = "application/problem+json"


@pytest.fixture(scope="module")
def model(stack, tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "table.csv"
    write_table(path, n=300)
    metadata = {"name": "it", "dataset": {"row_id_column": "row_id", "label_column": "label"}}
    with path.open("rb") as handle:
        response = stack.client.post(
            "/v1/models", data={"metadata": json.dumps(metadata)}, files={"file": ("table.csv", handle, "text/csv")}
        )
    assert response.status_code == 202, response.text
    model_id = response.json()["id"]
    body = wait_model(
        stack.client,
        model_id,
        timeout=120,
        what="version 1 trained by the Celery worker",
    )
    assert body["status"] == "ready", body
    return body


def _problem(response: httpx.Response, status: int, slug: str) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == PROBLEM
    body = response.json()
    assert body["type"] == f"https://lethe.dev/problems/{slug}", body
    assert body["status"] == status and "Traceback" not in response.text
    return body


def test_every_bad_input_gets_its_problem(stack, model):
    client, url = stack.client, "/v1/deletion-requests"
    ok_body = {"subject_ref": "s", "model_id": model["id"], "scope": {"kind": "samples", "sample_ids": ["r1"]}}

    _problem(
        client.post(url, content=b'{"subject_ref": ', headers={"content-type": "application/json"}),
        400,
        "malformed-json",
    )
    _problem(client.post(url, json={**ok_body, "model_id": "no-such-model"}), 404, "model-not-found")
    unknown = _problem(
        client.post(url, json={**ok_body, "scope": {"kind": "samples", "sample_ids": ["r1", "ghost-1", "ghost-2"]}}),
        422,
        "unknown-sample-ids",
    )
    assert unknown["unknown_sample_ids"] == ["ghost-1", "ghost-2"]
    _problem(
        client.post(url, json={**ok_body, "scope": {"kind": "client", "client_id": "c1"}}), 422, "scope-not-supported"
    )
    _problem(client.post(url, json={**ok_body, "scope": {"kind": "class", "label": "purple"}}), 422, "unknown-label")
    _problem(client.post(url, json={**ok_body, "method": "magic"}), 422, "unknown-method")
    _problem(client.post(url, json={**ok_body, "method": "l2ul"}), 409, "method-not-prepared")
    big = {**ok_body, "scope": {"kind": "samples", "sample_ids": [f"r{i}" for i in range(200_000)]}}
    _problem(client.post(url, json=big), 413, "payload-too-large")
    _problem(
        client.post(url, content=json.dumps(ok_body), headers={"content-type": "text/plain"}),
        415,
        "unsupported-media-type",
    )
    invalid = _problem(
        client.post(url, json={"model_id": model["id"], "scope": {"kind": "samples"}}), 422, "validation-error"
    )
    assert {tuple(e["location"][-1:]) for e in invalid["errors"]} >= {("subject_ref",), ("sample_ids",)}
    _problem(httpx.post(stack.base_url + url, json=ok_body), 401, "unauthorized")
    _problem(
        httpx.post(stack.base_url + url, json=ok_body, headers={"authorization": "Bearer lethe_x_y"}),
        401,
        "unauthorized",
    )
    reader = make_key(["requests:read"], name="reader")
    _problem(
        httpx.post(stack.base_url + url, json=ok_body, headers={"authorization": f"Bearer {reader}"}), 403, "forbidden"
    )
    _problem(client.get("/v1/deletion-requests/nope"), 404, "request-not-found")
    _problem(client.get("/v1/nowhere"), 404, "not-found")
    # model registration errors
    _problem(
        client.post(
            "/v1/models",
            json={"name": "x", "dataset": {"path": "/etc/passwd", "row_id_column": "a", "label_column": "b"}},
        ),
        422,
        "dataset-path-not-allowed",
    )
    _problem(
        client.post("/v1/models", content=b"x", headers={"content-type": "text/csv"}), 415, "unsupported-media-type"
    )


def test_twenty_concurrent_posts_with_one_key_make_one_request(stack, model):
    body = {"subject_ref": "carol", "model_id": model["id"], "scope": {"kind": "samples", "sample_ids": ["r5"]}}
    headers = {"Idempotency-Key": "same-key-20", "authorization": f"Bearer {stack.key}"}

    def post(_):
        return httpx.post(stack.base_url + "/v1/deletion-requests", json=body, headers=headers, timeout=60)

    with ThreadPoolExecutor(20) as pool:
        responses = list(pool.map(post, range(20)))
    assert {r.status_code for r in responses} == {202}
    assert len({r.json()["id"] for r in responses}) == 1
    with session_scope() as session:
        count = session.execute(
            select(func.count()).select_from(DeletionRequest).where(DeletionRequest.idempotency_key == "same-key-20")
        ).scalar_one()
    assert count == 1
    other = httpx.post(
        stack.base_url + "/v1/deletion-requests",
        headers=headers,
        json={**body, "scope": {"kind": "samples", "sample_ids": ["r6"]}},
    )
    _problem(other, 422, "idempotency-key-reused")
    request_id = responses[0].json()["id"]
    done = wait_request(stack.client, request_id, timeout=120)
    assert done["status"] == "certified", done
    versions = stack.client.get(f"/v1/models/{model['id']}/versions").json()
    assert sum(1 for v in versions if v["request_id"] == request_id) == 1


def test_audit_log_refuses_changes_and_names_a_tampered_row(stack, model, pg_url):
    verdict = stack.client.get("/v1/audit/verify").json()
    assert verdict["ok"], verdict
    dsn = pg_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(dsn, autocommit=True) as conn:
        for statement in (
            "UPDATE audit_events SET actor = 'mallory' WHERE seq = 2",
            "DELETE FROM audit_events WHERE seq = 2",
            "TRUNCATE audit_events",
        ):
            with pytest.raises(psycopg.errors.InsufficientPrivilege, match="append-only"):
                conn.execute(statement)
        # as the table owner, with the triggers switched off: the chain still tells
        (original,) = conn.execute("SELECT payload::text FROM audit_events WHERE seq = 3").fetchone()
        conn.execute("ALTER TABLE audit_events DISABLE TRIGGER USER")
        conn.execute("UPDATE audit_events SET payload = '{\"rewritten\": true}' WHERE seq = 3")
        conn.execute("ALTER TABLE audit_events ENABLE TRIGGER USER")
        try:
            verdict = stack.client.get("/v1/audit/verify").json()
        finally:  # the session's database is shared with later modules: leave the chain as it was found
            conn.execute("ALTER TABLE audit_events DISABLE TRIGGER USER")
            conn.execute("UPDATE audit_events SET payload = %s::jsonb WHERE seq = 3", (original,))
            conn.execute("ALTER TABLE audit_events ENABLE TRIGGER USER")
    assert verdict["ok"] is False
    assert verdict["first_broken_seq"] == 3
    assert "changed" in verdict["reason"]
    assert stack.client.get("/v1/audit/verify").json()["ok"] is True  # restored
    with session_scope() as session:
        assert session.execute(text("SELECT count(*) FROM audit_events")).scalar_one() >= 3

"""Issue 8 on PostgreSQL (what SQLite cannot show): a NUL byte or a bad number reaching the database inside a group
commit, JSONB rewriting numbers under the audit chain, column lengths, and revocation seen by another API process.

This module has its own database (the truncation test at the end cuts the audit log's tail) and its own API and
worker, with a longer intake batch window so that concurrent requests surely share a commit.
"""

from __future__ import annotations

import json
import os
import uuid

import httpx
import psycopg
import pytest
from sqlalchemy import update

from app.audit.service import append_event
from app.auth.tables import ApiKey
from app.db import session_scope, utcnow
from tests.helpers import configure, make_key, wait_for, write_table
from tests.integration.conftest import PG_ADMIN, Services

PROBLEM = "application/problem+json"
CHECKPOINT_EVERY = 5


@pytest.fixture(scope="module")
def own_pg_url():
    name = f"lethe_sec_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    base = PG_ADMIN.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://", 1)
    yield f"{base}/{name}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="module")
def stack(own_pg_url, redis_url, tmp_path_factory):
    home = tmp_path_factory.mktemp("lethe-sec")
    configure(
        home,
        database_url=own_pg_url,
        broker_url=redis_url,
        poll_seconds="0.2",
        lease_seconds="3",
        intake_batch_wait_ms="100",
        audit_checkpoint_every=str(CHECKPOINT_EVERY),
    )
    key = make_key()
    services = Services({**os.environ, "PYTHONUNBUFFERED": "1"}, home)
    services.start_api()
    services.worker = services.start_worker("sec")
    services.key = key
    services.home = home
    services.client = httpx.Client(base_url=services.base_url, headers={"authorization": f"Bearer {key}"}, timeout=60)
    yield services
    services.client.close()
    services.stop()


@pytest.fixture(scope="module")
def model(stack):
    path = stack.home / "table.csv"
    write_table(path, n=300)
    metadata = {"name": "sec", "dataset": {"row_id_column": "row_id", "label_column": "label"}}
    with path.open("rb") as handle:
        response = stack.client.post(
            "/v1/models", data={"metadata": json.dumps(metadata)}, files={"file": ("table.csv", handle, "text/csv")}
        )
    assert response.status_code == 202, response.text
    model_id = response.json()["id"]
    body = wait_for(
        lambda: (b := stack.client.get(f"/v1/models/{model_id}").json())["status"] != "registering" and b,
        timeout=120,
        what="version 1",
    )
    assert body["status"] == "ready", body
    return body


def _problem(response: httpx.Response, status: int, slug: str) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == PROBLEM
    body = response.json()
    assert body["type"] == f"https://lethe.dev/problems/{slug}", body
    return body


def test_item14_honest_numbers_survive_jsonb(stack):
    payload = {
        "big": 2.5e16,
        "negative_zero": -0.0,
        "long": 0.12345678901234567890,
        "tiny": 5e-324,
        "huge_int": 2**70,
        "exp": 1e-7,
        "nested": [1.0, 2.50, {"x": 1e300}],
    }
    with session_scope() as session:
        append_event(session, actor="test", action="numbers.recorded", entity_type="x", entity_id="n", payload=payload)
    verdict = stack.client.get("/v1/audit/verify").json()
    assert verdict["ok"], verdict


def test_item10_a_revoked_key_is_refused_at_once_by_another_api_process(stack, model):
    key = make_key(["requests:read"], name="revoke-me")
    auth = {"authorization": f"Bearer {key}"}
    assert httpx.get(stack.base_url + "/v1/deletion-requests", headers=auth).status_code == 200
    with session_scope() as session:  # what `lethe keys revoke` does, from another process
        session.execute(update(ApiKey).where(ApiKey.name == "revoke-me").values(revoked_at=utcnow()))
    _problem(httpx.get(stack.base_url + "/v1/deletion-requests", headers=auth), 401, "unauthorized")


def test_item14_zz_a_truncated_tail_is_named_by_its_checkpoint(stack, own_pg_url):
    """Last in the module: it cuts the audit log's tail (as the table owner, triggers disabled)."""
    for i in range(CHECKPOINT_EVERY + 2):
        with session_scope() as session:
            append_event(session, actor="test", action="filler", entity_type="x", entity_id=str(i))
    verdict = stack.client.get("/v1/audit/verify").json()
    assert verdict["ok"] and verdict["checkpoints"] >= 1, verdict
    last_checkpoint = verdict["last_checkpoint_seq"]
    dsn = own_pg_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(dsn, autocommit=True) as conn:
        with pytest.raises(psycopg.errors.InsufficientPrivilege, match="append-only"):
            conn.execute("DELETE FROM audit_checkpoints")
        conn.execute("ALTER TABLE audit_events DISABLE TRIGGER USER")
        conn.execute("DELETE FROM audit_events WHERE seq > %s", (last_checkpoint - 2,))
        conn.execute("ALTER TABLE audit_events ENABLE TRIGGER USER")
    verdict = stack.client.get("/v1/audit/verify").json()
    assert verdict["ok"] is False, verdict
    assert verdict["first_broken_seq"] == last_checkpoint - 1
    assert f"checkpoint {last_checkpoint}" in verdict["reason"] and "truncated" in verdict["reason"]

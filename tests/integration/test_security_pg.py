"""Issue 8 on PostgreSQL (what SQLite cannot show): a NUL byte or a bad number reaching the database inside a group
commit, JSONB rewriting numbers under the audit chain, column lengths, and revocation seen by another API process.

This module has its own database (the truncation test at the end cuts the audit log's tail) and its own API and
worker, with a longer intake batch window so that concurrent requests surely share a commit.
"""

from __future__ import annotations

import json
import os
import threading
import uuid
from concurrent.futures import Future

import httpx
import psycopg
import pytest
from sqlalchemy import select, update

from app.audit.service import append_event
from app.auth.service import hash_key, lookup_key
from app.auth.tables import ApiKey
from app.db import session_scope, utcnow
from app.requests.schemas import DeletionRequestCreate, SamplesScope
from tests.helpers import configure, make_key, wait_model, write_table
from tests.stack import PG_ADMIN, Services

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
    body = wait_model(
        stack.client,
        model_id,
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


def test_item13_one_poisoned_request_never_fails_thirty_others(stack, model):
    bodies = [
        {"subject_ref": f"s{i}", "model_id": model["id"], "scope": {"kind": "samples", "sample_ids": [f"r{10 + i}"]}}
        for i in range(30)
    ]
    poisoned = {"subject_ref": "p", "model_id": model["id"], "scope": {"kind": "samples", "sample_ids": ["r1\x00"]}}
    barrier = threading.Barrier(31)

    def post(body):
        barrier.wait()
        return httpx.post(stack.base_url + "/v1/deletion-requests", json=body, headers=stack.client.headers, timeout=60)

    results: list = [None] * 31
    threads = [
        threading.Thread(target=lambda i=i, b=b: results.__setitem__(i, post(b)))
        for i, b in enumerate([*bodies[:15], poisoned, *bodies[15:]])
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    statuses = [r.status_code for r in results]
    assert statuses.count(202) == 30 and statuses[15] == 422, [
        (s, r.text[:120]) for s, r in zip(statuses, results, strict=True)
    ]
    _problem(results[15], 422, "validation-error")


def test_item13_a_database_error_in_the_fast_path_falls_back_to_one_savepoint_per_request(stack, model):
    """A request that passes validation but fails in the database (here a NUL smuggled past the schema) shares a
    group commit with five good ones: the five are committed, it alone fails."""
    from app.requests.intake import IntakeBatcher
    from app.requests.tables import DeletionRequest

    principal = lookup_key(hash_key(stack.key))
    good = [
        DeletionRequestCreate.model_validate(
            {
                "subject_ref": f"g{i}",
                "model_id": model["id"],
                "scope": {"kind": "samples", "sample_ids": [f"r{50 + i}"]},
            }
        )
        for i in range(5)
    ]
    bad = DeletionRequestCreate.model_construct(
        subject_ref="b",
        model_id=model["id"],
        scope=SamplesScope(kind="samples", sample_ids=["r60"]),
        method="retrain",
        method_settings={"note": "a\x00b"},  # JSONB refuses \u0000: the INSERT fails inside the batch's commit
        callback_url=None,
    )
    batcher = IntakeBatcher(max_batch=16, wait_ms=300)
    try:
        futures: list[Future] = [batcher.submit(principal, body, f"fallback-{i}") for i, body in enumerate(good)]
        poisoned = batcher.submit(principal, bad, "fallback-bad")
        outcomes = [f.result(timeout=60) for f in futures]
        with pytest.raises(Exception, match="0000|NUL|nul"):
            poisoned.result(timeout=60)
    finally:
        batcher.stop()
    assert all(created for _, created in outcomes)
    with session_scope() as session:
        stored = session.execute(
            select(DeletionRequest.idempotency_key).where(DeletionRequest.idempotency_key.like("fallback-%"))
        ).scalars()
        assert sorted(stored) == [f"fallback-{i}" for i in range(5)]


def test_several_intake_threads_commit_every_request_once(stack, model):
    """``intake_threads`` > 1 (each thread its own connection and batches, the audit lock serialising the inserts):
    90 requests submitted at once, two pairs of them sharing an Idempotency-Key, are each stored once, every twin
    gets the same request back, the audit chain stays a line, and stop() ends every thread."""
    from app.requests.intake import IntakeBatcher
    from app.requests.tables import DeletionRequest

    principal = lookup_key(hash_key(stack.key))

    def body(i: int) -> DeletionRequestCreate:
        scope = {"kind": "samples", "sample_ids": [f"r{100 + i}"]}
        return DeletionRequestCreate.model_validate({"subject_ref": f"t{i}", "model_id": model["id"], "scope": scope})

    batcher = IntakeBatcher(max_batch=8, wait_ms=5, threads=3)
    try:
        futures = [batcher.submit(principal, body(i), f"threads-{i}") for i in range(90)]
        twins = [batcher.submit(principal, body(i), f"threads-{i}") for i in (3, 47)]
        outcomes = [f.result(timeout=60) for f in futures]
        twin_outcomes = [f.result(timeout=60) for f in twins]
    finally:
        batcher.stop()
    assert all(not t.is_alive() for t in batcher._threads)
    assert [out.id for out, _ in twin_outcomes] == [outcomes[3][0].id, outcomes[47][0].id]
    assert not any(created for _, created in twin_outcomes)
    with session_scope() as session:
        stored = session.execute(
            select(DeletionRequest.idempotency_key).where(DeletionRequest.idempotency_key.like("threads-%"))
        ).scalars()
        assert sorted(stored) == sorted(f"threads-{i}" for i in range(90))
    assert stack.client.get("/v1/audit/verify").json()["ok"] is True


def test_a_batch_finds_committed_twins_by_key_and_idempotency_key(stack, model):
    """The fast path's twin look-up (one index probe per (API key, Idempotency-Key) pair): a retry under the same
    key is answered with the committed request, and another API key using the same Idempotency-Key gets its own
    request, both in one batch, without the slow path (which would hide a look-up that finds nothing)."""
    from app.requests.intake import IntakeBatcher

    first, second = lookup_key(hash_key(stack.key)), lookup_key(hash_key(make_key(name="twin-b")))

    def body(row: int) -> DeletionRequestCreate:
        scope = {"kind": "samples", "sample_ids": [f"r{row}"]}
        return DeletionRequestCreate.model_validate({"subject_ref": "twin", "model_id": model["id"], "scope": scope})

    batcher = IntakeBatcher(max_batch=8, wait_ms=200)
    slow: list[int] = []
    one_by_one = batcher._one_by_one
    batcher._one_by_one = lambda batch: slow.append(len(batch)) or one_by_one(batch)
    try:
        original, created = batcher.submit(first, body(250), "twin-key").result(timeout=60)
        assert created
        retry = batcher.submit(first, body(250), "twin-key")
        other = batcher.submit(second, body(251), "twin-key")
        (replayed, replay_created), (own, own_created) = retry.result(timeout=60), other.result(timeout=60)
        # a batch of its own, the key not yet authenticated: its twin is found by the key's hash
        hashed, hashed_created = batcher.submit_key(hash_key(stack.key), body(250), "twin-key").result(timeout=60)
    finally:
        batcher.stop()
    assert replayed.id == original.id and not replay_created
    assert hashed.id == original.id and not hashed_created
    assert own.id != original.id and own_created
    assert slow == []


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


def test_item15_inputs_that_gave_a_500_on_postgresql_get_a_4xx(stack, model):
    client = stack.client
    _problem(client.get("/v1/deletion-requests/a%00b"), 422, "validation-error")
    _problem(client.get("/v1/models/a%00b/versions"), 422, "validation-error")
    _problem(client.get("/v1/deletion-requests", params={"model_id": "a\x00"}), 422, "validation-error")
    for path in ("/v1/deletion-requests/%ED%A0%80", "/v1/deletion-requests/%FF", "/v1/models/%C0%AF"):
        assert client.get(path).status_code in (400, 404), path
    body = {"subject_ref": "s", "model_id": model["id"], "scope": {"kind": "samples", "sample_ids": ["r2"]}}
    nan = json.dumps({**body, "method_settings": {"x": float("nan")}})
    assert (
        client.post("/v1/deletion-requests", content=nan, headers={"content-type": "application/json"}).status_code
        == 422
    )
    long_url = {**body, "callback_url": "https://example.com/" + "a" * 2100}
    _problem(client.post("/v1/deletion-requests", json=long_url), 422, "validation-error")
    table = stack.home / "t.csv"
    write_table(table, n=30)
    metadata = {"name": "m", "dataset": {"row_id_column": "row_id", "label_column": "label"}}
    response = client.post(
        "/v1/models",
        data={"metadata": json.dumps(metadata)},
        files={"file": ("x" * 300 + ".csv", table.read_bytes(), "text/csv")},
    )
    _problem(response, 422, "validation-error")
    # a server-side path whose name is longer than the column is stored by its last 200 characters
    long_name = stack.home / "data" / ("y" * 240 + ".csv")
    write_table(long_name, n=30)
    response = client.post(
        "/v1/models",
        json={"name": "m", "dataset": {"path": str(long_name), "row_id_column": "row_id", "label_column": "label"}},
    )
    assert response.status_code == 202, response.text


def test_item10_a_revoked_key_is_refused_at_once_by_another_api_process(stack, model):
    key = make_key(["requests:read"], name="revoke-me")
    auth = {"authorization": f"Bearer {key}"}
    assert httpx.get(stack.base_url + "/v1/deletion-requests", headers=auth).status_code == 200
    with session_scope() as session:  # what `lethe keys revoke` does, from another process
        session.execute(update(ApiKey).where(ApiKey.name == "revoke-me").values(revoked_at=utcnow()))
    _problem(httpx.get(stack.base_url + "/v1/deletion-requests", headers=auth), 401, "unauthorized")


def test_the_intake_commit_travels_with_its_last_statement(stack, own_pg_url):
    """``append_events(commit=True)`` (the intake batch): the events and the COMMIT go in one round trip, so the audit
    log's lock is released with it; another connection sees the events before ``session.commit()``, which then has
    nothing left to send, and the chain still verifies."""
    from app.audit.service import append_events
    from app.db import get_sessionmaker

    session = get_sessionmaker()()
    spec = {"actor": "test", "action": "commit.together", "entity_type": "x", "entity_id": "together-1"}
    try:
        append_events(session, [{**spec, "payload": {"n": 1}}, {**spec, "payload": {"n": 2}}], commit=True)
        with psycopg.connect(own_pg_url.replace("+psycopg", "")) as other:
            seen = other.execute("SELECT count(*) FROM audit_events WHERE entity_id = 'together-1'").fetchone()[0]
        session.commit()
    finally:
        session.close()
    assert seen == 2
    assert stack.client.get("/v1/audit/verify").json()["ok"] is True


def test_item14_zz_a_truncated_tail_is_named_by_its_checkpoint(tmp_path):
    """Last in the module (it points this process at another database): a quiet database of its own, so that no
    worker or dispatcher appends while the tail is cut (as the table owner, triggers disabled)."""
    from fastapi.testclient import TestClient

    from app.main import create_app

    name = f"lethe_sec_cut_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    base = PG_ADMIN.rsplit("/", 1)[0]
    try:
        configure(
            tmp_path,
            database_url=f"{base.replace('postgresql://', 'postgresql+psycopg://', 1)}/{name}",
            audit_checkpoint_every=str(CHECKPOINT_EVERY),
        )
        key = make_key(["audit:read"])
        for i in range(CHECKPOINT_EVERY + 2):
            with session_scope() as session:
                append_event(session, actor="test", action="filler", entity_type="x", entity_id=str(i))
        with TestClient(create_app(run_background=False)) as client:
            client.headers["authorization"] = f"Bearer {key}"
            verdict = client.get("/v1/audit/verify").json()
            assert verdict["ok"] and verdict["checkpoints"] == 1, verdict
            assert verdict["last_checkpoint_seq"] == CHECKPOINT_EVERY
            with psycopg.connect(f"{base}/{name}", autocommit=True) as conn:
                with pytest.raises(psycopg.errors.InsufficientPrivilege, match="append-only"):
                    conn.execute("DELETE FROM audit_checkpoints")
                conn.execute("ALTER TABLE audit_events DISABLE TRIGGER USER")
                conn.execute("DELETE FROM audit_events WHERE seq > %s", (CHECKPOINT_EVERY - 2,))
                conn.execute("ALTER TABLE audit_events ENABLE TRIGGER USER")
            verdict = client.get("/v1/audit/verify").json()
        assert verdict["ok"] is False, verdict
        assert verdict["first_broken_seq"] == CHECKPOINT_EVERY - 1
        assert f"checkpoint {CHECKPOINT_EVERY}" in verdict["reason"] and "truncated" in verdict["reason"]
    finally:
        from app.db import reset_engine_cache

        reset_engine_cache()
        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

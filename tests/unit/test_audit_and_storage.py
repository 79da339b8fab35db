"""The audit chain and the append-only triggers on SQLite; the content-addressed artifact store; the problem docs."""

from __future__ import annotations

import sqlite3

import pytest
from sqlalchemy import text

from app.audit.service import append_event, chain_head, verify_chain
from app.config import get_settings
from app.db import session_scope
from app.problems import Problem
from app.storage import ArtifactStore
from tests.helpers import configure


@pytest.fixture
def db(tmp_path):
    configure(tmp_path)
    return tmp_path / "lethe.db"


def _append(n: int) -> None:
    for i in range(n):
        with session_scope() as session:
            append_event(
                session,
                actor="t",
                action="x.happened",
                entity_type="x",
                entity_id=str(i),
                payload={"i": i, "nested": {"b": [1, 2], "a": "é"}},
            )


def test_chain_verifies_and_names_the_first_changed_row(db):
    _append(5)
    with session_scope() as session:
        verdict = verify_chain(session)
        assert verdict.ok and verdict.checked == 5 and verdict.head == chain_head(session)
    raw = sqlite3.connect(db)
    with pytest.raises(sqlite3.IntegrityError, match="append-only"):
        raw.execute("UPDATE audit_events SET actor = 'mallory' WHERE seq = 2")
    with pytest.raises(sqlite3.IntegrityError, match="append-only"):
        raw.execute("DELETE FROM audit_events WHERE seq = 4")
    # the table owner can drop the trigger; the chain still names the row
    raw.execute("DROP TRIGGER audit_events_no_update")
    raw.execute("UPDATE audit_events SET payload = json('{\"i\": 99}') WHERE seq = 3")
    raw.commit()
    with session_scope() as session:
        verdict = verify_chain(session)
    assert not verdict.ok and verdict.first_broken_seq == 3 and verdict.checked == 2


def test_chain_detects_a_removed_row(db):
    _append(4)
    raw = sqlite3.connect(db)
    raw.execute("DROP TRIGGER audit_events_no_delete")
    raw.execute("DELETE FROM audit_events WHERE seq = 2")
    raw.commit()
    with session_scope() as session:
        verdict = verify_chain(session)
    assert not verdict.ok and verdict.first_broken_seq == 2 and "missing" in verdict.reason


def test_appends_roll_back_with_their_transaction(db):
    _append(2)
    with pytest.raises(RuntimeError), session_scope() as session:
        append_event(session, actor="t", action="never", entity_type="x", entity_id="z")
        raise RuntimeError("the change this event records failed")
    with session_scope() as session:
        assert session.execute(text("SELECT count(*) FROM audit_events")).scalar_one() == 2
        assert verify_chain(session).ok


def test_store_is_content_addressed_and_checks_integrity(tmp_path):
    store = ArtifactStore(str(tmp_path / "a"))
    digest = store.put_bytes(b"hello")
    assert digest == "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824"
    assert store.put_bytes(b"hello") == digest and store.get_bytes(digest) == b"hello"
    path = store._path(digest)
    with open(path, "wb") as handle:
        handle.write(b"tampered")
    with pytest.raises(ValueError, match="corrupt"):
        store.get_bytes(digest)
    with pytest.raises(ValueError):
        store.get_bytes("../../etc/passwd")
    memory = ArtifactStore("memory://lethe-test")
    assert memory.get_json(memory.put_json({"b": 1, "a": [1]})) == {"a": [1], "b": 1}


def test_secret_is_generated_once_with_private_mode(tmp_path, monkeypatch):
    configure(tmp_path)
    monkeypatch.delenv("LETHE_SECRET_KEY")
    get_settings.cache_clear()
    first = get_settings().secret()
    assert first == get_settings().secret() and len(first) > 40
    assert (tmp_path / "secret.key").stat().st_mode & 0o777 == 0o600


def test_intake_drops_requests_whose_client_went_away(db):
    from concurrent.futures import Future

    from app.requests.intake import IntakeBatcher, _Item

    batcher = IntakeBatcher(max_batch=4, wait_ms=0)
    gone, here = Future(), Future()
    gone.cancel()
    items = [_Item(None, None, None, gone), _Item(None, None, None, here)]
    batcher._queue.put(items[1])
    batch = batcher._collect(items[0])
    assert batch == [items[1]] and here.running()  # taken: it can no longer be cancelled, so it will be answered


def test_a_request_the_database_cannot_take_is_answered_503_not_left_waiting(tmp_path):
    """Issue 22: with the database down, the batch's key look-up fails, the one-by-one fallback raised before staging
    anything, and the request's future was never completed (the POST hung, and held the API's shutdown). Every
    request now gets an answer: 503 intake-unavailable with Retry-After. The "database" is a closed loopback port."""
    from app.requests.intake import IntakeBatcher
    from app.requests.schemas import DeletionRequestCreate
    from tests.helpers import configure

    configure(tmp_path / "home")
    import os

    from app.config import get_settings
    from app.db import reset_engine_cache

    os.environ["LETHE_DATABASE_URL"] = "postgresql+psycopg://postgres@127.0.0.1:9/nowhere?connect_timeout=2"
    get_settings.cache_clear()
    reset_engine_cache()
    try:
        body = DeletionRequestCreate.model_validate(
            {"subject_ref": "s", "model_id": "m", "scope": {"kind": "samples", "sample_ids": ["r1"]}}
        )
        batcher = IntakeBatcher(max_batch=4, wait_ms=0)
        try:
            future = batcher.submit_key("0" * 64, body, "down-1")
            with pytest.raises(Problem) as raised:
                future.result(timeout=60)
        finally:
            batcher.stop()
        assert raised.value.status == 503 and raised.value.slug == "intake-unavailable"
        assert raised.value.headers["Retry-After"]
    finally:
        del os.environ["LETHE_DATABASE_URL"]
        get_settings.cache_clear()
        reset_engine_cache()

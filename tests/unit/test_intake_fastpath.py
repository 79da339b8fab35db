"""Issue 21's intake cuts, checked without timing anything: the fast path answers only what the full stack would
accept and hands everything else down byte for byte; a batch is cut when its burst is over; the audit event's text
assembled from its payload's text is the one ``event_body`` writes; rows go to the database as the JSON they were."""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from concurrent.futures import Future
from datetime import UTC, datetime

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import text

from app.audit.service import _event_text, canonical_json, event_body
from app.main import create_app
from app.ops import http as http_metrics
from app.requests import fastpath
from app.requests import router as requests_router
from app.requests.fastpath import PATH, IntakeFastPath
from app.requests.intake import ACTIVE_S, IntakeBatcher, _Item
from app.requests.schemas import DeletionRequestCreate
from tests.helpers import configure, make_key, wait_model, write_table

GOOD = {"subject_ref": "s", "model_id": "m", "scope": {"kind": "samples", "sample_ids": ["r1"]}}
JSON = [(b"content-type", b"application/json")]
KEY = [(b"authorization", b"Bearer k")]


def _scope(headers, query: bytes = b"") -> dict:
    return {"type": "http", "method": "POST", "path": PATH, "headers": headers, "query_string": query}


def _run(scope, chunks: list[bytes]):
    """Drive the fast path with ``chunks`` as the body; returns what it sent and what it passed down."""
    messages = [
        {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)
    ] or [{"type": "http.request", "body": b"", "more_body": False}]
    sent, down = [], {}

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    async def inner(scope, receive, send):  # the full stack: reads the body as the route would
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        down["body"] = body
        await send({"type": "http.response.start", "status": 299, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    asyncio.run(IntakeFastPath(inner)(scope, receive, send))
    return sent, down


class _NoBatcher:
    def submit_async(self, *args):
        raise AssertionError("a request the route would refuse reached the batcher")


@pytest.mark.parametrize(
    ("headers", "query", "chunks"),
    [
        (JSON, b"", [json.dumps(GOOD).encode()]),  # no key: 401 comes from the stack, before the body
        ([(b"content-type", b"text/plain"), *KEY], b"", [json.dumps(GOOD).encode()]),
        ([(b"content-type", b"application/merge+json"), *KEY], b"", [json.dumps(GOOD).encode()]),
        ([*JSON, *KEY], b"", [b'{"subject_ref": "s",']),  # malformed JSON
        ([*JSON, *KEY], b"", [json.dumps({**GOOD, "model_id": ""}).encode()]),  # schema
        ([*JSON, *KEY], b"", [json.dumps({**GOOD, "extra": 1}).encode()]),
        ([*JSON, *KEY, (b"idempotency-key", b"x" * 201)], b"", [json.dumps(GOOD).encode()]),
        ([*JSON, *KEY, (b"idempotency-key", b"a\x01b")], b"", [json.dumps(GOOD).encode()]),
        ([*JSON, *KEY, (b"authorization", b"Bearer other")], b"", [json.dumps(GOOD).encode()]),  # two keys
        ([*JSON, *KEY, (b"x-api-key", b"other")], b"", [json.dumps(GOOD).encode()]),
        ([*JSON, *KEY], b"a=%00", [json.dumps(GOOD).encode()]),  # a NUL in the query string
        ([*JSON, *KEY, (b"content-length", b"99999999")], b"", [json.dumps(GOOD).encode()]),
        ([*JSON, *KEY, (b"content-length", b"-1")], b"", [json.dumps(GOOD).encode()]),
        ([*JSON, *KEY], b"", [b"[" * 40_000, b"1" + b"]" * 40_000]),  # past max_body_bytes, in two chunks
        ([*JSON, *KEY], b"", [json.dumps({**GOOD, "method_settings": {"seed": 1}}).encode()]),  # not allowed
    ],
)
def test_what_the_route_would_refuse_goes_down_the_stack_byte_for_byte(tmp_path, monkeypatch, headers, query, chunks):
    configure(tmp_path, max_body_bytes="65536")
    monkeypatch.setattr(requests_router, "get_batcher", lambda: _NoBatcher())
    sent, down = _run(_scope(headers, query), chunks)
    assert down["body"] == b"".join(chunks)  # the stack reads the same bytes, in full
    assert [m.get("status") for m in sent if m["type"] == "http.response.start"] == [299]


def test_other_paths_and_methods_are_not_taken(tmp_path, monkeypatch):
    configure(tmp_path)
    monkeypatch.setattr(requests_router, "get_batcher", lambda: _NoBatcher())
    body = [json.dumps(GOOD).encode()]
    for scope in (
        {**_scope([*JSON, *KEY]), "path": PATH + "/"},
        {**_scope([*JSON, *KEY]), "method": "PUT"},
        {**_scope([*JSON, *KEY]), "path": "/v1/deletion-requests/x/cancel"},
    ):
        sent, down = _run(scope, body)
        assert down["body"] == body[0]


def test_an_accepted_request_is_answered_by_the_fast_path_with_the_routes_headers(tmp_path, monkeypatch):
    """End to end on the embedded default: 202 with Location, Retry-After and the request id; counted under the
    intake's route template; the batcher got the request from the fast path (not from the route)."""
    configure(tmp_path, poll_seconds="0.05")
    key = make_key()
    with TestClient(create_app(run_background=True)) as client:
        client.headers["authorization"] = f"Bearer {key}"
        metadata = {"name": "m", "dataset": {"row_id_column": "row_id", "label_column": "label"}}
        path = tmp_path / "data" / "t.csv"
        write_table(path, n=60)
        with path.open("rb") as handle:
            model_id = client.post(
                "/v1/models", data={"metadata": json.dumps(metadata)}, files={"file": ("t.csv", handle, "text/csv")}
            ).json()["id"]
        assert wait_model(client, model_id, timeout=60)["status"] == "ready"
        taken = []
        parse = fastpath._parse
        monkeypatch.setattr(fastpath, "_parse", lambda *a: taken.append(1) or parse(*a))
        observed = []
        observe = http_metrics._observe
        monkeypatch.setattr(http_metrics, "_observe", lambda *a: observed.append(a[:3]) or observe(*a))
        body = {**GOOD, "model_id": model_id, "method": "retrain"}
        response = client.post(PATH, json=body, headers={"Idempotency-Key": "fast-1", "X-Request-ID": "req-fast-1"})
        assert response.status_code == 202, response.text
        assert taken == [1]
        assert list(requests_router.get_batcher()._clients) == [("testclient", 50000)]  # the connection, for _collect
        out = response.json()
        assert response.headers["location"] == f"{PATH}/{out['id']}"
        assert int(response.headers["retry-after"]) > 0
        assert response.headers["x-request-id"] == "req-fast-1"
        assert response.headers["content-type"] == "application/json"
        assert client.get(response.headers["location"]).json()["id"] == out["id"]
        replay = client.post(PATH, json=body, headers={"Idempotency-Key": "fast-1"})
        assert replay.json()["id"] == out["id"]
        assert [o for o in observed if o[0] == "POST"] == [("POST", PATH, 202)] * 2  # under the route's template
        # refused by the batch (an unknown key), still answered by the fast path as problem+json
        refused = client.post(PATH, json=body, headers={"authorization": "Bearer nope"})
        assert refused.status_code == 401 and refused.headers["content-type"] == "application/problem+json"
        assert refused.json()["instance"] == PATH


def _item(n: int) -> _Item:
    body = DeletionRequestCreate.model_validate({**GOOD, "subject_ref": f"s{n}"})
    return _Item(None, body, None, Future(), "h")


def test_a_batch_is_cut_when_its_burst_is_over_not_at_the_end_of_the_window(tmp_path):
    configure(tmp_path)
    batcher = IntakeBatcher(max_batch=64, wait_ms=10_000, gap_ms=50)
    for n in range(1, 6):  # a burst: already queued when the batch starts
        batcher._queue.put(_item(n))
    late = _item(99)
    threading.Timer(1.0, batcher._queue.put, (late,)).start()  # long after the burst
    started = time.monotonic()
    batch = batcher._collect(_item(0))
    assert [item.body.subject_ref for item in batch] == [f"s{n}" for n in range(6)]
    assert time.monotonic() - started < 1.0  # the 10 s window was not waited out (nor the late request)
    time.sleep(1.2)
    assert batcher._collect(batcher._queue.get()) == [late]  # it starts the next batch


def test_a_batch_is_cut_once_every_sending_connection_is_in_it(tmp_path):
    """HTTP/1.1 carries one request at a time per connection: once the batch holds a request from every connection
    that has been sending, none is on its way, so the batch is cut then, not a gap (here 5 s) later. A connection
    quiet for longer than ``ACTIVE_S`` no longer counts; an address a proxy forwarded (port 0) counts for nothing."""
    configure(tmp_path)
    batcher = IntakeBatcher(max_batch=64, wait_ms=10_000, gap_ms=5_000)
    for port in (50001, 50002, 50003):
        batcher._note_client(("127.0.0.1", port), 100.0)
    for n in (1, 2):
        batcher._queue.put(_item(n))
    started = time.monotonic()
    assert len(batcher._collect(_item(0))) == 3
    assert time.monotonic() - started < 1.0
    batcher._note_client(("127.0.0.1", 50004), 100.0 + ACTIVE_S + 1)  # the first three went quiet
    assert batcher._active == 1
    started = time.monotonic()
    assert len(batcher._collect(_item(3))) == 1 and time.monotonic() - started < 1.0
    batcher._note_client(("127.0.0.1", 50005), 100.0 + ACTIVE_S + 1)
    late = _item(5)
    threading.Timer(0.3, batcher._queue.put, (late,)).start()
    assert [item.body.subject_ref for item in batcher._collect(_item(4))] == ["s4", "s5"]  # waited for the other

    queued: list = []
    batcher._start, batcher._enqueue = (lambda: None), queued.append

    async def forwarded():
        batcher.submit_async("h", _item(6).body, None, ("203.0.113.9", 0))

    asyncio.run(forwarded())
    assert len(queued) == 1 and batcher._active == 2  # unchanged


def test_a_batch_is_never_longer_than_its_window_nor_its_size(tmp_path):
    configure(tmp_path)
    batcher = IntakeBatcher(max_batch=3, wait_ms=10_000, gap_ms=10_000)
    for n in range(1, 6):
        batcher._queue.put(_item(n))
    assert len(batcher._collect(_item(0))) == 3
    short = IntakeBatcher(max_batch=64, wait_ms=200, gap_ms=10_000)
    stop = threading.Event()

    def trickle():  # a request every 20 ms, for ever: only the window ends the batch
        while not stop.wait(0.02):
            short._queue.put(_item(7))

    threading.Thread(target=trickle, daemon=True).start()
    try:
        started = time.monotonic()
        short._collect(_item(0))
        assert time.monotonic() - started < 5.0
    finally:
        stop.set()


@pytest.mark.parametrize(
    "payload",
    [
        {},
        {"model_id": "m", "scope": {"kind": "samples", "n_samples": 3}, "method": "auto", "job_id": None},
        {"quote": 'a"b\\c', "unicode": "é漢字😀", "control": "\u0001\n\t", "nan": math.nan, "inf": -math.inf},
        {"nested": [1, 2.5, {"z": 1e300, "a": [True, None]}], "big": 2**70, "neg0": -0.0, "tiny": 5e-324},
    ],
)
def test_the_event_text_from_the_payload_text_is_event_body(payload):
    at = datetime(2026, 12, 5, 17, 0, 0, 123456, tzinfo=UTC)
    for actor, action, entity in (("key:abc", "deletion_request.received", "r-1"), ('é"\\', "x.y", "😀")):
        expected = event_body(42, at, actor, action, "deletion_request", entity, json.loads(canonical_json(payload)))
        assert _event_text(42, at, actor, action, "deletion_request", entity, canonical_json(payload)) == expected


def test_rows_go_to_the_database_as_json_and_a_naive_datetime_is_refused():
    from app.audit.tables import AuditEvent
    from app.db import _rows_json

    events = AuditEvent.__table__
    when = datetime(2026, 12, 5, 17, 0, 0, 5, tzinfo=UTC)
    rows = [{"seq": 2**40, "at": when, "x": 0.1, "actor": 'q"\u0000', "payload": {"k": [1, None]}, "hash": None}]
    decoded = json.loads(_rows_json(events, rows))
    assert datetime.fromisoformat(decoded[0]["at"].replace("Z", "+00:00")) == when
    assert decoded[0] | {"at": None} == rows[0] | {"at": None}
    with pytest.raises(ValueError, match="naive datetime in audit_events.at"):
        _rows_json(events, [*rows, {**rows[0], "at": datetime(2026, 1, 1)}])
    with pytest.raises(TypeError):
        _rows_json(events, [{"payload": object()}])


class _Stalled(IntakeBatcher):
    """A batcher whose batches never come: every request waits until its deadline."""

    def __init__(self):
        super().__init__()
        self.queued: list[_Item] = []

    def _enqueue(self, item: _Item) -> None:
        self.queued.append(item)


def test_a_request_past_the_intake_timeout_is_refused_and_never_made_durable(tmp_path):
    """The intake's deadline is one sweep per event loop, not a timer per request: a request no batch took within
    ``intake_timeout_seconds`` raises TimeoutError soon after it (the route's 503), and is cancelled, so a batch that
    reaches it later drops it; an answered request leaves the sweep's book at the next sweep (the book holds a
    quarter-second of requests, not the timeout's worth), and the book is gone once nothing waits."""
    configure(tmp_path, intake_timeout_seconds="1.0")
    batcher = _Stalled()
    body = DeletionRequestCreate.model_validate(GOOD)

    async def scenario():
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        batcher.submit_async("h", body, None).set_result(("out", True))  # a batch answered this one at once
        waiting = batcher.submit_async("h", body, "k")
        await asyncio.sleep(0.4)
        booked = len(batcher._deadlines[loop])
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(waiting, 5)  # 5 s: fail, don't hang
        took = time.monotonic() - started
        await asyncio.sleep(0.3)
        return booked, took, loop in batcher._deadlines

    try:
        booked, took, still_booked = asyncio.run(scenario())
    finally:
        batcher.stop()
    assert booked == 1  # the answered one was dropped by the first sweep
    assert 1.0 <= took < 1.0 + 0.25 + 0.5  # the deadline, one sweep interval late at most, and slack
    late = batcher.queued[1]
    assert late.future.cancelled() and not late.future.set_running_or_notify_cancel()  # a batch would drop it
    assert not still_booked


def test_the_route_answers_503_when_the_intake_times_out(tmp_path, monkeypatch):
    configure(tmp_path, intake_timeout_seconds="0.2")
    batcher = _Stalled()
    monkeypatch.setattr(requests_router, "get_batcher", lambda: batcher)
    try:
        with TestClient(create_app(run_background=False)) as client:
            answer = client.post("/v1/deletion-requests", headers={"authorization": "Bearer k"}, json=GOOD)
    finally:
        batcher.stop()
    assert answer.status_code == 503, answer.text
    assert answer.json()["type"].endswith("intake-unavailable")
    assert int(answer.headers["Retry-After"]) > 0
    assert len(batcher.queued) == 1 and batcher.queued[0].future.cancelled()


def test_the_batch_lookup_probes_the_rows_index_whatever_the_plan(tmp_path):
    """The intake's one look-up statement (``_LOOKUPS``) must probe ``dataset_rows``' unique index per wanted row, also
    as the generic plan a prepared statement ends on: flattened into a join, the planner scanned every row of the
    table per batch (it did, here, before the ``LIMIT 1``)."""
    import psycopg

    from app.requests.intake import _LOOKUPS
    from tests.stack import fresh_database

    with fresh_database("lethe_lookups") as url:
        configure(tmp_path, database_url=url)
        with psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://", 1)) as conn:
            conn.execute(
                "INSERT INTO datasets (id, name, format, digest, row_id_column, label_column, columns, created_at) "
                "VALUES ('d', 'd', 'csv', 'x', 'row_id', 'label', '[]', now())"
            )
            conn.execute(
                "INSERT INTO dataset_rows (dataset_id, row_id, position, label) "
                "SELECT 'd', 'r' || i, i, '0' FROM generate_series(1, 20000) AS i"
            )
            conn.execute("ANALYZE dataset_rows")
            conn.execute("SET plan_cache_mode = force_generic_plan")
            wanted = {"keys": "[]", "twins": "[]", "rows": json.dumps([{"dataset_id": "d", "row_id": "r7"}])}
            sql = _LOOKUPS.replace("%(keys)s", "$1").replace("%(twins)s", "$2").replace("%(rows)s", "$3")
            conn.execute(f"PREPARE lookups (text, text, text) AS {sql}")
            explain = psycopg.ClientCursor(conn)  # EXPLAIN takes no bound parameters: the values are inlined
            explain.execute("EXPLAIN (FORMAT JSON) EXECUTE lookups (%s, %s, %s)", list(wanted.values()))
            ((plan,),) = explain.fetchall()
            found = conn.execute(_LOOKUPS, wanted).fetchall()

    def nodes(node):
        yield node
        for child in node.get("Plans", []):
            yield from nodes(child)

    on_rows = [n["Node Type"] for n in nodes(plan[0]["Plan"]) if n.get("Relation Name") == "dataset_rows"]
    assert on_rows and "Seq Scan" not in on_rows, on_rows
    assert [(part, a, b, h) for part, a, b, *_, h in found] == [(2, "d", "r7", 7)]


def test_appenders_in_parallel_each_read_the_head_after_the_lock(tmp_path):
    """The intake batch inserts its rows, takes the audit log's lock and reads the chain's head in ONE statement
    (``lethe_audit_lock_head``, migration 0016). The head must be read with a snapshot taken after the lock is held:
    read with the statement's own snapshot (taken before the lock), two appenders racing would both extend the same
    head (a duplicate position, the batch failed). Four threads appending at once: every position once, in order,
    the rows inserted with them all there, the chain verifying."""
    from app.audit.service import append_events, verify_chain
    from app.auth.tables import ApiKey
    from app.db import session_scope, utcnow
    from tests.stack import fresh_database

    spec = {"actor": "test", "action": "race", "entity_type": "x", "entity_id": "e"}
    errors: list[BaseException] = []

    def appender(t: int) -> None:
        try:
            for i in range(25):
                with session_scope() as session:
                    row = {"id": f"k{t}-{i}", "name": "n", "prefix": "p", "key_hash": f"h{t}-{i}", "scopes": []}
                    row["created_at"] = utcnow()
                    append_events(session, [spec] * 3, together_with=[(ApiKey.__table__, [row])], commit=True)
        except BaseException as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)

    with fresh_database("lethe_lock_head") as url:
        configure(tmp_path, database_url=url)
        threads = [threading.Thread(target=appender, args=(t,)) for t in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        with session_scope() as session:
            verdict = verify_chain(session)  # first: it reads the log in a snapshot of its own
        with session_scope() as session:
            seqs = [seq for (seq,) in session.execute(text("SELECT seq FROM audit_events ORDER BY seq"))]
            keys = session.execute(text("SELECT count(*) FROM api_keys")).scalar()
        from app.db import reset_engine_cache

        reset_engine_cache()
    assert not errors, errors[:2]
    assert seqs == list(range(1, 4 * 25 * 3 + 1)) and keys == 4 * 25
    assert verdict.ok


def test_ids_are_time_ordered_uuid7_shown_by_their_random_end_and_a_forked_child_does_not_repeat_its_parents():
    """``new_id`` makes version-7 UUIDs (their first 48 bits the clock's milliseconds: index inserts land on the
    rightmost pages) from a per-thread pool of random bytes (one system call per 256 ids), written as ``str(UUID)``
    would; none repeats; ids made later sort later; what the CLI and the dashboard show of them (``short_id``, their
    last 8 characters) differs between ids made in the same millisecond; and a forked child (Celery's prefork workers)
    empties its copy of the pool, or it would hand out the very random bytes its parent is about to."""
    import os
    import time
    import uuid

    from app.ids import new_id, short_id

    before = time.time_ns() // 1_000_000
    ids = [new_id() for _ in range(1000)]
    after = time.time_ns() // 1_000_000
    assert len(set(ids)) == 1000
    assert len({short_id(i) for i in ids[:100]}) == 100  # what is shown: random (a collision: ~1 in a million)
    for text_id in ids:
        parsed = uuid.UUID(text_id)
        assert parsed.version == 7 and parsed.variant == uuid.RFC_4122 and str(parsed) == text_id
        assert before <= parsed.int >> 80 <= after
    time.sleep(0.002)
    assert all(i < new_id() for i in ids)  # a later millisecond sorts after
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next id, to the parent
        os.write(write, new_id().encode())
        os._exit(0)
    os.waitpid(pid, 0)
    os.close(write)
    childs = os.read(read, 64).decode()
    os.close(read)
    assert childs and short_id(childs) != short_id(new_id())


def test_hmac_hex_is_hmac_sha256():
    """``hmac_hex`` copies a cached keyed state instead of keying anew: still HMAC-SHA256, the same for every caller
    (RFC 4231 test case 2, and the same state reused for a second message)."""
    from app.config import hmac_hex

    assert hmac_hex(b"Jefe", "what do ya want for nothing?") == (
        "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
    )
    assert hmac_hex(b"Jefe", "what do ya want for nothing?") == hmac_hex(b"Jefe", "what do ya want for nothing?")

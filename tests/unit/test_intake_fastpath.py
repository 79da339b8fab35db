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

from app.audit.service import _event_text, canonical_json, event_body
from app.main import create_app
from app.ops import http as http_metrics
from app.requests import fastpath
from app.requests import router as requests_router
from app.requests.fastpath import PATH, IntakeFastPath
from app.requests.intake import IntakeBatcher, _Item
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

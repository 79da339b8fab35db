"""app/client.py: the problem document of an answer, and one made up for an answer that is not problem+json (a
proxy's 502 page); retries (503, 429, Retry-After, refused connections; only calls safe to repeat) against a scripted
loopback server; the made-up Idempotency-Key deduplicated by the real service after a lost answer; the operator's
actions (model settings, bulk actions, per-person erasure). The service runs embedded on 127.0.0.1. More of the
client against a real service: tests/unit/test_cli.py, tests/model_listing.py (SQLite and PostgreSQL),
tests/integration/test_ease_service.py (the federation)."""

from __future__ import annotations

import hashlib
import json
import socket
import threading
import time
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import httpx
import numpy as np
import pytest
import uvicorn

from app.certificates.verify_cli import verify_file
from app.client import (
    BulkOutcome,
    BulkResult,
    DeletionRequest,
    Erasure,
    ErasureChild,
    ExportedVersion,
    LetheClient,
    LetheProblem,
    Model,
    Prediction,
    RetryNotice,
    SubjectRequests,
    retry_after_seconds,
)
from app.jobs.tabular import holdout_mask
from app.main import create_app
from app.requests.intake import MODEL_TTL
from tests.helpers import configure, make_key, wait_for, write_table
from tests.unit.scripted_server import ScriptedServer, json_answer, problem


def test_a_problem_document_keeps_its_fields_and_extensions():
    response = httpx.Response(
        422,
        json={
            "type": "https://lethe.dev/problems/unknown-sample-ids",
            "title": "Some sample ids are not in the data set",
            "status": 422,
            "detail": "1 unknown",
            "instance": "/v1/deletion-requests",
            "unknown_sample_ids": ["P9999"],
        },
        headers={"content-type": "application/problem+json"},
    )
    problem = LetheProblem.from_response(response)
    assert (problem.status, problem.slug, problem.detail) == (422, "unknown-sample-ids", "1 unknown")
    assert problem.instance == "/v1/deletion-requests" and problem.extensions == {"unknown_sample_ids": ["P9999"]}
    assert str(problem) == "422 unknown-sample-ids: 1 unknown"


def test_an_answer_that_is_not_a_problem_still_raises_a_typed_problem():
    problem = LetheProblem.from_response(httpx.Response(502, text="<html>Bad gateway</html>"))
    assert problem.status == 502 and problem.type == "about:blank" and "Bad gateway" in problem.detail


def test_models_accept_fields_a_newer_server_adds():
    body = {
        "id": "r", "model_id": "m", "subject_hash": "h", "scope": {}, "method": "retrain", "status": "certified",
        "created_at": "2026-01-01T00:00:00Z", "updated_at": "2026-01-01T00:00:00Z", "something_new": 1,
    }  # fmt: skip
    request = DeletionRequest.model_validate(body)
    assert request.done and request.model_extra == {"something_new": 1}


# ---------------------------------------------------------------------------------------------------- retries
# Against a scripted server on 127.0.0.1 (tests/unit/scripted_server.py): what the client does when the API answers
# 503 or 429, says Retry-After, or cannot be reached.

REQUEST = {
    "id": "r1", "model_id": "m1", "subject_hash": "h", "scope": {}, "method": "retrain", "status": "running",
    "progress": 0.5, "created_at": "2026-01-01T00:00:00Z", "updated_at": "2026-01-01T00:00:00Z",
}  # fmt: skip


def _sequence(*answers):
    """Answer the n-th call with the n-th answer (the last one repeats)."""
    return lambda arrival, index: answers[min(index, len(answers) - 1)]


def test_a_get_answered_503_is_retried_after_the_retry_after_it_was_given():
    notices: list[RetryNotice] = []
    answers = _sequence(problem(503, "unavailable", **{"Retry-After": "1"}), json_answer(200, REQUEST))
    with ScriptedServer(answers) as server, LetheClient(server.url, "k", backoff=0.01, on_retry=notices.append) as c:
        request = c.get_deletion("r1")
    assert request.status == "running" and len(server.arrivals) == 2
    gap = server.arrivals[1].at - server.arrivals[0].at
    assert gap >= 0.95, gap  # Retry-After: 1, although its own backoff would have waited 0.01 s
    assert [(n.attempt, n.delay, n.reason) for n in notices] == [(1, 1.0, "503 unavailable")]


def test_a_retry_after_given_as_an_http_date_is_honoured_too():
    assert retry_after_seconds("7") == 7.0
    assert retry_after_seconds("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0  # in the past: at once
    later = datetime.now(UTC) + timedelta(seconds=30)
    assert 28 <= retry_after_seconds(format_datetime(later, usegmt=True)) <= 30
    assert retry_after_seconds("soon") is None and retry_after_seconds(None) is None


def test_429_and_connection_errors_back_off_and_a_retry_after_too_long_is_not_waited():
    answers = _sequence(problem(429, "too-many"), problem(429, "too-many"), json_answer(200, REQUEST))
    with ScriptedServer(answers) as server, LetheClient(server.url, "k", backoff=0.2) as client:
        assert client.get_deletion("r1").status == "running"
    first, second, third = (a.at for a in server.arrivals)
    assert second - first >= 0.1 and third - second >= 0.2  # equal jitter: at least half of 0.2, then of 0.4

    longer = _sequence(problem(503, "unavailable", **{"Retry-After": "120"}), json_answer(200, REQUEST))
    with ScriptedServer(longer) as server, LetheClient(server.url, "k", max_backoff=5) as client:
        started = time.monotonic()
        with pytest.raises(LetheProblem) as raised:
            client.get_deletion("r1")
    assert raised.value.status == 503 and len(server.arrivals) == 1 and time.monotonic() - started < 2

    always = _sequence(problem(503, "unavailable"))
    with ScriptedServer(always) as server, LetheClient(server.url, "k", retries=2, backoff=0.01) as client:
        pytest.raises(LetheProblem, client.get_deletion, "r1")
    assert len(server.arrivals) == 3  # the first try and two retries, then the problem


def test_a_post_without_an_idempotency_key_is_not_retried_after_a_503_but_is_after_a_429():
    """A 503 may follow work that still commits: only a call that is safe to repeat goes again. A 429 was refused
    before any work."""
    unavailable = _sequence(problem(503, "unavailable"), json_answer(200, REQUEST))
    with ScriptedServer(unavailable) as server, LetheClient(server.url, "k", backoff=0.01) as client:
        pytest.raises(LetheProblem, client.cancel, "r1")
    assert [a.method for a in server.arrivals] == ["POST"]
    refused = _sequence(problem(429, "too-many"), json_answer(200, REQUEST))
    with ScriptedServer(refused) as server, LetheClient(server.url, "k", backoff=0.01) as client:
        assert client.cancel("r1").id == "r1"
    assert len(server.arrivals) == 2


def test_a_refused_connection_is_retried_until_the_api_listens():
    """Nothing was sent: even a POST goes again (here: the API starts 0.5 s after the first try)."""
    with ScriptedServer(_sequence(json_answer(200, REQUEST))) as probe:
        port = probe.port
    server = ScriptedServer(_sequence(json_answer(200, REQUEST)), port=port)
    starter = threading.Timer(0.5, server.start)
    starter.start()
    notices: list[RetryNotice] = []
    try:
        with LetheClient(f"http://127.0.0.1:{port}", "k", backoff=0.2, on_retry=notices.append) as client:
            assert client.cancel("r1").id == "r1"
    finally:
        starter.join()
        server.stop()
    assert notices and all(n.reason.startswith("cannot connect") for n in notices)
    with LetheClient(f"http://127.0.0.1:{port}", "k", retries=1, backoff=0.01) as client:  # nobody listens now
        pytest.raises(httpx.ConnectError, client.get_deletion, "r1")


def test_wait_rides_out_an_outage_after_its_first_answer_but_not_before():
    certified = REQUEST | {"status": "certified", "progress": 1.0}
    running, gone = json_answer(200, REQUEST), problem(503, "unavailable")
    answers = _sequence(running, problem(503, "unavailable", **{"Retry-After": "0"}), gone, running,
                        json_answer(200, certified))  # fmt: skip
    outages: list[tuple[str, float]] = []
    seen: list[str] = []
    with ScriptedServer(answers) as server, LetheClient(server.url, "k", retries=0) as client:
        done = client.wait("r1", interval=0.01, on_progress=lambda r: seen.append(r.status),
                           on_reconnect=lambda exc, delay: outages.append((str(exc), delay)))  # fmt: skip
    assert done.status == "certified" and len(outages) == 2
    assert outages[0][1] == 0.0  # its Retry-After
    assert seen == ["running", "running", "certified"]  # the first answer after the outage is shown, unchanged
    with ScriptedServer(_sequence(gone)) as server, LetheClient(server.url, "k", retries=0) as client:
        pytest.raises(LetheProblem, client.wait, "r1", interval=0.01)  # never answered: the caller hears at once


def test_a_prediction_is_repeated_after_a_503_like_a_get_it_changes_nothing():
    answer = {"model_id": "m1", "version": {"id": "v", "number": 2, "digest": "d"}, "classes": ["no", "yes"],
              "labels": ["yes"], "probabilities": [[0.25, 0.75]]}  # fmt: skip
    answers = _sequence(problem(503, "unavailable", **{"Retry-After": "0"}), json_answer(200, answer))
    with ScriptedServer(answers) as server, LetheClient(server.url, "k", backoff=0.01) as client:
        prediction = client.predict("m1", [{"x": 1.0}])
    assert isinstance(prediction, Prediction) and prediction.labels == ["yes"] and len(server.arrivals) == 2


# ------------------------------------------------------------------------------------------ against the service
# The embedded service (SQLite, in-process executor) in a uvicorn thread on 127.0.0.1.

SCOPES = ["models:write", "models:read", "requests:write", "requests:read", "audit:read", "admin"]
ALICE = "alice.client-test@example.org"  # three of the trained rows are hers


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    home = tmp_path_factory.mktemp("client")
    configure(home, poll_seconds="0.05")
    key = make_key(SCOPES, name="client-admin")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(run_background=True), host="127.0.0.1", port=port,
                                           log_level="warning"))  # fmt: skip
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, timeout=30, what="uvicorn")
    url = f"http://127.0.0.1:{port}"
    source = home / "data" / "people.csv"
    frame = write_table(source, n=160, seed=11)
    frame["person"] = [f"other-{i % 23}" for i in range(len(frame))]
    trained = [i for i, held in enumerate(holdout_mask(len(frame), 0.2, seed=0)) if not held]
    frame.loc[trained[:3], "person"] = ALICE
    frame.to_csv(source, index=False)
    client = LetheClient(url, key)
    dataset = {"row_id_column": "row_id", "label_column": "label", "subject_column": "person"}
    metadata = {"name": "client-people", "verification": {"shadows": 8}, "dataset": dataset}
    model = client.wait_model(client.register_model(metadata, source).id, timeout=120)
    assert model.status == "ready", model
    rows = iter(f"r{i}" for i in trained[3:])
    try:
        yield {"url": url, "key": key, "model": model, "client": client, "rows": rows}
    finally:
        client.close()
        server.should_exit = True
        thread.join(timeout=15)


class LoseTheFirstAnswer(httpx.HTTPTransport):
    """Sends every call to the service, but loses the answer to the first POST (read, then a ReadError): the
    service acted on it, the client does not know."""

    def __init__(self):
        super().__init__()
        self.keys: list[str | None] = []
        self.lost: list[dict] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = super().handle_request(request)
        if request.method == "POST":
            self.keys.append(request.headers.get("idempotency-key"))
            if len(self.keys) == 1:
                self.lost.append(json.loads(response.read()))
                response.close()
                raise httpx.ReadError("the answer was lost on the way", request=request)
        return response


def test_a_submission_whose_answer_was_lost_is_retried_with_the_same_made_up_key_and_deduplicated(api):
    transport = LoseTheFirstAnswer()
    model = api["model"]
    with LetheClient(api["url"], api["key"], transport=transport, backoff=0.01) as client:
        request = client.submit_deletion(model.id, {"kind": "samples", "sample_ids": [next(api["rows"])]}, "idem")
        other = client.submit_deletion(model.id, {"kind": "samples", "sample_ids": [next(api["rows"])]}, "idem-2")
    first, retry, second = transport.keys
    assert first == retry and first.startswith("lethe-client-")  # made up once, sent on both tries
    assert second != first  # another call, another key
    assert request.id == transport.lost[0]["id"]  # the service answered the retry with the request it had made
    mine = [r for r in api["client"].iter_deletions(model_id=model.id) if r.subject_hash == request.subject_hash]
    assert [r.id for r in mine] == [request.id]  # one request, not two
    assert other.id != request.id
    api["client"].wait(request.id, timeout=120)
    api["client"].wait(other.id, timeout=120)


def test_model_settings_and_bulk_actions_return_typed_answers(api):
    client: LetheClient = api["client"]
    model_id = api["model"].id
    changed = client.update_model(model_id, requires_approval=True, tags=["team:privacy"],
                                  batch={"max_requests": 3, "max_rows": 50})  # fmt: skip
    assert isinstance(changed, Model) and changed.requires_approval and changed.tags == ["team:privacy"]
    assert changed.batch == {"max_requests": 3, "max_rows": 50}
    with pytest.raises(ValueError):
        client.update_model(model_id)
    time.sleep(MODEL_TTL + 0.1)  # the intake's snapshot of the model is at most MODEL_TTL old
    try:
        waiting = [client.submit_deletion(model_id, {"kind": "samples", "sample_ids": [next(api["rows"])]}, s)
                   for s in ("bulk-1", "bulk-2")]  # fmt: skip
        assert {r.status for r in waiting} == {"pending-approval"}
        outcome = client.bulk("reject", ids=[r.id for r in waiting] + ["no-such-request"], reason="not our customer")
        assert isinstance(outcome, BulkOutcome) and (outcome.selected, outcome.done, outcome.skipped) == (3, 2, 1)
        skipped = next(r for r in outcome.results if r.outcome == "skipped")
        assert isinstance(skipped, BulkResult) and skipped.id == "no-such-request"
        assert skipped.problem_slug == "request-not-found"
        assert {r.status for r in outcome.results if r.outcome == "done"} == {"rejected"}
        with pytest.raises(LetheProblem) as empty:  # the same filter again selects nothing: refused as a whole
            client.bulk("reject", filter={"status": "pending-approval", "model_id": model_id}, reason="again")
        assert empty.value.slug == "bulk-selection-empty"
    finally:
        cleared = client.update_model(model_id, requires_approval=False, tags=[])
        assert not cleared.requires_approval and cleared.tags == []
        time.sleep(MODEL_TTL + 0.1)


def test_predict_splits_rows_by_the_servers_bound_and_export_writes_the_card(api, tmp_path, monkeypatch):
    """``predict`` sends more rows than the API takes in parts of its ``max_rows`` (413 too-many-rows), every part to
    the version the first was answered by; ``export_version`` writes the weights whole with the model card that
    app/ml/export.py reads back, and that predictor answers as the API did."""
    from app.ml.export import load
    from app.registry import service as registry_service

    client: LetheClient = api["client"]
    model = client.get_model(api["model"].id)
    assert model.inputs == {**{f"x{i}": "number" for i in range(6)}, "colour": "text"}
    frame = write_table(tmp_path / "rows.csv", n=160, seed=11)
    rows = [{column: record[column] for column in model.inputs} for record in frame.head(20).to_dict("records")]
    whole = client.predict(model.id, rows)
    assert isinstance(whole, Prediction) and len(whole.labels) == len(whole.probabilities) == 20
    assert whole.version.number == model.current_version.number

    bodies: list[dict] = []
    hook = {"request": [lambda request: request.method == "POST" and bodies.append(json.loads(request.content))]}
    monkeypatch.setattr(registry_service, "MAX_PREDICT_ROWS", 7)  # the API (in this process) now takes 7 a call
    with httpx.Client(base_url=api["url"], event_hooks=hook) as http:
        parted = LetheClient(http=http, api_key=api["key"]).predict(model.id, rows)
        assert [len(b["rows"]) for b in bodies] == [20, 7, 7, 6]  # refused whole (413 max_rows 7), then in parts
        assert [b.get("version") for b in bodies] == [None, None, whole.version.number, whole.version.number]
        assert parted.labels == whole.labels and parted.probabilities == whole.probabilities
        wrong = [dict(row) for row in rows]
        wrong[15]["x0"] = "not a number"
        with pytest.raises(LetheProblem) as refused:  # the third part's problem names the row as given
            LetheClient(http=http, api_key=api["key"]).predict(model.id, wrong)
    assert refused.value.slug == "invalid-rows" and refused.value.extensions["row_errors"][0]["row"] == 15
    monkeypatch.undo()

    number = model.current_version.number
    exported = client.export_version(model.id, number, tmp_path / "model.safetensors")
    assert isinstance(exported, ExportedVersion) and exported.format == "lethe.tabular/1"
    data = exported.path.read_bytes()
    assert exported.size == len(data) and exported.sha256 == hashlib.sha256(data).hexdigest()
    assert exported.card["model"]["id"] == model.id and exported.card["version"]["number"] == number
    assert exported.card["version"]["digest"] == model.current_version.digest
    predictor = load(exported.path)  # checks theta against the card
    assert predictor.card == exported.card and predictor.predict(rows) == whole.labels
    assert np.allclose(predictor.predict_proba(rows), whole.probabilities, atol=1e-12)
    with pytest.raises(LetheProblem) as unknown:
        client.export_version(model.id, 999, tmp_path / "none.safetensors")
    assert unknown.value.slug == "version-not-found" and unknown.value.status == 404
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors", "rows.csv"]  # no partial file left


def test_a_person_is_erased_followed_and_certified_through_the_client(api, tmp_path):
    client: LetheClient = api["client"]
    erasure = client.erase_subject(ALICE, method="retrain")
    assert isinstance(erasure, Erasure) and erasure.location == f"/v1/subjects/erasures/{erasure.id}"
    assert [c.model_id for c in erasure.children] == [api["model"].id] and erasure.children[0].n_samples == 3
    seen: list[str] = []
    done = client.wait_erasure(erasure.id, timeout=120, interval=0.1, on_progress=lambda e: seen.append(e.status))
    assert done.status == "certified" and done.done and done.progress == 1.0 and seen[-1] == "certified"
    assert isinstance(done.children[0], ErasureChild) and done.children[0].certificate_id
    envelope = client.erasure_certificate(erasure.id)
    cert, keys = tmp_path / "combined.json", tmp_path / "keys.json"
    cert.write_text(json.dumps(envelope))
    keys.write_text(json.dumps(client.signing_keys()))
    assert verify_file(cert, str(keys))[0]
    found = client.subject_requests(done.subject_hash)
    assert client.lookup_subject(ALICE) == found  # by the reference: the server computes the keyed hash
    assert isinstance(found, SubjectRequests)
    assert [r.id for r in found.requests] == [done.children[0].request_id]
    assert [e.id for e in found.erasures] == [erasure.id] and found.erasures[0].certificate_digest
    again = client.erase_subject(ALICE)  # every row of theirs is gone: answered, certified at once, and says so
    assert again.status == "certified" and again.no_data_found and again.children == []

"""Operator's view, items 2 and 3: deadlines (GDPR Art. 12(3)) with audited extensions and overdue flags; cancel a
request no worker has started, retry a failed one (embedded default)."""

from __future__ import annotations

import json
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta

import pytest
from fastapi.testclient import TestClient

from app.db import session_scope
from app.jobs.tabular import holdout_mask
from app.main import create_app
from app.ml.unlearning import base
from app.requests.service import add_months, flag_overdue
from app.requests.tables import DeletionRequest
from tests.helpers import configure, make_key, wait_for, wait_request, write_table

SCOPES = ["models:write", "requests:write", "requests:read", "audit:read", "admin"]


@pytest.fixture
def setup(tmp_path):
    configure(tmp_path / "home", poll_seconds="0.05")
    headers = {"authorization": f"Bearer {make_key(SCOPES)}"}
    source = tmp_path / "t.csv"
    write_table(source, n=200, seed=5)
    metadata = {
        "name": "ops",
        "verification": {"shadows": 8},
        "dataset": {"row_id_column": "row_id", "label_column": "label"},
    }
    with TestClient(create_app(run_background=True), headers=headers) as client:
        with source.open("rb") as handle:
            model_id = client.post(
                "/v1/models", data={"metadata": json.dumps(metadata)}, files={"file": ("t.csv", handle, "text/csv")}
            ).json()["id"]
        wait_for(lambda: client.get(f"/v1/models/{model_id}").json()["status"] == "ready", timeout=120, what="ready")
    return headers, model_id


@contextmanager
def _do_nothing(name: str):
    """A method that returns the model unchanged (its verdict fails), registered for one test only."""
    base.register_method(
        name,
        "app.ml.unlearning.baselines.sisa:DoNothingConfig",
        "app.ml.unlearning.baselines.sisa:DoNothing",
        model_kinds={"tabular"},
        scopes={"samples"},
    )
    try:
        yield
    finally:
        base._REGISTRY.pop(name, None)


def _ask(client, model_id, ids, **extra):
    return client.post(
        "/v1/deletion-requests",
        json={"subject_ref": "s", "model_id": model_id, "scope": {"kind": "samples", "sample_ids": ids}, **extra},
    )


def test_months_are_calendar_months():
    assert add_months(datetime(2026, 1, 31, tzinfo=UTC), 1) == datetime(2026, 2, 28, tzinfo=UTC)
    assert add_months(datetime(2026, 11, 15, tzinfo=UTC), 3) == datetime(2027, 2, 15, tzinfo=UTC)


def test_deadlines_extensions_overdue_and_cancel(setup):
    headers, model_id = setup
    with TestClient(create_app(run_background=False), headers=headers) as client:  # no worker: requests wait
        received = datetime.now(UTC) - timedelta(days=40)
        late = _ask(client, model_id, ["r1"], received_at=received.isoformat()).json()
        assert late["due_at"].startswith(add_months(received, 1).isoformat()[:19])
        assert late["overdue"] is True and late["days_left"] < 0
        fresh = _ask(client, model_id, ["r2"]).json()
        assert fresh["overdue"] is False and 27 <= fresh["days_left"] <= 31
        overdue = client.get("/v1/deletion-requests", params={"overdue": "true"}).json()["items"]
        assert [r["id"] for r in overdue] == [late["id"]]
        with session_scope() as session:
            assert flag_overdue(session) == 1
        with session_scope() as session:
            assert flag_overdue(session) == 0  # once
        events = [e["action"] for e in client.get("/v1/audit", params={"entity_id": late["id"]}).json()["items"]]
        assert "deletion_request.overdue" in events

        extended = client.post(f"/v1/deletion-requests/{late['id']}/extend", json={"months": 2, "reason": "complex"})
        assert extended.status_code == 200 and extended.json()["overdue"] is False
        assert extended.json()["extensions"][0]["reason"] == "complex"
        again = client.post(f"/v1/deletion-requests/{late['id']}/extend", json={"months": 1, "reason": "more"})
        assert again.status_code == 422 and again.json()["type"].endswith("/extension-too-long")

        cancelled = client.post(f"/v1/deletion-requests/{fresh['id']}/cancel")
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
        assert _ask(client, model_id, ["r2"]).status_code == 202  # its rows were released
        events = [e["action"] for e in client.get("/v1/audit", params={"entity_id": fresh["id"]}).json()["items"]]
        assert "deletion_request.cancelled" in events
    with TestClient(create_app(run_background=True), headers=headers) as client:
        done = wait_request(client, late["id"], timeout=120)
        assert done["status"] == "certified"
        refused = client.post(f"/v1/deletion-requests/{late['id']}/cancel")
        assert refused.status_code == 409 and refused.json()["type"].endswith("/request-started")
        reader = make_key(["requests:read"], name="reader")
        forbidden = client.post(
            f"/v1/deletion-requests/{late['id']}/extend",
            json={"months": 1, "reason": "x" * 5},
            headers={"authorization": f"Bearer {reader}"},
        )
        assert forbidden.status_code == 403


def test_a_failed_request_can_be_retried(setup):
    headers, model_id = setup
    with _do_nothing("test-nothing"), TestClient(create_app(run_background=True), headers=headers) as client:
        trained = next(f"r{i}" for i, held in enumerate(holdout_mask(200, 0.2, seed=0)) if not held)
        failed = wait_request(client, _ask(client, model_id, [trained], method="test-nothing").json()["id"], 120)
        assert failed["status"] == "failed" and "sample_ids" not in failed["scope"]  # only keyed hashes stay
        assert len(failed["scope"]["sample_id_hashes"]) == 1 and trained not in json.dumps(failed)
        clash = _ask(client, model_id, [trained])  # still owed: the row stays held by the failed request
        assert clash.status_code == 409 and clash.json()["type"].endswith("/deletion-in-progress"), clash.text
        retried = client.post(f"/v1/deletion-requests/{failed['id']}/retry")  # its row, by the position kept
        assert retried.status_code == 202 and retried.json()["status"] in ("received", "queued", "running")
        again = wait_request(client, failed["id"], timeout=120)
        assert again["status"] == "failed"  # the same method fails its verdict again, and says so
        with session_scope() as session:  # as an older release wrote it: the ids' keyed hashes, no positions
            request = session.get(DeletionRequest, failed["id"])
            assert request.scope["positions"] == [int(trained[1:])]
            request.scope = {k: v for k, v in request.scope.items() if k != "positions"}
        retried = client.post(f"/v1/deletion-requests/{failed['id']}/retry")  # finds its row again by the hash
        assert retried.status_code == 202, retried.text
        assert wait_request(client, failed["id"], timeout=120)["status"] == "failed"
        with session_scope() as session:
            assert session.get(DeletionRequest, failed["id"]).scope["positions"] == [int(trained[1:])]
        reports = client.get(again["links"]["reports"]).json()["items"]
        assert len(reports) == 3
        events = [e["action"] for e in client.get("/v1/audit", params={"entity_id": failed["id"]}).json()["items"]]
        assert events.count("deletion_request.retried") == 2


def test_a_failed_request_can_be_retried_with_another_method(setup):
    """The method failed its verdict: the operator retries with exact retraining, checked as at submission (an
    unknown method 422, one the model has not prepared 409, the request untouched), and the change is audited."""
    headers, model_id = setup
    with _do_nothing("test-nothing"), TestClient(create_app(run_background=True), headers=headers) as client:
        trained = next(f"r{i}" for i, held in enumerate(holdout_mask(200, 0.2, seed=0)) if not held)
        failed = wait_request(client, _ask(client, model_id, [trained], method="test-nothing").json()["id"], 120)
        assert failed["status"] == "failed" and failed["method"] == "test-nothing"
        retry = f"/v1/deletion-requests/{failed['id']}/retry"
        unknown = client.post(retry, json={"method": "no-such-method"})
        assert unknown.status_code == 422, unknown.text
        unprepared = client.post(retry, json={"method": "newton"})
        assert unprepared.status_code == 409 and unprepared.json()["type"].endswith("/method-not-prepared")
        assert client.post(retry, json={"method": "retrain", "x": 1}).status_code == 422  # extra fields refused
        assert client.get(failed["links"]["self"]).json()["status"] == "failed"  # nothing changed by the refusals
        retried = client.post(retry, json={"method": "retrain"})
        assert retried.status_code == 202 and retried.json()["method"] == "retrain", retried.text
        done = wait_request(client, failed["id"], timeout=120)
        assert done["status"] == "certified" and done["method"] == "retrain", done
        events = client.get("/v1/audit", params={"entity_id": failed["id"]}).json()["items"]
        (event,) = [e for e in events if e["action"] == "deletion_request.retried"]
        assert event["payload"]["method"] == "retrain" and event["payload"]["previous_method"] == "test-nothing"


def test_a_failed_request_can_be_withdrawn_and_its_rows_asked_for_again(setup):
    headers, model_id = setup
    with _do_nothing("test-nothing"), TestClient(create_app(run_background=True), headers=headers) as client:
        trained = next(f"r{i}" for i, held in enumerate(holdout_mask(200, 0.2, seed=0)) if not held)
        failed = wait_request(client, _ask(client, model_id, [trained], method="test-nothing").json()["id"], 120)
        assert failed["status"] == "failed"
        cancelled = client.post(f"/v1/deletion-requests/{failed['id']}/cancel")
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled", cancelled.text
        again = _ask(client, model_id, [trained], method="retrain")  # released: a new request may take the row
        assert again.status_code == 202, again.text
        assert wait_request(client, again.json()["id"], timeout=120)["status"] == "certified"


def test_a_received_at_in_the_future_is_refused(setup):
    """Issue 22 (LOW): the deadline runs from ``received_at``; 9999-12-31 answered 500 (a month later is past the
    calendar's end) and 2999 was accepted, evading "overdue". A date ahead of now is a 422 problem; now is fine."""
    headers, model_id = setup
    with TestClient(create_app(run_background=False), headers=headers) as client:
        for future in (
            "9999-12-31T00:00:00Z",
            "2999-01-01T00:00:00Z",
            (datetime.now(UTC) + timedelta(days=1)).isoformat(),
        ):
            response = _ask(client, model_id, ["r2"], received_at=future)
            assert response.status_code == 422, response.text
            assert response.headers["content-type"].startswith("application/problem+json")
            assert "future" in response.text
        assert _ask(client, model_id, ["r2"], received_at=datetime.now(UTC).isoformat()).status_code == 202


def test_the_deadline_is_the_obligation_not_the_status(setup):
    """Issue 23, item 3: a failed request (its erasure still owed) and one pending approval are overdue past their
    deadline, counted by the overdue filter, the audit flag and the gauge; an answer after the deadline is recorded
    as answered late (API, dashboard wording), never as on time."""
    import re
    import time

    from app.dashboard.views import time_left
    from app.requests.intake import MODEL_TTL

    headers, model_id = setup
    received = (datetime.now(UTC) - timedelta(days=40)).isoformat()
    with _do_nothing("test-nothing-late"), TestClient(create_app(run_background=True), headers=headers) as client:
        trained = [f"r{i}" for i, held in enumerate(holdout_mask(200, 0.2, seed=0)) if not held]
        asked = _ask(client, model_id, [trained[0]], method="test-nothing-late", received_at=received).json()
        failed = wait_request(client, asked["id"], 120)
        assert failed["status"] == "failed" and failed["overdue"] is True and failed["answered_late"] is False
        certified = wait_request(client, _ask(client, model_id, [trained[1]], received_at=received).json()["id"])
        assert certified["status"] == "certified"
        assert certified["overdue"] is False and certified["answered_late"] is True
        assert time_left(certified["days_left"], False, "certified", True) == "answered late"
        assert time_left(failed["days_left"], True, "failed").startswith("OVERDUE by")
        patched = client.patch(f"/v1/models/{model_id}", json={"requires_approval": True})
        assert patched.status_code == 200, patched.text
        time.sleep(MODEL_TTL + 0.1)  # the intake's snapshot of the model is at most MODEL_TTL old
        pending = _ask(client, model_id, [trained[2]], received_at=received).json()
        assert pending["status"] == "pending-approval" and pending["overdue"] is True
        overdue = {r["id"] for r in client.get("/v1/deletion-requests", params={"overdue": "true"}).json()["items"]}
        assert overdue == {failed["id"], pending["id"]}
        with session_scope() as session:
            flag_overdue(session)
        for rid in (failed["id"], pending["id"]):
            events = [e["action"] for e in client.get("/v1/audit", params={"entity_id": rid}).json()["items"]]
            assert "deletion_request.overdue" in events, rid
        metrics = client.get("/metrics").text
        assert "lethe_overdue_requests 2.0" in metrics
        age = re.search(r"^lethe_oldest_pending_request_age_seconds (\S+)$", metrics, flags=re.M)
        assert age and float(age.group(1)) > 0  # the pending approval counts (no job waits besides it)

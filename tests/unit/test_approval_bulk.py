"""Operator controls, the rest of item 3: optional approval before work starts (a per-model setting) and bulk
actions over ids or the list filter (embedded default, SQLite)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from app.db import session_scope
from app.jobs.dispatcher import Dispatcher
from app.jobs.tables import Job
from app.main import create_app
from tests.helpers import configure, make_key, wait_for, wait_request, write_table

SCOPES = ["models:write", "requests:write", "requests:read", "audit:read", "admin"]


@pytest.fixture
def setup(tmp_path):
    configure(tmp_path / "home", poll_seconds="0.05", bulk_max_requests="5", dispatch_timeout_seconds="1")
    # (a job the test dispatcher "sent" to nobody is re-offered after a second)
    headers = {"authorization": f"Bearer {make_key(SCOPES)}"}
    source = tmp_path / "t.csv"
    write_table(source, n=160, seed=7)
    metadata = {
        "name": "gated",
        "requires_approval": True,
        "verification": {"shadows": 8},
        "dataset": {"row_id_column": "row_id", "label_column": "label"},
    }
    with TestClient(create_app(run_background=True), headers=headers) as client:
        with source.open("rb") as handle:
            registered = client.post(
                "/v1/models", data={"metadata": json.dumps(metadata)}, files={"file": ("t.csv", handle, "text/csv")}
            ).json()
        assert registered["requires_approval"] is True
        model_id = registered["id"]
        wait_for(lambda: client.get(f"/v1/models/{model_id}").json()["status"] == "ready", timeout=120, what="ready")
    return headers, model_id


def _ask(client, model_id, ids, **extra):
    return client.post(
        "/v1/deletion-requests",
        json={"subject_ref": "s", "model_id": model_id, "scope": {"kind": "samples", "sample_ids": ids}, **extra},
    )


def _jobs_of(request_id: str) -> list[Job]:
    with session_scope() as session:
        return list(session.execute(select(Job).where(Job.request_id == request_id)).scalars())


def _actions(client, request_id: str) -> list[str]:
    return [e["action"] for e in client.get("/v1/audit", params={"entity_id": request_id}).json()["items"]]


def test_nothing_runs_before_approval(setup):
    headers, model_id = setup
    sent: list[str] = []
    dispatcher = Dispatcher(lambda job: sent.append(job.id))
    with TestClient(create_app(run_background=False), headers=headers) as client:
        received = (datetime.now(UTC) - timedelta(days=40)).isoformat()
        held = _ask(client, model_id, ["r1"], received_at=received)
        assert held.status_code == 202
        body = held.json()
        assert body["status"] == "pending-approval" and body["overdue"] is True  # the deadline keeps running
        assert _jobs_of(body["id"]) == []  # no job: the dispatcher has nothing it could hand to a worker
        assert _ask(client, model_id, ["r1"]).status_code == 409  # its rows are held all the same
        for _ in range(3):
            dispatcher.tick()
        assert sent == [] and client.get(f"/v1/deletion-requests/{body['id']}").json()["status"] == "pending-approval"
        listed = client.get("/v1/deletion-requests", params={"status": "pending-approval"}).json()["items"]
        assert [r["id"] for r in listed] == [body["id"]]
        assert 'lethe_deletion_requests{status="pending-approval"} 1.0' in client.get("/metrics").text

        reader = make_key(["requests:read", "requests:write"], name="no-admin")
        refused = client.post(
            f"/v1/deletion-requests/{body['id']}/approve", headers={"authorization": f"Bearer {reader}"}
        )
        assert refused.status_code == 403
        own = client.post(f"/v1/deletion-requests/{body['id']}/approve")  # the key that submitted it
        assert own.status_code == 403 and own.json()["type"].endswith("/approval-by-submitter")
        approver = {"authorization": f"Bearer {make_key(['admin'], name='approver')}"}
        approved = client.post(
            f"/v1/deletion-requests/{body['id']}/approve", json={"note": "checked the ticket"}, headers=approver
        )
        assert approved.status_code == 202 and approved.json()["status"] == "received"
        assert len(_jobs_of(body["id"])) == 1
        again = client.post(f"/v1/deletion-requests/{body['id']}/approve", headers=approver)
        assert again.status_code == 409 and again.json()["type"].endswith("/not-awaiting-approval")
        assert again.headers["content-type"].startswith("application/problem+json")
        dispatcher.tick()
        assert sent == [_jobs_of(body["id"])[0].id]
        assert client.get(f"/v1/deletion-requests/{body['id']}").json()["status"] == "queued"
        events = _actions(client, body["id"])
        assert events.index("deletion_request.received") < events.index("deletion_request.approved")
        assert events.index("deletion_request.approved") < events.index("deletion_request.queued")

        assert client.get(f"/v1/deletion-requests/{body['id']}").json()["notes"][0]["note"] == "checked the ticket"

        rejected_id = _ask(client, model_id, ["r2", "r3"]).json()["id"]
        rejected = client.post(f"/v1/deletion-requests/{rejected_id}/reject", json={"reason": "not our customer"})
        assert rejected.status_code == 200 and rejected.json()["status"] == "rejected"
        assert rejected.json()["error"]["type"].endswith("/rejected-by-operator")
        assert "sample_ids" not in rejected.json()["scope"]  # ended: only keyed hashes of its ids stay
        assert "deletion_request.rejected" in _actions(client, rejected_id)
        cancelled_id = _ask(client, model_id, ["r2"]).json()["id"]  # the rejected request released its rows
        cancelled = client.post(f"/v1/deletion-requests/{cancelled_id}/cancel")
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
        assert _jobs_of(cancelled_id) == []

        patched = client.patch(f"/v1/models/{model_id}", json={"requires_approval": False})
        assert patched.status_code == 200 and patched.json()["requires_approval"] is False
        events = [e["action"] for e in client.get("/v1/audit", params={"entity_id": model_id}).json()["items"]]
        assert "model.updated" in events
        forbidden = client.patch(
            f"/v1/models/{model_id}", json={"requires_approval": True}, headers={"authorization": f"Bearer {reader}"}
        )
        assert forbidden.status_code == 403
    with TestClient(create_app(run_background=True), headers=headers) as client:
        wait_for(
            lambda: client.get(f"/v1/models/{model_id}").json()["requires_approval"] is False, what="model snapshot"
        )
        ungated = wait_for(lambda: (r := _ask(client, model_id, ["r4"]).json()).get("id") and r, what="request")
        assert ungated["status"] in ("received", "queued", "running", "verifying", "certified")
        done = wait_request(client, body["id"], timeout=180)
        assert done["status"] == "certified"  # the approved request ran
        assert wait_request(client, ungated["id"], timeout=180)["status"] == "certified"


def test_bulk_actions_over_ids_and_filters(setup):
    headers, model_id = setup
    with TestClient(create_app(run_background=False), headers=headers) as client:
        ids = [_ask(client, model_id, [f"r{i}"]).json()["id"] for i in range(10, 14)]
        bulk = "/v1/deletion-requests/bulk"

        empty = client.post(bulk, json={"action": "approve", "filter": {"status": "failed"}})
        assert empty.status_code == 422 and empty.json()["type"].endswith("/bulk-selection-empty")
        too_many = client.post(bulk, json={"action": "cancel", "ids": [*ids, "a", "b"]})
        assert too_many.status_code == 422 and too_many.json()["type"].endswith("/bulk-selection-too-large")
        both = client.post(bulk, json={"action": "cancel", "ids": ids, "filter": {}})
        assert both.status_code == 422
        no_reason = client.post(bulk, json={"action": "extend", "ids": ids, "months": 1})
        assert no_reason.status_code == 422
        reader = make_key(["requests:read"], name="reader")
        assert (
            client.post(
                bulk, json={"action": "cancel", "ids": ids}, headers={"authorization": f"Bearer {reader}"}
            ).status_code
            == 403
        )

        cancelled = client.post(bulk, json={"action": "cancel", "ids": [ids[0], "no-such-request"]}).json()
        assert cancelled["done"] == 1 and cancelled["skipped"] == 1
        by_id = {r["id"]: r for r in cancelled["results"]}
        assert by_id[ids[0]] == {
            "id": ids[0], "outcome": "done", "status": "cancelled", "reason": None, "problem_type": None
        }  # fmt: skip
        assert by_id["no-such-request"]["outcome"] == "skipped"
        assert by_id["no-such-request"]["problem_type"].endswith("/request-not-found")

        extended = client.post(
            bulk,
            json={"action": "extend", "filter": {"model_id": model_id, "status": "pending-approval"}, "months": 2,
                  "reason": "many requests at once"},
        ).json()  # fmt: skip
        assert extended["selected"] == 3 and extended["done"] == 3
        assert extended["results"][0]["id"] == ids[1]  # oldest first

        approver = {"authorization": f"Bearer {make_key(['admin'], name='approver')}"}
        approved = client.post(
            bulk,
            json={"action": "approve", "filter": {"status": "pending-approval",
                  "created_after": (datetime.now(UTC) - timedelta(hours=1)).isoformat()}},
            headers=approver,
        ).json()  # fmt: skip
        assert approved["done"] == 3 and {r["status"] for r in approved["results"]} == {"received"}
        for request_id in ids[1:]:
            events = _actions(client, request_id)
            assert "deletion_request.approved" in events and "deletion_request.extended" in events
            assert len(_jobs_of(request_id)) == 1
        skipped = client.post(bulk, json={"action": "approve", "ids": ids}, headers=approver).json()
        assert skipped["done"] == 0 and {r["problem_type"].rsplit("/", 1)[-1] for r in skipped["results"]} == {
            "not-awaiting-approval"
        }
        retry = client.post(bulk, json={"action": "retry", "ids": ids[:2]}).json()
        assert retry["done"] == 0 and all(r["problem_type"].endswith("/not-failed") for r in retry["results"])


def test_a_bulk_filter_selects_what_the_list_shows_a_failed_overdue_request_too(setup):
    """The bulk filter is the list's filter (one function): `overdue` counts a failed request past its deadline (it
    still owes the erasure), so `retry` over the overdue filter reaches the request the list flagged."""
    from app.jobs import outbox
    from app.requests import service as requests_service

    headers, model_id = setup
    approver = {"authorization": f"Bearer {make_key(['admin'], name='approver')}"}
    late = (datetime.now(UTC) - timedelta(days=45)).isoformat()
    with TestClient(create_app(run_background=False), headers=headers) as client:
        request_id = _ask(client, model_id, ["r20"], received_at=late).json()["id"]
        assert client.post(f"/v1/deletion-requests/{request_id}/approve", json={}, headers=approver).status_code == 202
        with session_scope() as session:  # failed as a worker fails it: the job for good, then the request
            job_id = requests_service.get_request_or_404(session, request_id).job_id
            assert outbox.fail(session, job_id, None, "simulated failure", permanent=True) is not None
            requests_service.mark_failed(session, request_id, job_id, 1, "simulated failure", "failed", "job-failed")
        listed = client.get("/v1/deletion-requests", params={"overdue": "true"}).json()["items"]
        assert [(r["id"], r["status"]) for r in listed] == [(request_id, "failed")]
        retried = client.post(
            "/v1/deletion-requests/bulk", json={"action": "retry", "filter": {"overdue": True, "model_id": model_id}}
        )
        assert retried.status_code == 200, retried.text
        assert [(r["id"], r["outcome"]) for r in retried.json()["results"]] == [(request_id, "done")]
        for row in ("r21", "r22"):
            _ask(client, model_id, [row])
    with session_scope() as session:  # what the dashboard's "all N requests matching the filter" says
        assert requests_service.count_requests(session, model_id=model_id) == 3
        assert requests_service.count_requests(session, model_id=model_id, status="pending-approval") == 2
        assert requests_service.count_requests(session, 2, model_id=model_id) == 2  # counted no further
        assert requests_service.count_requests(session, overdue=True) == 1


def test_operators_free_text_stays_out_of_the_append_only_log(setup):
    """A reason or note an operator types may name a person: the request row keeps it (erasable), the hash-chained
    log only its keyed digest — so erasing the text never breaks the chain, and the log never holds it."""
    from app.requests.service import text_digest

    headers, model_id = setup
    texts = {"approve": "Jane Roe phoned on 3 May", "reject": "Jane Roe is not our customer", "extend": "Jane Roe ill"}
    with TestClient(create_app(run_background=False), headers=headers) as client:
        approver = {"authorization": f"Bearer {make_key(['admin'], name='approver')}"}
        first, second = (_ask(client, model_id, [row]).json()["id"] for row in ("r5", "r6"))
        assert client.post(
            f"/v1/deletion-requests/{first}/extend", json={"months": 1, "reason": texts["extend"]}
        ).is_success
        approve = client.post(
            f"/v1/deletion-requests/{first}/approve", json={"note": texts["approve"]}, headers=approver
        )
        assert approve.status_code == 202, approve.text
        assert client.post(f"/v1/deletion-requests/{second}/reject", json={"reason": texts["reject"]}).is_success
        shown = client.get(f"/v1/deletion-requests/{first}").json()
        assert shown["notes"][0]["note"] == texts["approve"] and shown["extensions"][0]["reason"] == texts["extend"]
        assert client.get(f"/v1/deletion-requests/{second}").json()["error"]["detail"] == texts["reject"]
        events = [
            e for rid in (first, second) for e in client.get("/v1/audit", params={"entity_id": rid}).json()["items"]
        ]
    logged = json.dumps(events)
    assert "Jane" not in logged and "Roe" not in logged
    digests = {e["action"].rsplit(".", 1)[-1]: e["payload"] for e in events}
    assert digests["approved"]["note_digest"] == text_digest(texts["approve"])
    assert digests["rejected"]["reason_digest"] == text_digest(texts["reject"])
    assert digests["extended"]["reason_digest"] == text_digest(texts["extend"])

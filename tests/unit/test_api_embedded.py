"""The service on the embedded default (SQLite + in-process executor), through HTTP with FastAPI's TestClient."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from fastapi.testclient import TestClient

from app.main import create_app
from tests.helpers import configure, make_key, wait_for, wait_model, write_table


@pytest.fixture
def client(tmp_path):
    configure(tmp_path, poll_seconds="0.05")
    key = make_key()
    with TestClient(create_app(run_background=True)) as test_client:
        test_client.headers["authorization"] = f"Bearer {key}"
        yield test_client


def _register(client, tmp_path, suffix=".csv", **extra):
    path = tmp_path / f"table{suffix}"
    frame = write_table(path)
    metadata = {"name": "m", "dataset": {"row_id_column": "row_id", "label_column": "label"}, **extra}
    with path.open("rb") as handle:
        response = client.post(
            "/v1/models",
            data={"metadata": json.dumps(metadata)},
            files={"file": (path.name, handle, "application/octet-stream")},
        )
    assert response.status_code == 202, response.text
    model_id = response.json()["id"]
    model = wait_model(
        client,
        model_id,
        timeout=60,
        what="model training",
    )
    assert model["status"] == "ready", model
    return model, frame


def _finished(client, location):
    return wait_for(
        lambda: (b := client.get(location).json())["status"] in ("certified", "failed", "rejected") and b,
        timeout=60,
        what="deletion request",
    )


@pytest.mark.parametrize("suffix", [".csv", ".parquet"])
def test_register_delete_and_lineage(client, tmp_path, suffix):
    model, frame = _register(client, tmp_path, suffix)
    assert model["current_version"]["number"] == 1
    assert 0.6 < model["current_version"]["metrics"]["accuracy_holdout"] <= 1.0

    response = client.post(
        "/v1/deletion-requests",
        json={
            "subject_ref": "alice",
            "model_id": model["id"],
            "scope": {"kind": "samples", "sample_ids": ["r1", "r2"]},
        },
    )
    assert response.status_code == 202
    assert response.headers["location"].startswith("/v1/deletion-requests/")
    assert int(response.headers["retry-after"]) > 0
    body = response.json()
    assert body["subject_hash"] != "alice" and len(body["subject_hash"]) == 64
    done = _finished(client, response.headers["location"])
    assert done["status"] == "certified", done
    assert done["attempts"] == 1

    versions = client.get(f"/v1/models/{model['id']}/versions").json()
    assert [v["number"] for v in versions] == [1, 2]
    assert versions[1]["parent_id"] == versions[0]["id"]
    assert versions[1]["digest"] != versions[0]["digest"]
    assert versions[1]["metrics"]["after"]["rows_forget"] == 2
    # the deleted rows are tombstones: asking again is a conflict
    again = client.post(
        "/v1/deletion-requests",
        json={"subject_ref": "alice", "model_id": model["id"], "scope": {"kind": "samples", "sample_ids": ["r1"]}},
    )
    assert again.status_code == 409
    assert again.json()["type"].endswith("/already-deleted")

    # a second, sequential deletion builds on version 2 and keeps the earlier tombstones out
    second = client.post(
        "/v1/deletion-requests",
        json={"subject_ref": "bob", "model_id": model["id"], "scope": {"kind": "samples", "sample_ids": ["r3"]}},
    )
    assert _finished(client, second.headers["location"])["status"] == "certified"
    versions = client.get(f"/v1/models/{model['id']}/versions").json()
    assert [v["number"] for v in versions] == [1, 2, 3]
    assert versions[2]["parent_id"] == versions[1]["id"]
    retained_v2 = versions[1]["metrics"]["after"]["rows_retain"]
    assert versions[2]["metrics"]["after"]["rows_retain"] in (retained_v2, retained_v2 - 1)

    journey = [e["action"] for e in client.get("/v1/audit", params={"entity_id": body["id"]}).json()["items"]]
    assert journey == [
        "deletion_request.received",
        "deletion_request.queued",
        "deletion_request.running",
        "deletion_request.verifying",
        "deletion_request.verified",
        "deletion_request.certified",
    ]
    verdict = client.get("/v1/audit/verify").json()
    assert verdict["ok"] and verdict["checked"] >= 9


def test_class_deletion_removes_the_class(client, tmp_path):
    model, frame = _register(client, tmp_path)
    response = client.post(
        "/v1/deletion-requests",
        json={"subject_ref": "policy-7", "model_id": model["id"], "scope": {"kind": "class", "label": "yes"}},
    )
    assert response.status_code == 202, response.text
    done = _finished(client, response.headers["location"])
    assert done["status"] == "certified", done
    version = client.get(f"/v1/models/{model['id']}/versions").json()[-1]
    after = version["metrics"]["after"]
    # every remaining training row is "no": the retrained model predicts "no" everywhere, so forget accuracy is 0
    assert after["accuracy_forget"] < 0.05
    assert after["rows_forget"] == int((frame["label"] == "yes").sum())


def test_listing_with_cursor_and_filter(client, tmp_path):
    model, _ = _register(client, tmp_path)
    ids = []
    for i in range(5):
        response = client.post(
            "/v1/deletion-requests",
            json={
                "subject_ref": f"s{i}",
                "model_id": model["id"],
                "scope": {"kind": "samples", "sample_ids": [f"r{10 + i}"]},
            },
        )
        ids.append(response.json()["id"])
    for request_id in ids:
        _finished(client, f"/v1/deletion-requests/{request_id}")
    seen, cursor = [], None
    while True:
        page = client.get("/v1/deletion-requests", params={"limit": 2, **({"cursor": cursor} if cursor else {})}).json()
        seen += [item["id"] for item in page["items"]]
        cursor = page["next_cursor"]
        if not cursor:
            break
    assert seen == list(reversed(ids))
    completed = client.get("/v1/deletion-requests", params={"status": "certified", "limit": 500}).json()["items"]
    assert {item["id"] for item in completed} == set(ids)
    assert client.get("/v1/deletion-requests", params={"status": "failed"}).json()["items"] == []
    bad = client.get("/v1/deletion-requests", params={"cursor": "not-a-cursor"})
    assert bad.status_code == 400 and bad.headers["content-type"] == "application/problem+json"


def test_api_process_never_loads_torch():
    code = (
        "import sys; from app.main import create_app; create_app(False)\n"
        "from app.ml.unlearning.base import available_methods\n"
        "names = sorted(m.name for m in available_methods())\n"
        "assert {'retrain', 'l2ul', 'ease', 'sisa'} <= set(names), names\n"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"


def test_rows_never_trained_on_need_no_unlearning(client, tmp_path):
    from app.jobs.tabular import holdout_mask

    model, frame = _register(client, tmp_path)
    held_out = frame["row_id"][holdout_mask(len(frame), 0.2, seed=0)].tolist()[:2]
    response = client.post(
        "/v1/deletion-requests",
        json={"subject_ref": "gina", "model_id": model["id"], "scope": {"kind": "samples", "sample_ids": held_out}},
    )
    done = _finished(client, response.headers["location"])
    assert done["status"] == "certified", done
    versions = client.get(f"/v1/models/{model['id']}/versions").json()
    assert versions[-1]["method"] == "none-needed"
    assert versions[-1]["digest"] == versions[-2]["digest"]  # same parameters, new version: the tombstones changed
    again = client.post(
        "/v1/deletion-requests",
        json={"subject_ref": "gina", "model_id": model["id"], "scope": {"kind": "samples", "sample_ids": held_out[:1]}},
    )
    assert again.status_code == 409


def test_a_request_between_two_polls_is_dispatched_at_once(tmp_path):
    """The intake nudges its process's dispatcher after the commit (outbox.nudge): a request accepted between two
    polls is dispatched then, not at the next poll (here a minute away)."""
    configure(tmp_path, poll_seconds="0.05")
    key = make_key()
    with TestClient(create_app(run_background=True), headers={"authorization": f"Bearer {key}"}) as fast:
        model, frame = _register(fast, tmp_path)
    configure(tmp_path, poll_seconds="60")  # the same database; the dispatcher's next full pass a minute away
    with TestClient(create_app(run_background=True), headers={"authorization": f"Bearer {key}"}) as client:
        import time

        time.sleep(1.0)  # the dispatcher's first pass (at start) is over
        response = client.post(
            "/v1/deletion-requests",
            json={
                "subject_ref": "nudge",
                "model_id": model["id"],
                "scope": {"kind": "samples", "sample_ids": [str(frame["row_id"].iloc[3])]},
            },
        )
        assert response.status_code == 202, response.text
        location = response.headers["location"]
        body = wait_for(
            lambda: (b := client.get(location).json())["status"] != "received" and b,
            timeout=20,
            what="the request's dispatch",
        )
        assert body["status"] in ("queued", "running", "verifying", "certified"), body

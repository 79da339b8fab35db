"""A request naming many sample ids is validated apart from the intake's batches (issue 22: one request with 90,000
unknown ids held the single intake thread, and every request behind it waited as long). On PostgreSQL, where the
intake is meant to carry load: the embedded SQLite default serialises every transaction (BEGIN IMMEDIATE), so there a
large request still delays the others by its own duration."""

from __future__ import annotations

import json
import threading

import pytest
from fastapi.testclient import TestClient

from app.main import create_app
from app.requests import intake
from tests.helpers import configure, make_key, wait_model, write_table
from tests.stack import fresh_database


@pytest.fixture
def client(tmp_path):
    with fresh_database() as url:
        configure(tmp_path, database_url=url, poll_seconds="0.05")
        yield from _client()


def _client():
    key = make_key()
    with TestClient(create_app(run_background=True)) as test_client:
        test_client.headers["authorization"] = f"Bearer {key}"
        yield test_client


def test_a_large_request_never_holds_the_batches_of_small_ones(client, tmp_path, monkeypatch):
    path = tmp_path / "data" / "table.csv"
    write_table(path)
    metadata = {"name": "m", "dataset": {"row_id_column": "row_id", "label_column": "label"}}
    with path.open("rb") as handle:
        response = client.post(
            "/v1/models", data={"metadata": json.dumps(metadata)}, files={"file": ("t.csv", handle, "text/csv")}
        )
    model_id = response.json()["id"]
    assert wait_model(client, model_id, timeout=120)["status"] == "ready"

    # the large request's row look-up waits until the small request has been answered (or 30 s: then it is red)
    small_answered = threading.Event()
    large_looking_up = threading.Event()
    pipelined = intake.pipelined  # the batch's look-ups, one statement (its keys, twins and rows)

    def gated_lookups(session, *statements):
        if any(
            sql == intake._LOOKUPS and len(json.loads(params["rows"])) > intake.LARGE_REQUEST_IDS
            for sql, params in statements
        ):
            large_looking_up.set()
            small_answered.wait(timeout=30)
        return pipelined(session, *statements)

    monkeypatch.setattr(intake, "pipelined", gated_lookups)
    large_ids = [f"unknown-{i}" for i in range(intake.LARGE_REQUEST_IDS + 1)]
    outcome: dict[str, int] = {}

    def large() -> None:
        body = {"subject_ref": "a", "model_id": model_id, "scope": {"kind": "samples", "sample_ids": large_ids}}
        outcome["large"] = client.post("/v1/deletion-requests", json=body).status_code

    thread = threading.Thread(target=large)
    thread.start()
    try:
        assert large_looking_up.wait(timeout=30)
        body = {"subject_ref": "b", "model_id": model_id, "scope": {"kind": "samples", "sample_ids": ["r0"]}}
        small = client.post("/v1/deletion-requests", json=body)
        answered_first = not small_answered.is_set() and "large" not in outcome
        small_answered.set()
    finally:
        small_answered.set()
        thread.join(timeout=60)
    assert small.status_code == 202, small.text
    assert answered_first  # the small request was answered while the large one was still being looked up
    assert outcome["large"] == 422  # and the large one still gets its own answer (unknown ids)

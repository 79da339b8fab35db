"""Shared plumbing for the tests that stop real Celery workers at a named step (app/jobs/faults.py) on PostgreSQL:
a small model, a deletion, and what the database says a job, a request and the stored data set hold."""

from __future__ import annotations

import io
import json
import os
import signal

import pandas as pd
from sqlalchemy import text

from app.db import session_scope
from app.registry.tables import Dataset, Model
from app.storage import get_store
from tests.helpers import wait_for, wait_model, write_table
from tests.stack import stopped


def register_small(stack, tmp_path, name: str, **spec) -> str:
    """A small tabular model (seconds to train and to delete from), registered by a worker that is gone after;
    ``spec``: more registration metadata."""
    source = tmp_path / f"{name}.csv"
    write_table(source, n=300, seed=5)
    metadata = {
        "name": name,
        "verification": {"shadows": 4},  # these tests are about workers and leases, not the audit's power
        "dataset": {"row_id_column": "row_id", "label_column": "label"},
        **spec,
    }
    worker = stack.start_worker(f"reg-{name}")
    try:
        with source.open("rb") as handle:
            response = stack.client.post(
                "/v1/models", data={"metadata": json.dumps(metadata)}, files={"file": ("t.csv", handle, "text/csv")}
            )
        model = wait_model(stack.client, response.json()["id"], timeout=300, interval=0.3)
        assert model["status"] == "ready", model
    finally:
        stack.kill(worker, signal.SIGTERM)
    return model["id"]


def ask(stack, model_id: str, ids: list[str], callback_url: str | None = None, subject: str = "s") -> str:
    """POST a retrain deletion of these rows; its id."""
    body = {"subject_ref": subject, "model_id": model_id, "method": "retrain"}
    body["scope"] = {"kind": "samples", "sample_ids": ids}
    if callback_url:
        body["callback_url"] = callback_url
    response = stack.client.post("/v1/deletion-requests", json=body)
    assert response.status_code == 202, response.text
    return response.json()["id"]


def wait_stopped(proc, what: str, timeout: float = 240) -> None:
    wait_for(lambda: stopped(proc) or proc.poll() is not None, timeout=timeout, interval=0.05, what=what)
    assert proc.poll() is None, f"the worker exited instead of stopping at {what}"


def resume(proc) -> None:
    os.killpg(proc.pid, signal.SIGCONT)


def sql(query: str, **params) -> list:
    with session_scope() as session:
        return list(session.execute(text(query), params).all())


def job_of(request_id: str):
    """(status, attempts, lease_owner) of the request's job."""
    return sql("SELECT status, attempts, lease_owner FROM jobs WHERE request_id = :r", r=request_id)[0]


def owned_by(owner: str | None, proc) -> bool:
    """A worker identity is host:pid:thread (app/jobs/dispatcher.py); a solo Celery worker runs jobs in its own pid."""
    return owner is not None and owner.split(":")[1] == str(proc.pid)


def written_for(request_id: str) -> dict[str, int]:
    """Everything a published deletion writes for its request: versions, certificates, erased rows, webhooks."""
    return {
        "versions": sql("SELECT count(*) FROM model_versions WHERE request_id = :r", r=request_id)[0][0],
        "certificates": sql("SELECT count(*) FROM certificates WHERE request_id = :r", r=request_id)[0][0],
        "erased_rows": sql("SELECT count(*) FROM erased_rows WHERE request_id = :r", r=request_id)[0][0],
        "webhooks": sql("SELECT count(*) FROM webhook_deliveries WHERE request_id = :r", r=request_id)[0][0],
    }


def version_chain(model_id: str) -> list[tuple[int, int | None]]:
    """(number, parent's number) of every version of the model, oldest first."""
    return [
        tuple(r)
        for r in sql(
            "SELECT v.number, p.number FROM model_versions v LEFT JOIN model_versions p ON p.id = v.parent_id "
            "WHERE v.model_id = :m ORDER BY v.number",
            m=model_id,
        )
    ]


def certified_events(stack, request_id: str) -> int:
    items = stack.client.get("/v1/audit", params={"entity_id": request_id, "limit": 100}).json()["items"]
    return [e["action"] for e in items].count("deletion_request.certified")


def assert_erased(model_id: str, ids: list[str]) -> None:
    """The rows are gone from the index and from the stored table the model now points at, and each is recorded
    erased once (a keyed hash)."""
    with session_scope() as session:
        dataset = session.get(Dataset, session.get(Model, model_id).dataset_id)
        dataset_id, digest, chunks, fmt = dataset.id, dataset.digest, dataset.chunks, dataset.format
    left = sql("SELECT count(*) FROM dataset_rows WHERE dataset_id = :d AND row_id = ANY(:ids)", d=dataset_id, ids=ids)
    assert left[0][0] == 0
    hashes = sql("SELECT count(*) FROM erased_rows WHERE dataset_id = :d", d=dataset_id)[0][0]
    assert hashes >= len(ids)
    for blob in chunks or [digest]:  # a chunked table's chunks are Parquet (app/jobs/chunks.py)
        raw = io.BytesIO(get_store().get_bytes(blob))
        frame = pd.read_parquet(raw) if chunks or fmt == "parquet" else pd.read_csv(raw)
        assert not set(ids) & set(frame["row_id"].astype(str)), f"erased rows still in the stored table {blob}"

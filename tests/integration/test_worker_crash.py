"""A worker killed with SIGKILL in the middle of a job: the lease expires, the reconciler re-offers the job, another
worker finishes it, and exactly one new model version exists: mid-retrain (timed by progress) and mid-batch. The kills
at each later step of a deletion are test_worker_crash_steps.py (their own file and stack, so that pytest-xdist runs
the two side by side)."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from sqlalchemy import select

from app.db import session_scope
from app.jobs.tables import Job
from app.registry.tables import ModelVersion
from tests.helpers import wait_for, wait_model, wait_request

pytestmark = pytest.mark.timeout(1200)  # each wait below is at most 600 s: a slow job names itself before the kill


def _slow_table(path, n=20000, d=20, seed=3):
    """Large enough that an MLP retrain takes seconds on 2 cores, so the kill lands mid-job."""
    from sklearn.datasets import make_classification

    X, y = make_classification(n, d, n_informative=10, random_state=seed)
    frame = pd.DataFrame(X.astype(np.float32), columns=[f"f{i}" for i in range(d)])
    frame.insert(0, "row_id", [f"id{i}" for i in range(n)])
    frame["y"] = y
    frame.to_csv(path, index=False)


def _register_slow(stack, tmp_path) -> str:
    path = tmp_path / "slow.csv"
    _slow_table(path)
    metadata = {
        "name": "slow-mlp",
        "family": "mlp",
        "recipe": {"hidden_units": 32, "max_iter": 400, "tol": 1e-12},
        "verification": {"shadows": 4},  # this test is about the crash, not the audit's power
        "dataset": {"row_id_column": "row_id", "label_column": "y"},
    }
    with path.open("rb") as handle:
        response = stack.client.post(
            "/v1/models", data={"metadata": json.dumps(metadata)}, files={"file": ("slow.csv", handle, "text/csv")}
        )
    model_id = response.json()["id"]
    model = wait_model(
        stack.client,
        model_id,
        timeout=600,
        interval=0.5,
        what="version 1",
    )
    assert model["status"] == "ready", model
    return model_id


def test_sigkill_mid_job_finishes_after_lease_expiry_with_one_version(stack, tmp_path):
    model_id = _register_slow(stack, tmp_path)
    response = stack.client.post(
        "/v1/deletion-requests",
        json={"subject_ref": "dave", "model_id": model_id, "scope": {"kind": "samples", "sample_ids": ["id1", "id2"]}},
    )
    assert response.status_code == 202
    request_id = response.json()["id"]
    wait_for(
        lambda: stack.client.get(f"/v1/deletion-requests/{request_id}").json()["status"] == "running",
        timeout=120,
        interval=0.05,
        what="the job to start",
    )
    wait_for(  # progress 0.1 = data loaded, the method (an MLP retrain of several seconds) has started
        lambda: stack.client.get(f"/v1/deletion-requests/{request_id}").json()["progress"] >= 0.1,
        timeout=60,
        interval=0.05,
        what="the unlearning step",
    )
    stack.kill(stack.worker)  # SIGKILL to the worker's whole process group, mid-retrain
    with session_scope() as session:
        job = session.execute(select(Job).where(Job.request_id == request_id)).scalar_one()
        assert job.status == "running" and job.attempts == 1

    stack.worker = stack.start_worker("w2")
    done = wait_request(stack.client, request_id, timeout=600)
    assert done["status"] == "certified", done
    assert done["attempts"] == 2
    with session_scope() as session:
        versions = session.execute(select(ModelVersion).where(ModelVersion.model_id == model_id)).scalars().all()
        assert sorted(v.number for v in versions) == [1, 2]
        assert sum(1 for v in versions if v.request_id == request_id) == 1
    actions = [
        e["action"]
        for e in stack.client.get("/v1/audit", params={"entity_id": request_id, "limit": 100}).json()["items"]
    ]
    assert actions.count("deletion_request.running") == 2
    assert actions.count("deletion_request.certified") == 1


def test_sigkill_mid_batch_loses_nothing_and_duplicates_nothing(stack, tmp_path):
    """Four requests waiting together are taken as one batch; the worker is killed mid-retrain. Every job's lease
    expires, a new worker takes them (as one batch again, or as several if the reconciler re-offers them apart):
    every request is certified exactly once, each row erased once, and no version is published twice."""
    model_id = _register_slow(stack, tmp_path)
    stack.kill(stack.worker)  # the requests queue up with no worker to take them
    ids = []
    for k in range(4):
        response = stack.client.post(
            "/v1/deletion-requests",
            json={
                "subject_ref": f"s{k}",
                "model_id": model_id,
                "method": "retrain",
                "scope": {"kind": "samples", "sample_ids": [f"id{10 + 2 * k}", f"id{11 + 2 * k}"]},
            },
        )
        assert response.status_code == 202
        ids.append(response.json()["id"])
    stack.worker = stack.start_worker("w1b")

    def all_unlearning():
        bodies = [stack.client.get(f"/v1/deletion-requests/{rid}").json() for rid in ids]
        return all(b["status"] == "running" and b["progress"] >= 0.1 for b in bodies)

    wait_for(all_unlearning, timeout=180, interval=0.05, what="the batch's unlearning step")  # one batch: all four
    stack.kill(stack.worker)
    with session_scope() as session:
        jobs = session.execute(select(Job).where(Job.request_id.in_(ids))).scalars().all()
        assert {(j.status, j.attempts) for j in jobs} == {("running", 1)}
        assert len({j.lease_owner for j in jobs}) == 1  # one worker held them all

    stack.worker = stack.start_worker("w2b")
    done = [wait_request(stack.client, rid, timeout=600) for rid in ids]
    assert [d["status"] for d in done] == ["certified"] * 4, done
    with session_scope() as session:
        versions = session.execute(select(ModelVersion).where(ModelVersion.model_id == model_id)).scalars().all()
    served = {d["result_version_id"] for d in done}
    assert {v.id for v in versions if v.number > 1} == served  # no version published that serves no request
    for rid in ids:
        actions = [
            e["action"] for e in stack.client.get("/v1/audit", params={"entity_id": rid, "limit": 100}).json()["items"]
        ]
        assert actions.count("deletion_request.certified") == 1
        certificate = stack.client.get(f"/v1/deletion-requests/{rid}").json()["erasure"]["index"]
        assert certificate["rows_deleted"] == 2

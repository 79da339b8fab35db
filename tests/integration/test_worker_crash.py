"""A worker killed with SIGKILL in the middle of a job: the lease expires, the reconciler re-offers the job, another
worker finishes it, and exactly one new model version exists."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
from sqlalchemy import select

from app.db import session_scope
from app.jobs.tables import Job
from app.registry.tables import ModelVersion
from tests.helpers import wait_for, wait_model, wait_request


def _slow_table(path, n=20000, d=20, seed=3):
    """Large enough that an MLP retrain takes seconds on 2 cores, so the kill lands mid-job."""
    from sklearn.datasets import make_classification

    X, y = make_classification(n, d, n_informative=10, random_state=seed)
    frame = pd.DataFrame(X.astype(np.float32), columns=[f"f{i}" for i in range(d)])
    frame.insert(0, "row_id", [f"id{i}" for i in range(n)])
    frame["y"] = y
    frame.to_csv(path, index=False)


def test_sigkill_mid_job_finishes_after_lease_expiry_with_one_version(stack, tmp_path):
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

"""The federated membership audit through the service (PostgreSQL + Celery, tiny CLIP): the audit's pool stored at
registration (no run trained: clip_shadows.shadow_pool), offline LiRA in the verify step of a deletion against the
shadow LoRA runs trained without its pairs (its reference), the verdict and certificate carrying its figures, and that
reference stored at erasure (the pool queued for shredding)."""

from __future__ import annotations

import base64
import json

import pytest

from app.fedclient import SimulatedClients
from app.jobs.federated import PUBLISHED_RUN
from app.ml.verification.clip_shadows import REPLAY_SOURCES
from tests.helpers import wait_model, wait_request

DATA = {"kind": "synthetic", "seed": 0, "n_clients": 3, "pairs_per_client": 30, "n_test": 30}
FED = {"rounds": 2, "batch_size": 15, "local_epochs": 1.0}


pytestmark = pytest.mark.timeout(1200)  # each wait below is at most 600 s: a slow job names itself before the kill


def test_a_federated_deletion_is_audited_with_shadow_lora_runs(stack):
    response = stack.client.post(
        "/v1/models",
        json={
            "name": "fed-audit",
            "kind": "clip_federated",
            "data": DATA,
            "fed_settings": FED,
            "verification": {"shadows": {"n_shadows": 4}},
        },
    )
    assert response.status_code == 202, response.text
    model_id = response.json()["id"]
    model = wait_model(
        stack.client,
        model_id,
        timeout=600,
        interval=0.5,
        what="version 1 and the audit pool",
    )
    assert model["status"] == "ready", model
    clients = SimulatedClients(stack.client, model_id)
    for r in range(FED["rounds"]):
        assert clients.round(r)["status"] == "succeeded"

    response = stack.client.post(
        "/v1/deletion-requests",
        json={
            "subject_ref": "two pairs",
            "model_id": model_id,
            "method": "fed_retrain",
            "scope": {"kind": "samples", "sample_ids": ["c0-00000", "c0-00001"]},
        },
    )
    assert response.status_code == 202, response.text
    done = wait_request(stack.client, response.json()["id"], timeout=600)
    report = stack.client.get(done["links"]["reports"]).json()["items"][-1]
    assert done["status"] == "certified", report
    attack = report["attack"]
    assert attack["name"] == "lira" and attack["mode"] == "offline" and attack["n_shadows"] == 4
    assert (
        attack["min_out_shadows"] >= 2
        and report["n_forget"] == 2
        and report["n_nonmembers"] == DATA["n_test"] - DATA["n_test"] // 2
    )  # the reference half
    assert {"original", "unlearned", "retrained"} <= set(report["models"])
    # audited against the recipe retrained without the pairs (clip_shadows.shadows_without: four runs, each its own
    # data order, trained before the verdict), so every forget pair is OUT for all four; the erasure stores that set
    assert attack["min_out_shadows"] == 4 and report["shadow_generation"] == 1, attack
    assert report["shadow_reference"]["trained"] == 4 and report["shadow_reference"]["pairs"] == 88
    # registration stored the pool only (clip_shadows.shadow_pool): no run to drop, none that saw an erased pair
    assert report["shadow_reference"]["dropped"] == 0 and report["shadow_reference"]["saw_erased_pairs"] == 0
    # run 0 is the model's recipe in its own data order: the exact method's replay, no second retraining
    assert report["shadow_reference"]["replay"] == REPLAY_SOURCES[True], report["shadow_reference"]
    # and fed_retrain published that run (federated._verifiers_run): the deletion trained the recipe once, not twice
    assert report["shadow_reference"]["published_run_0"] is True
    version = stack.client.get(f"/v1/models/{model_id}/versions").json()[-1]
    assert version["method"] == "fed_retrain" and version["metrics"]["method_info"]["source"] == PUBLISHED_RUN
    checks = {c["name"]: c for c in report["checks"]}
    assert len(checks["forget_excess"]["detail"]["null_draws"]) == 4  # the runs' own leave-one-out draws of E
    assert {"parameters_changed", "forget_attack", "retain_r1_drop"} <= set(checks)
    # the attack check counts only when the audit had power on the original model (policy.decide's rule)
    assert checks["forget_attack"]["passed"] is (True if report["informative"] else None)
    assert set(report["plots"]) == {"roc.png", "phi_hist.png"}
    assert stack.client.get(report["plots"]["roc.png"]).content[:4] == b"\x89PNG"
    # the pool is replaced by the reference; the old entry is queued for shredding
    assert done["erasure"]["verification_shadows"]["before"] != done["erasure"]["verification_shadows"]["after"]
    envelope = stack.client.get(done["links"]["certificate"]).json()
    figures = json.loads(base64.b64decode(envelope["payload"]))["predicate"]
    text = json.dumps(figures)
    assert '"forget_attack"' in text and '"lira_tpr_at_fpr"' in text

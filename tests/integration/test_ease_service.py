"""EASE through the service on PostgreSQL + Celery, on the tiny CLIP: register a federated model, upload rounds,
delete a whole client, read the forget lock, and see later rounds projected and the forgotten client refused."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save as save_tensors

from app.fedclient import SimulatedClients
from tests.helpers import wait_for, wait_model, wait_request

DATA = {"kind": "synthetic", "seed": 0, "n_clients": 4, "pairs_per_client": 40, "n_test": 40}
FED = {"rounds": 5, "batch_size": 20, "local_epochs": 1.0}
POLICY = {"max_retain_r1_drop_points": 15.0, "retain_against_reference": False, "require_informative_evidence": False}
"""This tiny federation (160 pairs, 5 rounds) is undertrained, and EASE's retain R@1 drop on it follows the bits of
the machine's tiny-CLIP backbone: 7.9 points for the client deletion on one machine, under the default 5 on another.
Its client deletion has no informative evidence (by default a request naming EASE then fails and ``auto`` retrains:
tests/unit/test_caption_federation_service.py). The test is about the service path (certificate, lock, refusals,
tombstones), so the model's policy allows a 15-point drop, does not hold the retain R@1 to the reference runs' spread
(stop 50's check) and certifies without informative evidence (per-model settings); the defaults' own effect is
tested in tests/unit (test_federated_verdict_follows_the_policy, test_clip_evidence.py)."""


@pytest.mark.timeout(1200)  # each wait below is at most 600 s: a slow job names itself before the kill
def test_client_deletion_with_ease(stack):
    response = stack.client.post(
        "/v1/models",
        json={
            "name": "fed-clip",
            "kind": "clip_federated",
            "data": DATA,
            "fed_settings": FED,
            "verification": {"policy": POLICY},
        },
    )
    assert response.status_code == 202, response.text
    model_id = response.json()["id"]
    model = wait_model(
        stack.client,
        model_id,
        timeout=600,
        interval=0.5,
        what="version 1 (tiny CLIP, LoRA init)",
    )
    assert model["status"] == "ready", model
    assert model["federation"]["clients"] == ["c0", "c1", "c2", "c3"]

    clients = SimulatedClients(stack.client, model_id)
    for r in range(FED["rounds"]):
        job = clients.round(r)
        assert job["status"] == "succeeded", job
    versions = stack.client.get(f"/v1/models/{model_id}/versions").json()
    assert [v["method"] for v in versions] == ["lora-init"] + ["fedavg"] * FED["rounds"]

    response = stack.client.post(
        "/v1/deletion-requests",
        json={
            "subject_ref": "client c1 leaves",
            "model_id": model_id,
            "method": "ease",
            "scope": {"kind": "client", "client_id": "c1"},
        },
    )
    assert response.status_code == 202, response.text
    request_id = response.json()["id"]
    done = wait_request(stack.client, request_id, timeout=600)
    assert done["status"] == "certified", (done.get("error"), done.get("verification"))
    version = stack.client.get(f"/v1/models/{model_id}/versions").json()[-1]
    assert version["method"] == "ease" and version["request_id"] == request_id
    before, after = version["metrics"]["before"], version["metrics"]["after"]
    assert {"forget_r1", "retain_r1", "test_r1"} <= set(before) and {"forget_r1", "retain_r1"} <= set(after)

    lock = stack.client.get(f"/v1/models/{model_id}/forget-lock").json()
    # α = 0: the server projection alone holds the lock (no client needs the basis; app/ml/unlearning/ease)
    assert lock["request_id"] == request_id and lock["rank"] >= 1 and lock["alpha"] == 0
    tensors = stack.client.get(lock["links"]["tensors"])
    assert tensors.status_code == 200 and len(tensors.content) > lock["n_params"] * 4
    model = stack.client.get(f"/v1/models/{model_id}").json()
    assert model["federation"]["removed_clients"] == ["c1"]

    # the forgotten client may not send updates any more
    p = lock["n_params"]
    bad = torch.zeros(4, p)
    bad[1] = 0.01
    response = stack.client.post(
        f"/v1/models/{model_id}/rounds",
        content=save_tensors({"updates": bad}),
        headers={"content-type": "application/octet-stream"},
    )
    job = wait_for(
        lambda: (
            (b := stack.client.get(f"/v1/jobs/{response.json()['job_id']}").json())["status"] in ("succeeded", "failed")
            and b
        ),
        timeout=120,
        what="refused round",
    )
    assert job["status"] == "failed" and "c1" in job["error"]

    # a later round is projected off the forget-exclusive directions before it is applied
    job = clients.round(FED["rounds"], use_lock=True)
    assert job["status"] == "succeeded", job
    latest = stack.client.get(f"/v1/models/{model_id}/versions").json()[-1]
    assert latest["method"] == "fedavg+forget-lock" and latest["metrics"]["projected"] is True
    assert latest["metrics"]["lock_drift"] < 1e-3

    # the departed client's pairs are no longer listed for training
    pairs = stack.client.get(f"/v1/models/{model_id}/pairs").json()
    assert pairs["clients"]["c1"] == [] and len(pairs["clients"]["c0"]) == DATA["pairs_per_client"]

    # a class deletion next, as ``auto`` runs it. Its verdict trains the recipe without the class for as many rounds
    # as the model has (federated._reference_rounds, past the recipe's five too), and that reference's run 0 is the
    # exact deletion, so ``auto`` publishes it at once (federated.Deletion.exact_in_verification, stop 48): no EASE
    # pass (which on this undertrained federation kept more of the class than the policy allows: E′ 2.22 against E₀
    # 4.82, and the attack). Retraining publishes no lock of its own: the client deletion's stays. The clients drop
    # the deleted pairs before their next round
    first_rank = lock["rank"]
    response = stack.client.post(
        "/v1/deletion-requests",
        json={
            "subject_ref": "no purple",
            "model_id": model_id,
            "method": "auto",
            "scope": {"kind": "class", "label": "purple"},
        },
    )
    assert response.status_code == 202, response.text
    done = wait_request(stack.client, response.json()["id"], timeout=600)
    assert done["status"] == "certified", (done.get("error"), done.get("verification"))
    reports = stack.client.get("/v1/reports", params={"request_id": done["id"]}).json()["items"]
    attempts = [(r["method"], r["verdict"]) for r in reports]
    assert attempts == [("fed_retrain", "pass")], attempts
    version = stack.client.get(f"/v1/models/{model_id}/versions").json()[-1]
    merged = stack.client.get(f"/v1/models/{model_id}/forget-lock").json()
    assert "run 0 is exact retraining" in version["metrics"]["choice"]["note"], version["metrics"]
    assert version["method"] == "fed_retrain" and merged["rank"] == first_rank
    pairs = stack.client.get(f"/v1/models/{model_id}/pairs").json()
    live = {pid for ids in pairs["clients"].values() for pid in ids}
    purple = {pid for c in clients.data.clients for pid, cap in zip(c.ids, c.captions, strict=True) if "purple" in cap}
    assert purple and not live & purple and pairs["n_pairs"] == len(live)
    job = clients.round(FED["rounds"] + 1)
    assert job["status"] == "succeeded", job
    trained = [cap for c in clients.fed.clients for cap in c.captions]
    assert trained and not any("purple" in cap for cap in trained)
    assert len(clients.fed.clients[1]) == 0

    # wrong shapes are refused at the door
    response = stack.client.post(
        f"/v1/models/{model_id}/rounds",
        content=save_tensors({"updates": torch.zeros(2, 3)}),
        headers={"content-type": "application/octet-stream"},
    )
    assert response.status_code == 422 and response.json()["type"].endswith("/invalid-round")
    response = stack.client.post(
        f"/v1/models/{model_id}/rounds",
        content=b"not safetensors",
        headers={"content-type": "application/octet-stream"},
    )
    assert response.status_code == 422
    unknown = stack.client.post(
        "/v1/deletion-requests",
        json={
            "subject_ref": "x",
            "model_id": model_id,
            "method": "ease",
            "scope": {"kind": "client", "client_id": "c9"},
        },
    )
    assert unknown.status_code == 422 and unknown.json()["type"].endswith("/unknown-client")

"""Certified removal through the API (issue 20, item 3; embedded default): a model registered with
``certified_removal`` publishes Guo et al.'s perturbed model on its first deletion, each certificate states (ε, δ) and
the residual budget spent, ``lethe verify-certificate`` shows the evidence class and the guarantee, and the evidence
is judged against the PERTURBED retained objective (the plain one would fail it: the noise moves the optimum)."""

from __future__ import annotations

import base64
import json

import pytest
from fastapi.testclient import TestClient

from app.certificates.verify_cli import verify_file
from app.main import create_app
from tests.helpers import configure, delete_rows, make_key, wait_for, write_table

SETTINGS = {"epsilon": 1.0, "delta": 1e-4, "residual_budget": 0.2}
"""ε′ small enough for a 480-row training set (σ = c·ε′/ε ≈ 0.9; the noise enters the mean objective as b/n): a
larger one costs more than the utility check allows against the unperturbed version 1."""


@pytest.fixture
def client(tmp_path):
    configure(tmp_path / "home", poll_seconds="0.05")
    key = make_key()
    with TestClient(create_app(run_background=True)) as c:
        c.headers["authorization"] = f"Bearer {key}"
        yield c


def _register(client, tmp_path, **extra):
    source = tmp_path / "table.csv"
    write_table(source, n=600, seed=3)
    metadata = {
        "name": "certified",
        "unlearning": ["certified_removal"],
        "method_settings": {"certified_removal": SETTINGS},
        "dataset": {"row_id_column": "row_id", "label_column": "label"},
        **extra,
    }
    with source.open("rb") as handle:
        response = client.post(
            "/v1/models", data={"metadata": json.dumps(metadata)}, files={"file": ("table.csv", handle, "text/csv")}
        )
    assert response.status_code == 202, response.text
    model_id = response.json()["id"]
    return wait_for(
        lambda: (
            (b := client.get(f"/v1/models/{model_id}").json())["unlearning"]["certified_removal"].get("status")
            in ("ready", "refused")
            and b
        ),
        timeout=120,
        what="certified_removal preparation",
    )


def _delete(client, model_id, rows, method="certified_removal"):
    return delete_rows(client, model_id, rows, method, timeout=120)


def test_certificates_state_epsilon_delta_and_the_budget(client, tmp_path):
    model = _register(client, tmp_path, verification={"shadows": 8})
    entry = model["unlearning"]["certified_removal"]
    assert entry["status"] == "ready", entry
    assert entry["info"]["noise_std"] > 0 and entry["info"]["spent"] < SETTINGS["residual_budget"]

    spent = []
    for rows in (["r3"], ["r10", "r11"]):
        done = _delete(client, model["id"], rows)
        assert done["status"] == "certified", (done["error"], done.get("status"))
        envelope = client.get(done["links"]["certificate"]).json()
        (tmp_path / "c.json").write_text(json.dumps(envelope))
        (tmp_path / "k.json").write_text(json.dumps(client.get("/.well-known/lethe-keys.json").json()))
        ok, summary = verify_file(str(tmp_path / "c.json"), str(tmp_path / "k.json"))
        assert ok, summary
        assert "evidence class: proven_distance[part perturbed]" in summary, summary
        assert "epsilon 1.0, delta 0.0001" in summary, summary
        statement = json.loads(base64.b64decode(envelope["payload"]))
        figures = statement["predicate"]["verification"]["figures"]
        guarantee = figures["certified_removal"]
        assert guarantee["epsilon"] == 1.0 and guarantee["delta"] == 1e-4 and guarantee["budget"] == 0.2
        assert 0 < guarantee["spent"] <= guarantee["budget"] and guarantee["exact_residual"] <= guarantee["spent"]
        spent.append(guarantee)
    # the second removal spends from the same budget (Algorithm 2's running sum) unless it had to retrain
    assert spent[1]["retrained"] or spent[1]["spent"] > spent[0]["spent"]

    # an erasure by another method purges the state model (it was trained on the row) with fresh noise
    done = _delete(client, model["id"], ["r20"], method="retrain")
    assert done["status"] == "certified", done
    assert done["erasure"]["method_state"]["certified_removal"]["action"] == "purged"


def test_an_mlp_registration_is_refused_with_the_reason(client, tmp_path):
    model = _register(
        client, tmp_path, family="mlp", recipe={"hidden_units": 3, "max_iter": 50}, verification={"shadows": 4}
    )
    entry = model["unlearning"]["certified_removal"]
    assert entry["status"] == "refused" and "binary logistic regression" in entry["reason"], entry

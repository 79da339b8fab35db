"""Issue 23, "models you can take out": a tabular version's weights download carries its model card (recipe, feature
order, encoder, label classes, parameter layout, lineage, digest, measured accuracy) and predicts, from the file alone
and a copy of app/ml/export.py run in a separate interpreter that cannot import the service, what the service
predicts; ``POST /v1/models/{id}/predict`` answers the same; retired versions stay refused."""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.numpy import load as load_arrays
from safetensors.numpy import save as save_arrays

from app.db import session_scope
from app.jobs.tabular import holdout_mask
from app.main import create_app
from app.ml import export, tabular
from app.ml.data.tabular import TableEncoder
from app.problems import PROBLEM_BASE
from app.registry import service as registry_service
from app.registry.tables import Model
from app.registry.versions import load_weights
from tests.helpers import ALL_SCOPES, configure, delete_rows, make_key, wait_model, write_table

ROOT = Path(__file__).resolve().parents[2]
HOLDOUT = 0.25
STANDALONE = """
import json, sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).parent))  # the copied reader, next to the file (-I keeps the repo away)
import lethe_export

model = lethe_export.load(Path(sys.argv[1]).read_bytes())
rows = json.loads(Path(sys.argv[2]).read_text())
X = model.encode(rows)
out = {"X": X.tolist(), "proba": model.predict_proba(X).tolist(), "labels": model.predict(X), "card": model.card,
       "modules": sorted(m for m in sys.modules if m.split(".")[0] in ("app", "torch", "pandas", "scipy", "tests"))}
print(json.dumps(out))
"""


def _rows(frame: pd.DataFrame, columns: list[str]) -> list[dict]:
    """Rows as JSON would carry them: NaN -> null, numpy scalars -> Python numbers."""
    out = []
    for record in frame[columns].to_dict("records"):
        out.append({k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in record.items()})
    return json.loads(json.dumps(out, default=lambda v: v.item()))


def _standalone(tmp_path: Path, data: bytes, rows: list[dict]) -> dict:
    """Run the copied reader on the file in an isolated interpreter (no PYTHONPATH, no repo on sys.path)."""
    where = tmp_path / "outside"
    where.mkdir(exist_ok=True)
    shutil.copy(ROOT / "app" / "ml" / "export.py", where / "lethe_export.py")
    (where / "use.py").write_text(STANDALONE)
    (where / "model.safetensors").write_bytes(data)
    (where / "rows.json").write_text(json.dumps(rows))
    result = subprocess.run(
        [sys.executable, "-I", str(where / "use.py"), str(where / "model.safetensors"), str(where / "rows.json")],
        capture_output=True,
        text=True,
        cwd=where,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["modules"] == [], out["modules"]  # nothing of the service, no torch or pandas: the file alone
    return out


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    home = tmp_path_factory.mktemp("export")
    configure(home, poll_seconds="0.05")
    key = make_key(ALL_SCOPES)
    path = home / "data" / "people.csv"
    frame = write_table(path, n=240, seed=5)
    held, trained = np.flatnonzero(holdout_mask(240, HOLDOUT, 0)), np.flatnonzero(~holdout_mask(240, HOLDOUT, 0))
    frame.loc[[held[0], held[1], trained[0]], "x1"] = np.nan  # missing values: imputed (0 after standardising)
    frame.loc[[held[2], trained[1]], "colour"] = None  # an all-zero one-hot block
    frame.to_csv(path, index=False)
    frame = pd.read_csv(path)  # the table as the service reads it
    metadata = {
        "name": "people",
        "holdout_fraction": HOLDOUT,
        "verification": {"shadows": 8},
        "dataset": {"row_id_column": "row_id", "label_column": "label"},
    }
    with TestClient(create_app(run_background=True)) as client:
        client.headers["authorization"] = f"Bearer {key}"
        with path.open("rb") as handle:
            response = client.post(
                "/v1/models", data={"metadata": json.dumps(metadata)}, files={"file": ("people.csv", handle)}
            )
        assert response.status_code == 202, response.text
        model = wait_model(client, response.json()["id"], timeout=300)
        assert model["status"] == "ready", model
        yield client, model, frame


def _problem(response, status: int, slug: str) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    body = response.json()
    assert body["type"] == PROBLEM_BASE + slug, body
    return body


def _service_proba(model_id: str, frame: pd.DataFrame, digest: str) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """What the service computes for rows (the worker's encoder and torch forward pass)."""
    with session_scope() as session:
        model = registry_service.get_model_or_404(session, model_id)
        encoder, recipe = TableEncoder.from_dict(model.state["encoder"]), registry_service._recipe(session, model)
    X = encoder.transform(frame)
    theta = torch.from_numpy(load_weights(digest))
    return (
        X,
        tabular.predict_proba(tabular.TabularRecipe.from_dict(recipe), theta, X, encoder.n_classes),
        encoder.classes,
    )


def test_an_exported_version_predicts_alone_what_the_service_predicts(stack, tmp_path):
    client, model, frame = stack
    model_id = model["id"]
    version = model["current_version"]
    data = client.get(f"/v1/models/{model_id}/versions/1/weights")
    assert data.status_code == 200 and data.headers["content-type"] == "application/octet-stream"
    assert data.headers["etag"] == f'"{hashlib.sha256(data.content).hexdigest()}"'

    held_out = frame[holdout_mask(len(frame), HOLDOUT, 0)]
    assert len(held_out) == 60 and held_out["x1"].isna().sum() == 2 and held_out["colour"].isna().sum() == 1
    columns = [c for c in frame.columns if c not in ("row_id", "label")]
    rows = _rows(held_out, columns)
    outside = _standalone(tmp_path, data.content, rows)
    X, proba, classes = _service_proba(model_id, held_out, version["digest"])
    assert np.array_equal(np.asarray(outside["X"], dtype=np.float32), X)  # the encoding, bit for bit
    assert np.abs(np.asarray(outside["proba"]) - proba).max() < 1e-12  # float64 rounding only
    assert outside["labels"] == [classes[k] for k in proba.argmax(1)]
    accuracy = float(np.mean(np.asarray(outside["labels"]) == held_out["label"].to_numpy()))
    assert version["quality"]["holdout_accuracy"] == round(accuracy, 6) == version["metrics"]["accuracy_holdout"]
    assert version["quality"]["holdout_rows"] == 60 and version["quality"]["trained_rows"] == 180

    card = outside["card"]
    assert card["format"] == "lethe.tabular/1"
    assert card["model"] == {"id": model_id, "name": "people", "kind": "tabular", "family": "logistic_regression"}
    assert {k: card["version"][k] for k in ("id", "number", "parent_id", "method", "request_id", "digest")} == {
        "id": version["id"], "number": 1, "parent_id": None, "method": "train", "request_id": None,
        "digest": version["digest"],
    }  # fmt: skip
    assert card["version"]["created_at"].startswith(version["created_at"][:19])
    assert (
        card["recipe"]["family"] == "logistic_regression"
        and card["recipe"]["l2"] == tabular.DEFAULT_L2["logistic_regression"]
    )
    assert card["encoder"]["feature_columns"] == columns and card["encoder"]["classes"] == ["no", "yes"]
    assert card["encoder"]["categories"]["colour"] == ["blue", "green", "red"]
    assert card["features"][-3:] == ["colour=blue", "colour=green", "colour=red"]
    assert (
        card["layout"]["params"]
        == [
            {"name": "weight", "shape": [1, 9], "offset": 0},
            {"name": "bias", "shape": [1], "offset": 9},
        ]
        and card["layout"]["members"] == 1
    )
    assert card["quality"] == version["quality"]
    # the digest certificates sign is the stored file of theta alone: recomputable from the export
    theta = load_arrays(data.content)["theta"]
    assert hashlib.sha256(save_arrays({"theta": theta})).hexdigest() == version["digest"]

    answered = client.post(f"/v1/models/{model_id}/predict", json={"rows": rows})
    assert answered.status_code == 200, answered.text
    body = answered.json()
    assert body["version"] == {"id": version["id"], "number": 1, "digest": version["digest"]}
    assert body["classes"] == ["no", "yes"] and body["labels"] == outside["labels"]
    assert np.abs(np.asarray(body["probabilities"]) - proba).max() < 1e-12
    assert client.get(f"/v1/models/{model_id}").json()["inputs"] == {
        **{f"x{i}": "number" for i in range(6)}, "colour": "text"
    }  # fmt: skip


def test_an_unlearned_version_exports_its_lineage_and_the_retired_one_stays_refused(stack, tmp_path):
    client, model, frame = stack
    model_id = model["id"]
    trained = frame[~holdout_mask(len(frame), HOLDOUT, 0)]
    done = delete_rows(client, model_id, [trained["row_id"].iloc[0]], "retrain")
    assert done["status"] == "certified", done
    versions = client.get(f"/v1/models/{model_id}/versions").json()
    v1, v2 = versions
    assert v2["quality"]["forget_rows"] == 1 and v2["quality"]["trained_rows"] == 179
    assert v2["quality"]["holdout_accuracy"] == v2["metrics"]["after"]["accuracy_holdout"]

    _problem(client.get(f"/v1/models/{model_id}/versions/1/weights"), 410, "version-retired")
    _problem(client.post(f"/v1/models/{model_id}/predict", json={"rows": [{}], "version": 1}), 410, "version-retired")
    data = client.get(f"/v1/models/{model_id}/versions/2/weights").content
    rows = _rows(frame, [c for c in frame.columns if c not in ("row_id", "label")])
    outside = _standalone(tmp_path, data, rows)
    card = outside["card"]["version"]
    assert (card["number"], card["parent_id"], card["parent_number"], card["method"], card["request_id"]) == (
        2, v1["id"], 1, "retrain", done["id"]
    )  # fmt: skip
    assert card["digest"] == v2["digest"] and outside["card"]["quality"] == v2["quality"]
    _, proba, _ = _service_proba(model_id, frame, v2["digest"])
    assert np.abs(np.asarray(outside["proba"]) - proba).max() < 1e-12
    body = client.post(f"/v1/models/{model_id}/predict", json={"rows": rows[:5]}).json()
    assert body["version"]["number"] == 2 and body["labels"] == outside["labels"][:5]


def test_predict_refuses_rows_that_do_not_fit(stack):
    client, model, _ = stack
    url = f"/v1/models/{model['id']}/predict"
    row = {**{f"x{i}": 0.5 for i in range(6)}, "colour": "red"}
    assert client.post(url, json={"rows": [row, {**row, "x0": None, "colour": "violet"}]}).status_code == 200

    problem = _problem(
        client.post(url, json={"rows": [{**row, "email": "a@b.org", "label": "yes"}]}), 422, "invalid-rows"
    )
    assert problem["unknown_columns"] == ["email", "label"] and problem["missing_columns"] == []
    problem = _problem(client.post(url, json={"rows": [row, {k: v for k, v in row.items() if k != "x3"}]}), 422,
                       "invalid-rows")  # fmt: skip
    assert problem["missing_columns"] == ["x3"] and "x3" in problem["detail"]
    problem = _problem(client.post(url, json={"rows": [row, {**row, "x2": "4.5", "colour": 3}]}), 422, "invalid-rows")
    assert [(e["row"], e["column"]) for e in problem["row_errors"]] == [(1, "x2"), (1, "colour")]
    assert problem["feature_columns"] == [*(f"x{i}" for i in range(6)), "colour"]
    _problem(client.post(url, json={"rows": [{**row, "x0": [1]}]}), 422, "validation-error")
    _problem(client.post(url, json={"rows": []}), 422, "validation-error")
    problem = _problem(client.post(url, json={"rows": [row] * 1001}), 413, "too-many-rows")
    assert problem["max_rows"] == 1000
    assert client.post(url, json={"rows": [row] * 1000}).status_code == 200
    _problem(client.post(url, json={"rows": [row], "version": 9}), 404, "version-not-found")
    _problem(client.post("/v1/models/nope/predict", json={"rows": [row]}), 404, "model-not-found")
    reader = make_key(["requests:read"], name="reader")
    response = client.post(url, json={"rows": [row]}, headers={"authorization": f"Bearer {reader}"})
    assert _problem(response, 403, "forbidden")["required_scope"] == "models:read"


def test_predict_bounds_rows_times_parameters(stack, monkeypatch):
    """A larger model takes fewer rows per call: the forward pass the API process runs stays bounded."""
    client, model, _ = stack
    monkeypatch.setattr(registry_service, "PREDICT_MAX_WORK", 10 * 10)  # the model has 10 parameters
    url = f"/v1/models/{model['id']}/predict"
    row = {**{f"x{i}": 0.5 for i in range(6)}, "colour": "red"}
    assert client.post(url, json={"rows": [row] * 10}).status_code == 200
    assert _problem(client.post(url, json={"rows": [row] * 11}), 413, "too-many-rows")["max_rows"] == 10


def test_predict_answers_a_clear_problem_for_federated_and_unready_models(stack):
    client, _, _ = stack
    with session_scope() as session:
        fed = Model(name="fed", kind="clip_federated", status="ready", spec={}, state={})
        pending = Model(name="pending", kind="tabular", status="registering", spec={}, state={})
        session.add_all([fed, pending])
        session.flush()
        ids = fed.id, pending.id
    row = {"x0": 1.0}
    problem = _problem(client.post(f"/v1/models/{ids[0]}/predict", json={"rows": [row]}), 422,
                       "prediction-not-supported")  # fmt: skip
    assert "clip_federated" in problem["detail"]
    _problem(client.post(f"/v1/models/{ids[1]}/predict", json={"rows": [row]}), 409, "model-not-ready")


# ---------------------------------------------------------------------------------------------- the reader alone
@pytest.mark.parametrize(
    ("family", "classes", "members"),
    [("logistic_regression", 2, 1), ("logistic_regression", 3, 1), ("mlp", 3, 1), ("mlp", 2, 3)],
)
def test_the_reader_matches_the_service_forward_pass(tmp_path, family, classes, members):
    """Every layout the service stores (binary and softmax LR, the MLP, SISA's concatenated members) reads back to
    the service's probabilities; the layout is the service's own."""
    frame = write_table(tmp_path / "t.csv", n=200, seed=2, classes=classes)
    frame.loc[3, "x2"] = np.nan
    encoder = TableEncoder.fit(frame, "label", exclude=["row_id"])
    X, y = encoder.transform(frame), encoder.encode_labels(frame["label"])
    recipe = tabular.TabularRecipe(family=family, hidden_units=4)
    parts = [tabular.train(tabular.TabularRecipe(family=family, hidden_units=4, seed=s), X, y, encoder.n_classes)
             for s in range(members)]  # fmt: skip
    theta = torch.cat(parts).numpy()
    card = export.make_card(
        model={"id": "m"}, version={"id": "v"}, recipe=recipe.to_dict(), encoder=encoder.to_dict(), theta=theta
    )
    expected = tabular.param_shapes(recipe, encoder.n_features, encoder.n_classes)
    assert [(p["name"], tuple(p["shape"])) for p in card["layout"]["params"]] == expected
    assert card["layout"]["members"] == members
    predictor = export.load(export.export_bytes(theta, card))
    rows = _rows(frame, encoder.feature_columns)
    assert np.array_equal(predictor.encode(rows), X)
    proba = tabular.predict_proba(recipe, torch.from_numpy(theta), X, encoder.n_classes)
    assert np.abs(predictor.predict_proba(rows) - proba).max() < 1e-12
    assert predictor.predict(rows) == encoder.decode_labels(proba.argmax(1))


def test_the_reader_refuses_what_is_not_an_untouched_export(tmp_path):
    frame = write_table(tmp_path / "t.csv", n=80, seed=1)
    encoder = TableEncoder.fit(frame, "label", exclude=["row_id"])
    theta = np.linspace(-1, 1, encoder.n_features + 1).astype(np.float32)
    card = export.make_card(
        model={"id": "m"}, version={"id": "v"}, recipe={"family": "logistic_regression"}, encoder=encoder.to_dict(),
        theta=theta,
    )  # fmt: skip
    data = export.export_bytes(theta, card)
    assert export.load(data).n_params == theta.size
    changed = bytearray(data)
    changed[-1] ^= 0x01  # one bit of theta
    with pytest.raises(export.ExportError, match="theta_sha256"):
        export.load(bytes(changed))
    with pytest.raises(export.ExportError, match="not an exported"):
        export.load(save_arrays({"theta": theta}))  # the bare stored file carries no card
    with pytest.raises(export.ExportError, match="multiple"):
        export.make_card(model={}, version={}, recipe={"family": "mlp"}, encoder=encoder.to_dict(), theta=theta)

"""Issue 23: a registration whose table has an identifier column (an e-mail, a UUID, a name on every row, a row
counter) not named as ``subject_column`` is refused with ``422 identifier-column`` naming the column, instead of
one-hot encoding the identifiers into the weights; ``subject_column``, ``exclude_columns`` and
``allow_identifier_columns`` each settle it; real tables (Adult) and the tests' generated tables pass; the worker
checks the whole table again."""

from __future__ import annotations

import io
import json
import uuid
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from fastapi.testclient import TestClient

from app.main import create_app
from app.ml import identifiers
from app.ml.data.tabular import TableEncoder, load_table
from app.problems import PROBLEM_BASE
from app.registry import identifier_guard
from tests.helpers import configure, make_key, wait_model, write_table

ADULT = Path(__file__).resolve().parents[3] / "shared" / "datasets" / "adult.csv"
N = 120


def _table(tmp_path: Path, **columns) -> pd.DataFrame:
    frame = write_table(tmp_path / "base.csv", n=N, seed=7)
    for name, values in columns.items():
        frame[name] = values
    return frame


def _csv(frame: pd.DataFrame, index: bool = False) -> bytes:
    return frame.to_csv(index=index).encode()


@pytest.fixture
def api(tmp_path):
    configure(tmp_path / "home")
    key = make_key()
    with TestClient(create_app(run_background=False)) as client:
        client.headers["authorization"] = f"Bearer {key}"
        yield client


def _register(client, data: bytes, name: str = "t.csv", extra: dict | None = None, **dataset):
    metadata = {
        "name": "m",
        "dataset": {"row_id_column": "row_id", "label_column": "label", **dataset},
        **(extra or {}),
    }
    return client.post("/v1/models", data={"metadata": json.dumps(metadata)}, files={"file": (name, data)})


def _refused(response) -> dict:
    assert response.status_code == 422, response.text
    body = response.json()
    assert body["type"] == PROBLEM_BASE + "identifier-column", body
    return body


EMAILS = [f"person{i}@example.org" for i in range(N)]


@pytest.mark.parametrize(
    ("column", "values", "reason"),
    [
        ("email", EMAILS, "email"),
        ("contact", [EMAILS[0] if i == 5 else "phone" for i in range(N)], "email"),  # one address is one too many
        ("session", [str(uuid.UUID(int=i + 1)) for i in range(N)], "uuid"),
        ("full_name", [f"Person Number {i}" for i in range(N)], "unique"),
    ],
)
def test_an_identifier_feature_column_is_refused_by_name(api, tmp_path, column, values, reason):
    body = _refused(_register(api, _csv(_table(tmp_path, **{column: values}))))
    assert body["columns"] == [{"column": column, "reason": reason, "explanation": body["columns"][0]["explanation"]}]
    assert column in body["detail"] and "subject_column" in body["detail"] and "exclude_columns" in body["detail"]
    assert "person0@" not in json.dumps(body)  # the values themselves are never echoed


def test_a_row_counter_and_parquet_tables_are_caught(api, tmp_path):
    frame = _table(tmp_path)
    indexed = _csv(frame, index=True)  # pandas' index, written under a blank header: read back as "Unnamed: 0"
    body = _refused(_register(api, indexed))
    assert [c["column"] for c in body["columns"]] == ["Unnamed: 0"] and body["columns"][0]["reason"] == "counter"
    assert _register(api, indexed, exclude_columns=["Unnamed: 0"]).status_code == 202
    buffer = io.BytesIO()
    _table(tmp_path, email=EMAILS, customer=np.arange(1000, 1000 + N)).to_parquet(buffer, index=False)
    body = _refused(_register(api, buffer.getvalue(), "t.parquet"))
    assert [(c["column"], c["reason"]) for c in body["columns"]] == [("email", "email"), ("customer", "counter")]


def test_the_caller_settles_it_with_one_field(api, tmp_path):
    data = _csv(_table(tmp_path, email=EMAILS))
    assert _register(api, data, subject_column="email").status_code == 202
    assert _register(api, data, exclude_columns=["email"]).status_code == 202
    assert _register(api, data, allow_identifier_columns=["email"]).status_code == 202
    response = _register(api, data, exclude_columns=["mail"])
    assert response.status_code == 422 and response.json()["type"] == PROBLEM_BASE + "unknown-column"
    response = _register(api, data, exclude_columns=["label"])
    assert response.status_code == 422 and response.json()["type"] == PROBLEM_BASE + "validation-error"


def test_a_server_side_file_is_refused_without_naming_its_columns(api, tmp_path):
    path = tmp_path / "home" / "data" / "people.csv"
    path.write_bytes(_csv(_table(tmp_path, secret_column_name=EMAILS)))
    metadata = {"name": "m", "dataset": {"path": str(path), "row_id_column": "row_id", "label_column": "label"}}
    body = _refused(api.post("/v1/models", json=metadata))
    assert "secret_column_name" not in json.dumps(body) and "e-mail" in body["detail"]


def test_ordinary_tables_pass(api, tmp_path):
    """The tests' generated tables (float features, a three-colour category), a measurement that is distinct on
    every row (not a counter), a subject column, repeated categories: no finding."""
    grams = np.random.default_rng(0).integers(10_000, 90_000, N)
    frame = _table(tmp_path, grams=grams, person=[f"p{i % 9}" for i in range(N)])
    assert _register(api, _csv(frame)).status_code == 202
    features = [c for c in frame.columns if c not in ("row_id", "label")]
    assert identifier_guard.findings(_csv(frame), "csv", features) == []


@pytest.mark.skipif(not ADULT.exists(), reason="the Adult table is not in shared/datasets")
def test_adult_has_no_identifier_column():
    """The benchmark's real table: no column of Adult looks like an identifier, in the registration's sample or
    over the whole table (fnlwgt is an integer that is nearly unique but no counter)."""
    data = ADULT.read_bytes()
    frame = load_table(data, "csv")
    columns = [c for c in frame.columns if c != "Salary"]
    assert identifier_guard.findings(data, "csv", columns) == []
    encoder = TableEncoder.fit(frame, "Salary")
    assert identifiers.encoder_findings(encoder.to_dict(), len(frame)) == []


def test_the_worker_checks_the_whole_table(tmp_path, monkeypatch):
    """A column that looks harmless in the registration's sample (here: 20 rows) and holds e-mail addresses further
    down fails the registration in the worker, before anything is trained; listed in ``exclude_columns`` it is no
    feature of the trained model."""
    monkeypatch.setattr(identifier_guard, "SAMPLE_ROWS", 20)
    configure(tmp_path / "home", poll_seconds="0.05")
    key = make_key()
    late = ["n/a" if i < 20 else EMAILS[i] for i in range(N)]
    data = _csv(_table(tmp_path, contact=late))
    with TestClient(create_app(run_background=True)) as client:
        client.headers["authorization"] = f"Bearer {key}"
        response = _register(client, data, extra={"verification": {"shadows": 4}})
        assert response.status_code == 202, response.text
        failed = wait_model(client, response.json()["id"], timeout=120)
        assert failed["status"] == "failed" and "'contact'" in failed["error"] and "e-mail" in failed["error"]
        assert failed["current_version"] is None
        response = _register(client, data, extra={"verification": {"shadows": 4}}, exclude_columns=["contact"])
        ready = wait_model(client, response.json()["id"], timeout=300)
        assert ready["status"] == "ready", ready
        assert "contact" not in ready["inputs"] and list(ready["inputs"])[-1] == "colour"


def test_the_rules():
    assert identifiers.text_finding("c", ["a.b+tag@mail.example.co.uk"], 1).reason == "email"
    assert identifiers.text_finding("c", ["{123E4567-E89B-12D3-A456-426614174000}"], 1).reason == "uuid"
    assert identifiers.text_finding("c", ["@handle", "a@b", "red"], 3) is None
    assert identifiers.text_finding("c", [str(i) + "x" for i in range(44)], 50) is None  # below 90 % distinct
    assert identifiers.text_finding("c", [str(i) + "x" for i in range(45)], 49) is None  # too few rows to tell
    assert identifiers.text_finding("c", [str(i) + "x" for i in range(50)], 50).reason == "unique"
    assert identifiers.integer_finding("c", list(range(7, 57))).reason == "counter"
    assert identifiers.integer_finding("c", list(range(0, 100, 2))) is None
    assert identifiers.integer_finding("c", [*range(49), 0]) is None

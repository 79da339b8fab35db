"""Trust issue, erasure: a completed deletion leaves no stored copy of the erased rows (embedded default: SQLite file
and WAL, artifact folder), retires the versions trained on them, purges or drops every prepared method's state, and
keeps only keyed hashes of the ids. Each assertion failed on the code before the erase step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from app.main import create_app
from tests.helpers import configure, make_key, wait_for, wait_request, write_table

MARK = b"ZQX7"
SMALL_L2UL = {"m": 24, "subset_size": 120, "t": 10, "epochs": 20, "workers": 1, "units": 2, "calibration_tasks": 0}


@pytest.fixture
def stack(tmp_path):
    home = tmp_path / "home"
    configure(home, poll_seconds="0.05")
    key = make_key()
    with TestClient(create_app(run_background=True)) as client:
        client.headers["authorization"] = f"Bearer {key}"
        yield client, home


def _bytes_with_mark(home: Path) -> list[str]:
    return [str(p.relative_to(home)) for p in home.rglob("*") if p.is_file() and MARK in p.read_bytes()]


def _delete(client, model_id, row_id, method):
    response = client.post(
        "/v1/deletion-requests",
        json={
            "subject_ref": f"subject {row_id}",
            "model_id": model_id,
            "method": method,
            "scope": {"kind": "samples", "sample_ids": [row_id]},
        },
    )
    assert response.status_code == 202, response.text
    done = wait_request(client, response.json()["id"], timeout=300)
    assert done["status"] == "certified", done
    return done


def test_a_completed_deletion_leaves_no_stored_copy(stack, tmp_path):
    client, home = stack
    source = tmp_path / "src" / "people.csv"
    source.parent.mkdir()
    frame = write_table(source, n=300, seed=3)
    for i, tag in enumerate(("alpha", "beta")):  # unique ids and unique feature values (a category of their own)
        frame.loc[10 + i, "row_id"] = f"subj-ZQX7-{tag}"
        frame.loc[10 + i, "colour"] = f"violet-ZQX7-{tag}"
    frame.to_csv(source, index=False)
    metadata = {
        "name": "people",
        "unlearning": ["l2ul", "sisa"],
        "method_settings": {"l2ul": SMALL_L2UL, "sisa": {"shards": 3, "slices": 2}},
        "holdout_fraction": 0.0,
        "dataset": {"row_id_column": "row_id", "label_column": "label"},
    }
    with source.open("rb") as handle:
        response = client.post(
            "/v1/models", data={"metadata": json.dumps(metadata)}, files={"file": ("people.csv", handle, "text/csv")}
        )
    assert response.status_code == 202, response.text
    model_id = response.json()["id"]
    model = wait_for(
        lambda: (
            (b := client.get(f"/v1/models/{model_id}").json())["status"] != "registering"
            and all(m.get("status") == "ready" for m in b["unlearning"].values())
            and b
        ),
        timeout=300,
        what="registration and preparation",
    )
    assert _bytes_with_mark(home), "the stored table holds the rows before any deletion"

    first = _delete(client, model_id, "subj-ZQX7-alpha", "retrain")
    manifest = first["erasure"]
    assert manifest["dataset"]["before"] != manifest["dataset"]["after"]
    assert manifest["index"]["rows_deleted"] == 1
    assert [v["number"] for v in manifest["versions_retired"]] == [1]
    assert manifest["method_state"]["sisa"]["action"] == "purged"  # SISA retrains the shard that held the row
    assert manifest["method_state"]["l2ul"]["action"] == "purged"  # L2UL drops the unit that held the row
    assert "sample_ids" not in first["scope"] and len(first["scope"]["sample_id_hashes"]) == 1
    gone = client.get(f"/v1/models/{model_id}/versions/1/weights")
    assert gone.status_code == 410 and gone.headers["content-type"] == "application/problem+json"
    assert client.get(f"/v1/models/{model_id}/versions/2/weights").status_code == 200
    model = client.get(f"/v1/models/{model_id}").json()
    assert model["unlearning"]["l2ul"]["status"] == "ready"  # its other unit never saw the row

    second = _delete(client, model_id, "subj-ZQX7-beta", "sisa")
    assert second["erasure"]["method_state"]["sisa"]["action"] == "purged"
    l2ul = client.get(f"/v1/models/{model_id}").json()["unlearning"]["l2ul"]
    if second["erasure"]["method_state"]["l2ul"]["action"] == "purged":  # the two rows sat in one unit
        assert l2ul["status"] == "ready"
    else:  # its last unit held the row: dropped with it, so L2UL must be prepared again before it serves
        assert l2ul["status"] == "invalidated" and "prepare" in l2ul["reason"]
    assert [v["number"] for v in second["erasure"]["versions_retired"]] == [2]
    versions = client.get(f"/v1/models/{model_id}/versions").json()
    assert [v["retired_at"] is not None for v in versions] == [True, True, False]  # lineage stays listed

    again = client.post(
        "/v1/deletion-requests",
        json={
            "subject_ref": "x",
            "model_id": model_id,
            "scope": {"kind": "samples", "sample_ids": ["subj-ZQX7-alpha"]},
        },
    )
    assert again.status_code == 409 and again.json()["type"].endswith("/already-deleted")

    wait_for(lambda: not _bytes_with_mark(home), timeout=30, what="the last copies to be shredded")
    assert _bytes_with_mark(home) == []  # no byte of the SQLite file, its WAL or the artifact store holds them


def test_newton_deletes_through_the_api_and_its_state_is_purged_by_other_methods(stack, tmp_path):
    client, _ = stack
    source = tmp_path / "t.csv"
    write_table(source, n=300, seed=8)
    metadata = {
        "name": "newton",
        "unlearning": ["newton"],
        "holdout_fraction": 0.2,
        "dataset": {"row_id_column": "row_id", "label_column": "label"},
    }
    with source.open("rb") as handle:
        response = client.post(
            "/v1/models", data={"metadata": json.dumps(metadata)}, files={"file": ("t.csv", handle, "text/csv")}
        )
    model_id = response.json()["id"]
    wait_for(
        lambda: client.get(f"/v1/models/{model_id}").json()["unlearning"]["newton"].get("status") == "ready",
        timeout=120,
        what="newton preparation",
    )
    done = _delete(client, model_id, "r3", "newton")
    version = client.get(f"/v1/models/{model_id}/versions").json()[-1]
    assert version["method"] == "newton" and version["metrics"]["method_info"]["retained_grad_norm"] >= 0
    assert done["erasure"]["method_state"]["newton"]["action"] == "purged"  # its Hessian no longer holds the row
    later = _delete(client, model_id, "r4", "retrain")  # another method erases: newton's stored state follows
    assert later["erasure"]["method_state"]["newton"]["action"] in ("purged", "state deleted; prepare again to use")

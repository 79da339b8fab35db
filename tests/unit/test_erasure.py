"""Trust issue, erasure: a completed deletion leaves no stored copy of the erased rows (embedded default: SQLite file
and WAL, artifact folder), retires the versions trained on them, purges or drops every prepared method's state, and
keeps only keyed hashes of the ids. Each assertion failed on the code before the erase step."""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from app.jobs import tabular as wing
from app.main import create_app
from app.ml.unlearning import warm
from app.storage import ArtifactStore
from tests import erasure_bytes as B
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


# ------------------------------------------------------------------------------------------------------ every byte
# Issue 22, item 1: after each certified deletion (each method, each model kind, CSV and Parquet uploads: LR with
# both, MLP with Parquet, to keep the suite's time) no stored byte holds the erased row (its id, its category, its
# numeric value as text or as float32/float64 bytes), no blob the erasure manifest names as replaced is left in the
# store, and no blob that existed only because of the row (the retired version's weights, the shadows that trained on
# it, the superseded SISA shard, L2UL unit and Newton state) is left either.
# Newton, influence and L2UL (which refuses an MLP's recipe) are prepared on LR only. L2UL's and influence's state is
# purged by each deletion; at these small sizes their own deletions fail verification (influence's first-order step
# needs thousands of rows), so none is made with them here.
LR_METHODS = ["retrain", "newton", "sisa"]
MLP_METHODS = ["retrain", "sisa"]
MLP = {"hidden_units": 8, "max_iter": 60}


def _register(client, source: Path, family: str, methods: list[str], also: tuple[str, ...] = ()) -> str:
    prepared = [*also, *(m for m in methods if m != "retrain")]
    metadata = {
        "name": f"bytes-{family}",
        "family": family,
        "unlearning": prepared,
        "method_settings": {"l2ul": SMALL_L2UL, "sisa": {"shards": 3, "slices": 2}},
        "holdout_fraction": 0.0,  # every erased row was trained on: each method has state to purge
        "verification": {"shadows": 8},
        "dataset": {"row_id_column": "row_id", "label_column": "label"},
        **({"recipe": MLP} if family == "mlp" else {}),
    }
    kind = "application/vnd.apache.parquet" if source.suffix == ".parquet" else "text/csv"
    with source.open("rb") as handle:
        response = client.post(
            "/v1/models", data={"metadata": json.dumps(metadata)}, files={"file": (source.name, handle, kind)}
        )
    assert response.status_code == 202, response.text
    model_id = response.json()["id"]
    model = wait_for(
        lambda: (
            (b := client.get(f"/v1/models/{model_id}").json())["status"] != "registering"
            and all(b["unlearning"].get(m, {}).get("status") not in (None, "preparing") for m in prepared)
            and b
        ),
        timeout=300,
        what="registration and preparation",
    )
    assert model["status"] == "ready", model
    assert {m: model["unlearning"][m]["status"] for m in prepared} == dict.fromkeys(prepared, "ready")
    return model_id


def _leftovers(home: Path, model_id: str, erased: list[B.Row], gone: set[str], manifest: dict) -> list[str]:
    """What a settled erasure must not leave: a needle of an erased row in any file, a blob the manifest names as
    replaced, a blob the model held before and no longer serves (one an attempt wrote and never published, its lease
    lost, is the orphan sweep's)."""
    return [
        *B.files_holding(home, erased),
        *(f"manifest {label}: {d}" for label, d in B.manifest_befores(manifest).items() if B.stored([d])),
        *(f"superseded blob {d}" for d in B.stored(gone)),
    ]


def _settled(check) -> list[str]:
    """``check()`` once the deletion's upkeep (shadow refill, Newton's purge, shredding) has had time to finish."""
    with contextlib.suppress(TimeoutError):
        wait_for(lambda: not check(), timeout=120, interval=0.2, what="the erasure to settle")
    return check()


@pytest.mark.parametrize(
    ("family", "suffix", "methods"),
    [
        pytest.param("logistic_regression", ".csv", LR_METHODS, id="lr-csv"),
        pytest.param("logistic_regression", ".parquet", LR_METHODS, id="lr-parquet"),
        pytest.param("mlp", ".parquet", MLP_METHODS, id="mlp-parquet"),
    ],
)
def test_every_byte_of_an_erased_row_is_gone_after_each_method(stack, tmp_path, family, suffix, methods):
    client, home = stack
    source = tmp_path / "src" / f"people{suffix}"
    source.parent.mkdir()
    frame = write_table(source, n=240, seed=11)
    rows = B.plant_rows(frame, "QB8", len(methods))
    B.write(frame, source)
    also = ("l2ul", "influence") if family == "logistic_regression" else ()  # L2UL refuses an MLP's recipe
    model_id = _register(client, source, family, methods, also)
    before = B.files_holding(home, rows)
    for row in rows:  # the search finds each row as stored: in the table's chunks (Parquet) and the database
        assert any(f"{row.row_id} id" in hit for hit in before), before
        assert any(f"{row.row_id} category" in hit for hit in before), before
        assert any(f"{row.row_id} float64 LE" in hit for hit in before), before
    for k, (row, method) in enumerate(zip(rows, methods, strict=True)):
        held = B.live_digests(model_id)
        done = _delete(client, model_id, row.row_id, method)
        manifest = done["erasure"]
        befores = B.manifest_befores(manifest)
        assert {"dataset", f"version {k + 1} weights", "verification shadows"} <= set(befores), befores
        assert any(label.startswith("method sisa/") for label in befores), befores  # the shard that held the row
        erased = rows[: k + 1]
        leftovers = _settled(lambda: _leftovers(home, model_id, erased, held - B.live_digests(model_id), manifest))  # noqa: B023
        assert leftovers == [], f"after the {method} deletion"


CACHES = ("ENCODED", "FRAMES", "ARTIFACT_BYTES", "SHADOWS", "ENCODED_CHUNKS", "MANIFESTS")


def _cached_copies(model_id: str, erased: B.Row) -> list[str]:
    """Values this process keeps in memory (app/jobs/tabular.py's caches, the methods' parsed states) that are
    copies of a blob the model no longer serves, or that hold the erased row's id."""
    live, hits = B.live_digests(model_id), []
    for name in CACHES:
        for key, value in list(getattr(wing, name)._entries.items()):
            digest = key[0] if isinstance(key, tuple) else key
            if digest not in live:
                hits.append(f"{name}: {digest}")
            ids = getattr(value, "row_ids", None)
            if ids is None and hasattr(value, "columns") and "row_id" in value.columns:
                ids = value["row_id"]
            if ids is not None and erased.row_id in set(map(str, ids)):
                hits.append(f"{name}: {digest} holds {erased.row_id}")
    for states in list(warm._EVERY):
        for data, _ in list(states._entries.values()):
            if hashlib.sha256(data).hexdigest() not in live:
                hits.append(f"parsed method state of {hashlib.sha256(data).hexdigest()}")
    return hits


def test_the_worker_forgets_its_in_memory_copies_of_erased_rows(stack, tmp_path):
    """Issue 22 (worker caches): the tables, chunks, method state and shadows a worker keeps in memory between
    requests are copies of the erased rows too: the erasing worker drops them with the certificate."""
    client, _ = stack
    for name in CACHES:  # a worker that served nothing else (this process ran the other tests' models too)
        getattr(wing, name).clear()
    for states in list(warm._EVERY):
        states.clear()
    source = tmp_path / "src" / "people.csv"
    source.parent.mkdir()
    frame = write_table(source, n=240, seed=12)
    (row,) = B.plant_rows(frame, "QC9", 1)
    B.write(frame, source)
    model_id = _register(client, source, "logistic_regression", ["newton", "sisa"])
    _delete(client, model_id, "r0", "newton")  # a warm worker: the table, its chunks and each method's state cached
    assert any(f"holds {row.row_id}" in hit for hit in _cached_copies(model_id, row))
    _delete(client, model_id, row.row_id, "retrain")
    assert _settled(lambda: _cached_copies(model_id, row)) == []


def test_shredding_resumes_after_a_restart_mid_shred(tmp_path, monkeypatch):
    """The erasure's shredding dies after its first file (a crash mid-shred); the service restarts: every copy the
    erasure superseded is still shredded (the queue is durable and the deletion counts nothing done until it is)."""
    home = tmp_path / "home"
    configure(home, poll_seconds="0.05")
    key = make_key()
    source = tmp_path / "src" / "people.parquet"
    source.parent.mkdir()
    frame = write_table(source, n=240, seed=13)
    (row,) = B.plant_rows(frame, "QD4", 1)
    B.write(frame, source)
    real_delete, deleted = ArtifactStore.delete, []

    def dies_after_the_first(store, digest):
        if deleted:
            raise RuntimeError("the worker died mid-shred")
        deleted.append(digest)
        real_delete(store, digest)

    with TestClient(create_app(run_background=True)) as client:
        client.headers["authorization"] = f"Bearer {key}"
        model_id = _register(client, source, "logistic_regression", ["newton", "sisa"])
        held = B.live_digests(model_id)
        monkeypatch.setattr(ArtifactStore, "delete", dies_after_the_first)
        manifest = _delete(client, model_id, row.row_id, "retrain")["erasure"]
        wait_for(lambda: deleted, timeout=60, what="the shredding to start")
        time.sleep(1)  # the job's retries and the dispatcher's ticks meet the same death
        assert B.stored(B.manifest_befores(manifest).values()), "the crash left copies to shred"
    monkeypatch.undo()
    configure(home, poll_seconds="0.05")  # a fresh process: settings, engine and store read again
    with TestClient(create_app(run_background=True)) as client:
        client.headers["authorization"] = f"Bearer {key}"
        check = lambda: _leftovers(home, model_id, [row], held - B.live_digests(model_id), manifest)  # noqa: E731
        assert _settled(check) == []


def test_a_request_names_its_rows_by_position_and_one_written_by_an_older_release_by_id(tmp_path):
    """Issue 22: intake writes a samples scope as its ids' keyed hashes and the rows' positions; a request an older
    release wrote (raw ids, hashed only at its end) is still served by id. A row erased meanwhile (its index entry
    deleted) is named by neither."""
    from sqlalchemy import delete

    from app.db import session_scope
    from app.registry.tables import Dataset, DatasetRow
    from app.registry.versions import index_rows, positions_by_request, positions_of

    configure(tmp_path / "home")
    with session_scope() as session:
        session.add(Dataset(id="d1", name="t", format="csv", digest="0" * 64, row_id_column="id", label_column="y",
                            columns=["id", "y"]))  # fmt: skip
        session.flush()
        index_rows(session, "d1", [f"p{i}" for i in range(10)], ["a", "b"] * 5)
    with session_scope() as session:
        new = {"kind": "samples", "sample_id_hashes": ["h"] * 3, "n_samples": 3, "positions": [7, 2, 5]}
        old = {"kind": "samples", "sample_ids": ["p5", "p9"]}
        assert positions_by_request(session, "d1", {"new": new, "old": old}) == {"new": [2, 5, 7], "old": [5, 9]}
        assert positions_of(session, "d1", new) == [2, 5, 7] and positions_of(session, "d1", old) == [5, 9]
        session.execute(delete(DatasetRow).where(DatasetRow.dataset_id == "d1", DatasetRow.position == 5))
        assert positions_by_request(session, "d1", {"new": new, "old": old}) == {"new": [2, 7], "old": [9]}

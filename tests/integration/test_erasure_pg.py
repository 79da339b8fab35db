"""Trust issue, erasure on PostgreSQL + Celery: after a completed deletion no table row (read back as text), no
artifact and no service log holds the erased row's id or values; earlier versions answer 410."""

from __future__ import annotations

import json

import psycopg

from tests.helpers import wait_for, wait_request, write_table

MARK = "ZQX9"


def _tables_with_mark(pg_url: str) -> list[str]:
    url = pg_url.replace("postgresql+psycopg://", "postgresql://", 1)
    hits = []
    with psycopg.connect(url) as conn:
        tables = [
            r[0]
            for r in conn.execute(
                "SELECT table_name FROM information_schema.tables WHERE table_schema = 'public'"
            ).fetchall()
        ]
        for table in tables:
            count = conn.execute(f'SELECT count(*) FROM "{table}" t WHERE t::text LIKE %s', (f"%{MARK}%",)).fetchone()[
                0
            ]
            if count:
                hits.append(table)
    return hits


def _files_with_mark(home) -> list[str]:
    return [str(p) for p in home.rglob("*") if p.is_file() and MARK.encode() in p.read_bytes()]


def test_erasure_leaves_no_copy_on_postgresql(stack, pg_url, tmp_path):
    source = tmp_path / "people.csv"
    frame = write_table(source, n=300, seed=5)
    frame.loc[7, "row_id"] = f"subj-{MARK}-gamma"
    frame.loc[7, "colour"] = f"teal-{MARK}-gamma"
    frame.to_csv(source, index=False)
    metadata = {
        "name": "erasure-pg",
        "unlearning": ["sisa"],
        "method_settings": {"sisa": {"shards": 3, "slices": 2}},
        "holdout_fraction": 0.0,
        "dataset": {"row_id_column": "row_id", "label_column": "label"},
    }
    with source.open("rb") as handle:
        response = stack.client.post(
            "/v1/models", data={"metadata": json.dumps(metadata)}, files={"file": ("people.csv", handle, "text/csv")}
        )
    assert response.status_code == 202, response.text
    model_id = response.json()["id"]
    wait_for(
        lambda: stack.client.get(f"/v1/models/{model_id}").json()["unlearning"]["sisa"].get("status") == "ready",
        timeout=300,
        what="registration",
    )
    assert "datasets" not in _tables_with_mark(pg_url) and "dataset_rows" in _tables_with_mark(pg_url)
    assert _files_with_mark(stack.home)  # the uploaded table is stored

    response = stack.client.post(
        "/v1/deletion-requests",
        json={
            "subject_ref": "gamma",
            "model_id": model_id,
            "method": "retrain",
            "scope": {"kind": "samples", "sample_ids": [f"subj-{MARK}-gamma"]},
        },
    )
    assert response.status_code == 202, response.text
    done = wait_request(stack.client, response.json()["id"], timeout=300)
    assert done["status"] == "certified", done
    assert done["erasure"]["method_state"]["sisa"]["action"] == "purged"
    assert stack.client.get(f"/v1/models/{model_id}/versions/1/weights").status_code == 410
    assert _tables_with_mark(pg_url) == []
    wait_for(lambda: not _files_with_mark(stack.home), timeout=30, what="shredding")

"""Issue 22, blobs of an attempt that never publishes: what an attempt writes before its publishing transaction is
named first (a write-ahead intent) and shredded when the attempt ends without publishing, whoever ends it; a sweep
shreds what nothing references; a failed write leaves no temp file. Real SQLite, real artifact folder, a real
subprocess for the failing write."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import insert, select

from app.db import session_scope
from app.jobs import blobs
from app.jobs import tabular as tabular_wing
from app.jobs.tables import BlobIntent, Job
from app.main import create_app
from app.registry.tables import Dataset
from app.storage import TEMP_MARK, get_store
from tests.helpers import configure, make_key, wait_for, wait_model, wait_request, write_table

MARK = b"ZQX7"


def _store_files(root: Path) -> list[Path]:
    return [p for p in (root / "sha256").rglob("*") if p.is_file()]


def _digests_in(value) -> set[str]:
    """Every sha256-looking string anywhere in a JSON value."""
    if isinstance(value, dict):
        return set().union(*(_digests_in(v) for v in value.values())) if value else set()
    if isinstance(value, list):
        return set().union(*(_digests_in(v) for v in value)) if value else set()
    if isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value):
        return {value}
    return set()


def assert_the_sweep_keeps_every_stored_reference() -> None:
    """Every digest a model's state or a report names, and that is in the store, counts as referenced: the sweep
    never shreds a blob the service still reads."""
    from app.registry.tables import Model
    from app.reports.tables import Report

    store = get_store()
    with session_scope() as session:
        named = set().union(*(_digests_in(s) for s in session.execute(select(Model.state)).scalars()))
        named |= set().union(*(_digests_in(p) for p in session.execute(select(Report.plots)).scalars()))
        keep = blobs.referenced(session)
    assert sorted(d for d in named if store.exists(d) and d not in keep) == []


def _age(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


# ------------------------------------------------------------------------------------------------ a whole deletion
@pytest.fixture
def stack(tmp_path):
    home = tmp_path / "home"
    configure(home, poll_seconds="0.05", max_attempts="1")
    key = make_key()
    with TestClient(create_app(run_background=True)) as client:
        client.headers["authorization"] = f"Bearer {key}"
        yield client, Path(get_store().root)


def _delete(client, model_id: str, row_id: str) -> dict:
    response = client.post(
        "/v1/deletion-requests",
        json={
            "subject_ref": f"subject {row_id}",
            "model_id": model_id,
            "method": "retrain",
            "scope": {"kind": "samples", "sample_ids": [row_id]},
        },
    )
    assert response.status_code == 202, response.text
    return wait_request(client, response.json()["id"], timeout=120)


@pytest.mark.parametrize("settled_by", ["worker", "reconciler"])
def test_an_attempt_that_dies_after_its_table_rewrite_leaves_no_blob(stack, tmp_path, monkeypatch, settled_by):
    """The first deletion's attempt dies right after its wing rewrote the table (the chunk without alpha, still
    holding beta) and before publishing; beta is then erased and certified. No blob may hold beta's row, and every
    blob left is referenced. On the code before the intents, the dead attempt's chunk stayed, with beta's row.
    ``reconciler``: the worker dies before it can settle its attempt; the dispatcher's tick settles it."""
    client, store_root = stack
    if settled_by == "reconciler":
        monkeypatch.setattr(blobs, "settle", lambda owner: 0)
    source = tmp_path / "src" / "people.csv"
    source.parent.mkdir()
    frame = write_table(source, n=200, seed=5)
    frame.loc[10, "row_id"] = "subj-alpha"
    frame.loc[11, "row_id"] = "subj-ZQX7-beta"  # the only marker: beta's row, in the same chunk as alpha's
    frame.to_csv(source, index=False)
    metadata = {
        "name": "people",
        "family": "logistic_regression",
        "verification": {"shadows": 4},
        "dataset": {"row_id_column": "row_id", "label_column": "label"},
    }
    with source.open("rb") as handle:
        response = client.post(
            "/v1/models", data={"metadata": json.dumps(metadata)}, files={"file": ("people.csv", handle, "text/csv")}
        )
    assert response.status_code == 202, response.text
    model_id = response.json()["id"]
    assert wait_model(client, model_id, timeout=120)["status"] == "ready"

    real_erase, calls = tabular_wing.Deletion.erase, []

    def erase_then_die(self, work, unlearned, ctx):
        plan = real_erase(self, work, unlearned, ctx)  # the rewritten chunks are in the store now
        calls.append(plan.dataset_chunks)
        if len(calls) == 1:
            raise RuntimeError("the worker died between its table rewrite and publishing")
        return plan

    monkeypatch.setattr(tabular_wing.Deletion, "erase", erase_then_die)

    first = _delete(client, model_id, "subj-alpha")
    assert first["status"] == "failed", first  # one attempt allowed (max_attempts=1): the request ends failed
    dead_chunks = calls[0]
    assert dead_chunks, "the dead attempt rewrote the table"

    second = _delete(client, model_id, "subj-ZQX7-beta")
    assert second["status"] == "certified", second
    assert set(calls[1]).isdisjoint(dead_chunks)  # a different version: the dead attempt's chunk is not reused

    def leftovers() -> list[str]:
        return [p.name for p in _store_files(store_root) if MARK in p.read_bytes()]

    def intents() -> list[str]:
        with session_scope() as session:
            return session.execute(select(BlobIntent.digest)).scalars().all()

    wait_for(lambda: not leftovers(), timeout=20, what="every copy of beta's row to be shredded")
    wait_for(lambda: not intents(), timeout=20, what="every attempt's intents to be settled")
    files = _store_files(store_root)
    assert [p.name for p in files if TEMP_MARK in p.name] == []
    with session_scope() as session:
        referenced = blobs.referenced(session)
    assert sorted(p.name for p in files if p.name not in referenced) == []  # every stored blob is referenced
    assert_the_sweep_keeps_every_stored_reference()
    assert not any(get_store().exists(d) for d in dead_chunks)


# ------------------------------------------------------------------------------------------------ units
@pytest.fixture
def home(tmp_path):
    configure(tmp_path / "home", orphan_blob_grace_seconds="60")
    return tmp_path / "home"


def _job(session, status: str, owner: str | None) -> str:
    job = Job(kind="deletion", model_id="m", status=status, lease_owner=owner, payload={})
    session.add(job)
    session.flush()
    return job.id


def _intend(session, owner: str, job_id: str, *digests: str) -> None:
    session.execute(insert(BlobIntent), [{"owner": owner, "job_id": job_id, "digest": d} for d in digests])


def _dataset(session, digest: str) -> None:
    session.add(Dataset(name="t", format="csv", digest=digest, row_id_column="id", label_column="y", columns=[]))


def test_the_reconciler_shreds_what_a_killed_attempt_wrote_and_nothing_else(home):
    """A worker killed mid-attempt: its job was re-offered (no one holds it), its intents are settled by the
    dispatcher's tick; a blob also named by a live attempt, or referenced by the registry, stays."""
    from app.reports.tables import Report

    store = get_store()
    dead_only, also_live, published, live_only, plotted = (store.put_bytes(f"blob {i}".encode()) for i in range(5))
    with session_scope() as session:
        dead_job = _job(session, "pending", None)  # re-offered after the killed worker's lease expired
        live_job = _job(session, "running", "host:2:1")
        _intend(session, "host:1:1", dead_job, dead_only, also_live, published, plotted)
        _intend(session, "host:2:1", live_job, also_live, live_only)
        _dataset(session, published)
        session.add(
            Report(request_id="r", model_id="m", verdict="fail", body={}, plots={"roc": {"data": plotted}}, etag="e")
        )
    with session_scope() as session:
        assert blobs.settle_dead(session) == 1
    assert not store.exists(dead_only)
    assert all(store.exists(d) for d in (also_live, published, live_only, plotted))
    with session_scope() as session:
        left = session.execute(select(BlobIntent.owner, BlobIntent.digest)).all()
    assert sorted(left) == sorted([("host:2:1", also_live), ("host:2:1", live_only)])


def test_an_attempt_settles_what_it_wrote(home):
    """``settle`` (the worker ending its attempt without publishing) shreds the blobs its intents name."""
    store = get_store()
    with session_scope() as session:
        job = _job(session, "running", "w:1:1")
        _dataset(session, store.put_bytes(b"a data set"))
    with blobs.recording(job, "w:1:1"):
        digest = store.put_bytes(b"a chunk")
        kept = store.put_bytes(b"a data set")  # already referenced: named again, never shredded
    assert blobs.settle("w:1:1") == 1
    assert not store.exists(digest) and store.exists(kept)


def test_the_sweep_shreds_only_old_unreferenced_blobs_and_stale_temp_files(home):
    store = get_store()
    orphan, referenced, fresh, intended = (store.put_bytes(f"sweep {i}".encode()) for i in range(4))
    root = Path(store.root) / "sha256"
    for digest in (orphan, referenced, intended):
        _age(root / digest[:2] / digest, 3600)
    stale_tmp = root / orphan[:2] / f"{orphan}{TEMP_MARK}deadbeef"
    fresh_tmp = root / fresh[:2] / f"{fresh}{TEMP_MARK}cafebabe"
    stale_tmp.write_bytes(b"half")
    fresh_tmp.write_bytes(b"half")
    _age(stale_tmp, 3600)
    with session_scope() as session:
        _dataset(session, referenced)
        _intend(session, "w:9:9", _job(session, "running", "w:9:9"), intended)

    assert blobs.sweep() == {"blobs": 1, "temp_files": 1}
    assert not store.exists(orphan) and not stale_tmp.exists()
    assert store.exists(referenced) and store.exists(fresh) and store.exists(intended) and fresh_tmp.exists()


FAILING_WRITE = """
import os, resource, signal, sys
from pathlib import Path
from sqlalchemy import select
from tests.helpers import configure
from app.db import session_scope
from app.jobs import blobs
from app.jobs.tables import BlobIntent, Job
from app.storage import get_store

configure(Path(sys.argv[1]))
with session_scope() as session:
    job = Job(kind="deletion", model_id="m", status="running", lease_owner="w:1:1", payload={})
    session.add(job)
    session.flush()
    job_id = job.id
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG) as a full disk would (ENOSPC)
resource.setrlimit(resource.RLIMIT_FSIZE, (4 << 20, resource.RLIM_INFINITY))
try:
    with blobs.recording(job_id, "w:1:1"):
        get_store().put_bytes(os.urandom(8 << 20))
except OSError as exc:
    print("failed:", exc.errno)
with session_scope() as session:
    print("intents:", len(session.execute(select(BlobIntent.digest)).scalars().all()))
print("store:", get_store().root)
"""


def test_a_failed_write_leaves_no_temp_file_and_was_named_first(tmp_path):
    """A write the disk refuses (a real OS error: the file-size limit, as ENOSPC would) removes its temp file; its
    intent was committed before the first byte (write-ahead), so a kill at any point leaves a named blob."""
    done = subprocess.run(
        [sys.executable, "-c", FAILING_WRITE, str(tmp_path / "home")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    assert done.returncode == 0, done.stderr
    lines = dict(line.split(": ", 1) for line in done.stdout.splitlines())
    assert "failed" in lines, done.stdout  # the write did fail
    assert lines["intents"] == "1"  # named before the write began
    assert [p for p in Path(lines["store"]).rglob("*") if p.is_file()] == []  # and the failed write left nothing

"""Issue 22, fault findings: a full artifact disk failed the request after 3 attempts in ~6 s of backoff (2 s, 4 s),
never retried later. A resource that is away (a full disk, the database down) now spends no attempt: the job waits
with a growing delay, up to minutes, and runs when the resource is back. The faults are real: /dev/full (ENOSPC), a
worker process whose file-size limit is 0 (RLIMIT_FSIZE: every artifact write fails with EFBIG), a closed loopback
port for the database."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from datetime import timedelta

from fastapi.testclient import TestClient
from sqlalchemy import create_engine, text

from app.db import session_scope, utcnow
from app.jobs import lease, outbox
from app.jobs.pipeline import execute_job
from app.jobs.tables import Job
from app.main import create_app
from tests.helpers import configure, make_key, wait_for, wait_request, write_table
from tests.stack import ROOT, fresh_database


def _real_enospc() -> OSError:
    try:
        with open("/dev/full", "wb") as handle:
            handle.write(b"x")
            handle.flush()
    except OSError as exc:
        return exc
    raise AssertionError("/dev/full accepted a write")


def test_what_counts_as_the_infrastructure_away_and_what_as_the_jobs_own_error(tmp_path):
    full = _real_enospc()
    assert full.errno == errno.ENOSPC and outbox.infrastructure_error(full)
    try:
        create_engine("postgresql+psycopg://postgres@127.0.0.1:9/x").connect()
    except Exception as exc:  # a real refused connection, wrapped by SQLAlchemy
        down = exc
    assert outbox.infrastructure_error(down)
    wrapped = RuntimeError("storing the version failed")
    wrapped.__cause__ = full
    assert outbox.infrastructure_error(wrapped)  # found under what a library wrapped it in
    missing = FileNotFoundError(errno.ENOENT, "no such data set", str(tmp_path / "gone.csv"))
    for own in (ValueError("singular matrix"), missing, KeyError("row_id")):
        assert not outbox.infrastructure_error(own)


def _job(model_id: str) -> str:
    with session_scope() as session:
        return outbox.new_job(session, kind="deletion", model_id=model_id, model_kind="tabular").id


def test_a_full_disk_spends_no_attempt_and_waits_minutes_not_seconds(tmp_path):
    """With the default settings: five ENOSPC failures in a row leave the job pending with all its attempts, each
    wait twice the last (5, 10, 20, 40, 80 s), capped at 300 s; a genuine error still spends its attempt."""
    configure(tmp_path)
    job_id = _job("m1")
    waits = []
    for _ in range(5):
        assert lease.claim(job_id, "w1") is not None
        before = utcnow()
        lease.fail(job_id, "w1", f"OSError: {_real_enospc()}", permanent=False, infrastructure=True)
        with session_scope() as session:
            job = session.get(Job, job_id)
            assert job.status == "pending" and job.attempts == 0, (job.status, job.attempts)
            waits.append((job.available_at - before).total_seconds())
    assert [round(w) for w in waits] == [5, 10, 20, 40, 80]
    for _ in range(3):
        assert lease.claim(job_id, "w1") is not None
        lease.fail(job_id, "w1", "OSError: disk full", permanent=False, infrastructure=True)
    with session_scope() as session:
        assert session.get(Job, job_id).available_at - utcnow() > timedelta(seconds=290)  # capped at 300 s
    assert lease.claim(job_id, "w1").attempts == 1
    lease.fail(job_id, "w1", "ValueError: the method diverged", permanent=False)  # the job's own error counts
    with session_scope() as session:
        assert session.get(Job, job_id).attempts == 1


FULL_DISK_WORKER = """
import json, resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing us
resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
from app.jobs.pipeline import execute_job
print(json.dumps([execute_job(sys.argv[1], "full-disk-worker") for _ in range(4)]), flush=True)
"""


def test_a_request_outlives_a_full_artifact_disk_and_is_certified_when_it_is_back(tmp_path):
    """A worker whose every artifact write fails (EFBIG, its file-size limit 0) runs the deletion four times, more
    than max_attempts (3): the job is still pending with no attempt spent. A worker with a working disk then
    certifies the request."""
    with fresh_database("lethe_fulldisk") as url:
        configure(tmp_path / "home", database_url=url, poll_seconds="0.05")
        key = make_key()
        source = tmp_path / "t.csv"
        write_table(source, n=200, seed=5)
        metadata = {
            "name": "fulldisk",
            "verification": {"shadows": 4},
            "dataset": {"row_id_column": "row_id", "label_column": "label"},
        }
        headers = {"authorization": f"Bearer {key}"}
        with TestClient(create_app(run_background=True), headers=headers) as client:
            with source.open("rb") as handle:
                response = client.post(
                    "/v1/models",
                    data={"metadata": json.dumps(metadata)},
                    files={"file": ("t.csv", handle, "text/csv")},
                )
            model_id = response.json()["id"]
            wait_for(
                lambda: client.get(f"/v1/models/{model_id}").json()["status"] == "ready", timeout=120, what="ready"
            )
        with TestClient(create_app(run_background=False), headers=headers) as client:  # no worker: the job waits
            request = client.post(
                "/v1/deletion-requests",
                json={"subject_ref": "s", "model_id": model_id, "scope": {"kind": "samples", "sample_ids": ["r1"]}},
            ).json()
            with session_scope() as session:
                job_id = session.execute(
                    text("SELECT id FROM jobs WHERE request_id = :r"), {"r": request["id"]}
                ).scalar_one()

            worker = subprocess.run(
                [sys.executable, "-c", FULL_DISK_WORKER, job_id],
                cwd=ROOT,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
                capture_output=True,
                timeout=300,
            )
            assert worker.returncode == 0, worker.stderr.decode()[-3000:]
            assert json.loads(worker.stdout.decode().strip().splitlines()[-1]) == ["waiting"] * 4
            with session_scope() as session:
                job = session.get(Job, job_id)
                assert job.status == "pending" and job.attempts == 0, (job.status, job.attempts, job.error)
                assert "File too large" in job.error and job.payload["outage"]["failures"] == 4
            assert client.get(f"/v1/deletion-requests/{request['id']}").json()["status"] not in ("failed", "rejected")

            assert execute_job(job_id, "worker-with-disk") == "succeeded"  # the disk is back
            assert wait_request(client, request["id"], timeout=30)["status"] == "certified"


def test_a_lease_that_ran_out_while_the_database_was_down_spends_no_attempt(tmp_path):
    """No worker can renew its lease while the database is away: a lease that ran out meanwhile is re-offered at the
    dispatcher's first pass after the outage without spending an attempt (max_attempts 1 here: a spent attempt
    would fail the job for good). A lease that runs out with the database up still spends its attempt."""
    from app.config import get_settings
    from app.db import reset_engine_cache
    from app.jobs.dispatcher import Dispatcher
    from tests.unit.test_db_outage import closed_port

    configure(tmp_path, max_attempts="1")
    database = get_settings().resolved_database_url
    outage, killed = _job("m1"), _job("m2")
    for job_id in (outage, killed):
        assert lease.claim(job_id, "w1") is not None
    dispatcher = Dispatcher(lambda job: None)
    with session_scope() as session:
        session.get(Job, killed).lease_expires_at = utcnow()  # its worker died, the database up
    dispatcher.step()
    with session_scope() as session:
        session.get(Job, outage).lease_expires_at = utcnow()  # runs out during the outage below

    os.environ["LETHE_DATABASE_URL"] = f"postgresql+psycopg://postgres@127.0.0.1:{closed_port()}/down"
    get_settings.cache_clear()
    reset_engine_cache()
    dispatcher.step()  # the pass meets the database away
    os.environ["LETHE_DATABASE_URL"] = database
    get_settings.cache_clear()
    reset_engine_cache()
    dispatcher.step(housekeeping=False)  # a nudge: no reconciling yet
    dispatcher.step()

    with session_scope() as session:
        spared, spent = session.get(Job, outage), session.get(Job, killed)
        assert spared.status in ("pending", "dispatched") and spared.attempts == 0, (spared.status, spared.attempts)
        assert spent.status == "failed"

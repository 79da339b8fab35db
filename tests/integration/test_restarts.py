"""Restarts mid-load (issue 22), on a redis-server and a PostgreSQL cluster of the module's own (free loopback ports;
the shared ones are never restarted):

- Redis: the broker loses every message it held (no persistence). Deletions whose jobs were dispatched into the lost
  queue are re-offered from the outbox after the dispatch timeout and a worker that reconnected does them.
- PostgreSQL: restarted while a worker is in the middle of a deletion and more wait; the worker's and the API's
  connections are cut. The job ends (this attempt or a re-run) and the waiting ones follow.

Either way none is lost, none done twice, every row erased."""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import redis

from tests.helpers import wait_for, wait_request
from tests.integration.pipeline_faults import (
    ask,
    assert_erased,
    certified_events,
    register_small,
    sql,
    version_chain,
    written_for,
)
from tests.stack import _free_port, api_stack


def _redis_server(port: int, home) -> subprocess.Popen:
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        cwd=home,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    client = redis.Redis(host="127.0.0.1", port=port)
    wait_for(lambda: _pings(client), timeout=30, interval=0.1, what="redis-server")
    return proc


def _pings(client) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    """Its own redis-server: (port, process holder, home); stopped after the module."""
    home, port = tmp_path_factory.mktemp("redis"), _free_port()
    held = {"proc": _redis_server(port, home)}
    yield port, held, home
    held["proc"].kill()
    held["proc"].wait(timeout=10)


class Cluster:
    """A PostgreSQL cluster of the test's own (initdb, trust auth, loopback only, no fsync), run as the ``postgres``
    user when the tests run as root (PostgreSQL refuses to run as root)."""

    def __init__(self, root: Path):
        found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl")) or [shutil.which("pg_ctl") or ""]
        assert found[-1], "no PostgreSQL server binaries (initdb, pg_ctl) on this machine"
        self.bin, self.root, self.port = Path(found[-1]).parent, root, _free_port()
        self.data = root / "data"
        self._as = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        if self._as:
            shutil.chown(root, "postgres")
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8")
        self.start()

    def _run(self, tool: str, *args: str) -> None:
        done = subprocess.run([*self._as, str(self.bin / tool), *args], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"{tool} failed: {done.stdout}{done.stderr}"

    def _options(self) -> str:
        return f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.root} -c fsync=off"

    def start(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-o", self._options(), "-l", str(self.root / "log"), "-w", "start")

    def restart(self) -> None:
        """Fast shutdown (every connection cut, open transactions rolled back), then up again."""
        self._run(
            "pg_ctl",
            "-D",
            str(self.data),
            "-o",
            self._options(),
            "-l",
            str(self.root / "log"),
            "-m",
            "fast",
            "-w",
            "restart",
        )

    def stop(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"


@pytest.fixture(scope="module")
def cluster():
    root = Path(tempfile.mkdtemp(prefix="lethe-pg-"))  # not under pytest's folder: the postgres user cannot enter it
    own = Cluster(root)
    yield own
    own.stop()
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def stack(cluster, broker, tmp_path_factory):
    port, _, _ = broker
    with api_stack(
        tmp_path_factory.mktemp("lethe-restarts"),
        database_url=cluster.url,
        broker_url=f"redis://127.0.0.1:{port}/0",
        poll_seconds="0.2",
        lease_seconds="3",
        dispatch_timeout_seconds="5",  # a job dispatched into a lost queue is re-offered this soon
    ) as services:
        yield services


@pytest.fixture(scope="module")
def model_id(stack, tmp_path_factory):
    return register_small(stack, tmp_path_factory.mktemp("restart-data"), "restarts")


def _all_done_once(stack, model_id: str, ids: list[str], rows: list[list[str]]) -> None:
    done = [wait_request(stack.client, rid, timeout=300) for rid in ids]
    assert [d["status"] for d in done] == ["certified"] * len(ids), done
    for rid in ids:
        assert certified_events(stack, rid) == 1
        written = written_for(rid)
        assert (written["certificates"], written["erased_rows"]) == (1, 2)  # a batch's version names its leader
    chain = version_chain(model_id)
    assert [parent for _, parent in chain[1:]] == [n for n, _ in chain[:-1]], chain
    served = {
        v for (v,) in sql("SELECT DISTINCT result_version_id FROM deletion_requests WHERE model_id = :m", m=model_id)
    }
    assert len(served) == len(chain) - 1  # every version after the first serves a request: none published twice
    assert_erased(model_id, [r for pair in rows for r in pair])


def test_a_redis_restart_loses_no_deletion_and_duplicates_none(stack, broker, model_id):
    port, held, home = broker
    rows = [[f"r{50 + 2 * k}", f"r{51 + 2 * k}"] for k in range(4)]
    ids = [ask(stack, model_id, r, subject=f"s{k}") for k, r in enumerate(rows)]  # no worker: queued in Redis
    # the dispatcher hands the broker one job per model at a time (the others wait in the outbox): that one's message
    # is what the restart loses
    wait_for(
        lambda: sql("SELECT count(*) FROM jobs WHERE request_id = ANY(:ids) AND status = 'dispatched'", ids=ids)[0][0],
        timeout=60,
        what="a job dispatched into the broker",
    )
    assert redis.Redis(host="127.0.0.1", port=port).llen("cpu") >= 1  # the messages are in the queue

    held["proc"].send_signal(signal.SIGKILL)  # the broker dies with its queue (no persistence) ...
    held["proc"].wait(timeout=10)
    time.sleep(1)
    held["proc"] = _redis_server(port, home)  # ... and comes back empty
    assert redis.Redis(host="127.0.0.1", port=port).llen("cpu") == 0

    worker = stack.start_worker("after-redis-restart")
    try:
        _all_done_once(stack, model_id, ids, rows)
    finally:
        stack.kill(worker)


def test_a_postgresql_restart_mid_job_loses_no_deletion_and_duplicates_none(stack, cluster, model_id, tmp_path):
    worker = stack.start_worker("pg-restart", LETHE_TEST_HOLD_AT="verify", LETHE_TEST_HOLD_DIR=str(tmp_path))
    try:
        rows = [[f"r{70 + 2 * k}", f"r{71 + 2 * k}"] for k in range(3)]
        ids = [ask(stack, model_id, rows[0], subject="p0")]
        wait_for(lambda: (tmp_path / "verify.reached").exists(), timeout=240, what="the worker mid-job")
        ids += [ask(stack, model_id, r, subject=f"p{k}") for k, r in enumerate(rows[1:], start=1)]  # they wait
        cluster.restart()
        (tmp_path / "verify.go").touch()
        _all_done_once(stack, model_id, ids, rows)
    finally:
        stack.kill(worker)

"""A Redis restart mid-load (issue 22): the broker loses every message it held (no persistence). Deletions whose jobs
were dispatched into the lost queue are re-offered from the outbox after the dispatch timeout and a worker that
reconnected does them: none lost, none done twice, every row erased. The test runs its own redis-server on a free
loopback port (the shared one is never restarted)."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import httpx
import pytest
import redis

from tests.helpers import configure, make_key, wait_for, wait_request
from tests.integration.pipeline_faults import (
    ask,
    assert_erased,
    certified_events,
    register_small,
    sql,
    version_chain,
    written_for,
)
from tests.stack import Services, _free_port


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


@pytest.fixture(scope="module")
def stack(pg_url, broker, tmp_path_factory):
    port, _, _ = broker
    home = tmp_path_factory.mktemp("lethe-broker")
    configure(
        home,
        database_url=pg_url,
        broker_url=f"redis://127.0.0.1:{port}/0",
        poll_seconds="0.2",
        lease_seconds="3",
        dispatch_timeout_seconds="5",  # a job dispatched into a lost queue is re-offered this soon
    )
    services = Services({**os.environ, "PYTHONUNBUFFERED": "1"}, home)
    services.start_api()
    services.client = httpx.Client(
        base_url=services.base_url, headers={"authorization": f"Bearer {make_key()}"}, timeout=60
    )
    yield services
    services.client.close()
    services.stop()


def test_a_redis_restart_loses_no_deletion_and_duplicates_none(stack, broker, tmp_path):
    port, held, home = broker
    model_id = register_small(stack, tmp_path, "broker")
    rows = [[f"r{50 + 2 * k}", f"r{51 + 2 * k}"] for k in range(4)]
    ids = [ask(stack, model_id, r, subject=f"s{k}") for k, r in enumerate(rows)]  # no worker: queued in Redis
    wait_for(
        lambda: (
            sql("SELECT count(*) FROM jobs WHERE request_id = ANY(:ids) AND status = 'dispatched'", ids=ids)[0][0]
            == len(ids)
        ),
        timeout=60,
        what="the jobs dispatched into the broker",
    )
    assert redis.Redis(host="127.0.0.1", port=port).llen("cpu") >= 1  # the messages are in the queue

    held["proc"].send_signal(signal.SIGKILL)  # the broker dies with its queue (no persistence) ...
    held["proc"].wait(timeout=10)
    time.sleep(1)
    held["proc"] = _redis_server(port, home)  # ... and comes back empty
    assert redis.Redis(host="127.0.0.1", port=port).llen("cpu") == 0

    stack.start_worker("after-restart")
    done = [wait_request(stack.client, rid, timeout=300) for rid in ids]
    assert [d["status"] for d in done] == ["certified"] * len(ids), done
    for rid in ids:
        assert certified_events(stack, rid) == 1
        written = written_for(rid)
        assert (written["certificates"], written["erased_rows"]) == (1, 2)  # a batch's version names its leader
    chain = version_chain(model_id)
    assert [parent for _, parent in chain[1:]] == [n for n, _ in chain[:-1]], chain
    served = {d["result_version_id"] for d in done}
    assert len(served) == len(chain) - 1  # every version after the first serves a request: none published twice
    assert_erased(model_id, [r for pair in rows for r in pair])

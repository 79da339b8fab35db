"""Leases and per-model serialisation with real Celery workers on PostgreSQL (issue 22). Workers are stopped at a
named step of a job (app/jobs/faults.py): SIGSTOP pauses one past its lease (heartbeat thread included), a hold
keeps one at a step with its lease renewed. Leases last 3 s here; a job has 2 attempts."""

from __future__ import annotations

import time

import pytest

from app.ml.verification.shadows import shadows_from_bytes
from app.storage import get_store
from tests.helpers import wait_for, wait_request
from tests.integration.pipeline_faults import (
    ask,
    assert_erased,
    certified_events,
    job_of,
    owned_by,
    register_small,
    resume,
    sql,
    version_chain,
    wait_stopped,
    written_for,
)
from tests.stack import api_stack
from tests.unit.loopback_server import loopback_server

NOTHING = {"versions": 0, "certificates": 0, "erased_rows": 0, "webhooks": 0}


@pytest.fixture(scope="module")
def stack(pg_url, redis_url, tmp_path_factory):
    """API only: each test starts (and kills) its own workers, each with its own fault points."""
    with api_stack(
        tmp_path_factory.mktemp("lethe-race"),
        database_url=pg_url,
        broker_url=redis_url,
        poll_seconds="0.2",
        lease_seconds="3",
        max_attempts="2",
        webhook_allowed_hosts='["127.0.0.1"]',
    ) as services:
        yield services


@pytest.fixture(scope="module")
def model_id(stack, tmp_path_factory):
    # one request per job: a worker that took a second job on the model would otherwise serve the first in its batch
    return register_small(stack, tmp_path_factory.mktemp("race-data"), "race", batch={"max_requests": 1})


@pytest.fixture
def workers(stack):
    """Workers a test starts; SIGKILLed after it (a stopped one ignores SIGTERM), so none takes the next test's job."""
    started = []
    yield lambda name, **env: started.append(stack.start_worker(name, **env)) or started[-1]
    for proc in started:
        if proc.poll() is None:
            stack.kill(proc)


def test_a_worker_paused_past_its_lease_writes_nothing_when_it_wakes(stack, model_id, workers, tmp_path):
    """w1 stops (SIGSTOP) just before publishing; its lease runs out; w2 takes the job and is held just before
    publishing, holding the lease. w1 wakes and must write nothing: no version, no certificate, no erasure, no
    webhook. Then w2 publishes: one version, one certificate, one webhook."""
    ids = ["r10", "r11"]
    with loopback_server({"/hook": (204, {}, b"")}) as receiver:
        w1 = workers("lease-w1", LETHE_TEST_STOP_AT="publish")
        request_id = ask(stack, model_id, ids, callback_url=receiver.url("/hook"))
        wait_stopped(w1, "w1 before publishing")
        assert owned_by(job_of(request_id).lease_owner, w1)

        w2 = workers("lease-w2", LETHE_TEST_HOLD_AT="publish", LETHE_TEST_HOLD_DIR=str(tmp_path))
        wait_for(lambda: (tmp_path / "publish.reached").exists(), timeout=240, what="w2 before publishing")
        status, attempts, owner = job_of(request_id)
        assert (status, attempts) == ("running", 2) and owned_by(owner, w2)

        resume(w1)
        wait_for(lambda: "lease lost" in stack.log("lease-w1"), timeout=60, what="w1 to notice it lost the lease")
        assert written_for(request_id) == NOTHING
        assert version_chain(model_id) == [(1, None)]
        assert stack.client.get(f"/v1/deletion-requests/{request_id}").json()["status"] != "certified"

        (tmp_path / "publish.go").touch()
        done = wait_request(stack.client, request_id, timeout=240)
        assert done["status"] == "certified" and done["attempts"] == 2, done
        wait_for(lambda: receiver.received, timeout=60, what="the webhook")
    assert written_for(request_id) == {"versions": 1, "certificates": 1, "erased_rows": 2, "webhooks": 1}
    assert version_chain(model_id) == [(1, None), (2, 1)]
    assert certified_events(stack, request_id) == 1
    assert len(receiver.received) == 1
    assert_erased(model_id, ids)


def test_a_worker_that_wakes_after_another_published_its_job_writes_nothing(stack, model_id, workers):
    """w1 stops just before publishing; its lease runs out; w2 takes the job and publishes it. Then w1 wakes: the
    request keeps its one version, certificate, erasure and webhook."""
    ids = ["r12", "r13"]
    with loopback_server({"/hook": (204, {}, b"")}) as receiver:
        w1 = workers("late-w1", LETHE_TEST_STOP_AT="publish")
        request_id = ask(stack, model_id, ids, callback_url=receiver.url("/hook"))
        wait_stopped(w1, "w1 before publishing")
        workers("late-w2")
        done = wait_request(stack.client, request_id, timeout=240)
        assert done["status"] == "certified" and done["attempts"] == 2, done
        published = {"versions": 1, "certificates": 1, "erased_rows": 2, "webhooks": 1}
        assert written_for(request_id) == published
        chain = version_chain(model_id)

        resume(w1)
        wait_for(lambda: "lease lost" in stack.log("late-w1"), timeout=60, what="w1 to notice it lost the lease")
        wait_for(lambda: receiver.received, timeout=60, what="the webhook")
    assert written_for(request_id) == published
    assert version_chain(model_id) == chain
    assert certified_events(stack, request_id) == 1
    assert len(receiver.received) == 1


def test_a_job_whose_lease_expires_on_every_attempt_fails_attempts_exhausted(stack, model_id, workers):
    """Two workers each stop mid-job (before unlearning) and never come back: after LETHE_MAX_ATTEMPTS (2) expired
    leases the request ends failed with the documented problem type, and nothing was written."""
    w1 = workers("dead-w1", LETHE_TEST_STOP_AT="unlearn")
    request_id = ask(stack, model_id, ["r20", "r21"])
    wait_stopped(w1, "w1 before unlearning")
    w2 = workers("dead-w2", LETHE_TEST_STOP_AT="unlearn")
    wait_stopped(w2, "w2 before unlearning")
    assert owned_by(job_of(request_id).lease_owner, w2)
    done = wait_request(stack.client, request_id, timeout=120)
    assert done["status"] == "failed", done
    assert done["error"]["type"] == "https://lethe.dev/problems/attempts-exhausted", done
    assert done["attempts"] == 2
    assert job_of(request_id)[:2] == ("failed", 2)
    assert written_for(request_id) == NOTHING


def _advisory_waiters() -> int:
    """Backends of this database waiting for an advisory lock (a worker's claim, queued behind another's)."""
    return sql(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
        "AND wait_event_type = 'Lock' AND wait_event = 'advisory'"
    )[0][0]


def test_two_workers_racing_one_model_run_its_jobs_one_at_a_time(stack, model_id, workers, tmp_path, redis_url):
    """A stops between the per-model check and its claim (the check passed: the model is free). B takes a second
    deletion on the same model meanwhile. Per-model serialisation means B waits for A's claim and then finds the
    model busy; without it, B claims too and both run on one model at once. Each request is then published exactly
    once, on a linear chain of versions, and every row is erased."""
    a = workers("race-a", LETHE_TEST_STOP_AT="claim")
    first = ask(stack, model_id, ["r30", "r31"], subject="a")
    wait_stopped(a, "A between the per-model check and its claim")
    workers("race-b", LETHE_TEST_HOLD_AT="publish", LETHE_TEST_HOLD_DIR=str(tmp_path))
    second = ask(stack, model_id, ["r32", "r33"], subject="b")
    # the dispatcher hands a worker one job per model at a time, so B's job waits in the outbox while A's is on its
    # way; a second dispatcher, or a re-offer after the dispatch timeout, can still send it: send it as they would,
    # so that B meets the per-model check its own claim makes (what this test is about)
    from celery import Celery

    ((b_job,),) = sql("SELECT id FROM jobs WHERE request_id = :r", r=second)
    Celery(broker=redis_url).send_task("workers.tasks.execute_job", args=[b_job], queue="cpu")
    wait_for(
        lambda: _advisory_waiters() or (tmp_path / "publish.reached").exists(),
        timeout=240,
        what="B queued behind A's claim (or running beside it)",
    )
    resume(a)
    wait_for(lambda: job_of(first).status == "running", timeout=60, what="A's claim")
    running = sql(
        "SELECT DISTINCT lease_owner FROM jobs WHERE model_id = :m AND status = 'running' AND lease_expires_at > now()",
        m=model_id,
    )
    assert [owned_by(o, a) for (o,) in running] == [True], "another worker runs a job on the model A holds"
    (tmp_path / "publish.go").touch()  # B's own run (after A's) may pass its hold

    done = [wait_request(stack.client, rid, timeout=300) for rid in (first, second)]
    assert [d["status"] for d in done] == ["certified", "certified"], done
    assert done[0]["attempts"] == 1, done[0]  # A never lost a race for the model it had claimed
    chain = version_chain(model_id)
    assert [parent for _, parent in chain[1:]] == [n for n, _ in chain[:-1]], chain  # each from the one before
    for rid in (first, second):
        assert certified_events(stack, rid) == 1
        assert written_for(rid)["certificates"] == 1
    assert {d["result_version_id"] for d in done} <= {r[0] for r in sql("SELECT id FROM model_versions")}
    assert_erased(model_id, ["r30", "r31", "r32", "r33"])


def test_a_batch_publishing_slowly_keeps_its_lease_for_the_upkeep(stack, workers, tmp_path, tmp_path_factory):
    """Issue 21: the heartbeat's renewal of a batch's jobs waited on the rows the publishing transaction had locked
    and then found the members finished, so the worker took its lease as lost after every batch: the upkeep stopped
    and the model stayed held until the lease ran out. Here the publishing transaction is held (rows locked) for
    several beats (every 0.5 s of the 3-s lease): the batch is certified, the job that keeps the model for the
    upkeep ends ``succeeded`` in its first attempt, and the worker never reports a lost lease."""
    batched = register_small(stack, tmp_path_factory.mktemp("batch-data"), "batch-slow-publish")
    ids = [ask(stack, batched, [f"r{50 + 2 * k}", f"r{51 + 2 * k}"], subject=f"b{k}") for k in range(3)]
    workers("slow-publish", LETHE_TEST_HOLD_AT="publishing", LETHE_TEST_HOLD_DIR=str(tmp_path))
    wait_for(lambda: (tmp_path / "publishing.reached").exists(), timeout=240, what="the publishing transaction")
    time.sleep(2.0)  # four beats, each waiting on the locked job rows
    (tmp_path / "publishing.go").touch()
    done = [wait_request(stack.client, rid, timeout=300) for rid in ids]
    assert [d["status"] for d in done] == ["certified"] * 3, done
    assert len({d["result_version_id"] for d in done}) == 1, "the three requests were not served as one batch"
    wait_for(
        lambda: (
            {s for (s,) in sql("SELECT status FROM jobs WHERE model_id = :m AND kind = 'deletion'", m=batched)}
            == {"succeeded"}
        ),
        timeout=60,
        what="every job of the batch ended (the upkeep's too)",
    )
    assert {a for (a,) in sql("SELECT attempts FROM jobs WHERE request_id = ANY(:ids)", ids=ids)} == {1}
    assert "lease lost" not in stack.log("slow-publish")


def test_a_refill_paused_past_its_lease_writes_no_shadow_after_another_worker_erased_a_row(
    stack, workers, tmp_path_factory
):
    """Issue 21: the refill after a certificate trains shadows on the rows present when it started; a row erased
    meanwhile must never reach a stored set. w1 certifies a deletion and stops (SIGSTOP) in its upkeep with a refill
    block trained on every row but not yet swapped in; its lease runs out; w2 serves a second deletion, erasing a
    row that w1's new shadows may have trained on, and refills the pool itself. w1 wakes: its swap finds the lease
    lost (and the set it started from replaced), writes nothing, and its stored block is shredded with its attempt;
    the model's shadow set is w2's, untouched."""
    model = register_small(stack, tmp_path_factory.mktemp("refill-data"), "refill-race", batch={"max_requests": 1})
    w1 = workers("refill-w1", LETHE_TEST_STOP_AT="refill")
    first = ask(stack, model, ["r60"], subject="a")
    assert wait_request(stack.client, first, timeout=240)["status"] == "certified"
    wait_stopped(w1, "w1 in its refill, before the swap")
    workers("refill-w2")
    second = ask(stack, model, ["r61"], subject="b")
    assert wait_request(stack.client, second, timeout=240)["status"] == "certified"

    def entry() -> dict:
        return sql("SELECT state FROM models WHERE id = :m", m=model)[0][0]["verification"]

    wait_for(
        lambda: not sql("SELECT 1 FROM jobs WHERE model_id = :m AND status <> 'succeeded'", m=model),
        timeout=120,
        what="w2 to end every job on the model (the re-offered upkeep included)",
    )
    settled = entry()
    resume(w1)
    wait_for(lambda: "lease lost" in stack.log("refill-w1"), timeout=60, what="w1 to notice it lost the lease")
    pool = shadows_from_bytes(get_store().get_bytes(entry()["shadows"]))
    assert not {60, 61} & set(pool.row_ids.tolist())  # no column, so no shadow, of an erased row (r<i>: position i)
    assert entry() == settled and pool.n_shadows == pool.settings.n_shadows
    intents = "SELECT 1 FROM blob_intents WHERE job_id IN (SELECT id FROM jobs WHERE model_id = :m)"
    wait_for(lambda: not sql(intents, m=model), timeout=60, what="w1's attempt to shred what it stored")

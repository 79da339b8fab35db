"""A worker killed with SIGKILL at each later step of a deletion (verify, erase, publish, shred: the worker stops
itself there, app/jobs/faults.py): the lease expires, another worker re-runs the job, and exactly one new model
version, one certificate and one erasure of each row exist. The kills mid-retrain and mid-batch are
test_worker_crash.py (their own file and stack, so that pytest-xdist runs the two side by side)."""

from __future__ import annotations

import pytest

from app.storage import get_store
from tests.helpers import wait_for, wait_request
from tests.integration.pipeline_faults import (
    ask,
    assert_erased,
    certified_events,
    job_of,
    register_small,
    sql,
    version_chain,
    wait_stopped,
    written_for,
)

pytestmark = pytest.mark.timeout(1200)  # each wait below is at most 600 s


@pytest.fixture(scope="module")
def small_model(stack, tmp_path_factory):
    return register_small(stack, tmp_path_factory.mktemp("crash-data"), "crash-small")


@pytest.mark.parametrize(
    ("step", "rows"),
    [("verify", ["r40", "r41"]), ("erase", ["r42", "r43"]), ("publish", ["r44", "r45"]), ("shred", ["r46", "r47"])],
)
def test_sigkill_at_each_step_loses_nothing_and_duplicates_nothing(stack, small_model, step, rows):
    """A worker stops itself at the step (app/jobs/faults.py) and is SIGKILLed there. Before publishing, the lease
    runs out and a new worker re-runs the job: one version, one certificate, each row erased once. At the shred (the
    job already finished), the request stays certified once and the dispatcher's tick shreds what was due."""
    idle = "SELECT count(*) FROM jobs WHERE status IN ('pending', 'dispatched', 'running')"
    wait_for(lambda: sql(idle)[0][0] == 0, timeout=600, what="the last test's jobs (upkeep) to end")  # not re-run
    if stack.worker.poll() is None:
        stack.kill(stack.worker)
    doomed = stack.start_worker(f"doomed-{step}", LETHE_TEST_STOP_AT=step)
    request_id = ask(stack, small_model, rows)
    wait_stopped(doomed, f"the worker at {step}")
    stack.kill(doomed)
    before = job_of(request_id)
    if step == "shred":
        assert before[:2] == ("succeeded", 1)
    else:
        assert before[:2] == ("running", 1)
        assert written_for(request_id) == {"versions": 0, "certificates": 0, "erased_rows": 0, "webhooks": 0}

    stack.worker = stack.start_worker(f"after-{step}")
    done = wait_request(stack.client, request_id, timeout=300)
    assert done["status"] == "certified", done
    assert done["attempts"] == (1 if step == "shred" else 2)
    # certified with its version; the job ends after the upkeep (while it still holds the model)
    wait_for(lambda: job_of(request_id).status != "running", timeout=120, what="the job's upkeep")
    assert job_of(request_id)[:2] == ("succeeded", done["attempts"])
    assert written_for(request_id) == {"versions": 1, "certificates": 1, "erased_rows": 2, "webhooks": 0}
    assert certified_events(stack, request_id) == 1
    chain = version_chain(small_model)
    assert [parent for _, parent in chain[1:]] == [n for n, _ in chain[:-1]], chain
    assert_erased(small_model, rows)  # re-checked on what the re-run left
    wait_for(
        lambda: sql("SELECT count(*) FROM shred_queue WHERE done_at IS NULL AND not_before <= now()")[0][0] == 0,
        timeout=60,
        what="the due blobs shredded",
    )
    replaced = (done["erasure"].get("dataset") or {}).get("before")
    if replaced:
        assert not get_store().exists(replaced), "the table as it was before the erasure is still stored"

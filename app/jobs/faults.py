"""Test-only fault points: the integration tests stop a real worker at a named step of a job, to kill it there or
to let its lease run out there (tests/integration/test_worker_crash.py, test_lease_race_pg.py). With the variables
unset (production) every point is a no-op.

``LETHE_TEST_STOP_AT=publish,erase``: the process stops itself (SIGSTOP, heartbeat thread included) the first time
it reaches each named step. ``LETHE_TEST_HOLD_AT=publish`` with ``LETHE_TEST_HOLD_DIR=DIR``: the first time it
reaches the step it writes ``DIR/<step>.reached`` and waits (its lease still renewed) until ``DIR/<step>.go``
exists."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

_passed: set[str] = set()


def _named(variable: str, step: str) -> bool:
    return step in (os.environ.get(variable) or "").split(",")


def point(step: str) -> None:
    """A named step of a job is about to run (each fires once per process)."""
    if step in _passed or not (_named("LETHE_TEST_STOP_AT", step) or _named("LETHE_TEST_HOLD_AT", step)):
        return
    _passed.add(step)
    if _named("LETHE_TEST_STOP_AT", step):
        os.kill(os.getpid(), signal.SIGSTOP)
        return
    gate = Path(os.environ["LETHE_TEST_HOLD_DIR"])
    (gate / f"{step}.reached").write_text(str(os.getpid()))
    while not (gate / f"{step}.go").exists():
        time.sleep(0.05)

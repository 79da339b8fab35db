"""The README's quickstart runs as written (scripts/quickstart.sh: serve, key, register, delete, watch, report,
certificate verified offline), on the embedded default, on 127.0.0.1."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_quickstart_ends_with_a_valid_certificate():
    env = {k: v for k, v in os.environ.items() if not k.startswith("LETHE_")}
    env["LETHE_BIN"] = str(Path(sys.executable).parent)
    run = subprocess.run(
        ["bash", str(REPO / "scripts" / "quickstart.sh"), str(_free_port())],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    assert "Lethe API on http://127.0.0.1:" in out and "certified" in out
    assert "VALID: deletion certificate" in out and "evidence class:" in out, out[-2000:]

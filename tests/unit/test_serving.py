"""``lethe serve --workers N`` (app/serving.py): each worker listens on a socket of its own, so a client opening many
connections at once reaches every worker (uvicorn's shared socket let one worker take all of them: issue 21)."""

from __future__ import annotations

import collections
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PID_APP = """
import os
async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    body = str(os.getpid()).encode()
    headers = [(b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})
"""

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="connections spread over SO_REUSEPORT sockets on Linux only"
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start(tmp_path: Path, app: str, workers: int = 2) -> tuple[subprocess.Popen, int]:
    (tmp_path / "pidapp.py").write_text(PID_APP)
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    command = [sys.executable, "-m", "app.serving", app, "--port", str(port), "--workers", str(workers)]
    return subprocess.Popen(command, cwd=tmp_path, env=env), port


def _pids_of_burst(port: int, n: int) -> collections.Counter:
    """Open ``n`` connections at once (as a client pool or wrk does), then ask each which process answers it."""
    sockets = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(n)]
    answers = collections.Counter()
    try:
        for sock in sockets:
            sock.sendall(b"GET / HTTP/1.1\r\nHost: test\r\n\r\n")
        for sock in sockets:
            data = b""
            while b"\r\n\r\n" not in data or not data.split(b"\r\n\r\n", 1)[1]:
                chunk = sock.recv(4096)
                assert chunk, "connection closed without an answer"
                data += chunk
            answers[int(data.split(b"\r\n\r\n", 1)[1])] += 1
    finally:
        for sock in sockets:
            sock.close()
    return answers


def _wait_ready(server: subprocess.Popen, port: int, workers: int) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert server.poll() is None, f"the server exited ({server.returncode})"
        if _listeners(port) == workers:
            return
        time.sleep(0.1)
    raise AssertionError(f"{workers} workers not listening on {port}")


def _listeners(port: int) -> int:
    """Listening TCP sockets on ``port`` (/proc/net/tcp: state 0A); a socket shared by several processes counts once."""
    count = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":
            count += 1
    return count


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads /proc/net/tcp")
def test_each_worker_listens_on_its_own_socket_and_a_burst_reaches_every_worker(tmp_path):
    server, port = _start(tmp_path, "pidapp:app", workers=2)
    try:
        _wait_ready(server, port, 2)  # two listening sockets (uvicorn's supervisor: one, shared)
        burst = _pids_of_burst(port, 32)
        assert len(burst) == 2 and min(burst.values()) >= 4, burst  # P(fail) ~1e-6 with the kernel's hash spread

        # a worker that dies is replaced, and the port keeps answering on both
        os.kill(next(iter(burst)), signal.SIGKILL)
        deadline = time.monotonic() + 30
        pids: collections.Counter = collections.Counter()
        while time.monotonic() < deadline:
            try:
                pids = _pids_of_burst(port, 32)
            except OSError:  # a connection the dying worker held
                pids = collections.Counter()
            if len(pids) == 2 and next(iter(burst)) not in pids:
                break
            time.sleep(0.2)
        assert len(pids) == 2 and next(iter(burst)) not in pids, pids

        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=30) == 0
        assert _listeners(port) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_a_worker_that_cannot_start_stops_the_server(tmp_path):
    server, _ = _start(tmp_path, "no_such_module:app", workers=2)
    try:
        assert server.wait(timeout=60) == 3
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_a_port_already_taken_is_a_clear_error(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        command = [sys.executable, "-m", "app.serving", "pidapp:app", "--port", str(port), "--workers", "2"]
        done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 3
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr and "Traceback" not in done.stderr

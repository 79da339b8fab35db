"""Real processes for the integration tests and the stream benchmark: a fresh PostgreSQL database, an API server
(uvicorn) and Celery workers as child processes sharing one environment. Loopback only."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import psycopg

PG_ADMIN = os.environ.get("LETHE_TEST_PG_ADMIN", "postgresql://postgres@127.0.0.1:5432/postgres")
REDIS_URL = os.environ.get("LETHE_TEST_REDIS", "redis://127.0.0.1:6379/15")
ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def fresh_database(prefix: str = "lethe_it"):
    """A new, empty PostgreSQL database (its SQLAlchemy URL), dropped afterwards."""
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    base = PG_ADMIN.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://", 1)
    try:
        yield f"{base}/{name}"
    finally:
        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


class Services:
    """An API server and Celery workers as child processes sharing one environment."""

    def __init__(self, env: dict[str, str], home: Path):
        self.env, self.home = env, home
        self.procs: list[subprocess.Popen] = []
        self.base_url = ""

    def _spawn(self, args: list[str], log_name: str) -> subprocess.Popen:
        log = open(self.home / log_name, "ab")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(
            args, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.procs.append(proc)
        return proc

    def start_api(self) -> str:
        port = _free_port()
        self._spawn(
            [
                sys.executable,
                "-m",
                "uvicorn",
                "app.asgi:app",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--log-level",
                "warning",
            ],
            "api.log",
        )
        self.base_url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.base_url}/healthz", timeout=1).status_code == 200:
                    return self.base_url
            except httpx.HTTPError:
                time.sleep(0.2)
        raise RuntimeError(f"API did not start; log:\n{(self.home / 'api.log').read_text()[-3000:]}")

    def start_worker(self, name: str) -> subprocess.Popen:
        return self._spawn(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "workers.celery_app",
                "worker",
                "-Q",
                "cpu,gpu",
                "--concurrency",
                "1",
                "-P",
                "solo",
                "--prefetch-multiplier",
                "1",
                "-n",
                f"{name}@%h",
                "--loglevel",
                "INFO",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
            ],
            f"worker-{name}.log",
        )

    def kill(self, proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
        os.killpg(proc.pid, sig)
        proc.wait(timeout=30)

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)

"""Integration tests: a fresh PostgreSQL database per session, Redis as the Celery broker, and real processes
(uvicorn for the API, `celery worker` for jobs). They fail, not skip, when PostgreSQL or Redis is not there."""

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
import pytest
import redis

from tests.helpers import configure, make_key

PG_ADMIN = os.environ.get("LETHE_TEST_PG_ADMIN", "postgresql://postgres@127.0.0.1:5432/postgres")
REDIS_URL = os.environ.get("LETHE_TEST_REDIS", "redis://127.0.0.1:6379/15")
ROOT = Path(__file__).resolve().parents[2]


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


@pytest.fixture(scope="session")
def pg_url():
    with fresh_database() as url:
        yield url


@pytest.fixture(scope="session")
def redis_url():
    client = redis.Redis.from_url(REDIS_URL)
    client.ping()
    client.flushdb()
    yield REDIS_URL
    client.flushdb()


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


@pytest.fixture(scope="module")
def stack(pg_url, redis_url, tmp_path_factory):
    """PostgreSQL + Redis + API process + one Celery worker, migrated, with an all-scopes key."""
    home = tmp_path_factory.mktemp("lethe")
    configure(
        home,
        database_url=pg_url,
        broker_url=redis_url,
        poll_seconds="0.2",
        lease_seconds="3",
        webhook_allowed_hosts='["127.0.0.1"]',  # the tests' own receivers listen on loopback only
    )
    key = make_key()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    services = Services(env, home)
    services.start_api()
    services.worker = services.start_worker("w1")
    services.key = key
    services.client = httpx.Client(base_url=services.base_url, headers={"authorization": f"Bearer {key}"}, timeout=60)
    yield services
    services.client.close()
    services.stop()

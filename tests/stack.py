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

    def _spawn(self, args: list[str], log_name: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        log = open(self.home / log_name, "ab")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(
            args, cwd=ROOT, env=env or self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
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

    def start_worker(self, name: str, **extra_env: str) -> subprocess.Popen:
        """A Celery worker (one solo process); ``extra_env`` is its own on top of the shared environment (the fault
        points of app/jobs/faults.py, say)."""
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
            {**self.env, **extra_env},
        )

    def kill(self, proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
        os.killpg(proc.pid, sig)
        proc.wait(timeout=30)

    def log(self, name: str) -> str:
        """A worker's log so far."""
        return (self.home / f"worker-{name}.log").read_text(errors="replace")

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


def stopped(proc: subprocess.Popen) -> bool:
    """Whether the process has stopped itself (SIGSTOP: state T in /proc/PID/stat)."""
    try:
        stat = Path(f"/proc/{proc.pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] in ("T", "t")


def worker_redis_url(url: str, worker: str) -> str:
    """The Redis database of pytest-xdist worker ``worker`` ("gw0", "gw1", …; "" without xdist): ``url``'s own for
    gw0 and a plain run, the N-th below it for gwN."""
    if not worker:
        return url
    base, db = url.rsplit("/", 1)
    index = int(db) - int(worker.removeprefix("gw"))
    if index < 0:
        raise RuntimeError(f"{url}: too few Redis databases below it for xdist worker {worker}")
    return f"{base}/{index}"


@contextlib.contextmanager
def claimed_redis_db(url: str):
    """Use a Redis database for one test module and leave it as it was found: empty. It is claimed with a marker key;
    a database holding anyone else's keys is refused (never flushed), one left by an earlier test run is cleared."""
    import redis

    client = redis.Redis.from_url(url)
    marker = "lethe-tests:claimed-by"
    if client.dbsize() and not client.exists(marker):
        raise RuntimeError(f"{url} holds keys that are not a Lethe test's: set LETHE_TEST_REDIS to an empty database")
    holder = int(client.get(marker) or 0)
    if holder and holder != os.getpid() and Path(f"/proc/{holder}").exists():
        raise RuntimeError(f"{url} is in use by another test run (pid {holder}): give each run its own database")
    client.flushdb()  # empty, or left by an earlier (killed) test run of ours
    client.set(marker, str(os.getpid()))
    try:
        yield url
    finally:
        client.flushdb()
        client.close()


@contextlib.contextmanager
def api_stack(home: Path, **settings: str):
    """``configure(home, **settings)``, then the API as a child process and a client holding an all-scopes key
    (``services.key``); no worker — the caller starts its own. Stopped (with every worker) on exit."""
    from tests.helpers import configure, make_key

    configure(home, **settings)
    services = Services({**os.environ, "PYTHONUNBUFFERED": "1"}, home)
    services.start_api()
    services.key = make_key()
    services.client = httpx.Client(
        base_url=services.base_url, headers={"authorization": f"Bearer {services.key}"}, timeout=60
    )
    try:
        yield services
    finally:
        services.client.close()
        services.stop()

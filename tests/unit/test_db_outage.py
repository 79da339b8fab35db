"""Issue 22, fault findings: with PostgreSQL down every API error was a 500 without Retry-After, and with PostgreSQL
frozen every call waited without limit. The "database" here is a closed loopback port, or a loopback listener that
accepts connections and never answers (what a frozen server looks like to a new connection)."""

from __future__ import annotations

import os
import socket
import threading
import time
from contextlib import contextmanager

import pytest
from fastapi.testclient import TestClient

from app.config import get_settings
from app.db import reset_engine_cache
from app.main import create_app
from app.problems import PROBLEM_BASE
from tests.helpers import configure, make_key


@contextmanager
def silent_listener():
    """A loopback TCP listener that accepts every connection and never sends a byte."""
    server = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept():
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except TimeoutError:
                continue
            except OSError:
                return

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        stop.set()
        thread.join(timeout=5)
        for conn in held:
            conn.close()
        server.close()


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def database_at(port: int, **env: str):
    os.environ["LETHE_DATABASE_URL"] = f"postgresql+psycopg://postgres@127.0.0.1:{port}/lethe"
    for key, value in env.items():
        os.environ[f"LETHE_{key.upper()}"] = value
    get_settings.cache_clear()
    reset_engine_cache()
    try:
        yield
    finally:
        for key in ["LETHE_DATABASE_URL", *(f"LETHE_{k.upper()}" for k in env)]:
            os.environ.pop(key, None)
        get_settings.cache_clear()
        reset_engine_cache()


def _assert_503(response) -> None:
    assert response.status_code == 503, (response.status_code, response.text[:300])
    assert response.headers["content-type"].startswith("application/problem+json")
    assert response.json()["type"] == PROBLEM_BASE + "database-unavailable"
    assert int(response.headers["Retry-After"]) > 0


def test_database_down_is_503_with_retry_after_on_every_kind_of_route(tmp_path):
    """A route's own query (/healthz), an authenticated route (the key look-up), and the upload route (the key is
    looked up in a middleware, before the body): each answers 503 database-unavailable with Retry-After."""
    configure(tmp_path)
    key = make_key()
    with database_at(closed_port()):
        client = TestClient(create_app(run_background=False), raise_server_exceptions=False)
        auth = {"authorization": f"Bearer {key}"}
        _assert_503(client.get("/healthz"))
        _assert_503(client.get("/v1/jobs/some-job", headers=auth))
        _assert_503(client.get("/v1/models", headers=auth))
        _assert_503(client.post("/v1/models", headers=auth, files={"file": ("t.csv", b"a,b\n1,2\n", "text/csv")}))


def test_a_frozen_database_is_503_within_the_connect_timeout_not_a_hang(tmp_path):
    """A server that accepts and never answers: the call is answered 503 after about the connect timeout (2 s)."""
    configure(tmp_path)
    with silent_listener() as port, database_at(port, db_connect_timeout_seconds="2"):
        client = TestClient(create_app(run_background=False), raise_server_exceptions=False)
        answers: list = []
        started = time.monotonic()
        thread = threading.Thread(target=lambda: answers.append(client.get("/healthz")), daemon=True)
        thread.start()
        thread.join(timeout=20)
        if not answers:
            pytest.fail("a frozen database held the call for more than 20 s")
        _assert_503(answers[0])
        assert time.monotonic() - started < 10


def test_a_statement_that_waits_too_long_is_503_after_the_statement_timeout(tmp_path):
    """PostgreSQL up, but the table a call needs is locked by someone else (a stuck migration, a frozen
    transaction): the key look-up waits at most the statement timeout (1 s here), then the call is answered 503."""
    import psycopg

    from app.db import migrate
    from tests.stack import fresh_database

    with fresh_database("lethe_outage") as url:
        configure(tmp_path, database_url=url, db_statement_timeout_seconds="1")
        migrate(url)
        key = make_key()
        client = TestClient(create_app(run_background=False), raise_server_exceptions=False)
        auth = {"authorization": f"Bearer {key}"}
        assert client.get("/v1/models", headers=auth).status_code == 200
        with psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://")) as locker:
            locker.execute("LOCK TABLE api_keys IN ACCESS EXCLUSIVE MODE")
            answers: list = []
            started = time.monotonic()
            thread = threading.Thread(target=lambda: answers.append(client.get("/v1/models", headers=auth)))
            thread.daemon = True
            thread.start()
            thread.join(timeout=20)
            locker.rollback()
        if not answers:
            pytest.fail("a locked table held the call for more than 20 s")
        _assert_503(answers[0])
        assert time.monotonic() - started < 10
        reset_engine_cache()

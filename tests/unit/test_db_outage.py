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


def _answer(call, limit: float):
    """``call()``'s response, run in a thread so that a hang fails the test after ``limit`` seconds instead of
    holding it (None then), and how long it took."""
    answers: list = []
    started = time.monotonic()
    thread = threading.Thread(target=lambda: answers.append(call()), daemon=True)
    thread.start()
    thread.join(timeout=limit)
    return (answers[0] if answers else None), time.monotonic() - started


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
        answer, took = _answer(lambda: client.get("/healthz"), 20)
        if answer is None:
            pytest.fail("a frozen database held the call for more than 20 s")
        _assert_503(answer)
        assert took < 10


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
            answer, took = _answer(lambda: client.get("/v1/models", headers=auth), 20)
            locker.rollback()
        if answer is None:
            pytest.fail("a locked table held the call for more than 20 s")
        _assert_503(answer)
        assert took < 10
        reset_engine_cache()


class FreezableProxy:
    """A loopback TCP proxy to PostgreSQL that can be frozen: it keeps every connection open and reads nothing more
    (its kernel still acknowledges what the client sends), as a SIGSTOPped server or a hung host looks to a client
    whose connection is already established; new connections are accepted and never answered."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.frozen = threading.Event()
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client = self.server.accept()[0]
            except OSError:
                return
            self.held.append(client)
            if self.frozen.is_set():
                continue
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            self.held.append(upstream)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        while True:
            while self.frozen.is_set():
                time.sleep(0.05)
            try:
                data = source.recv(65536)
                if not data:
                    return
                while self.frozen.is_set():  # a reply read just before the freeze is held back too
                    time.sleep(0.05)
                sink.sendall(data)
            except OSError:
                return

    def close(self) -> None:
        self.server.close()
        for sock in self.held:
            sock.close()


@contextmanager
def frozen_database(name: str):
    """A fresh migrated PostgreSQL database reached through a FreezableProxy: (the proxied URL, the proxy)."""
    from urllib.parse import urlsplit

    from app.db import migrate
    from tests.stack import fresh_database

    with fresh_database(name) as url:
        migrate(url)
        real = urlsplit(url.replace("postgresql+psycopg://", "http://", 1))
        proxy = FreezableProxy(real.port or 5432)
        try:
            yield url.replace(f"{real.hostname}:{real.port}", f"127.0.0.1:{proxy.port}", 1), proxy
        finally:
            proxy.close()
            reset_engine_cache()


def test_a_database_frozen_under_a_pooled_connection_is_503_not_a_hang(tmp_path):
    """Issue 22: PostgreSQL frozen while the API holds pooled connections to it. The server's statement_timeout
    cannot fire (its clock is stopped) and the kernel acknowledges every byte, so only a client-side deadline ends
    the wait: the call is answered 503 within about the statement plus the connect timeout (1 + 2 s here), and once
    the database answers again so is the next call."""
    with frozen_database("lethe_frozen") as (proxied, proxy):
        configure(tmp_path, database_url=proxied, db_statement_timeout_seconds="1", db_connect_timeout_seconds="2")
        key = make_key()
        client = TestClient(create_app(run_background=False), raise_server_exceptions=False)
        auth = {"authorization": f"Bearer {key}"}
        assert client.get("/v1/models", headers=auth).status_code == 200  # the pool holds a live connection
        proxy.frozen.set()
        answer, took = _answer(lambda: client.get("/v1/models", headers=auth), 30)
        if answer is None:
            pytest.fail("a frozen database held a pooled connection's call for more than 30 s")
        _assert_503(answer)
        assert took < 15
        proxy.frozen.clear()
        assert client.get("/v1/models", headers=auth).status_code == 200  # a fresh connection, once it answers


def _assert_intake_503(response) -> None:
    """The intake answers a request it could not make durable 503 (the database's problem, or its own when the batch
    failed before a request was staged), always with Retry-After."""
    assert response.status_code == 503, (response.status_code, response.text[:300])
    assert response.json()["type"] in (PROBLEM_BASE + "database-unavailable", PROBLEM_BASE + "intake-unavailable")
    assert int(response.headers["Retry-After"]) > 0


def test_an_intake_batch_on_a_frozen_database_is_503_not_a_hang(tmp_path):
    """Issue 21 moved the intake batch's statements past SQLAlchemy (app.db.pipelined), on the connection the intake
    thread holds between batches: the watchdog must bound those round trips too. PostgreSQL frozen under that
    connection: the POST is answered 503 within about the statement plus the connect timeout (1 + 2 s), long before
    the intake's own timeout (60 s here), and once the database answers again so is the next POST."""
    from app.requests.intake import reset_batcher

    with frozen_database("lethe_frozen_intake") as (proxied, proxy):
        try:
            configure(
                tmp_path,
                database_url=proxied,
                db_statement_timeout_seconds="1",
                db_connect_timeout_seconds="2",
                intake_timeout_seconds="60",
            )
            key = make_key()
            client = TestClient(create_app(run_background=False), raise_server_exceptions=False)
            headers = {"authorization": f"Bearer {key}"}
            body = {
                "subject_ref": "s-1",
                "model_id": "no-such-model",
                "scope": {"kind": "samples", "sample_ids": ["r1"]},
            }

            def post():
                return client.post("/v1/deletion-requests", headers=headers, json=body)

            assert post().status_code == 404  # a batch ran: the intake thread holds a live connection
            proxy.frozen.set()
            answer, took = _answer(post, 40)
            if answer is None:
                pytest.fail("a frozen database held the intake for more than 40 s")
            _assert_intake_503(answer)
            assert took < 20
            proxy.frozen.clear()
            assert post().status_code == 404
        finally:
            reset_batcher()


def test_statements_run_past_sqlalchemy_raise_its_errors(tmp_path):
    """``pipelined`` runs statements through psycopg directly; callers still see SQLAlchemy's errors: the intake's
    twin fallback catches IntegrityError, and a statement timeout is an OperationalError that ``is_unavailable``
    reads as the database being away (503)."""
    from sqlalchemy.exc import IntegrityError, OperationalError

    from app.db import get_sessionmaker, is_unavailable, pipelined
    from tests.stack import fresh_database

    with fresh_database("lethe_pipelined") as url:
        configure(tmp_path, database_url=url, db_statement_timeout_seconds="1")
        try:
            with get_sessionmaker()() as session:
                assert pipelined(session, ("SELECT 1 + %s", (1,)), ("SELECT %s::text", ("a",))) == [[(2,)], [("a",)]]
                with pytest.raises(IntegrityError):
                    pipelined(
                        session, ("CREATE TEMP TABLE t (x int PRIMARY KEY)", ()), ("INSERT INTO t VALUES (1), (1)", ())
                    )
            with get_sessionmaker()() as session, pytest.raises(OperationalError) as caught:
                pipelined(session, ("SELECT pg_sleep(3)", ()))
            assert is_unavailable(caught.value)
        finally:
            reset_engine_cache()

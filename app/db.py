"""Engine, sessions and the declarative Base (with a naming convention so Alembic names constraints stably)."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import UTC, datetime
from functools import lru_cache
from typing import Any

from pydantic_core import PydanticSerializationError, to_json
from sqlalchemy import JSON, DateTime, Engine, MetaData, Table, create_engine, event, insert, pool
from sqlalchemy.dialects import postgresql
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Session, sessionmaker
from sqlalchemy.types import TypeDecorator

from app.config import get_settings
from app.ids import new_id  # noqa: F401  (re-exported: the tables' default ids)

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


JSONType = JSON().with_variant(JSONB(), "postgresql")


class UTCDateTime(TypeDecorator):
    """Timezone-aware UTC datetimes on both PostgreSQL and SQLite (which stores naive values)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value, dialect):
        if value is not None and value.tzinfo is None:
            raise ValueError("naive datetime")
        return value

    def process_result_value(self, value, dialect):
        if value is not None and value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        return value


def utcnow() -> datetime:
    return datetime.now(UTC)


def make_engine(url: str) -> Engine:
    """``hide_parameters``: bound values (API-key hashes, sample ids, callback URLs) never reach logs or the text
    of a database exception."""
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30}, hide_parameters=True)

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_connection, _record):
            cursor = dbapi_connection.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.execute("PRAGMA busy_timeout=30000")
            cursor.execute("PRAGMA secure_delete=ON")  # freed pages are zeroed: erased rows leave no old content
            cursor.close()
            # let SQLAlchemy's BEGIN reach SQLite so that writers serialise on BEGIN IMMEDIATE (see _begin)
            dbapi_connection.isolation_level = None

        @event.listens_for(engine, "begin")
        def _begin(conn):
            conn.exec_driver_sql("BEGIN IMMEDIATE")

        return engine
    settings = get_settings()
    connect_args: dict[str, Any] = {}
    if url.startswith("postgresql"):
        # issue 22: a database away or frozen made every call wait without limit. libpq's connect_timeout bounds the
        # whole connection (a listener that accepts and never answers included); statement_timeout bounds each
        # statement (lock waits included) on the server.
        connect_args["connect_timeout"] = settings.db_connect_timeout_seconds
        if settings.db_statement_timeout_seconds > 0:
            connect_args["options"] = f"-c statement_timeout={int(settings.db_statement_timeout_seconds * 1000)}"
    engine = create_engine(
        url,
        pool_size=10,
        max_overflow=20,
        pool_pre_ping=True,
        pool_timeout=settings.db_pool_timeout_seconds,
        hide_parameters=True,
        connect_args=connect_args,
    )
    if url.startswith("postgresql") and settings.db_statement_timeout_seconds > 0:
        _watch(engine, settings.db_statement_timeout_seconds + settings.db_connect_timeout_seconds)
    return engine


class StatementWatchdog:
    """A client-side deadline on every round trip of a pooled PostgreSQL connection (issue 22: a frozen database).

    A server that is frozen (SIGSTOP, a hung host) keeps an established connection's socket open and its kernel
    acknowledges every byte, so neither ``statement_timeout`` (the server's own clock) nor TCP keepalives end the wait:
    a call on a pooled connection waited without limit. One daemon thread shuts down the socket of a connection
    whose statement, commit, rollback or ping outlives ``limit`` seconds; psycopg then raises OperationalError, the
    pool discards the connection and the caller answers 503 (``is_unavailable``). ``limit`` is the server's
    statement timeout plus the connect timeout, so a statement the server would end itself is never cut here.
    Hand-written: neither psycopg nor SQLAlchemy bounds a synchronous round trip on the client."""

    def __init__(self, limit: float) -> None:
        self.limit = limit
        self._due: dict[int, tuple[float, weakref.ref]] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def arm(self, dbapi_connection) -> None:
        dbapi_connection = getattr(dbapi_connection, "dbapi_connection", dbapi_connection)  # a pool's proxy: its own
        with self._lock:
            self._due[id(dbapi_connection)] = (time.monotonic() + self.limit, weakref.ref(dbapi_connection))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="lethe-db-watchdog", daemon=True)
                self._thread.start()

    def disarm(self, dbapi_connection) -> None:
        dbapi_connection = getattr(dbapi_connection, "dbapi_connection", dbapi_connection)
        with self._lock:
            self._due.pop(id(dbapi_connection), None)

    def _run(self) -> None:
        tick = min(1.0, self.limit / 4)
        while True:
            time.sleep(tick)
            now = time.monotonic()
            with self._lock:
                late = [key for key, (due, _) in self._due.items() if due <= now]
                conns = [self._due.pop(key)[1]() for key in late]
            for conn in conns:
                if conn is not None:
                    self._cut(conn)

    def _cut(self, conn) -> None:
        try:
            if conn.closed:
                return
            fd = conn.pgconn.socket
            with socket.socket(fileno=os.dup(fd)) as sock:  # a duplicate: shutting it down ends the shared socket
                sock.shutdown(socket.SHUT_RDWR)
            logging.getLogger("lethe.db").warning("a database round trip outlived %.0f s: connection cut", self.limit)
        except Exception:  # closed meanwhile: nothing left to cut
            pass


_WATCHDOGS: weakref.WeakKeyDictionary[Engine, StatementWatchdog] = weakref.WeakKeyDictionary()
"""Each watched engine's watchdog, for the round trips made past SQLAlchemy (``pipelined``)."""


def _watch(engine: Engine, limit: float) -> None:
    """Arm the watchdog around each round trip an engine's connections make — statements, and the dialect's commit,
    rollback (the pool's reset included) and pre-ping, which no engine event brackets — and disarm it when the round
    trip returns."""
    watchdog = _WATCHDOGS[engine] = StatementWatchdog(limit)
    event.listen(engine, "before_cursor_execute", lambda conn, *_: watchdog.arm(conn.connection.dbapi_connection))
    event.listen(engine, "after_cursor_execute", lambda conn, *_: watchdog.disarm(conn.connection.dbapi_connection))

    @event.listens_for(engine, "handle_error")
    def _disarm(context) -> None:
        if context.connection is not None and context.connection.connection.dbapi_connection is not None:
            watchdog.disarm(context.connection.connection.dbapi_connection)

    dialect = engine.dialect
    for name in ("do_commit", "do_rollback", "do_ping"):
        setattr(dialect, name, _bracketed(watchdog, getattr(dialect, name)))


def _bracketed(watchdog: StatementWatchdog, call):
    def bracketed(dbapi_connection):
        watchdog.arm(dbapi_connection)
        try:
            return call(dbapi_connection)
        finally:
            watchdog.disarm(dbapi_connection)

    return bracketed


def is_unavailable(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) says the database is away, not that a statement is wrong: a refused or
    timed-out connection, a connection lost mid-statement, a statement timeout, the pool exhausted (issue 22: these
    were 500s; they are 503 with Retry-After, and a job that meets one waits for the database without spending an
    attempt)."""
    from sqlalchemy import exc as sa_exc

    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, sa_exc.TimeoutError):  # no pooled connection came free
            return True
        if isinstance(exc, sa_exc.DBAPIError) and (
            exc.connection_invalidated or isinstance(exc, (sa_exc.OperationalError, sa_exc.InterfaceError))
        ):
            return not _statement_error(exc.orig)
        if _psycopg_unavailable(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _psycopg_unavailable(exc: BaseException) -> bool:
    try:
        import psycopg
    except ImportError:  # SQLite only
        return False
    return isinstance(exc, (psycopg.OperationalError, psycopg.InterfaceError))


def _statement_error(orig: BaseException | None) -> bool:
    """SQLite reports a wrong statement as an OperationalError too ("no such table", a syntax error): those are bugs,
    not an outage. Locked or busy, disk I/O or a full disk are the database being unavailable."""
    if orig is None or type(orig).__module__ != "sqlite3":
        return False
    text = str(orig).lower()
    return not any(word in text for word in ("locked", "busy", "disk", "full", "unable to open", "readonly"))


def pipelined(session: Session, *statements: tuple[str, Any], commit: bool = False) -> list[list[tuple]]:
    """Run ``statements`` (psycopg SQL with ``%s``/``%(name)s`` placeholders, and their parameters) in the session's
    transaction, straight through psycopg in pipeline mode: ONE round trip for all of them (and for the BEGIN when
    the transaction starts here), each statement prepared once per connection (a single statement inside a transaction,
    without the COMMIT, is sent as such: one round trip either way). Returns each statement's rows ([] for
    one that returns none). PostgreSQL only.

    The intake batch's hot path (issue 21): through SQLAlchemy a statement cost several times its own time in
    Python (an ORM read of one API key ~0.6 ms of CPU), and each was a round trip of its own. The guards of any other
    statement still hold: pending ORM changes are flushed first (as autoflush would), the StatementWatchdog bounds
    the round trip, and a driver error is raised as SQLAlchemy's (IntegrityError, OperationalError... with the
    parameters hidden), the connection invalidated when it broke, so callers' fallbacks and the 503 mapping
    (``is_unavailable``) see what a statement run by SQLAlchemy raises.

    ``commit=True``: the transaction's COMMIT travels in the same round trip, after the statements (the audit log's
    lock is then held one round trip less). Call it last: the caller's ``session.commit()`` that follows finds the
    driver's transaction already closed and sends nothing."""
    import psycopg
    from sqlalchemy import exc as sa_exc

    if session.autoflush:
        session.flush()
    connection = session.connection()
    raw = connection.connection.dbapi_connection
    watchdog = _WATCHDOGS.get(connection.engine)
    if watchdog is not None:
        watchdog.arm(raw)
    sql, params = statements[0]
    try:
        cursors = []
        if len(statements) == 1 and not commit and raw.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS:
            # inside a transaction, one statement needs no pipeline to enter and leave (a third of the client's CPU);
            # outside one, psycopg would send the BEGIN as a round trip of its own
            cursors.append(raw.cursor())
            cursors[-1].execute(sql, params, prepare=True)
        else:
            with raw.pipeline():
                for sql, params in statements:
                    cursors.append(raw.cursor())
                    cursors[-1].execute(sql, params, prepare=True)
                if commit:
                    raw.commit()
        return [cursor.fetchall() if cursor.description else [] for cursor in cursors]
    except psycopg.Error as error:
        if raw.broken:
            connection.invalidate(error)
        raise sa_exc.DBAPIError.instance(
            sql, params, error, psycopg.Error, hide_parameters=True, connection_invalidated=raw.broken
        ) from error
    finally:
        if watchdog is not None:
            watchdog.disarm(raw)


def insert_rows(session: Session, table: Table, rows: list[dict[str, Any]]) -> None:
    """Insert ``rows`` (dicts that all name the same columns) with one statement; see ``insert_many``."""
    insert_many(session, [(table, rows)])


def insert_many(session: Session, parts: list[tuple[Table, list[dict[str, Any]]]]) -> None:
    """Insert rows into several tables with ONE statement and no ORM objects: the intake batch's hot path.

    PostgreSQL: each table's rows travel as one JSON text parameter, ``INSERT ... SELECT ... FROM
    json_to_recordset(:rows)``, the tables joined as data-modifying CTEs (``WITH a AS (INSERT ...), b AS (INSERT ...)
    SELECT 1``; PostgreSQL runs every one of them, in the same snapshot, and a constraint violation fails the whole
    statement). One round trip whatever the number of rows and tables, and the SQL text depends only on the tables
    and columns, so psycopg prepares it once; the rows cost one ``json.dumps`` per table. (A multi-row VALUES list is
    a new text of thousands of placeholders to build and parse per batch, and the ORM's executemany runs one INSERT
    per row.) Elsewhere (SQLite): a Core executemany per table. Every row of a table must name the same columns."""
    if session.get_bind().dialect.name != "postgresql":
        for table, rows in parts:
            if rows:
                session.execute(insert(table), rows)
        return
    statement = insert_statement(parts)
    if statement is not None:
        pipelined(session, statement)


def insert_statement(parts: list[tuple[Table, list[dict[str, Any]]]]) -> tuple[str, dict[str, str]] | None:
    """``insert_many``'s one statement and its parameters, for ``pipelined`` (PostgreSQL); None when no rows."""
    shapes, params = _bulk(parts)
    return (_recordset_insert(shapes), params) if shapes else None


def _bulk(parts: list[tuple[Table, list[dict[str, Any]]]]) -> tuple[tuple[_Shape, ...], dict[str, str]]:
    """The shapes of the parts that have rows (a statement's text depends only on them) and those rows as the JSON
    parameters ``rows0``, ``rows1``... (``insert_statement``, ``insert_then``)."""
    parts = [(table, rows) for table, rows in parts if rows]
    return tuple(_shape(table, rows) for table, rows in parts), {
        f"rows{i}": _rows_json(table, rows) for i, (table, rows) in enumerate(parts)
    }


def _rows_json(table: Table, rows: list[dict[str, Any]]) -> str:
    """The rows as one JSON text, by pydantic-core's serializer (a quarter of ``json.dumps``'s time with a Python
    ``default`` per datetime: issue 21). A naive datetime in a timestamp column would be stored in the session's time
    zone: refused (only those columns are looked at; a datetime inside a JSON value is written as its ISO text)."""
    for name in _timestamp_columns(table):
        for row in rows:
            value = row.get(name)
            if isinstance(value, datetime) and value.tzinfo is None:
                raise ValueError(f"naive datetime in {table.name}.{name}")
    try:
        return to_json(rows).decode()
    except PydanticSerializationError as exc:
        raise TypeError(f"cannot store this value in a bulk insert: {exc}") from None


@lru_cache(maxsize=64)
def _timestamp_columns(table: Table) -> tuple[str, ...]:
    types = ((column.name, column.type) for column in table.columns)
    return tuple(name for name, t in types if isinstance(t.impl if isinstance(t, TypeDecorator) else t, DateTime))


def insert_then(
    parts: list[tuple[Table, list[dict[str, Any]]]], select: str, params: dict[str, Any]
) -> tuple[str, dict]:
    """ONE statement that inserts ``parts`` (as ``insert_many``: data-modifying CTEs) and then runs ``select`` (psycopg
    placeholders by name), where ``{inserted}`` stands for the number of rows inserted: PostgreSQL must finish the
    inserts before it can evaluate that (an unreferenced CTE's insert runs after the main query). For ``pipelined``
    (PostgreSQL): the audit log's lock taken in the same statement as the intake batch's rows (issue 21)."""
    shapes, rows_params = _bulk(parts)
    if not shapes:
        return select.format(inserted="0"), params
    ctes, inserted = _recordset_ctes(shapes)
    return f"WITH {ctes} {select.format(inserted=inserted)}", {**params, **rows_params}


@lru_cache(maxsize=64)
def _recordset_ctes(parts: tuple[_Shape, ...]) -> tuple[str, str]:
    """``insert_then``'s CTEs (each ``RETURNING 1``) and the expression that counts their rows."""
    ctes = ", ".join(f"part{i} AS ({sql} RETURNING 1)" for i, sql in enumerate(_recordset_inserts(parts)))
    return ctes, " + ".join(f"(SELECT count(*) FROM part{i})" for i in range(len(parts)))


@lru_cache(maxsize=64)
def _recordset_insert(parts: tuple[_Shape, ...]) -> str:
    """The statement's text, with psycopg's placeholders (it is run by ``pipelined``)."""
    inserts = _recordset_inserts(parts)
    if len(inserts) == 1:
        return inserts[0]
    ctes = ", ".join(f"part{i} AS ({sql})" for i, sql in enumerate(inserts))
    return f"WITH {ctes} SELECT 1"


class JsonText(str):
    """A JSON column's value given as its JSON text: ``insert_many`` on PostgreSQL hands the text to the column as it is
    (``CAST(... AS jsonb)``), not parsed into Python objects and dumped again (the audit events' payloads, whose
    canonical text is made anyway: issue 21). Elsewhere (SQLite) give the object, not this."""


_Shape = tuple[Table, tuple[str, ...], frozenset[str]]
"""A table, the columns its rows name, and which of them hold ``JsonText``: the statement's text depends on these."""


def _shape(table: Table, rows: list[dict[str, Any]]) -> _Shape:
    """Every row must name the same columns and give ``JsonText`` in the same ones as the first."""
    first = rows[0]
    return table, tuple(first), frozenset(name for name, value in first.items() if isinstance(value, JsonText))


def _recordset_inserts(parts: tuple[_Shape, ...]) -> list[str]:
    """One ``INSERT ... SELECT ... FROM json_to_recordset(%(rows<i>)s)`` per table."""
    dialect = postgresql.dialect()
    inserts = []
    for i, (table, names, texts) in enumerate(parts):
        fields, values = [], []
        for name in names:
            column_type = table.c[name].type
            if isinstance(column_type, JSON):
                sql_type = "text" if name in texts else "jsonb"
            else:
                base = column_type.impl if isinstance(column_type, TypeDecorator) else column_type
                sql_type = base.compile(dialect=dialect)
            fields.append(f'"{name}" {sql_type}')
            values.append(f'CAST("{name}" AS jsonb)' if name in texts else f'"{name}"')
        columns = ", ".join(f'"{n}"' for n in names)
        inserts.append(
            f'INSERT INTO "{table.name}" ({columns}) SELECT {", ".join(values)} '
            f"FROM json_to_recordset(CAST(%(rows{i})s AS json)) AS r({', '.join(fields)})"
        )
    return inserts


def release_freed_pages() -> None:
    """After an erasure on SQLite: copy the WAL back and truncate it, so no old page image of an erased row stays in
    the -wal file (secure_delete already zeroes freed pages in the database file). PostgreSQL: deleted tuples are
    invisible at once and their space is reclaimed by autovacuum (not zeroed; see the README)."""
    engine = get_engine()
    if engine.dialect.name == "sqlite":
        raw = engine.raw_connection()  # outside SQLAlchemy's transaction: a checkpoint needs no open transaction
        try:
            raw.cursor().execute("PRAGMA wal_checkpoint(TRUNCATE)")
        finally:
            raw.close()


@lru_cache
def get_engine() -> Engine:
    return make_engine(get_settings().resolved_database_url)


@lru_cache
def get_sessionmaker() -> sessionmaker[Session]:
    return sessionmaker(get_engine(), expire_on_commit=False)


def reset_engine_cache() -> None:
    """For tests and the CLI: forget the cached engine after settings change."""
    if get_engine.cache_info().currsize:
        get_engine().dispose()
    get_engine.cache_clear()
    get_sessionmaker.cache_clear()


_ACTIVE: ContextVar[Session | None] = ContextVar("lethe_active_session", default=None)


def active_session() -> Session | None:
    """The ``session_scope`` transaction open in this thread, if any: a write that must go with the caller's own
    transaction (an attempt's blob intent, app/jobs/blobs.py) uses it, since a second writer would wait on SQLite's
    lock that the first holds."""
    return _ACTIVE.get()


@contextmanager
def session_scope() -> Iterator[Session]:
    """One transaction: commit on success, roll back on error."""
    session = get_sessionmaker()()
    token = _ACTIVE.set(session)
    try:
        with session.begin():
            yield session
    finally:
        _ACTIVE.reset(token)
        session.close()


def get_session() -> Iterator[Session]:
    """FastAPI dependency: a session per request; routers commit explicitly."""
    session = get_sessionmaker()()
    try:
        yield session
    finally:
        session.close()


def migrate(url: str | None = None) -> None:
    """Bring the database to the newest Alembic revision (tests and the CLI migrate; nothing calls create_all). The
    revisions ship inside the package (``app/migrations``), so an installed wheel migrates from any working
    directory; ``alembic.ini`` at the repository's root is for developers running ``alembic`` by hand."""
    from pathlib import Path

    from alembic import command
    from alembic.config import Config

    settings = get_settings()
    config = Config()
    config.set_main_option("script_location", str(Path(__file__).resolve().parent / "migrations"))
    config.attributes["url"] = url or settings.migration_database_url or settings.resolved_database_url
    command.upgrade(config, "head")


RUNTIME_TABLE_RIGHTS = "SELECT, INSERT, UPDATE, DELETE"
RUNTIME_SEQUENCE_RIGHTS = "USAGE, SELECT, UPDATE"


def separate_runtime_role() -> bool:
    """True when the service runs as another PostgreSQL role than the one that migrates (the tables' owner)."""
    from sqlalchemy.engine import make_url

    settings = get_settings()
    if not settings.migration_database_url or not settings.resolved_database_url.startswith("postgresql"):
        return False
    owner, runtime = make_url(settings.migration_database_url), make_url(settings.resolved_database_url)
    return owner.username != runtime.username


def grant_runtime_role(append_only: tuple[str, ...], role: str | None = None, password: str | None = None) -> str:
    """PostgreSQL: give the service's runtime role what it needs and no more (issue 22): read and write on every
    table, but only SELECT and INSERT on the ``append_only`` ones, the audit log's (no UPDATE, DELETE, TRUNCATE),
    SELECT on alembic_version, and no ownership: the account the service runs as cannot rewrite the audit chain, not
    even by disabling its triggers. Connects as the owner (``migration_database_url``, else ``database_url``); creates
    the role (LOGIN, with ``password`` or the one in ``database_url`` when that URL names the role) when it is
    missing. Idempotent: ``lethe migrate`` runs it after each upgrade. Returns the role's name."""
    from psycopg import sql
    from sqlalchemy.engine import make_url

    settings = get_settings()
    runtime = make_url(settings.resolved_database_url)
    role = role or runtime.username
    if not role:
        raise ValueError("name the runtime role, or put it in LETHE_DATABASE_URL")
    if password is None and runtime.username == role:
        password = runtime.password
    owner_url = settings.migration_database_url or settings.resolved_database_url
    if not owner_url.startswith("postgresql"):
        raise ValueError("a runtime role is for PostgreSQL (SQLite has no roles)")
    engine = create_engine(owner_url, poolclass=pool.NullPool)
    try:
        with engine.begin() as connection:
            cursor = connection.connection.driver_connection.cursor()
            ident = sql.Identifier(role)
            cursor.execute("SELECT current_user, current_database(), current_schema()")
            owner, database, schema = cursor.fetchone()
            if role == owner:
                raise ValueError(f"the runtime role {role!r} is the tables' owner: use another role")
            cursor.execute("SELECT rolsuper FROM pg_roles WHERE rolname = %s", (role,))
            found = cursor.fetchone()
            login = sql.SQL(" LOGIN PASSWORD {}").format(sql.Literal(password)) if password else sql.SQL(" LOGIN")
            if found is None:
                cursor.execute(sql.SQL("CREATE ROLE {}").format(ident) + login)
            elif found[0]:
                raise ValueError(f"the runtime role {role!r} is a superuser: its rights cannot be limited")
            elif password:
                cursor.execute(sql.SQL("ALTER ROLE {}").format(ident) + login)
            cursor.execute("SELECT pg_has_role(%s, %s, 'MEMBER')", (role, owner))
            if cursor.fetchone()[0]:
                raise ValueError(f"the runtime role {role!r} is a member of the owner {owner!r}: it owns the tables")
            tables = sql.SQL(", ").join(sql.Identifier(schema, name) for name in append_only)
            version = sql.Identifier(schema, "alembic_version")
            for statement in (
                sql.SQL("GRANT CONNECT ON DATABASE {} TO {}").format(sql.Identifier(database), ident),
                sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(sql.Identifier(schema), ident),
                sql.SQL(f"GRANT {RUNTIME_TABLE_RIGHTS} ON ALL TABLES IN SCHEMA {{}} TO {{}}").format(
                    sql.Identifier(schema), ident
                ),
                sql.SQL(f"GRANT {RUNTIME_SEQUENCE_RIGHTS} ON ALL SEQUENCES IN SCHEMA {{}} TO {{}}").format(
                    sql.Identifier(schema), ident
                ),
                sql.SQL("REVOKE ALL ON {} FROM {}").format(tables, ident),
                sql.SQL("GRANT SELECT, INSERT ON {} TO {}").format(tables, ident),
                sql.SQL("REVOKE ALL ON {} FROM {}").format(version, ident),
                sql.SQL("GRANT SELECT ON {} TO {}").format(version, ident),
                sql.SQL(
                    f"ALTER DEFAULT PRIVILEGES IN SCHEMA {{}} GRANT {RUNTIME_TABLE_RIGHTS} ON TABLES TO {{}}"
                ).format(sql.Identifier(schema), ident),
                sql.SQL(
                    f"ALTER DEFAULT PRIVILEGES IN SCHEMA {{}} GRANT {RUNTIME_SEQUENCE_RIGHTS} ON SEQUENCES TO {{}}"
                ).format(sql.Identifier(schema), ident),
            ):
                cursor.execute(statement)
    finally:
        engine.dispose()
    return role

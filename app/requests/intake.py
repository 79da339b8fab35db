"""Group commit for deletion-request intake.

Every accepted request must be durable before its 202, and the audit chain must be a line, so each intake
transaction ends with an fsync'd commit while holding the audit log's append lock. One request per transaction
therefore caps intake at 1 / (commit latency) — about 290 requests/s on a disk with 3.5 ms fsyncs, whatever the
number of API threads. The batcher instead takes up to ``intake_batch_max`` waiting requests and commits them
together: one fsync and one lock hold per batch. Its fast path reads the batch's API keys (the route only checks that
a key is present), every Idempotency-Key and every sample id it names in one round trip (pipelined), validates each
request (a bad one fails alone: nothing is written before validation passes), inserts the requests, jobs and held rows
with one statement, then takes the audit log's lock and appends the events, with the COMMIT (``append_events``). On
PostgreSQL these statements go straight through psycopg (``app.db.pipelined``: the same watchdog and errors as any
other; SQLAlchemy's execution machinery cost more CPU than the statements). If another API process commits a twin
of one of its keys in between (the unique constraint fires), or any other error strikes the batch (a database error
caused by one request), the batch is redone one request per SAVEPOINT, so one bad request never fails the others. A
request waits for company at most ``intake_batch_wait_ms``, and ``intake_batch_gap_ms`` after the last one joined;
nobody is answered before the commit that makes their request durable.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from pydantic_core import to_json
from sqlalchemy import select, tuple_
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from app.auth.service import Principal, live_principals, principals_for, scope_problem, unknown_key_problem
from app.config import get_settings
from app.db import get_engine, get_sessionmaker, pipelined
from app.jobs.outbox import nudge
from app.problems import Problem
from app.registry.tables import Model
from app.requests.schemas import DeletionRequestCreate
from app.requests.service import (
    Prepared,
    StagedRequest,
    insert_requests,
    lookup_rows,
    prepare,
    replay,
    request_rows,
    stage_request,
    to_out,
    validate_against_registry,
)
from app.requests.tables import DeletionRequest

MODEL_TTL = 1.0
HELD_IDLE_S = 10.0
SWEEP_S = 0.25
"""How often an event loop with requests waiting looks for those past ``intake_timeout_seconds`` (``_sweep``): a
timed-out request is answered at most this much after its deadline."""

log = logging.getLogger("lethe.intake")

ACTIVE_S = 1.0
"""A connection that sent a request within this long counts as one that may send the next (``_note_client``)."""


@dataclass
class _Item:
    principal: Principal | None
    body: DeletionRequestCreate
    idempotency_key: str | None
    future: Future
    key_hash: str | None = None  # submit_key: the API key is looked up with the rest of the batch
    waiter: asyncio.Future | None = None  # submit_async: the event loop's future, woken with its batch
    prepared: Prepared | None = None  # submit_async: hashed on the event loop (not for a large request)


LARGE_REQUEST_IDS = 1_000
"""A request naming more sample ids than this is validated and made durable apart, on the intake's one large-request
thread, so no batch of other requests waits for its look-up (issue 22: 90,000 unknown ids held the single intake
thread for 3 s here, 33 s before the look-ups were batched, and every request behind them waited as long)."""


def _is_large(body: DeletionRequestCreate) -> bool:
    return body.scope.kind == "samples" and len(body.scope.sample_ids) > LARGE_REQUEST_IDS


class IntakeBatcher:
    def __init__(
        self,
        max_batch: int | None = None,
        wait_ms: float | None = None,
        threads: int | None = None,
        gap_ms: float | None = None,
    ):
        settings = get_settings()
        self.max_batch = max_batch or settings.intake_batch_max
        self.wait = (settings.intake_batch_wait_ms if wait_ms is None else wait_ms) / 1000
        self.gap = (settings.intake_batch_gap_ms if gap_ms is None else gap_ms) / 1000
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()  # C: a put is no lock and condition of ours
        self._threads = [
            threading.Thread(target=self._run, name=f"lethe-intake-{i}", daemon=True)
            for i in range(max(1, int(threads or settings.intake_threads)))
        ]
        self._large = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lethe-intake-large")
        self._started = False
        self._lock = threading.Lock()
        self._models: dict[str, tuple[float, Model]] = {}
        self._held = threading.local()  # each intake thread's own connection (see _held_session)
        # per event loop: (deadline, item) of its submit_async waiters, oldest first (see _sweep)
        self._deadlines: dict[asyncio.AbstractEventLoop, collections.deque[tuple[float, weakref.ref[_Item]]]] = {}
        self._clients: dict[tuple[str, int], float] = {}  # connection → when it last sent a request (_note_client)
        self._pruned = 0.0
        self._active = 0

    def _start(self) -> None:
        with self._lock:
            if not self._started:
                for thread in self._threads:
                    thread.start()
                self._started = True

    def submit(self, principal: Principal, body: DeletionRequestCreate, idempotency_key: str | None) -> Future:
        """Returns a future of (DeletionRequestOut, created); it raises the request's Problem, if any."""
        self._start()
        future: Future = Future()
        self._enqueue(_Item(principal, body, idempotency_key, future))
        return future

    def submit_key(self, key_hash: str, body: DeletionRequestCreate, idempotency_key: str | None) -> Future:
        """As ``submit``, for a request not yet authenticated: its key (HMAC) is looked up, with every other key of
        the batch, in one query just before the batch is validated; 401/403 problems come back on the future."""
        self._start()
        future: Future = Future()
        self._enqueue(_Item(None, body, idempotency_key, future, key_hash))
        return future

    def submit_async(
        self,
        key_hash: str,
        body: DeletionRequestCreate,
        idempotency_key: str | None,
        client: tuple[str, int] | None = None,
    ) -> asyncio.Future:
        """As ``submit_key``, awaited on the running event loop. A batch wakes each loop it answers ONCE (one
        ``call_soon_threadsafe`` for all its requests of that loop): a future per request, wrapped with
        ``asyncio.wrap_future``, cost a self-pipe write per request, a system call that let the event loop take the
        GIL from the intake thread in the middle of its batch. Cancelling the returned future (the client went
        away) cancels the request if no batch has taken it yet; so does ``intake_timeout_seconds`` passing, after
        which the future raises TimeoutError (``_sweep``). ``client``: the connection's (host, port), see
        ``_note_client``."""
        self._start()
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        prepared = None if _is_large(body) else prepare(body)  # hashing 1,000+ ids would hold the event loop
        item = _Item(None, body, idempotency_key, Future(), key_hash, waiter, prepared)
        waiter.add_done_callback(lambda w: w.cancelled() and item.future.cancel())
        self._expire(loop, item, get_settings().intake_timeout_seconds)
        if client is not None and client[1]:  # port 0: an address a proxy forwarded, not a connection
            self._note_client((client[0], client[1]), loop.time())
        self._enqueue(item)
        return waiter

    def _note_client(self, client: tuple[str, int], now: float) -> None:
        """``client`` (a connection) sent a request ``now``. HTTP/1.1 carries one request at a time per connection, so
        once every connection that has been sending (within ``ACTIVE_S``) has its request in the batch being
        gathered, no other request is on its way and ``_collect`` cuts the batch then, not ``gap`` later (issue 21:
        in bench/intake.py's closed loop that wait left a core idle; alternated full runs: cores busy 1.59-1.62 ->
        1.66-1.71, ratio 0.200/0.200 -> 0.226/0.237). A connection per request, or connections gone quiet, only make
        the count larger: the gap then cuts, as before."""
        seen = self._clients
        if now - self._pruned > ACTIVE_S / 4:
            for gone in [c for c, at in seen.items() if now - at > ACTIVE_S]:
                del seen[gone]
            self._pruned = now
        seen[client] = now
        self._active = len(seen)  # an int for the intake threads to read (the dict changes on the event loop)

    def _expire(self, loop: asyncio.AbstractEventLoop, item: _Item, timeout: float) -> None:
        """Give ``item``'s waiter its deadline: one sweep every ``SWEEP_S`` per loop while any waits, not a timer
        per request (``asyncio.wait_for`` cost a timer handle, a second future and two callbacks per request: ~3 %
        of the API's CPU at intake rates, issue 21)."""
        pending = self._deadlines.get(loop)
        if pending is None:
            pending = self._deadlines[loop] = collections.deque()
            loop.call_later(min(SWEEP_S, timeout), self._sweep, loop)
        pending.append((loop.time() + timeout, weakref.ref(item)))  # weak: an answered request is freed at once

    def _sweep(self, loop: asyncio.AbstractEventLoop) -> None:
        """On ``loop``: forget the waiters already answered, time out those past their deadline (the request is
        cancelled if no batch took it yet: it is never made durable; one already taken may still commit, and its
        Idempotency-Key then finds it), and come back while any waits. Waiters join in deadline order (one timeout
        per process), so the sweep stops at the first one still waiting inside its time."""
        pending = self._deadlines[loop]
        now = loop.time()
        while pending and ((item := pending[0][1]()) is None or item.waiter.done() or pending[0][0] <= now):
            pending.popleft()
            if item is not None and not item.waiter.done():
                item.future.cancel()
                item.waiter.set_exception(TimeoutError())
        if pending:
            loop.call_later(min(SWEEP_S, max(pending[0][0] - now, 0.0)), self._sweep, loop)
        else:
            del self._deadlines[loop]

    def _enqueue(self, item: _Item) -> None:
        if _is_large(item.body):
            self._large.submit(self._alone, item)
        else:
            self._queue.put(item)

    def _alone(self, item: _Item) -> None:
        """One large request, as a batch of its own on this thread (and this thread's own connection)."""
        if not item.future.set_running_or_notify_cancel():
            return
        try:
            self._commit_batch([item])
        except Exception:
            log.exception("large intake request crashed")
            if not item.future.done():
                item.future.set_exception(RuntimeError("intake failed; retry with the same Idempotency-Key"))
            _wake([item])

    def stop(self) -> None:
        self._large.shutdown(wait=True, cancel_futures=False)
        if self._started:
            self._queue.put(None)  # each thread puts it back for the next
            for thread in self._threads:
                thread.join(timeout=10)

    def _collect(self, first: _Item) -> list[_Item]:
        """Up to ``max_batch`` items: those arriving within ``gap`` of the one before, for at most ``wait`` (a burst
        of requests shares a commit; the batch is cut once the burst is over, not at the end of the window, so neither
        a lone request nor a finished burst waits the whole of it), and no more once it holds a request from every
        connection that has been sending (``_note_client``). An item whose client went away (its future was
        cancelled) is dropped here; once taken, a future is "running" and can no longer be cancelled, so its outcome
        is always delivered."""
        start = time.monotonic()
        batch, deadline, last = [first] if first.future.set_running_or_notify_cancel() else [], start + self.wait, start
        while len(batch) < self.max_batch and not 0 < self._active <= len(batch):
            timeout = min(deadline, last + self.gap) - time.monotonic()
            try:
                item = self._queue.get(timeout=timeout) if timeout > 0 else self._queue.get_nowait()
            except queue.Empty:
                break
            if item is None:
                self._queue.put(None)
                break
            last = time.monotonic()
            if item.future.set_running_or_notify_cancel():
                batch.append(item)
        return batch

    def _held_session(self) -> Session:
        """A session on the connection this thread keeps between batches: a pool checkout pings the database (a
        round trip per batch); a connection used a moment ago needs none. Idle for ``HELD_IDLE_S``, it goes back
        to the pool (and the next checkout pings); after any error it is dropped (``_drop_connection``)."""
        now = time.monotonic()
        engine = get_engine()
        held: Connection | None = getattr(self._held, "connection", None)
        if held is not None and (
            now - self._held.used > HELD_IDLE_S or held.engine is not engine  # settings changed
        ):
            self._drop_connection()
            held = None
        if held is None:
            held = self._held.connection = engine.connect()
        self._held.used = now
        return Session(bind=held, expire_on_commit=False)

    def _drop_connection(self) -> None:
        held: Connection | None = getattr(self._held, "connection", None)
        if held is not None:
            try:
                held.close()
            except Exception:  # a broken connection: the pool discards it
                log.debug("closing the intake connection failed", exc_info=True)
            self._held.connection = None

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                self._queue.put(None)  # the other intake threads stop too
                self._drop_connection()
                return
            batch = self._collect(first)
            if not batch:
                continue
            try:
                self._commit_batch(batch)
            except Exception:  # never let the intake thread die: every later request would hang
                log.exception("intake batch crashed")
                for item in batch:
                    if not item.future.done():
                        item.future.set_exception(RuntimeError("intake failed; retry with the same Idempotency-Key"))
                _wake(batch)

    @staticmethod
    def _authenticate(session, batch: list[_Item], principals: dict[str, Principal] | None = None) -> list[_Item]:
        """Resolve the batch's not-yet-authenticated keys in one query (in the batch's own transaction: a key
        revoked before it began is refused), or from ``principals`` read already; a refused item is answered here."""
        pending = {item.key_hash for item in batch if item.principal is None and item.key_hash}
        if not pending:
            return batch
        if principals is None:
            principals = principals_for(session, sorted(pending))
        admitted = []
        for item in batch:
            if item.principal is None:
                principal = principals.get(item.key_hash) if item.key_hash else None
                problem = unknown_key_problem() if principal is None else scope_problem(principal, "requests:write")
                if problem is not None:
                    item.future.set_exception(problem)
                    continue
                item.principal = principal
            admitted.append(item)
        return admitted

    def _commit_batch(self, batch: list[_Item]) -> None:
        try:
            outcomes = self._batched(batch)
        except IntegrityError:  # another API process committed a twin between our look-up and our insert
            log.info("intake batch of %d hit a concurrent Idempotency-Key twin; one by one", len(batch))
            outcomes = self._one_by_one(batch)
        except Exception:  # any other error (a database error caused by one request): one SAVEPOINT per request
            log.warning("intake batch of %d failed; one by one", len(batch), exc_info=True)
            outcomes = self._one_by_one(batch)
        self._deliver(batch, outcomes)

    @staticmethod
    def _deliver(batch: list[_Item], outcomes: list[tuple[_Item, object]]) -> None:
        for item, outcome in outcomes:
            if isinstance(outcome, BaseException):
                item.future.set_exception(outcome)
            else:
                item.future.set_result(outcome)
        for item in batch:  # nothing staged (the database down before the first look-up): never left waiting
            if not item.future.done():
                item.future.set_exception(unavailable())
        _wake(batch)

    def _model(self, session, model_id: str):
        """A snapshot of the model row, at most ``MODEL_TTL`` old: status and prepared methods change rarely."""
        now = time.monotonic()
        hit = self._models.get(model_id)
        if hit and hit[0] > now:
            return hit[1]
        model = session.get(Model, model_id)
        if model is not None:
            session.expunge(model)
            self._models[model_id] = (now + MODEL_TTL, model)
        return model

    def _wanted_rows(self, session, batch: list[_Item]) -> dict[str, list[str]]:
        """Data set id → the sample ids the batch's sample-scoped requests name there (one look-up per data set)."""
        wanted: dict[str, dict[str, None]] = {}
        max_ids = get_settings().max_sample_ids
        for item in batch:
            if item.body.scope.kind != "samples":
                continue
            ids = dict.fromkeys(item.body.scope.sample_ids)
            if len(ids) > max_ids:
                continue  # refused by validation (too-many-sample-ids) without reading its rows
            model = self._model(session, item.body.model_id)
            if model is not None:
                wanted.setdefault(model.dataset_id, {}).update(ids)
        return {dataset_id: list(ids) for dataset_id, ids in wanted.items()}

    def _lookups(self, session, batch: list[_Item]) -> tuple[list[_Item], dict[tuple[str, str], object], dict]:
        """The batch authenticated (``_authenticate``: the refused items answered and left out), the requests already
        made under its (API key, Idempotency-Key) pairs, and the data-set rows its requests name (data set id → row
        id → (``deleted_by``, position)), read for the whole batch at once: on PostgreSQL in ONE statement
        (``_LOOKUPS``; three in one pipeline before, two round trips before that), the twins found by the key's hash
        where the key is not yet known. The rows of a replayed or refused request are read too (rare; nothing is
        written or told for them)."""
        if session.get_bind().dialect.name != "postgresql":
            batch = self._authenticate(session, batch)
            keys = [(item.principal.key_id, item.idempotency_key) for item in batch if item.idempotency_key]
            known = _idempotent_twins(session, keys) if keys else {}
            wanted = self._wanted_rows(session, batch)
            return batch, known, {d: lookup_rows(session, d, ids) for d, ids in wanted.items()}
        pending = sorted({item.key_hash for item in batch if item.principal is None and item.key_hash})
        keyed = [item for item in batch if item.idempotency_key]
        wanted = self._wanted_rows(session, batch)
        twins_wanted = [
            {
                "key_id": item.principal.key_id if item.principal else None,
                "key_hash": None if item.principal else item.key_hash,
                "idem": item.idempotency_key,
            }
            for item in keyed
        ]
        rows_wanted = [{"dataset_id": d, "row_id": row_id} for d, ids in wanted.items() for row_id in ids]
        wanted_json = {"keys": pending, "twins": twins_wanted, "rows": rows_wanted}
        (found,) = pipelined(session, (_LOOKUPS, {name: to_json(v).decode() for name, v in wanted_json.items()}))
        keys, twins, rows = [], [], {dataset_id: {} for dataset_id in wanted}
        for part, a, b, c, d, e, f, g, h in found:
            if part == 0:
                keys.append((a, b, c, d, e, f, g))
            elif part == 1:
                twins.append(a)
            else:
                rows[a][b] = (c, h)
        batch = self._authenticate(session, batch, live_principals(keys) if pending else None)
        return batch, _requests_by_key(session, twins) if batch else {}, rows

    def _batched(self, batch: list[_Item]) -> list[tuple[_Item, object]]:
        """The fast path, one transaction in three round trips (eight before issue 21): the batch's keys,
        Idempotency-Keys and sample ids (``_lookups``); validation in Python; ONE statement inserting requests, jobs
        and held rows (no ORM objects, no per-row statements) with the audit log's lock and head; the events with the
        COMMIT (``insert_requests``)."""
        session = self._held_session()
        try:
            batch, known, rows = self._lookups(session, batch)
            if not batch:
                session.rollback()
                return []
            outcomes: list[tuple[_Item, object]] = []
            staged: list[dict] = []
            for item in batch:
                prepared = item.prepared or prepare(item.body)
                key = (item.principal.key_id, item.idempotency_key) if item.idempotency_key else None
                try:
                    if key in known:
                        outcomes.append((item, (replay(known[key], prepared.fingerprint), False)))
                        continue
                    model = self._model(session, item.body.model_id)
                    found = rows.get(model.dataset_id) if model is not None else None
                    model = validate_against_registry(session, item.body, model, found)
                    values = request_rows(
                        item.principal, item.body, item.idempotency_key, model, prepared.fingerprint, found, prepared
                    )
                    staged.append(values)
                    request = StagedRequest(**values["request"])
                    if key:
                        known[key] = request  # the same key again in this batch replays this request
                    outcomes.append((item, (request, True)))
                except Problem as exc:
                    outcomes.append((item, exc))
            insert_requests(session, staged, commit=True)
            session.commit()
            if staged:
                nudge()
            return [(item, o if isinstance(o, BaseException) else (to_out(o[0]), o[1])) for item, o in outcomes]
        except Exception:
            try:
                session.rollback()
            finally:
                session.close()
                self._drop_connection()  # the slow path starts on a fresh (pinged) connection
            raise
        finally:
            session.close()

    def _one_by_one(self, batch: list[_Item]) -> list[tuple[_Item, object]]:
        """The slow path: each request in its own SAVEPOINT (stage_request), one commit."""
        outcomes: list[tuple[_Item, object]] = []
        session = get_sessionmaker()()
        staged = []
        try:
            batch = [item for item in batch if not item.future.done()]  # refused keys were answered already
            if any(item.principal is None for item in batch):  # the fast path failed before authenticating
                batch = self._authenticate(session, batch)
            for item in batch:
                try:
                    request, created = stage_request(session, item.principal, item.body, item.idempotency_key)
                    staged.append((item, request, created))
                except Exception as exc:  # a Problem (or a bug) belongs to this request alone
                    outcomes.append((item, exc))
            session.commit()
            if staged:
                nudge()
            outcomes += [(item, (to_out(request), created)) for item, request, created in staged]
        except Exception as exc:
            session.rollback()
            outcomes += [(item, exc) for item, _, _ in staged]
        finally:
            session.close()
        return outcomes


_LOOKUPS = (
    "SELECT 0 AS part, k.key_hash AS a, k.id AS b, k.name AS c, k.scopes AS d, k.model_id AS e, k.client_id AS f, "
    "k.expires_at AS g, NULL::integer AS h FROM api_keys AS k "
    "WHERE k.key_hash IN (SELECT json_array_elements_text(CAST(%(keys)s AS json))) AND k.revoked_at IS NULL "
    "UNION ALL SELECT 1, r.id, NULL, NULL, NULL, NULL, NULL, NULL, NULL "
    "FROM json_to_recordset(CAST(%(twins)s AS json)) AS p(key_id varchar, key_hash varchar, idem varchar) "
    "CROSS JOIN LATERAL (SELECT d.id FROM deletion_requests AS d WHERE d.api_key_id = COALESCE(p.key_id, "
    "(SELECT k.id FROM api_keys AS k WHERE k.key_hash = p.key_hash)) AND d.idempotency_key = p.idem LIMIT 1) AS r "
    "UNION ALL SELECT 2, p.dataset_id, x.row_id, x.deleted_by, NULL, NULL, NULL, NULL, x.position "
    "FROM json_to_recordset(CAST(%(rows)s AS json)) AS p(dataset_id varchar, row_id varchar) "
    "CROSS JOIN LATERAL (SELECT y.row_id, y.deleted_by, y.position FROM dataset_rows AS y "
    "WHERE y.dataset_id = p.dataset_id AND y.row_id = p.row_id LIMIT 1) AS x"
)
"""The intake batch's reads in ONE statement (one round trip: a loopback TCP round trip costs ~50 µs of the API's
CPU on the benchmark's machine, and psycopg's pipeline a send per statement; issue 21), the three parts told apart by
``part``: 0, the live keys among the batch's not-yet-authenticated key hashes (``LIVE_KEYS``' columns); 1, the ids of
the requests already made under its (API key, Idempotency-Key) pairs, the key given by its id or, not yet
authenticated, by its hash; 2, the data-set rows its requests name ((data set, row id) → ``deleted_by``, position).
The lists travel as JSON texts (psycopg dumps a list element by element in Python). Parts 1 and 2 probe a unique
index once per pair, whatever the planner's statistics say (``LIMIT 1``: without it the planner flattens part 2
into a hash join over every row of ``dataset_rows``): a row-value IN list was planned from statistics taken
when the table was small, as one probe on the key alone, filtering every request that key ever made (1.5 ms a batch
after 3,500 requests, growing with the table). A twin under a key that authentication then refuses is read and
never used (only an admitted item looks its twin up)."""


def _requests_by_key(session: Session, ids: list[str]) -> dict[tuple[str, str], DeletionRequest]:
    """The requests ``ids`` (the twins found; replays are rare), by (API key, Idempotency-Key)."""
    if not ids:
        return {}
    query = select(DeletionRequest).where(DeletionRequest.id.in_(ids))
    return {(r.api_key_id, r.idempotency_key): r for r in session.execute(query).scalars()}


def _idempotent_twins(session: Session, keys: list[tuple[str, str]]) -> dict[tuple[str, str], DeletionRequest]:
    """The requests already made under the batch's (API key, Idempotency-Key) pairs (not PostgreSQL: ``_lookups``
    probes them with ``_LOOKUPS``)."""
    query = select(DeletionRequest).where(tuple_(DeletionRequest.api_key_id, DeletionRequest.idempotency_key).in_(keys))
    return {(r.api_key_id, r.idempotency_key): r for r in session.execute(query).scalars()}


def _wake(items: list[_Item]) -> None:
    """Hand each settled item's outcome to its event loop's waiter (``submit_async``'s; others have none): one
    ``call_soon_threadsafe`` per loop."""
    by_loop: dict[asyncio.AbstractEventLoop, list[_Item]] = {}
    for item in (i for i in items if i.waiter is not None):
        by_loop.setdefault(item.waiter.get_loop(), []).append(item)
    for loop, waiting in by_loop.items():
        try:
            loop.call_soon_threadsafe(_settle, waiting)
        except RuntimeError:  # the loop is closed: nobody waits any more
            log.debug("intake answers for a closed event loop dropped")


def _settle(items: list[_Item]) -> None:
    """On the event loop: each waiter gets its item's outcome (one already cancelled is left alone)."""
    for item in items:
        if item.waiter.done():
            continue
        if item.future.cancelled():
            item.waiter.cancel()
        elif (exc := item.future.exception()) is not None:
            item.waiter.set_exception(exc)
        else:
            item.waiter.set_result(item.future.result())


def unavailable() -> Problem:
    """A request the intake could not make durable (the database did not answer): 503, retry with the same
    Idempotency-Key (issue 22: such a request used to wait for ever, and held the API's shutdown)."""
    problem = Problem(
        503,
        "intake-unavailable",
        "The request could not be recorded now",
        "The database did not answer; nothing was accepted. Retry later with the same Idempotency-Key.",
    )
    problem.headers["Retry-After"] = str(get_settings().retry_after_seconds)
    return problem


_batcher: IntakeBatcher | None = None
_batcher_lock = threading.Lock()


def get_batcher() -> IntakeBatcher:
    global _batcher
    with _batcher_lock:
        if _batcher is None:
            _batcher = IntakeBatcher()
        return _batcher


def reset_batcher() -> None:
    global _batcher
    with _batcher_lock:
        if _batcher is not None:
            _batcher.stop()
        _batcher = None

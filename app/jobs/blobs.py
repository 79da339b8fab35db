"""The blobs an attempt writes before it publishes (issue 22): a rewritten table's chunks, new weights, method state,
shadow sets, a forget lock, plot data. The registry is the log of what is live (as Delta Lake's log is); this module
is the only writer of the write-ahead intents (``blob_intents``) and shreds what no log entry references.

* ``recording``: for the length of an attempt, every blob is named in ``blob_intents`` before its bytes reach the
  store (in the caller's transaction when one is open, else in its own, committed first).
* ``settle``: whoever ends the attempt without publishing it — the worker itself (a failed or rejected verdict, an
  error, a lost lease) or, for a worker killed outright, the dispatcher's reconciler (``settle_dead``: intents whose
  owner holds no running job) — shreds exactly those blobs, except what something references (a published version,
  a data set's chunks, a report's plots, a queued shredding, another live attempt's intent). Publishing clears the
  intents in its own transaction (``clear``): its blobs are referenced from then on.
* ``sweep``: shreds every blob nothing references once it is older than ``orphan_blob_grace_seconds``, and every
  stale temp file (run by the dispatcher at most every ``blob_sweep_interval_seconds``; a test calls it directly).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from sqlalchemy import delete, insert, select
from sqlalchemy.orm import Session

from app.config import get_settings
from app.db import active_session, session_scope
from app.jobs.tables import BlobIntent, Job
from app.registry import versions as registry
from app.reports import service as reports
from app.storage import get_store
from app.storage import recording as store_recording

log = logging.getLogger("lethe.blobs")

ACTIVE_JOB_STATUSES = ("pending", "dispatched", "running")
"""A job in one of these may still read the blob its payload names (an uploaded round)."""


class _Intent:
    """The ``before_write`` hook of one attempt (app/storage.py ``recording``)."""

    def __init__(self, job_id: str, owner: str):
        self.job_id, self.owner = job_id, owner

    def __call__(self, digest: str) -> None:
        row = {"owner": self.owner, "job_id": self.job_id, "digest": digest}
        session = active_session()
        if session is not None:  # with the caller's transaction: SQLite's one writer is that transaction
            session.execute(insert(BlobIntent), [row])
            return
        with session_scope() as own:
            own.execute(insert(BlobIntent), [row])


@contextmanager
def recording(job_id: str, owner: str) -> Iterator[None]:
    """Within the block (this thread), every blob written is first recorded as this attempt's intent."""
    with store_recording(_Intent(job_id, owner)):
        yield


def clear(session: Session, owner: str) -> None:
    """In the publishing transaction: the attempt's blobs are referenced by what it publishes."""
    session.execute(delete(BlobIntent).where(BlobIntent.owner == owner))


def referenced(session: Session, excluding: Iterable[str] = ()) -> set[str]:
    """Every digest something references: the registry's live blobs and queued shreddings, reports' plots, the
    payloads of jobs still to run, and the intents of every attempt but the owners ``excluding``."""
    out = registry.referenced_digests(session) | reports.plot_digests(session)
    for payload in session.execute(select(Job.payload).where(Job.status.in_(ACTIVE_JOB_STATUSES))).scalars():
        out |= {v for k, v in (payload or {}).items() if k.endswith("digest") and isinstance(v, str)}
    query = select(BlobIntent.digest).distinct()
    excluded = list(excluding)
    if excluded:
        query = query.where(BlobIntent.owner.not_in(excluded))
    return out | set(session.execute(query).scalars())


def _shred(session: Session, owners: list[str]) -> int:
    """Shred the unreferenced blobs the ``owners``' intents name and drop those intents (one transaction)."""
    if not owners:
        return 0
    named = set(session.execute(select(BlobIntent.digest).where(BlobIntent.owner.in_(owners))).scalars())
    if not named:
        return 0
    keep, store, shredded = referenced(session, excluding=owners), get_store(), 0
    for digest in sorted(named - keep):
        store.delete(digest)  # the shredding an erasure uses
        shredded += 1
    session.execute(delete(BlobIntent).where(BlobIntent.owner.in_(owners)))
    return shredded


def settle(owner: str) -> int:
    """The attempt ``owner`` ran has ended (or a verdict failed and what it wrote so far is moot): shred the blobs it
    wrote that nothing references. Returns how many were shredded."""
    with session_scope() as session:
        shredded = _shred(session, [owner])
    if shredded:
        log.info("shredded %d blob(s) written by an attempt that did not publish them", shredded)
    return shredded


def settle_dead(session: Session) -> int:
    """The reconciler's part: intents whose owner holds no running job (a worker killed, its lease expired, the job
    failed or re-offered) are settled as their worker would have. Returns how many blobs were shredded."""
    holding = select(Job.lease_owner).where(Job.status == "running", Job.lease_owner.is_not(None))
    dead = list(session.execute(select(BlobIntent.owner).where(BlobIntent.owner.not_in(holding)).distinct()).scalars())
    shredded = _shred(session, dead)
    if shredded:
        log.warning("shredded %d blob(s) of %d attempt(s) that ended without publishing", shredded, len(dead))
    return shredded


_SWEEP_LOCK = threading.Lock()
_last_sweep: float | None = None


def sweep() -> dict[str, int]:
    """Shred every blob in the artifact store that nothing references (``referenced``, every intent included) once
    it is older than the grace period, and every temp file as old. The listing is taken before the references, so a
    blob referenced meanwhile is seen referenced."""
    grace = get_settings().orphan_blob_grace_seconds
    store = get_store()
    listing = list(store.listing())
    with session_scope() as session:
        keep = referenced(session)
    counts = store.sweep(keep, grace, listing)
    if counts["blobs"] or counts["temp_files"]:
        log.warning("sweep: shredded %(blobs)d unreferenced blob(s), removed %(temp_files)d temp file(s)", counts)
    return counts


def sweep_if_due() -> dict[str, int] | None:
    """``sweep`` at most every ``blob_sweep_interval_seconds`` in this process (the dispatcher's tick calls it)."""
    global _last_sweep
    with _SWEEP_LOCK:
        now = time.monotonic()
        if _last_sweep is not None and now - _last_sweep < get_settings().blob_sweep_interval_seconds:
            return None
        _last_sweep = now
    return sweep()

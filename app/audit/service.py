"""The tamper-evident audit log: every row carries sha256(prev_hash ‖ canonical JSON of the row).

Appends are serialised (a transaction-scoped advisory lock on PostgreSQL; SQLite's BEGIN IMMEDIATE already serialises
writers) so the chain is a line, never a tree. ``verify_chain`` recomputes it and names the first broken row.

The canonical text is stored as text beside the JSON payload (PostgreSQL's JSONB rewrites ``2.5e16`` as
``25000000000000000``, so a hash recomputed from JSONB would break on honest rows); verification hashes the text and
checks that the columns say the same thing. Non-finite floats, which JSON cannot carry, are written as the strings
``"NaN"``, ``"Infinity"`` and ``"-Infinity"``. Every ``audit_checkpoint_every`` events a checkpoint row anchors the
head with an HMAC (audit-checkpoint key), so a chain cut short after a checkpoint no longer verifies.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import Table, event, select, text
from sqlalchemy.orm import Session

from app.audit.tables import AuditCheckpoint, AuditEvent
from app.config import get_settings
from app.db import insert_many, utcnow

GENESIS_HASH = "0" * 64
_ADVISORY_LOCK_ID = 0x1E7E_A0D1  # any constant shared by every writer of the audit log


def _finite(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return "NaN" if math.isnan(obj) else ("Infinity" if obj > 0 else "-Infinity")
    if isinstance(obj, dict):
        return {str(k): _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


def canonical_json(obj: Any) -> str:
    return json.dumps(_finite(obj), sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def event_body(
    seq: int, at: datetime, actor: str, action: str, entity_type: str, entity_id: str, payload: dict[str, Any]
) -> str:
    """The canonical text of one event: what its hash covers (after the previous row's hash)."""
    return canonical_json(
        {
            "seq": seq,
            "at": at.isoformat(timespec="microseconds"),
            "actor": actor,
            "action": action,
            "entity_type": entity_type,
            "entity_id": entity_id,
            "payload": payload,
        }
    )


def event_hash(
    prev_hash: str,
    seq: int,
    at: datetime,
    actor: str,
    action: str,
    entity_type: str,
    entity_id: str,
    payload: dict[str, Any],
) -> str:
    body = event_body(seq, at, actor, action, entity_type, entity_id, payload)
    return hashlib.sha256((prev_hash + body).encode()).hexdigest()


CHECKPOINT_KEY_ID = "hkdf:audit-checkpoint:v1"


def checkpoint_mac(seq: int, hash_: str, key_id: str = CHECKPOINT_KEY_ID) -> str:
    """HMAC of one checkpoint (a later change may sign with the certificate key; ``key_id`` names the key used)."""
    if key_id != CHECKPOINT_KEY_ID:
        raise ValueError(f"unknown checkpoint key {key_id!r}")
    message = f"lethe-audit-checkpoint:v1:{seq}:{hash_}".encode()
    return hmac.new(get_settings().derived_key("audit-checkpoint"), message, hashlib.sha256).hexdigest()


def hash_subject(secret: bytes, subject_ref: str) -> str:
    """Subject identifiers are personal data: only this keyed hash is stored (ARCHITECTURE.md, contracts)."""
    return hmac.new(secret, subject_ref.encode(), hashlib.sha256).hexdigest()


_HEAD_KEY = "lethe.audit_head"


@event.listens_for(Session, "after_transaction_end")
def _forget_head(session: Session, transaction) -> None:
    """The head cached for a transaction (see append_event) dies with it."""
    if transaction.parent is None:
        session.info.pop(_HEAD_KEY, None)


def forget_head(session: Session) -> None:
    """Call after rolling back a SAVEPOINT that may have appended (its lock and rows are gone)."""
    session.info.pop(_HEAD_KEY, None)


def _locked_head(session: Session) -> tuple[int, str]:
    """(seq, hash) of the chain's head, taking the log's lock on the transaction's first call."""
    head = session.info.get(_HEAD_KEY)
    if head is None:
        if session.get_bind().dialect.name == "postgresql":
            session.execute(text("SELECT pg_advisory_xact_lock(:id)"), {"id": _ADVISORY_LOCK_ID})
        last = session.execute(select(AuditEvent.seq, AuditEvent.hash).order_by(AuditEvent.seq.desc()).limit(1)).first()
        head = (last.seq, last.hash) if last else (0, GENESIS_HASH)
    return head


def append_event(
    session: Session,
    *,
    actor: str,
    action: str,
    entity_type: str,
    entity_id: str,
    payload: dict[str, Any] | None = None,
    flush: bool = True,
) -> AuditEvent:
    """Append one event inside the caller's transaction (so it commits or rolls back with the change it records).

    The first append of a transaction takes the log's lock and reads the head; later appends in the same
    transaction (a batch of intake requests) reuse that head instead of asking the database again.
    """
    seq, prev_hash = _locked_head(session)
    seq += 1
    at = utcnow()
    payload = json.loads(canonical_json(payload or {}))  # what is hashed is what is stored
    body = event_body(seq, at, actor, action, entity_type, entity_id, payload)
    event = AuditEvent(
        seq=seq,
        at=at,
        actor=actor,
        action=action,
        entity_type=entity_type,
        entity_id=entity_id,
        payload=payload,
        prev_hash=prev_hash,
        hash=hashlib.sha256((prev_hash + body).encode()).hexdigest(),
        canonical=body,
    )
    session.add(event)
    if seq % get_settings().audit_checkpoint_every == 0:
        session.add(
            AuditCheckpoint(
                seq=seq, hash=event.hash, at=at, key_id=CHECKPOINT_KEY_ID, mac=checkpoint_mac(seq, event.hash)
            )
        )
    if flush:
        session.flush()
    session.info[_HEAD_KEY] = (seq, event.hash)
    return event


def append_events(
    session: Session, events: list[dict[str, Any]], together_with: list[tuple[Table, list[dict[str, Any]]]] = ()
) -> None:
    """Append several events (dicts of ``actor``, ``action``, ``entity_type``, ``entity_id``, ``payload``) in order,
    with one statement that also inserts the caller's ``together_with`` rows (``app.db.insert_many``): the intake
    batch writes its requests, jobs, held rows, events and checkpoints in one round trip. Same chain, same lock as
    ``append_event``; call it last in the transaction, so the lock is held only for that statement and the commit."""
    if not events:
        return
    seq, prev_hash = _locked_head(session)
    every = get_settings().audit_checkpoint_every
    rows: list[dict[str, Any]] = []
    checkpoints: list[dict[str, Any]] = []
    for spec in events:
        seq += 1
        at = utcnow()
        payload = json.loads(canonical_json(spec.get("payload") or {}))  # what is hashed is what is stored
        body = event_body(seq, at, spec["actor"], spec["action"], spec["entity_type"], spec["entity_id"], payload)
        hash_ = hashlib.sha256((prev_hash + body).encode()).hexdigest()
        rows.append(
            {
                "seq": seq,
                "at": at,
                "actor": spec["actor"],
                "action": spec["action"],
                "entity_type": spec["entity_type"],
                "entity_id": spec["entity_id"],
                "payload": payload,
                "prev_hash": prev_hash,
                "hash": hash_,
                "canonical": body,
            }
        )
        if seq % every == 0:
            checkpoints.append(
                {"seq": seq, "hash": hash_, "at": at, "key_id": CHECKPOINT_KEY_ID, "mac": checkpoint_mac(seq, hash_)}
            )
        prev_hash = hash_
    insert_many(session, [*together_with, (AuditEvent.__table__, rows), (AuditCheckpoint.__table__, checkpoints)])
    session.info[_HEAD_KEY] = (seq, prev_hash)


def chain_head(session: Session) -> dict[str, Any]:
    """The newest event: the one this transaction appended last (events not flushed yet included), else the log's."""
    if (head := session.info.get(_HEAD_KEY)) is not None:
        return {"seq": head[0], "hash": head[1]}
    last = session.execute(select(AuditEvent.seq, AuditEvent.hash).order_by(AuditEvent.seq.desc()).limit(1)).first()
    return {"seq": last.seq, "hash": last.hash} if last else {"seq": 0, "hash": GENESIS_HASH}


def events_for(session: Session, entity_id: str, limit: int = 500) -> list[AuditEvent]:
    """One entity's events in chain order (a deletion request's timeline)."""
    query = select(AuditEvent).where(AuditEvent.entity_id == entity_id).order_by(AuditEvent.seq).limit(limit)
    return list(session.execute(query).scalars())


def latest_events(session: Session, limit: int = 50) -> list[AuditEvent]:
    """The newest events, newest first."""
    return list(session.execute(select(AuditEvent).order_by(AuditEvent.seq.desc()).limit(limit)).scalars())


@dataclass
class ChainVerdict:
    ok: bool
    checked: int
    head: dict[str, Any]
    first_broken_seq: int | None = None
    reason: str | None = None
    checkpoints: int = 0
    last_checkpoint_seq: int | None = None


def _same_json(a: Any, b: Any) -> bool:
    """JSON equality that forgives what JSONB does to numbers (2.5e16 == 25000000000000000, -0.0 == 0) and nothing
    else (true is not 1, "1" is not 1)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return Decimal(repr(a) if isinstance(a, float) else a) == Decimal(repr(b) if isinstance(b, float) else b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_json(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same_json(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def _row_hash_problem(row: AuditEvent) -> str | None:
    """Why the row does not match its hash, or None."""
    if row.canonical is None:  # written before revision 0002: recompute from the columns
        recomputed = event_hash(
            row.prev_hash, row.seq, row.at, row.actor, row.action, row.entity_type, row.entity_id, row.payload
        )
        return (
            None if recomputed == row.hash else "content does not match the row's hash (changed after it was written)"
        )
    if hashlib.sha256((row.prev_hash + row.canonical).encode()).hexdigest() != row.hash:
        return "content does not match the row's hash (changed after it was written)"
    try:
        doc = json.loads(row.canonical)
        same = (
            doc["seq"] == row.seq
            and datetime.fromisoformat(doc["at"]) == row.at
            and (doc["actor"], doc["action"], doc["entity_type"], doc["entity_id"])
            == (row.actor, row.action, row.entity_type, row.entity_id)
            and _same_json(doc["payload"], row.payload)
        )
    except (ValueError, KeyError, TypeError):
        same = False
    return None if same else "the row's columns were changed: they no longer say what its hashed text says"


def verify_chain(session: Session, batch: int = 5000) -> ChainVerdict:
    """Recompute every hash in order (the first row whose link or content does not match is named), then check the
    checkpoints: each one's MAC, the hash of the row it anchors, and that the chain reaches it (a cut tail)."""
    checkpoints = list(session.execute(select(AuditCheckpoint).order_by(AuditCheckpoint.seq)).scalars())
    anchored = {cp.seq: cp for cp in checkpoints}
    last_cp = checkpoints[-1].seq if checkpoints else None
    for cp in checkpoints:
        try:
            good = hmac.compare_digest(cp.mac, checkpoint_mac(cp.seq, cp.hash, cp.key_id))
        except ValueError:
            good = False
        if not good:
            return ChainVerdict(
                False, 0, {"seq": 0, "hash": GENESIS_HASH}, cp.seq, f"checkpoint {cp.seq} has a bad MAC", 0, last_cp
            )
    prev_hash, expected_seq, checked, after = GENESIS_HASH, 1, 0, 0
    while True:
        rows = (
            session.execute(select(AuditEvent).where(AuditEvent.seq > after).order_by(AuditEvent.seq).limit(batch))
            .scalars()
            .all()
        )
        if not rows:
            break
        for row in rows:
            head = {"seq": after, "hash": prev_hash}
            if row.seq != expected_seq:
                return ChainVerdict(
                    False,
                    checked,
                    head,
                    expected_seq,
                    f"row {expected_seq} is missing (next row is {row.seq})",
                    len(checkpoints),
                    last_cp,
                )
            if row.prev_hash != prev_hash:
                return ChainVerdict(
                    False,
                    checked,
                    head,
                    row.seq,
                    "prev_hash does not match the hash of the row before",
                    len(checkpoints),
                    last_cp,
                )
            problem = _row_hash_problem(row)
            if problem is not None:
                return ChainVerdict(False, checked, head, row.seq, problem, len(checkpoints), last_cp)
            cp = anchored.get(row.seq)
            if cp is not None and cp.hash != row.hash:
                return ChainVerdict(
                    False,
                    checked,
                    head,
                    row.seq,
                    f"checkpoint {cp.seq} anchors another hash than row {row.seq} has (the chain was rewritten)",
                    len(checkpoints),
                    last_cp,
                )
            prev_hash, after, expected_seq, checked = row.hash, row.seq, row.seq + 1, checked + 1
        session.expunge_all()
    if last_cp is not None and last_cp > after:
        return ChainVerdict(
            False,
            checked,
            {"seq": after, "hash": prev_hash},
            after + 1,
            f"the chain ends at seq {after} but checkpoint {last_cp} anchors a head at seq {last_cp}: "
            "the tail was truncated",
            len(checkpoints),
            last_cp,
        )
    return ChainVerdict(True, checked, {"seq": after, "hash": prev_hash}, None, None, len(checkpoints), last_cp)

"""The tamper-evident audit log: every row carries sha256(prev_hash ‖ canonical JSON of the row).

Appends are serialised (a transaction-scoped advisory lock on PostgreSQL; SQLite's BEGIN IMMEDIATE already serialises
writers) so the chain is a line, never a tree. ``verify_chain`` recomputes it and names the first broken row.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import event, select, text
from sqlalchemy.orm import Session

from app.audit.tables import AuditEvent
from app.db import utcnow

GENESIS_HASH = "0" * 64
_ADVISORY_LOCK_ID = 0x1E7E_A0D1  # any constant shared by every writer of the audit log


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


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
    body = canonical_json(
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
    return hashlib.sha256((prev_hash + body).encode()).hexdigest()


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
    head = session.info.get(_HEAD_KEY)
    if head is None:
        if session.get_bind().dialect.name == "postgresql":
            session.execute(text("SELECT pg_advisory_xact_lock(:id)"), {"id": _ADVISORY_LOCK_ID})
        last = session.execute(select(AuditEvent.seq, AuditEvent.hash).order_by(AuditEvent.seq.desc()).limit(1)).first()
        head = (last.seq, last.hash) if last else (0, GENESIS_HASH)
    seq, prev_hash = head[0] + 1, head[1]
    at = utcnow()
    payload = json.loads(canonical_json(payload or {}))  # what is hashed is exactly what is stored
    event = AuditEvent(
        seq=seq,
        at=at,
        actor=actor,
        action=action,
        entity_type=entity_type,
        entity_id=entity_id,
        payload=payload,
        prev_hash=prev_hash,
        hash=event_hash(prev_hash, seq, at, actor, action, entity_type, entity_id, payload),
    )
    session.add(event)
    if flush:
        session.flush()
    session.info[_HEAD_KEY] = (seq, event.hash)
    return event


def chain_head(session: Session) -> dict[str, Any]:
    last = session.execute(select(AuditEvent.seq, AuditEvent.hash).order_by(AuditEvent.seq.desc()).limit(1)).first()
    return {"seq": last.seq, "hash": last.hash} if last else {"seq": 0, "hash": GENESIS_HASH}


@dataclass
class ChainVerdict:
    ok: bool
    checked: int
    head: dict[str, Any]
    first_broken_seq: int | None = None
    reason: str | None = None


def verify_chain(session: Session, batch: int = 5000) -> ChainVerdict:
    """Recompute every hash in order; the first row whose link or content does not match is named."""
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
            if row.seq != expected_seq:
                return ChainVerdict(
                    False,
                    checked,
                    {"seq": after, "hash": prev_hash},
                    expected_seq,
                    f"row {expected_seq} is missing (next row is {row.seq})",
                )
            if row.prev_hash != prev_hash:
                return ChainVerdict(
                    False,
                    checked,
                    {"seq": after, "hash": prev_hash},
                    row.seq,
                    "prev_hash does not match the hash of the row before",
                )
            recomputed = event_hash(
                row.prev_hash, row.seq, row.at, row.actor, row.action, row.entity_type, row.entity_id, row.payload
            )
            if recomputed != row.hash:
                return ChainVerdict(
                    False,
                    checked,
                    {"seq": after, "hash": prev_hash},
                    row.seq,
                    "content does not match the row's hash (changed after it was written)",
                )
            prev_hash, after, expected_seq, checked = row.hash, row.seq, row.seq + 1, checked + 1
        session.expunge_all()
    return ChainVerdict(True, checked, {"seq": after, "hash": prev_hash})

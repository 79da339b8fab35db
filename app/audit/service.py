"""The tamper-evident audit log: every row carries sha256(prev_hash ‖ canonical JSON of the row).

Appends are serialised (a transaction-scoped advisory lock on PostgreSQL; SQLite's BEGIN IMMEDIATE already serialises
writers) so the chain is a line, never a tree. ``verify_chain`` recomputes it and names the first broken row.

The canonical text is stored as text beside the JSON payload (PostgreSQL's JSONB rewrites ``2.5e16`` as
``25000000000000000``, so a hash recomputed from JSONB would break on honest rows); verification hashes the text and
checks that the columns say the same thing. Non-finite floats, which JSON cannot carry, are written as the strings
``"NaN"``, ``"Infinity"`` and ``"-Infinity"``.

Anchoring (issue 22): the service's own database role owns these tables, so triggers alone cannot stop it from
rewriting the chain and re-linking the hashes. Every ``audit_checkpoint_every`` events a checkpoint anchors the head,
signed with the certificate signing key (Ed25519, app/certificates/signing.py; checked with the published keys, so a
table owner without the private key cannot forge one). Each checkpoint signs its position, the hash there, the
interval in force and the position of the checkpoint before it, so none can go missing unnoticed: a deleted one is
named by its successor, and a deleted tail by the interval. Deletion certificates carry the latest checkpoint
(``audit_anchor``), so whoever holds a certificate can later check the served log against it. Run the service as a
role that may only INSERT and SELECT here (``lethe db grant-runtime-role``) and the rewrite needs the owner.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any

from cryptography.exceptions import InvalidSignature
from sqlalchemy import Table, event, func, select
from sqlalchemy.orm import Session

from app.audit.tables import AuditCheckpoint, AuditEvent
from app.certificates.signing import (
    InvalidKeys,
    default_keystore,
    encode_pae,
    load_public_keys,
    parse_timestamp,
    utc_timestamp,
)
from app.config import get_settings, hmac_hex
from app.db import JsonText, insert_many, insert_statement, insert_then, pipelined, utcnow

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


_JSON_TEXT = json.encoder.encode_basestring
"""A string as ``canonical_json`` writes it (``ensure_ascii=False``: what ``JSONEncoder.encode`` calls for a ``str``,
without its Python wrapper; the C version where the interpreter has it)."""


def _event_text(seq: int, at: datetime, actor: str, action: str, entity_type: str, entity_id: str, payload: str) -> str:
    """``event_body`` from the payload's canonical text (``canonical_json``, a fixed point of loading and dumping
    again): the same characters, the keys in sorted order, without walking and dumping the payload a second time
    (issue 21: the intake batch's hashing was a fifth of its CPU). Tested equal to ``event_body``."""
    text = _JSON_TEXT
    return (
        f'{{"action":{text(action)},"actor":{text(actor)},"at":"{at.isoformat(timespec="microseconds")}",'
        f'"entity_id":{text(entity_id)},"entity_type":{text(entity_type)},"payload":{payload},"seq":{int(seq)}}}'
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


LEGACY_CHECKPOINT_KEY_ID = "hkdf:audit-checkpoint:v1"
CHECKPOINT_KEY_ID = LEGACY_CHECKPOINT_KEY_ID  # the name older code imports
CHECKPOINT_PAYLOAD_TYPE = "application/vnd.lethe.audit-checkpoint+json"


def checkpoint_mac(seq: int, hash_: str, key_id: str = LEGACY_CHECKPOINT_KEY_ID) -> str:
    """HMAC of a checkpoint written before revision 0013 (verified, no longer written)."""
    if key_id != LEGACY_CHECKPOINT_KEY_ID:
        raise ValueError(f"unknown checkpoint key {key_id!r}")
    message = f"lethe-audit-checkpoint:v1:{seq}:{hash_}".encode()
    return hmac.new(get_settings().derived_key("audit-checkpoint"), message, hashlib.sha256).hexdigest()


def checkpoint_statement(seq: int, hash_: str, every: int, prev_seq: int, at: datetime | str) -> bytes:
    """The bytes a checkpoint's Ed25519 signature covers (DSSE pre-authentication encoding of canonical JSON): its
    position, the hash there, the interval in force and the checkpoint before it (0: none)."""
    body = canonical_json(
        {
            "type": "lethe-audit-checkpoint/v1",
            "seq": seq,
            "hash": hash_,
            "every": every,
            "prev_seq": prev_seq,
            "at": utc_timestamp(at),
        }
    )
    return encode_pae(CHECKPOINT_PAYLOAD_TYPE, body.encode())


def _signed_checkpoint(seq: int, hash_: str, every: int, prev_seq: int, at: datetime) -> dict[str, Any]:
    signer = default_keystore().active_signer()
    signature = signer.sign(checkpoint_statement(seq, hash_, every, prev_seq, at))
    return {
        "seq": seq,
        "hash": hash_,
        "at": at,
        "key_id": signer.key_id,
        "mac": "",
        "every": every,
        "prev_seq": prev_seq,
        "signature": base64.b64encode(signature).decode("ascii"),
    }


def checkpoint_anchor(checkpoint: AuditCheckpoint | Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A checkpoint as a certificate carries it (``audit_anchor``): enough to check its signature with the published
    keys and, given the log, that the log still has that hash at that position."""
    if checkpoint is None:
        return None
    get = checkpoint.get if isinstance(checkpoint, Mapping) else lambda k: getattr(checkpoint, k)
    if not get("signature"):
        return None  # a legacy (HMAC) checkpoint: nothing an outsider could check
    return {
        "seq": get("seq"),
        "hash": get("hash"),
        "every": get("every"),
        "prev_seq": get("prev_seq"),
        "at": utc_timestamp(get("at")),
        "key_id": get("key_id"),
        "signature": get("signature"),
    }


def latest_anchor(session: Session) -> dict[str, Any] | None:
    """The newest signed checkpoint (this transaction's included), as a certificate carries it; None before the
    first one. Read once per transaction that holds the log's lock (no other writer can add a checkpoint then, and
    this one's appends keep it current): a batch's 2,000 certificates asked the database 2,000 times, each query
    flushing the rows added since the last one on its own (issue 21: 7.7 s of a 20-s batch)."""
    locked = _HEAD_KEY in session.info
    if locked and _ANCHOR_KEY in session.info:
        return session.info[_ANCHOR_KEY]
    row = (
        session.execute(
            select(AuditCheckpoint)
            .where(AuditCheckpoint.signature.is_not(None))
            .order_by(AuditCheckpoint.seq.desc())
            .limit(1)
        )
        .scalars()
        .first()
    )
    anchor = checkpoint_anchor(row)
    if locked:
        session.info[_ANCHOR_KEY] = anchor
    return anchor


def check_anchor_signature(anchor: Mapping[str, Any], keys: Mapping[str, Any]) -> str | None:
    """Why a signed checkpoint (an anchor or a row) does not verify with ``keys``, or None. ``keys`` is a keys
    document (then a key retired before the checkpoint's time signed nothing then) or ``{kid: Ed25519PublicKey}``."""
    document = isinstance(keys.get("keys"), list)
    try:
        public = load_public_keys(keys) if document else dict(keys)
    except InvalidKeys as exc:
        return f"the keys are unusable: {exc.reason}"
    kid = anchor.get("key_id")
    if kid not in public:
        return f"signed by unknown key {kid!r}"
    try:
        signature = base64.b64decode(str(anchor.get("signature")), validate=True)
        message = checkpoint_statement(
            int(anchor["seq"]), str(anchor["hash"]), int(anchor["every"]), int(anchor["prev_seq"]), anchor["at"]
        )
        public[kid].verify(signature, message)
    except (InvalidSignature, ValueError, TypeError, KeyError):
        return f"its signature by key {kid} does not verify"
    entry = next((k for k in keys["keys"] if k.get("kid") == kid), {}) if document else {}
    if entry.get("revoked"):  # a compromised key: whoever holds it can sign any checkpoint, at any date
        return f"signed by key {kid}, revoked ({entry.get('revocation_reason') or 'no reason given'})"
    retired = entry.get("retired")
    if retired and parse_timestamp(utc_timestamp(anchor["at"])) >= parse_timestamp(retired):
        return f"signed by key {kid} after it was retired ({retired})"
    return None


def check_anchor_against_log(anchor: Mapping[str, Any], events: list[Mapping[str, Any]]) -> str | None:
    """Why the log (events as ``GET /v1/audit`` serves them, or ``lethe export audit --format json``) does not lead
    to the anchor's hash at the anchor's position, or None. Every hash from the first event up to that position is
    recomputed, so a rewrite of any of them — even one re-linked with fresh hashes — shows up as another hash there."""
    position, prev_hash, expected = int(anchor["seq"]), GENESIS_HASH, 1
    for row in sorted(events, key=lambda e: int(e["seq"])):
        seq = int(row["seq"])
        if seq > position:
            break
        if seq != expected:
            return f"the log lacks event {expected} (next is {seq})"
        if row.get("prev_hash") != prev_hash:
            return f"event {seq} is not linked to the event before it"
        canonical = row.get("canonical")
        if canonical is not None:
            recomputed = hashlib.sha256((prev_hash + canonical).encode()).hexdigest()
            try:
                doc = json.loads(canonical)
                same = (doc["seq"], doc["actor"], doc["action"], doc["entity_type"], doc["entity_id"]) == (
                    seq,
                    row["actor"],
                    row["action"],
                    row["entity_type"],
                    row["entity_id"],
                )
            except (ValueError, KeyError, TypeError):
                same = False
            if not same:
                return f"event {seq}'s columns do not say what its hashed text says"
        else:
            at = row["at"] if isinstance(row["at"], datetime) else datetime.fromisoformat(str(row["at"]))
            recomputed = event_hash(
                prev_hash,
                seq,
                at,
                row["actor"],
                row["action"],
                row["entity_type"],
                row["entity_id"],
                row["payload"],
            )
        if recomputed != row.get("hash"):
            return f"event {seq}'s content does not match its hash"
        prev_hash, expected = recomputed, seq + 1
    if expected <= position:
        return f"the log ends at event {expected - 1}, before the anchored position {position}"
    if prev_hash != anchor["hash"]:
        return (
            f"the log's hash at event {position} is {prev_hash[:16]}…, the certificate anchored "
            f"{str(anchor['hash'])[:16]}…: events up to {position} were rewritten after the certificate was issued"
        )
    return None


def hash_subject(secret: bytes, subject_ref: str) -> str:
    """Subject identifiers are personal data: only this keyed hash is stored (ARCHITECTURE.md, contracts)."""
    return hmac_hex(secret, subject_ref)


_HEAD_KEY = "lethe.audit_head"
_ANCHOR_KEY = "lethe.audit_anchor"
_LAST_CHECKPOINT_KEY = "lethe.audit_last_checkpoint"


@event.listens_for(Session, "after_transaction_end")
def _forget_head(session: Session, transaction) -> None:
    """The head (and newest checkpoint) cached for a transaction (see append_event) die with it."""
    if transaction.parent is None:
        forget_head(session)


def forget_head(session: Session) -> None:
    """Call after rolling back a SAVEPOINT that may have appended (its lock and rows are gone)."""
    for key in (_HEAD_KEY, _ANCHOR_KEY, _LAST_CHECKPOINT_KEY):
        session.info.pop(key, None)


def _locked_head(session: Session, before: list[tuple[Table, list[dict[str, Any]]]] | None = None) -> tuple[int, str]:
    """(seq, hash) of the chain's head, taking the log's lock on the transaction's first call. ``before`` (PostgreSQL:
    rows to insert, as ``insert_many``'s parts) is inserted first, in the same statement, so the lock is asked for
    only once they are written (a row another transaction holds makes us wait without holding the lock)."""
    head = session.info.get(_HEAD_KEY)
    if head is not None and before:
        insert_many(session, before)
    if head is None:
        if session.get_bind().dialect.name == "postgresql":
            # one statement: lethe_audit_lock_head (migration 0016) takes the lock, then reads the head with a snapshot
            # of its own (READ COMMITTED), which sees the previous holder's commit; the newest checkpoint's position
            # rides along: a batch that reaches a checkpoint needs it (issue 21)
            statement = insert_then(before or [], _LOCK_HEAD_SQL, {"lock": _ADVISORY_LOCK_ID})
            ((seq, hash_, checkpoint),) = pipelined(session, statement)[0]
            session.info[_LAST_CHECKPOINT_KEY] = checkpoint or 0
            last = (seq, hash_) if seq is not None else None
        else:
            last = session.execute(
                select(AuditEvent.seq, AuditEvent.hash).order_by(AuditEvent.seq.desc()).limit(1)
            ).first()
        head = (last[0], last[1]) if last else (0, GENESIS_HASH)
    return head


_LOCK_HEAD_SQL = "SELECT head_seq, head_hash, checkpoint_seq FROM lethe_audit_lock_head(%(lock)s, {inserted})"
"""The log's lock, then the chain's head (none: NULLs) and the newest checkpoint's position (migration 0016)."""


def _last_checkpoint_seq(session: Session) -> int:
    """The newest checkpoint's position (0: none), read under the log's lock only when a checkpoint is due, and once
    per transaction: its own checkpoints keep it current (each read flushed the batch's pending rows first)."""
    if (seq := session.info.get(_LAST_CHECKPOINT_KEY)) is None:
        seq = session.execute(select(func.max(AuditCheckpoint.seq))).scalar() or 0
    return seq


def _checkpointed(session: Session, checkpoint: dict[str, Any]) -> None:
    """This transaction wrote ``checkpoint`` (under the log's lock): the newest one, and the newest anchor."""
    session.info[_LAST_CHECKPOINT_KEY] = checkpoint["seq"]
    session.info[_ANCHOR_KEY] = checkpoint_anchor(checkpoint)


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
    every = get_settings().audit_checkpoint_every
    if seq % every == 0:
        checkpoint = _signed_checkpoint(seq, event.hash, every, _last_checkpoint_seq(session), at)
        session.add(AuditCheckpoint(**checkpoint))
        _checkpointed(session, checkpoint)
    if flush:
        session.flush()
    session.info[_HEAD_KEY] = (seq, event.hash)
    return event


def append_events(
    session: Session,
    events: list[dict[str, Any]],
    together_with: list[tuple[Table, list[dict[str, Any]]]] = (),
    commit: bool = False,
) -> None:
    """Append several events (dicts of ``actor``, ``action``, ``entity_type``, ``entity_id``, ``payload``) in order,
    after inserting the caller's ``together_with`` rows (the intake batch's requests, jobs and held rows). Same chain,
    same lock as ``append_event``; call it last in the transaction (``commit=True``: the caller commits right after).

    The lock serialises every writer of the log, so what happens while it is held bounds the intake of all API
    processes together (issue 21: the lock was held ~70 % of the time at 2,700 requests/s). On PostgreSQL that is two
    round trips: the caller's rows, the lock and the head in the first, ONE statement (``_locked_head``; the rows are
    written before the lock is asked for), the events and checkpoints with the COMMIT in the second. A row another
    transaction holds without the lock (a concurrent twin) makes the insert wait for that one's end, never for the
    lock: no cycle through it."""
    if not events:
        insert_many(session, list(together_with))
        return
    texts = [canonical_json(spec.get("payload") or {}) for spec in events]  # before the lock: they need no head
    postgres = session.get_bind().dialect.name == "postgresql"
    if postgres:
        seq, prev_hash = _locked_head(session, before=list(together_with))
    else:
        insert_many(session, list(together_with))
        seq, prev_hash = _locked_head(session)
    every = get_settings().audit_checkpoint_every
    rows: list[dict[str, Any]] = []
    checkpoints: list[dict[str, Any]] = []
    last_checkpoint: int | None = None
    for spec, payload_text in zip(events, texts, strict=True):
        seq += 1
        at = utcnow()
        # what is hashed is what is stored: PostgreSQL parses the text itself, SQLite's JSON column takes the object
        payload = JsonText(payload_text) if postgres else json.loads(payload_text)
        body = _event_text(seq, at, spec["actor"], spec["action"], spec["entity_type"], spec["entity_id"], payload_text)
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
            if last_checkpoint is None:
                last_checkpoint = _last_checkpoint_seq(session)
            checkpoints.append(_signed_checkpoint(seq, hash_, every, last_checkpoint, at))
            last_checkpoint = seq
        prev_hash = hash_
    written = [(AuditEvent.__table__, rows), (AuditCheckpoint.__table__, checkpoints)]
    if postgres:
        pipelined(session, insert_statement(written), commit=commit)
    else:
        insert_many(session, written)
    session.info[_HEAD_KEY] = (seq, prev_hash)
    if checkpoints:
        _checkpointed(session, checkpoints[-1])


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
    code: str | None = None


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


def _checkpoint_problem(
    checkpoints: list[AuditCheckpoint], keys: Mapping[str, Any] | None
) -> tuple[str, int, str] | None:
    """``(code, position, reason)`` for the first checkpoint that is forged or missing, judged by the checkpoints
    alone: each signature (a legacy HMAC only before the first signed one), and each signed checkpoint's link to the
    one before it (a deleted checkpoint is named by its successor)."""
    previous, signed_seen = 0, False
    for cp in checkpoints:
        if not cp.signature:
            try:
                good = not signed_seen and hmac.compare_digest(cp.mac, checkpoint_mac(cp.seq, cp.hash, cp.key_id))
            except ValueError:
                good = False
            if not good:
                return "checkpoint-forged", cp.seq, f"checkpoint {cp.seq} has a bad MAC"
            previous = cp.seq
            continue
        signed_seen = True
        if keys is None:
            problem = "no signing keys to check it with"
        else:
            problem = check_anchor_signature(checkpoint_anchor(cp), keys)
        if problem is not None:
            return "checkpoint-forged", cp.seq, f"checkpoint {cp.seq} is not the service's: {problem}"
        if cp.every is None or cp.every < 1 or cp.seq % cp.every:
            return "checkpoint-forged", cp.seq, f"checkpoint {cp.seq} is not at a multiple of its interval"
        if cp.prev_seq > previous:
            return (
                "checkpoint-missing",
                cp.prev_seq,
                f"checkpoint-missing: checkpoint {cp.seq} follows checkpoint {cp.prev_seq}, which is gone",
            )
        if cp.prev_seq < previous:
            return (
                "checkpoint-forged",
                cp.seq,
                f"checkpoint {cp.seq} follows checkpoint {cp.prev_seq}, but checkpoint {previous} lies between",
            )
        previous = cp.seq
    return None


def verify_chain(session: Session, batch: int = 5000) -> ChainVerdict:
    """Recompute every hash in order (the first row whose link or content does not match is named), then check the
    checkpoints: each one's signature, that none is missing (every ``audit_checkpoint_every`` events, each linked to
    the one before), the hash of the row it anchors, and that the chain reaches it (a cut tail).

    The checkpoints and the rows are read in one snapshot (REPEATABLE READ on PostgreSQL; the session must not have
    read yet, as every caller's has not: SQLAlchemy warns otherwise): read by separate READ COMMITTED statements, a
    batch committed between them (a worker publishing 30 deletions adds ~90 events and their checkpoints at once)
    made a growing log look like one whose checkpoints were missing."""
    if session.get_bind().dialect.name == "postgresql":
        session.connection(execution_options={"isolation_level": "REPEATABLE READ"})
    checkpoints = list(session.execute(select(AuditCheckpoint).order_by(AuditCheckpoint.seq)).scalars())
    anchored = {cp.seq: cp for cp in checkpoints}
    last_cp = checkpoints[-1].seq if checkpoints else None
    genesis = {"seq": 0, "hash": GENESIS_HASH}
    try:
        keys = default_keystore().public_keys() if any(cp.signature for cp in checkpoints) else None
    except Exception:  # noqa: BLE001 - an unreadable key folder: every signed checkpoint is then unverifiable
        keys = None
    problem = _checkpoint_problem(checkpoints, keys)
    if problem is not None:
        code, position, reason = problem
        return ChainVerdict(False, 0, genesis, position, reason, len(checkpoints), last_cp, code)

    def broken(checked: int, head: dict[str, Any], seq: int, reason: str, code: str) -> ChainVerdict:
        return ChainVerdict(False, checked, head, seq, reason, len(checkpoints), last_cp, code)

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
                return broken(
                    checked, head, expected_seq, f"row {expected_seq} is missing (next row is {row.seq})", "row-missing"
                )
            if row.prev_hash != prev_hash:
                return broken(checked, head, row.seq, "prev_hash does not match the hash of the row before", "relinked")
            problem = _row_hash_problem(row)
            if problem is not None:
                return broken(checked, head, row.seq, problem, "row-changed")
            cp = anchored.get(row.seq)
            if cp is not None and cp.hash != row.hash:
                return broken(
                    checked,
                    head,
                    row.seq,
                    f"checkpoint {cp.seq} anchors another hash than row {row.seq} has (the chain was rewritten)",
                    "checkpoint-mismatch",
                )
            prev_hash, after, expected_seq, checked = row.hash, row.seq, row.seq + 1, checked + 1
        session.expunge_all()
    head = {"seq": after, "hash": prev_hash}
    if last_cp is not None and last_cp > after:
        return broken(
            checked,
            head,
            after + 1,
            f"the chain ends at seq {after} but checkpoint {last_cp} anchors a head at seq {last_cp}: "
            "the tail was truncated",
            "truncated",
        )
    # the next checkpoint is due at the next multiple of the interval; after a change of AUDIT_CHECKPOINT_EVERY the
    # later of the configured and the last checkpoint's signed interval, so that neither direction cries wolf
    last = checkpoints[-1] if checkpoints else None
    every = get_settings().audit_checkpoint_every
    due = ((last_cp or 0) // every + 1) * every
    if last is not None and last.every:
        due = max(due, (last.seq // last.every + 1) * last.every)
    if after >= due:
        return broken(
            checked,
            head,
            due,
            f"checkpoint-missing: the chain reaches seq {after}, past seq {due}, but no checkpoint anchors seq {due} "
            f"(one is written every {every} events)",
            "checkpoint-missing",
        )
    return ChainVerdict(True, checked, head, None, None, len(checkpoints), last_cp)

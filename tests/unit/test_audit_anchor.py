"""Issue 22 on SQLite: the audit chain anchored beyond the table owner's reach. Every checkpoint is required, each
is signed with the certificate key (a forged one is refused), and a certificate carries the latest one, so its
holder detects a rewrite from the certificate and the served log alone."""

from __future__ import annotations

import base64
import json
import sqlite3
from datetime import UTC, datetime
from types import SimpleNamespace

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from app.audit.router import AuditEventOut
from app.audit.service import (
    LEGACY_CHECKPOINT_KEY_ID,
    append_event,
    checkpoint_mac,
    checkpoint_statement,
    latest_anchor,
    verify_chain,
)
from app.audit.tables import AuditEvent
from app.certificates import service as certificates
from app.certificates.signing import public_keys
from app.certificates.verify_cli import verify_file
from app.db import session_scope
from tests.audit_rewrite import rewritten_rows
from tests.helpers import configure

EVERY = 5


def _setup(tmp_path, n: int) -> sqlite3.Connection:
    configure(tmp_path, audit_checkpoint_every=str(EVERY))
    for i in range(n):
        with session_scope() as session:
            append_event(session, actor="t", action="x.done", entity_type="x", entity_id=str(i), payload={"i": i})
    with session_scope() as session:
        verdict = verify_chain(session)
    assert verdict.ok and verdict.checkpoints == n // EVERY, verdict
    raw = sqlite3.connect(tmp_path / "lethe.db")
    for trigger in ("audit_events_no_update", "audit_checkpoints_no_delete"):
        raw.execute(f"DROP TRIGGER {trigger}")  # what the tables' owner may do
    return raw


def _rewrite(raw: sqlite3.Connection, first: int, last: int) -> None:
    rows = raw.execute("SELECT seq, hash, canonical FROM audit_events ORDER BY seq").fetchall()
    for seq, prev_hash, hash_, canonical, payload in rewritten_rows(rows, first, last):
        raw.execute(
            "UPDATE audit_events SET prev_hash = ?, hash = ?, canonical = ?, payload = json(?) WHERE seq = ?",
            (prev_hash, hash_, canonical, payload, seq),
        )


def _verdict():
    with session_scope() as session:
        return verify_chain(session)


def test_a_rewritten_middle_with_its_checkpoints_deleted_no_longer_verifies(tmp_path):
    raw = _setup(tmp_path, 23)  # checkpoints at 5, 10, 15, 20
    _rewrite(raw, 7, 12)
    raw.execute("DELETE FROM audit_checkpoints WHERE seq >= 10")  # every checkpoint the rewrite contradicts
    raw.commit()
    verdict = _verdict()
    assert not verdict.ok and verdict.code == "checkpoint-missing", verdict
    assert verdict.first_broken_seq == 10 and "10" in verdict.reason


def test_a_deleted_middle_checkpoint_is_named_by_its_successor(tmp_path):
    raw = _setup(tmp_path, 16)  # checkpoints at 5, 10, 15
    raw.execute("DELETE FROM audit_checkpoints WHERE seq = 10")
    raw.commit()
    verdict = _verdict()
    assert not verdict.ok and verdict.code == "checkpoint-missing" and verdict.first_broken_seq == 10, verdict


def test_a_forged_checkpoint_signed_by_another_key_is_refused(tmp_path):
    raw = _setup(tmp_path, 12)  # checkpoints at 5, 10
    seq, hash_, at, key_id, every, prev_seq = raw.execute(
        "SELECT seq, hash, at, key_id, every, prev_seq FROM audit_checkpoints WHERE seq = 10"
    ).fetchone()
    with session_scope() as session:
        moment = session.get(AuditEvent, 10).at  # the checkpoint's time is its event's
    forger = Ed25519PrivateKey.generate()
    signature = base64.b64encode(forger.sign(checkpoint_statement(seq, hash_, every, prev_seq, moment))).decode()
    raw.execute("DELETE FROM audit_checkpoints WHERE seq = 10")
    raw.execute(
        "INSERT INTO audit_checkpoints (seq, hash, at, key_id, mac, every, prev_seq, signature) "
        "VALUES (?, ?, ?, ?, '', ?, ?, ?)",
        (seq, hash_, at, key_id, every, prev_seq, signature),
    )
    raw.commit()
    verdict = _verdict()
    assert not verdict.ok and verdict.code == "checkpoint-forged" and verdict.first_broken_seq == 10, verdict
    assert "does not verify" in verdict.reason


def _make_legacy(raw: sqlite3.Connection, seq: int) -> None:
    """Replace a checkpoint by the HMAC one revision 0004 wrote (a secret the service holds, not a signature)."""
    hash_, at = raw.execute("SELECT hash, at FROM audit_checkpoints WHERE seq = ?", (seq,)).fetchone()
    raw.execute("DELETE FROM audit_checkpoints WHERE seq = ?", (seq,))
    raw.execute(
        "INSERT INTO audit_checkpoints (seq, hash, at, key_id, mac) VALUES (?, ?, ?, ?, ?)",
        (seq, hash_, at, LEGACY_CHECKPOINT_KEY_ID, checkpoint_mac(seq, hash_)),
    )
    raw.commit()


def test_hmac_checkpoints_from_before_0013_verify_only_before_the_first_signed_one(tmp_path):
    raw = _setup(tmp_path, 16)  # checkpoints at 5, 10, 15
    _make_legacy(raw, 5)  # an upgraded log: its old checkpoints keep their HMAC
    assert _verdict().ok, _verdict()
    _make_legacy(raw, 15)  # one with the secret but without the signing key replaces a signed checkpoint
    verdict = _verdict()
    assert not verdict.ok and verdict.code == "checkpoint-forged" and verdict.first_broken_seq == 15, verdict


def test_the_interval_a_checkpoint_records_is_signed(tmp_path):
    raw = _setup(tmp_path, 12)  # checkpoints at 5, 10
    raw.execute("DROP TRIGGER audit_checkpoints_no_update")
    raw.execute("UPDATE audit_checkpoints SET every = 10 WHERE seq = 10")  # "the interval was always 10"
    raw.commit()
    verdict = _verdict()
    assert not verdict.ok and verdict.code == "checkpoint-forged" and verdict.first_broken_seq == 10, verdict


def _append(n: int) -> None:
    for _ in range(n):
        with session_scope() as session:
            append_event(session, actor="t", action="x.done", entity_type="x", entity_id="e")


def test_changing_the_interval_is_no_false_alarm_and_gaps_still_show(tmp_path):
    _setup(tmp_path, 12)  # every 5: checkpoints at 5, 10
    configure(tmp_path, audit_checkpoint_every="3")  # lowered: 12 passed unanchored, the next one is at 15
    _append(2)
    assert _verdict().ok, _verdict()
    _append(1)
    configure(tmp_path, audit_checkpoint_every="7")  # raised: after 15 the next one is at 21
    _append(5)
    verdict = _verdict()
    assert verdict.ok and verdict.checked == 20 and verdict.last_checkpoint_seq == 15, verdict
    _append(1)
    raw = sqlite3.connect(tmp_path / "lethe.db")
    raw.execute("DELETE FROM audit_checkpoints WHERE seq = 21")
    raw.commit()
    verdict = _verdict()
    assert not verdict.ok and verdict.code == "checkpoint-missing" and verdict.first_broken_seq == 21, verdict


def _certificate(tmp_path) -> dict:
    """A deletion certificate issued the way the publishing transaction issues it (certificates.issue)."""
    now = datetime.now(UTC)
    with session_scope() as session:
        certificate = certificates.issue(
            session,
            request=SimpleNamespace(id="req-1", subject_hash="a" * 64, created_at=now),
            version=SimpleNamespace(id="v-2", model_id="m-1", digest="b" * 64),
            parent_digest="c" * 64,
            method="retrain",
            method_settings={},
            manifest={},
            figures={},
            verdict="pass",
            audit_head={"seq": 12, "hash": "d" * 64},
            completed_at=now,
        )
        return certificate.envelope


def _served_log() -> list[dict]:
    with session_scope() as session:
        rows = session.query(AuditEvent).order_by(AuditEvent.seq).all()
        return [AuditEventOut.model_validate(r, from_attributes=True).model_dump(mode="json") for r in rows]


def test_a_certificates_anchor_detects_a_rewrite(tmp_path):
    raw = _setup(tmp_path, 12)  # checkpoints at 5, 10
    envelope = _certificate(tmp_path)
    predicate = json.loads(base64.b64decode(envelope["payload"]))["predicate"]
    with session_scope() as session:
        assert predicate["audit_anchor"] == latest_anchor(session) and predicate["audit_anchor"]["seq"] == 10
    files = {name: tmp_path / f"{name}.json" for name in ("cert", "keys", "log")}
    files["cert"].write_text(json.dumps(envelope))
    files["keys"].write_text(json.dumps(public_keys()))
    files["log"].write_text(json.dumps(_served_log()))
    ok, message = verify_file(files["cert"], str(files["keys"]), files["log"])
    assert ok and "the log matches it" in message, message

    _rewrite(raw, 3, 4)  # before the anchor; the owner also removes every checkpoint the rewrite contradicts
    raw.execute("DELETE FROM audit_checkpoints")
    raw.commit()
    files["log"].write_text(json.dumps(_served_log()))
    ok, message = verify_file(files["cert"], str(files["keys"]), files["log"])
    assert not ok and message.startswith("INVALID (anchor-mismatch)") and "rewritten" in message, message


def test_a_checkpoint_signed_by_a_key_later_revoked_no_longer_anchors(tmp_path):
    """A compromised key can sign any checkpoint at any date: once revoked, nothing it signed anchors the log."""
    from app.audit.service import check_anchor_signature
    from app.certificates.signing import revoke_key

    _setup(tmp_path, 6)  # one checkpoint, at 5
    with session_scope() as session:
        anchor = latest_anchor(session)
    assert check_anchor_signature(anchor, public_keys()) is None
    revoke_key(anchor["key_id"], "the key file was copied off a backup")
    problem = check_anchor_signature(anchor, public_keys())
    assert problem is not None and "revoked" in problem and "backup" in problem, problem


def test_one_transaction_appending_many_events_anchors_each_certificate_on_the_newest_checkpoint(tmp_path):
    """A batch's publishing transaction appends events and issues certificates in turn; the newest checkpoint (and
    the one before each new checkpoint) is kept by the transaction instead of asked of the database each time (issue
    21). Each certificate must still carry the checkpoint newest at its issue — the transaction's own included — and
    the checkpoints must still name their predecessors (the chain verifies)."""
    _setup(tmp_path, 3)  # events 1-3, no checkpoint yet
    anchors = []
    with session_scope() as session:
        for i in range(14):  # events 4..17: checkpoints at 5, 10, 15 written by this transaction
            append_event(session, actor="t", action="x.done", entity_type="x", entity_id=f"b{i}", flush=False)
            anchor = latest_anchor(session)
            anchors.append((4 + i, anchor["seq"] if anchor else None))
    assert anchors == [(seq, (seq // EVERY) * EVERY or None) for seq in range(4, 18)], anchors
    with session_scope() as session:
        assert latest_anchor(session)["seq"] == 15
    verdict = _verdict()
    assert verdict.ok and verdict.checkpoints == 3, verdict

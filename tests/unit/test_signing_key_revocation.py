"""Revoking a compromised signing key (issue 22): the keys document marks it ``revoked`` with a time and a reason, and
the verifier refuses every certificate it signed, whatever its date (retirement refuses only the later ones);
revoking the active key first rotates to a new one; ``lethe signing-keys revoke`` publishes it and audits it."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select
from typer.testing import CliRunner

from app.audit.tables import AuditEvent
from app.certificates import signing
from app.certificates.router import KEYS_PATH
from app.certificates.signing import (
    InvalidCertificate,
    KeyStore,
    build_deletion_predicate,
    build_statement,
    issue_certificate,
    sign_envelope,
    verify_envelope,
)
from app.certificates.verify_cli import verify_file
from app.cli import app as cli_app
from app.dashboard import router as dashboard
from app.db import session_scope
from app.main import create_app
from tests.helpers import configure

DIGEST = "ab" * 32
REASON = "private key copied off a decommissioned host"


def predicate(**extra) -> dict:
    return build_deletion_predicate(
        request_id="req-1",
        subject_hash="f" * 64,
        model_id="model-1",
        parent_version_digest="cd" * 32,
        new_version_digest=DIGEST,
        method="retrain",
        method_settings={},
        erasure_manifest={"rows_erased": 1, "copies": []},
        verification_figures={},
        verdict="pass",
        audit_chain_head={"seq": 1, "hash": "0" * 64},
        requested_at=datetime(2026, 1, 1, tzinfo=UTC),
        completed_at=datetime(2026, 1, 1, 0, 5, tzinfo=UTC),
        **extra,
    )


@pytest.fixture
def store(tmp_path) -> KeyStore:
    return KeyStore(tmp_path / "keys")


def _refused(envelope, document) -> InvalidCertificate:
    with pytest.raises(InvalidCertificate) as refused:
        verify_envelope(envelope, document)
    return refused.value


def test_a_certificate_by_a_key_later_revoked_verifies_before_and_fails_after_with_the_reason(store):
    first = store.active_key_id()
    early = issue_certificate(DIGEST, predicate(), keystore=store)  # issued while the key signed: within its window
    second = store.rotate_key()
    later = issue_certificate(DIGEST, predicate(), keystore=store)
    assert verify_envelope(early, store.public_keys()).key_id == first  # retired, but issued before: valid

    done = store.revoke_key(first, REASON)
    assert done.newly and done.successor is None and store.active_key_id() == second  # not active: no rotation
    document = store.public_keys()
    entry = next(k for k in document["keys"] if k["kid"] == first)
    assert entry["revoked"] == done.revoked and entry["revocation_reason"] == REASON
    assert [k["revoked"] for k in document["keys"] if k["kid"] == second] == [None]
    refused = _refused(early, document)
    assert refused.code == "key-revoked" and first in refused.reason and REASON in refused.reason
    assert verify_envelope(later, document).key_id == second  # another key's certificates are untouched
    # the same through the keys document as published (JSON), as an offline verifier reads it
    assert _refused(json.dumps(early), json.loads(json.dumps(document))).code == "key-revoked"
    # revoking it again changes nothing
    assert not store.revoke_key(first, "again").newly and store.public_keys() == document


def test_revoking_the_active_key_rotates_first_so_the_service_keeps_signing(store):
    leaked = store.active_signer()  # what a thief holds: the private key itself
    before = issue_certificate(DIGEST, predicate(), keystore=store)
    done = store.revoke_key(leaked.key_id, REASON)
    assert done.successor is not None and done.successor != leaked.key_id
    assert store.active_key_id() == done.successor and KeyStore(store.folder).active_key_id() == done.successor
    assert not (store.folder / f"{leaked.key_id}.key").exists()
    document = store.public_keys()
    entry = next(k for k in document["keys"] if k["kid"] == leaked.key_id)
    assert entry["revoked"] and entry["retired"] and not entry["active"]
    after = issue_certificate(DIGEST, predicate(), keystore=store)
    assert after["signatures"][0]["keyid"] == done.successor and verify_envelope(after, document)
    assert _refused(before, document).code == "key-revoked"
    # a forgery dated inside the key's old window (what retirement alone would let through) is refused too
    backdated = {**predicate(issued_at="2020-01-01T00:00:00Z"), "key_id": leaked.key_id}
    assert _refused(sign_envelope(build_statement(DIGEST, backdated), signer=leaked), document).code == "key-revoked"


def test_a_second_signature_by_a_trusted_key_still_carries_an_envelope(store):
    """DSSE takes one good signature: a revoked key's signature beside it counts for nothing, it does not spoil it."""
    old = store.active_signer()
    store.rotate_key()
    new = store.active_signer()
    statement = build_statement(DIGEST, predicate())
    both = sign_envelope(statement, signer=old)
    both["signatures"].append(sign_envelope(statement, signer=new)["signatures"][0])
    store.revoke_key(old.key_id, REASON)
    assert verify_envelope(both, store.public_keys()).key_id == new.key_id


def test_revoke_refuses_an_unknown_key_or_no_reason(store):
    kid = store.active_key_id()
    with pytest.raises(ValueError, match="no signing key"):
        store.revoke_key("0" * 16, REASON)
    with pytest.raises(ValueError, match="reason"):
        store.revoke_key(kid, "  ")
    assert store.active_key_id() == kid and not any(k["revoked"] for k in store.public_keys()["keys"])


def test_cli_revokes_publishes_audits_and_the_offline_verifier_refuses(tmp_path):
    configure(tmp_path)
    signing._keystore_at.cache_clear()
    try:
        keystore = signing.default_keystore()
        kid = keystore.active_key_id()
        certificate = tmp_path / "cert.json"
        certificate.write_text(json.dumps(issue_certificate(DIGEST, predicate(), keystore=keystore)))
        keys_file = tmp_path / "keys.json"
        with TestClient(create_app(run_background=False)) as client:
            keys_file.write_text(client.get(KEYS_PATH).text)
            assert verify_file(certificate, str(keys_file))[0] is True

            runner = CliRunner()
            assert runner.invoke(cli_app, ["signing-keys", "revoke", "0" * 16, "--reason", REASON]).exit_code == 3
            done = runner.invoke(cli_app, ["signing-keys", "revoke", kid, "--reason", REASON])
            assert done.exit_code == 0, done.output
            successor = keystore.active_key_id()
            assert successor != kid and successor in done.output

            published = client.get(KEYS_PATH).json()
            entry = next(k for k in published["keys"] if k["kid"] == kid)
            assert entry["revoked"] and entry["revocation_reason"] == REASON and not entry["active"]
            keys_file.write_text(json.dumps(published))
        ok, message = verify_file(certificate, str(keys_file))
        assert not ok and message.startswith("INVALID (key-revoked)") and REASON in message
        # the dashboard's "verify again" checks against the same published document
        ok, message = dashboard.verify_certificate(json.loads(certificate.read_text()))
        assert not ok and message.startswith("INVALID (key-revoked)")
        listed = runner.invoke(cli_app, ["signing-keys", "list"], env={"COLUMNS": "250"})
        assert listed.exit_code == 0 and REASON in listed.output
        with session_scope() as session:
            event = session.scalars(select(AuditEvent).where(AuditEvent.action == "signing-key.revoked")).one()
            assert event.entity_id == kid and event.actor == "cli"
            assert event.payload["reason"] == REASON and event.payload["rotated_to"] == successor
            assert event.payload["revoked"] == entry["revoked"]
    finally:
        signing._keystore_at.cache_clear()

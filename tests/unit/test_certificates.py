"""Deletion certificates: DSSE v1.0 envelopes over in-toto Statement v1, Ed25519 keys, offline verification."""

from __future__ import annotations

import base64
import json
import multiprocessing
import os
import threading
from datetime import UTC, datetime
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from app.certificates import signing
from app.certificates.router import KEYS_PATH
from app.certificates.router import router as certificates_router
from app.certificates.signing import (
    PAYLOAD_TYPE,
    PREDICATE_TYPE,
    STATEMENT_TYPE,
    InvalidCertificate,
    InvalidKeys,
    KeyStore,
    build_deletion_predicate,
    build_statement,
    encode_pae,
    issue_certificate,
    sign_envelope,
    verify_envelope,
)
from app.certificates.verify_cli import InputUnavailable, verify_file
from app.cli import app as cli_app
from app.config import get_settings
from tests.unit.loopback_server import loopback_server

NEW_DIGEST = "ab" * 32
PARENT_DIGEST = "cd" * 32


def predicate(**extra) -> dict:
    return build_deletion_predicate(
        request_id="req-1",
        subject_hash="f" * 64,
        model_id="model-1",
        parent_version_digest=PARENT_DIGEST,
        new_version_digest=NEW_DIGEST,
        method="retrain",
        method_settings={"epochs": 3},
        erasure_manifest={"rows_erased": 2, "copies": [{"kind": "dataset", "action": "rewritten"}]},
        verification_figures={"utility_delta": -0.01, "lira_auc": 0.51},
        verdict="pass",
        audit_chain_head={"seq": 7, "hash": "0" * 64},
        requested_at=datetime(2026, 1, 1, tzinfo=UTC),
        completed_at=datetime(2026, 1, 1, 0, 5, tzinfo=UTC),
        **extra,
    )


@pytest.fixture
def store(tmp_path) -> KeyStore:
    return KeyStore(tmp_path / "keys")


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """Point the service's settings (and so its default key store) at a fresh home."""
    monkeypatch.setenv("LETHE_HOME", str(tmp_path))
    get_settings.cache_clear()
    signing._keystore_at.cache_clear()
    yield tmp_path
    get_settings.cache_clear()
    signing._keystore_at.cache_clear()


def flip_byte(b64: str, index: int = 10) -> str:
    data = bytearray(base64.b64decode(b64))
    data[index] ^= 0x01
    return base64.b64encode(bytes(data)).decode()


def test_pae_is_the_dsse_v1_encoding():
    # the worked example of the DSSE v1.0 protocol
    assert encode_pae("http://example.com/HelloWorld", b"hello world") == (
        b"DSSEv1 29 http://example.com/HelloWorld 11 hello world"
    )
    assert encode_pae("t", b"") == b"DSSEv1 1 t 0 "
    assert encode_pae("é", b"x") == "DSSEv1 2 é 1 x".encode()  # lengths in bytes, not characters


def test_sign_then_verify(store):
    envelope = issue_certificate(NEW_DIGEST, predicate(), keystore=store)
    assert envelope["payloadType"] == PAYLOAD_TYPE
    assert [s["keyid"] for s in envelope["signatures"]] == [store.active_key_id()]
    statement = json.loads(base64.b64decode(envelope["payload"]))
    assert statement["_type"] == STATEMENT_TYPE and statement["predicateType"] == PREDICATE_TYPE
    assert statement["subject"] == [{"name": "model-version", "digest": {"sha256": NEW_DIGEST}}]

    verified = verify_envelope(envelope, store.public_keys())
    assert verified.key_id == store.active_key_id()
    assert verified.subject_digest == NEW_DIGEST
    assert verified.predicate["request_id"] == "req-1"
    assert verified.predicate["key_id"] == verified.key_id
    assert verified.predicate["timestamps"]["requested_at"] == "2026-01-01T00:00:00Z"
    # the JSON text of the envelope verifies the same way
    assert verify_envelope(json.dumps(envelope), store.public_keys()).statement == statement


def test_flipped_payload_byte_is_a_bad_signature(store):
    envelope = issue_certificate(NEW_DIGEST, predicate(), keystore=store)
    envelope["payload"] = flip_byte(envelope["payload"])
    with pytest.raises(InvalidCertificate) as caught:
        verify_envelope(envelope, store.public_keys())
    assert caught.value.code == "bad-signature"
    assert "does not verify" in caught.value.reason and store.active_key_id() in caught.value.reason


def test_flipped_signature_byte_is_a_bad_signature(store):
    envelope = issue_certificate(NEW_DIGEST, predicate(), keystore=store)
    envelope["signatures"][0]["sig"] = flip_byte(envelope["signatures"][0]["sig"])
    with pytest.raises(InvalidCertificate) as caught:
        verify_envelope(envelope, store.public_keys())
    assert caught.value.code == "bad-signature"


def test_flipped_public_key_byte_fails(store):
    envelope = issue_certificate(NEW_DIGEST, predicate(), keystore=store)
    document = store.public_keys()
    entry = document["keys"][0]
    raw = bytearray(base64.urlsafe_b64decode(entry["x"] + "=="))
    raw[5] ^= 0x01
    # in a keys document, the key id is the key's hash: the altered document is refused as such
    entry["x"] = base64.urlsafe_b64encode(bytes(raw)).decode().rstrip("=")
    with pytest.raises(InvalidKeys) as caught:
        verify_envelope(envelope, document)
    assert "does not match its public key" in caught.value.reason
    # handed over directly as {kid: raw key}, the altered key no longer verifies the signature
    with pytest.raises(InvalidCertificate) as caught_signature:
        verify_envelope(envelope, {entry["kid"]: bytes(raw)})
    assert caught_signature.value.code == "bad-signature"


def test_unknown_key_id(store, tmp_path):
    envelope = issue_certificate(NEW_DIGEST, predicate(), keystore=store)
    other = KeyStore(tmp_path / "other-keys")
    with pytest.raises(InvalidCertificate) as caught:
        verify_envelope(envelope, other.public_keys())
    assert caught.value.code == "unknown-key"
    assert store.active_key_id() in caught.value.reason and other.active_key_id() in caught.value.reason


def test_wrong_payload_type_and_malformed_envelopes(store):
    envelope = issue_certificate(NEW_DIGEST, predicate(), keystore=store)
    keys = store.public_keys()
    with pytest.raises(InvalidCertificate) as caught:
        verify_envelope({**envelope, "payloadType": "application/json"}, keys)
    assert caught.value.code == "wrong-payload-type" and "application/json" in caught.value.reason
    cases = {
        "not json {": "not valid JSON",
        "[]": "not a DSSE envelope",
        json.dumps({**envelope, "payload": "%%%"}): "payload is not base64",
        json.dumps({**envelope, "signatures": []}): 'no "signatures"',
        json.dumps({**envelope, "signatures": [{"keyid": store.active_key_id(), "sig": "@@"}]}): "sig is not base64",
        json.dumps(envelope)[:-1] + ',"payload":"x"}': "duplicate key",
    }
    for text, message in cases.items():
        with pytest.raises(InvalidCertificate) as caught:
            verify_envelope(text, keys)
        assert caught.value.code == "malformed", text
        assert message in caught.value.reason, (text, caught.value.reason)


def test_signed_payload_that_is_not_a_statement(store):
    signer = store.active_signer()
    for statement, message in [
        ({"hello": "world"}, "not an in-toto Statement v1"),
        ({"_type": STATEMENT_TYPE, "subject": [], "predicateType": PREDICATE_TYPE, "predicate": {}}, "no subject"),
        (
            {"_type": STATEMENT_TYPE, "subject": [{"name": "x", "digest": {"sha1": "0"}}], "predicate": {}},
            "sha256",
        ),
    ]:
        with pytest.raises(InvalidCertificate) as caught:
            verify_envelope(sign_envelope(statement, signer=signer), store.public_keys())
        assert caught.value.code == "not-a-statement" and message in caught.value.reason
    other_type = build_statement(NEW_DIGEST, {}, predicate_type="https://example.com/other")
    with pytest.raises(InvalidCertificate) as caught:
        verify_envelope(sign_envelope(other_type, signer=signer), store.public_keys())
    assert caught.value.code == "wrong-predicate-type"


def test_predicate_must_agree_with_signature_and_subject(store):
    signer = store.active_signer()
    lying_key = build_statement(NEW_DIGEST, {**predicate(), "key_id": "0" * 16})
    with pytest.raises(InvalidCertificate) as caught:
        verify_envelope(sign_envelope(lying_key, signer=signer), store.public_keys())
    assert caught.value.code == "inconsistent" and "names key" in caught.value.reason
    other_subject = build_statement("ee" * 32, predicate())
    with pytest.raises(InvalidCertificate) as caught:
        verify_envelope(sign_envelope(other_subject, signer=signer), store.public_keys())
    assert caught.value.code == "inconsistent"


def test_statement_refuses_what_is_not_strict_json():
    with pytest.raises(ValueError, match="sha256"):
        build_statement("ABC", {})
    with pytest.raises(ValueError):
        build_statement(NEW_DIGEST, {"auc": float("nan")})
    with pytest.raises(ValueError, match="sha256"):
        build_statement(NEW_DIGEST + "\n", {})


def test_rotation_keeps_old_certificates_verifiable(store):
    old_kid = store.active_key_id()
    old_certificate = issue_certificate(NEW_DIGEST, predicate(), keystore=store)
    new_kid = store.rotate_key()
    assert new_kid != old_kid and store.active_key_id() == new_kid
    new_certificate = issue_certificate(NEW_DIGEST, predicate(), keystore=store)
    assert new_certificate["signatures"][0]["keyid"] == new_kid

    document = store.public_keys()
    assert [(k["kid"], k["active"]) for k in document["keys"]] == [(old_kid, False), (new_kid, True)]
    assert verify_envelope(old_certificate, document).key_id == old_kid
    assert verify_envelope(new_certificate, document).key_id == new_kid
    # the retired private key is gone; its public key stays
    assert not (store.folder / f"{old_kid}.key").exists()
    assert (store.folder / f"{new_kid}.key").exists()
    # another process's store sees the rotation
    assert KeyStore(store.folder).active_signer().key_id == new_kid


def test_a_retired_key_signs_nothing_issued_after_its_retirement(store):
    """Issue 22: a certificate forged with a rotated key and dated 2030 verified VALID. The keys document marks a
    rotated key ``retired``; the verifier refuses its certificates issued from then on, and keeps the older ones."""
    old_signer = store.active_signer()  # what a leaked copy of the old private key could still sign with
    before = issue_certificate(NEW_DIGEST, predicate(), keystore=store)
    store.rotate_key()
    document = store.public_keys()
    old = next(k for k in document["keys"] if k["kid"] == old_signer.key_id)
    assert old["retired"] and not old["active"]
    assert [k["retired"] for k in document["keys"] if k["active"]] == [None]
    assert verify_envelope(before, document).key_id == old_signer.key_id
    late = predicate(issued_at="2030-01-01T00:00:00Z")
    forged = sign_envelope(build_statement(NEW_DIGEST, {**late, "key_id": old_signer.key_id}), signer=old_signer)
    with pytest.raises(InvalidCertificate) as refused:
        verify_envelope(forged, document)
    assert refused.value.code == "outside-key-window" and "retired" in refused.value.reason


def test_key_files_are_private(store):
    kid = store.active_key_id()
    assert (store.folder / f"{kid}.key").stat().st_mode & 0o777 == 0o600
    assert store.folder.stat().st_mode & 0o777 == 0o700
    store.rotate_key()
    for path in store.folder.glob("*.key"):
        assert path.stat().st_mode & 0o777 == 0o600


def _private_key_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("*.key"))


def test_concurrent_first_starts_in_threads_make_one_key(tmp_path):
    folder = tmp_path / "keys"
    workers = 8
    barrier = threading.Barrier(workers)
    kids: list[str] = []

    def start() -> None:
        barrier.wait()
        kids.append(KeyStore(folder).active_key_id())

    threads = [threading.Thread(target=start) for _ in range(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert len(kids) == workers and len(set(kids)) == 1
    assert _private_key_files(folder) == [f"{kids[0]}.key"]
    assert [k["kid"] for k in KeyStore(folder).public_keys()["keys"]] == [kids[0]]


def _first_start(folder: str, barrier, results) -> None:
    barrier.wait()
    results.put(KeyStore(Path(folder)).active_key_id())


def test_concurrent_first_starts_in_processes_make_one_key(tmp_path):
    folder = tmp_path / "keys"
    context = multiprocessing.get_context("fork")
    workers = 4
    barrier = context.Barrier(workers)
    results = context.Queue()
    processes = [context.Process(target=_first_start, args=(str(folder), barrier, results)) for _ in range(workers)]
    for process in processes:
        process.start()
    kids = {results.get(timeout=30) for _ in range(workers)}
    for process in processes:
        process.join(timeout=30)
        assert process.exitcode == 0
    assert len(kids) == 1
    assert _private_key_files(folder) == [f"{kids.pop()}.key"]


def test_losing_the_first_start_race_discards_the_losers_key(tmp_path, monkeypatch):
    """Deterministic: another worker publishes its key while this one is still making its own."""
    folder = tmp_path / "keys"
    winner, loser = KeyStore(folder), KeyStore(folder)
    made = loser._new_key
    calls = []

    def new_key_while_winner_publishes():
        if not calls:
            calls.append(winner.active_key_id())
        return made()

    monkeypatch.setattr(loser, "_new_key", new_key_while_winner_publishes)
    assert loser.active_key_id() == calls[0]
    assert _private_key_files(folder) == [f"{calls[0]}.key"]


def test_keys_document_is_json_with_the_active_key(store):
    text = json.dumps(store.public_keys())
    document = json.loads(text)
    (entry,) = document["keys"]
    assert entry["kid"] == store.active_key_id() and entry["active"] is True
    assert entry["alg"] == "Ed25519" and entry["kty"] == "OKP" and entry["crv"] == "Ed25519"
    assert len(base64.urlsafe_b64decode(entry["x"] + "=")) == 32
    assert entry["created"].endswith("Z")


def test_well_known_route_serves_the_keys(home):
    api = FastAPI()
    api.include_router(certificates_router)
    with TestClient(api) as client:
        response = client.get(KEYS_PATH)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("application/json")
    assert "max-age" in response.headers["cache-control"]
    assert response.json() == signing.public_keys()
    assert (home / "keys").is_dir()


def write_certificate(tmp_path: Path, store: KeyStore) -> Path:
    path = tmp_path / "certificate.json"
    path.write_text(json.dumps(issue_certificate(NEW_DIGEST, predicate(), keystore=store)))
    return path


def test_verify_file_with_keys_from_a_file(tmp_path, store):
    certificate = write_certificate(tmp_path, store)
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps(store.public_keys()))
    ok, message = verify_file(certificate, str(keys))
    assert ok and message.startswith("VALID") and NEW_DIGEST in message and "req-1" in message

    envelope = json.loads(certificate.read_text())
    envelope["payload"] = flip_byte(envelope["payload"])
    certificate.write_text(json.dumps(envelope))
    ok, message = verify_file(certificate, str(keys))
    assert not ok and message.startswith("INVALID (bad-signature)")

    with pytest.raises(InputUnavailable, match="cannot read"):
        verify_file(tmp_path / "missing.json", str(keys))
    keys.write_text("{")
    with pytest.raises(InputUnavailable, match="unusable"):
        verify_file(certificate, str(keys))


def test_verify_file_with_keys_from_a_loopback_server(tmp_path, store):
    certificate = write_certificate(tmp_path, store)
    document = json.dumps(store.public_keys()).encode()
    routes = {KEYS_PATH: (200, {"content-type": "application/json"}, document), "/moved": (302, {"location": "/"}, b"")}
    with loopback_server(routes) as server:
        ok, message = verify_file(certificate, server.url(KEYS_PATH))
        assert ok, message
        with pytest.raises(InputUnavailable, match="HTTP 404"):
            verify_file(certificate, server.url("/nothing"))
        with pytest.raises(InputUnavailable, match="redirect"):
            verify_file(certificate, server.url("/moved"))
    assert [r.path for r in server.received] == [KEYS_PATH, "/nothing", "/moved"]


def test_plain_http_keys_from_elsewhere_are_refused_before_any_connection(tmp_path, store):
    certificate = write_certificate(tmp_path, store)
    # a documentation address (TEST-NET-3): refused by the URL check, no socket is opened
    with pytest.raises(InputUnavailable, match="plain http"):
        verify_file(certificate, "http://203.0.113.9/.well-known/lethe-keys.json")


def test_cli_exit_codes(tmp_path, store):
    certificate = write_certificate(tmp_path, store)
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps(store.public_keys()))
    runner = CliRunner()

    valid = runner.invoke(cli_app, ["verify-certificate", str(certificate), "--keys", str(keys)])
    assert valid.exit_code == 0, valid.output
    assert "VALID" in valid.output

    unknown = KeyStore(tmp_path / "other")
    other_keys = tmp_path / "other.json"
    other_keys.write_text(json.dumps(unknown.public_keys()))
    invalid = runner.invoke(cli_app, ["verify-certificate", str(certificate), "--keys", str(other_keys)])
    assert invalid.exit_code == 1 and "unknown-key" in invalid.output

    missing = runner.invoke(cli_app, ["verify-certificate", str(tmp_path / "nope.json"), "--keys", str(keys)])
    assert missing.exit_code == 2 and "cannot read" in missing.output
    usage = runner.invoke(cli_app, ["verify-certificate", str(certificate)])
    assert usage.exit_code == 2


def test_default_keystore_lives_under_home(home):
    kid = signing.default_keystore().active_key_id()
    assert (home / "keys" / f"{kid}.key").exists()
    assert signing.rotate_key() != kid
    assert os.stat(home / "keys").st_mode & 0o777 == 0o700


def test_cli_rotates_signing_keys_and_audits_it(home):
    """`lethe signing-keys rotate`: a new active key, the old public key still published (its certificates verify),
    the rotation in the audit log; `list` shows both."""
    from sqlalchemy import select

    from app.audit.tables import AuditEvent
    from app.db import reset_engine_cache, session_scope

    reset_engine_cache()
    try:
        first = signing.default_keystore().active_key_id()
        old_envelope = issue_certificate(NEW_DIGEST, predicate(), keystore=signing.default_keystore())
        runner = CliRunner()
        rotated = runner.invoke(cli_app, ["signing-keys", "rotate"])
        assert rotated.exit_code == 0, rotated.output
        second = signing.default_keystore().active_key_id()
        assert second != first and f"{first} -> {second}" in rotated.output
        published = {k["kid"]: k["active"] for k in signing.default_keystore().public_keys()["keys"]}
        assert published == {first: False, second: True}
        keys = signing.load_public_keys(signing.default_keystore().public_keys())
        assert signing.verify_envelope(old_envelope, keys)  # a certificate signed before the rotation still verifies
        listed = runner.invoke(cli_app, ["signing-keys", "list"])
        assert listed.exit_code == 0 and first in listed.output and second in listed.output
        with session_scope() as session:
            event = session.scalars(select(AuditEvent).where(AuditEvent.action == "signing-key.rotated")).one()
            assert event.entity_id == second and event.payload["previous"] == first
    finally:
        reset_engine_cache()

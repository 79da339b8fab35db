"""Deletion certificates: Ed25519-signed DSSE envelopes over in-toto Statements, checkable offline.

Why these standards: anyone holding Lethe's public keys (``/.well-known/lethe-keys.json``) must be able to check a
certificate without trusting, or even reaching, the service, and with tooling that is not ours.

- in-toto Statement v1 (https://github.com/in-toto/attestation/blob/main/spec/v1/statement.md): the *subject* is
  the new model version, named by its sha256 digest; the *predicate* says what was erased and how it was checked.
- DSSE v1.0 (https://github.com/secure-systems-lab/dsse/blob/master/protocol.md): the signature covers
  ``PAE(payloadType, payload)``, so the exact payload bytes are signed (no JSON canonicalisation to get wrong) and
  the payload type cannot be swapped under a valid signature.
- Ed25519 (RFC 8032) from ``cryptography``; no cryptography is written here, PAE is only an encoding.

Predicate (``predicateType`` :data:`PREDICATE_TYPE`), built by :func:`build_deletion_predicate`; every digest is
lowercase hex sha256, every time RFC 3339 UTC (``...Z``):

- ``request_id``: the deletion request's id.
- ``subject_hash``: the keyed hash (HMAC) of the data subject's reference, never the raw reference.
- ``model_id``: the registered model.
- ``parent_version_digest``: the version that was unlearned from; ``new_version_digest``: the version produced
  (equal to the Statement's subject digest; the verifier checks this).
- ``method``: ``{"name": ..., "settings": {...}}``, the unlearning method and the settings it ran with.
- ``erasure_manifest``: every stored copy of the erased rows and what happened to it (from the erase step).
- ``verification``: ``{"figures": {...}, "verdict": "pass" | "fail" | ...}``: utility, LiRA, bounds and the verdict.
- ``audit_chain_head``: the audit log head when the certificate was made (e.g. ``{"seq": 42, "hash": "..."}``).
- ``timestamps``: ``{"requested_at", "completed_at", "issued_at"}``.
- ``key_id``: the id of the key that signed the envelope, set by :func:`issue_certificate` (the verifier checks it
  matches the signature's ``keyid``, so it is covered by the signature too).

Keys live in ``settings.home / "keys"`` (folder 0700):

- ``<kid>.key``: the Ed25519 private key (PKCS#8 PEM), created with ``O_CREAT | O_EXCL`` and mode 0600, so it is
  never readable by others, not even for an instant, and never overwritten.
- ``keyring.<generation>.json``: which keys exist (kid, raw public key, created) and which one signs. A generation
  is written to a temporary file and then published with ``os.link``, which, like ``O_EXCL``, fails when the name
  exists: two API workers starting together both try to publish generation 1, exactly one wins and the other throws
  its key away. Readers never see a half-written file. Rotation publishes the next generation the same way.

A key id is the first 16 hex characters of the sha256 of the raw public key, so a key document cannot pair an id
with another key without the verifier noticing.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import json
import logging
import os
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

log = logging.getLogger("lethe.certificates")

STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE = "https://lethe.dev/deletion-certificate/v1"
SUBJECT_ERASURE_PREDICATE_TYPE = "https://lethe.dev/subject-erasure-certificate/v1"
"""A per-person erasure's combined certificate: the Statement's subjects are the child deletion certificates (each
named ``deletion-certificate:<id>``, digest: the sha256 of its envelope as JSON with sorted keys and no spaces, the
digest the service records for it), the predicate lists each child and says ``"no_data_found": false``.

When no model held live rows of the subject, the same predicate type says ``"no_data_found": true`` with no children
and a ``search`` record (``searched_at``, ``models_searched``: the models whose subject index was searched,
``models_not_searched``: models registered with a subject column whose index did not exist yet, each with its status
and why). An in-toto Statement needs a subject, so its one subject is that record: named ``subject-search:<erasure
id>``, digest the sha256 of the record's canonical JSON (sorted keys, no spaces); the verifier recomputes it."""
SEARCH_SUBJECT_PREFIX = "subject-search:"
PREDICATE_TYPES = (PREDICATE_TYPE, SUBJECT_ERASURE_PREDICATE_TYPE)
PAYLOAD_TYPE = "application/vnd.in-toto+json"
DSSE_PAE_PREFIX = b"DSSEv1"
ALGORITHM = "Ed25519"
JWK_KEY_TYPE = "OKP"  # RFC 8037: octet key pair
DEFAULT_SUBJECT_NAME = "model-version"

KEYS_DIRNAME = "keys"
FOLDER_MODE = 0o700
PRIVATE_FILE_MODE = 0o600
PRIVATE_KEY_SUFFIX = ".key"
KEYRING_NAME = re.compile(r"keyring\.([0-9]{8})\.json")
KEY_ID_HEX_CHARS = 16
ED25519_PUBLIC_KEY_BYTES = 32
ED25519_SIGNATURE_BYTES = 64
PUBLISH_ATTEMPTS = 16
MAX_SIGNATURES = 16
SHA256_HEX = re.compile(r"[0-9a-f]{64}")


# --------------------------------------------------------------------------------------------------- errors


class InvalidCertificate(Exception):
    """A certificate that does not verify. ``code`` is stable (switch on it); ``reason`` is for people."""

    def __init__(self, code: str, reason: str):
        super().__init__(reason)
        self.code = code
        self.reason = reason


class InvalidKeys(ValueError):
    """A public-key document (or mapping) that cannot be used to verify anything; ``reason`` says why."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class KeyStoreError(RuntimeError):
    """The local key folder is unusable (tampered keyring, missing or foreign private key)."""


# --------------------------------------------------------------------------------------------------- encodings


def encode_pae(payload_type: str, payload: bytes) -> bytes:
    """DSSE v1.0 Pre-Authentication Encoding: ``"DSSEv1" SP LEN(type) SP type SP LEN(body) SP body``.

    LEN is the byte length as ASCII decimal without leading zeros; the type is UTF-8. Signing this, not the bare
    payload, binds the payload type and makes the boundary between type and body unambiguous.
    """
    type_bytes = payload_type.encode("utf-8")
    return b" ".join(
        [DSSE_PAE_PREFIX, str(len(type_bytes)).encode("ascii"), type_bytes, str(len(payload)).encode("ascii"), payload]
    )


def key_id(raw_public_key: bytes) -> str:
    """The key id: sha256 of the raw 32-byte public key, hex, first 16 characters."""
    return hashlib.sha256(raw_public_key).hexdigest()[:KEY_ID_HEX_CHARS]


def _b64encode(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _b64url_nopad(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _b64decode(text: Any) -> bytes:
    """Strict base64, standard or URL-safe alphabet, padding optional (DSSE allows either alphabet)."""
    if not isinstance(text, str):
        raise ValueError("not a string")
    normal = text.replace("-", "+").replace("_", "/")
    normal += "=" * (-len(normal) % 4)
    try:
        return base64.b64decode(normal, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(str(exc)) from exc


def _canonical_json(value: Any) -> bytes:
    """Deterministic, strict JSON (no NaN/Infinity): the exact bytes that get signed."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def parse_strict_json(data: bytes | str) -> Any:
    """Parse JSON refusing duplicate keys and NaN/Infinity, so every parser reads the signed bytes the same way."""

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        result: dict[str, Any] = {}
        for key, value in pairs:
            if key in result:
                raise ValueError(f"duplicate key {key!r}")
            result[key] = value
        return result

    def no_constants(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    if isinstance(data, bytes):
        data = data.decode("utf-8")
    return json.loads(data, object_pairs_hook=no_duplicates, parse_constant=no_constants)


def utc_timestamp(value: datetime | str | None = None) -> str:
    """RFC 3339 UTC with a ``Z`` (now when ``value`` is None); strings pass through unchanged."""
    if isinstance(value, str):
        return value
    moment = value or datetime.now(UTC)
    if moment.tzinfo is None:
        raise ValueError("timestamps must be timezone-aware")
    return moment.astimezone(UTC).isoformat().replace("+00:00", "Z")


def parse_timestamp(text: str) -> datetime:
    """An RFC 3339 time as written by utc_timestamp (a ``Z`` or an offset; a naive time is refused)."""
    moment = datetime.fromisoformat(str(text).replace("Z", "+00:00"))
    if moment.tzinfo is None:
        raise ValueError(f"{text!r} has no time zone")
    return moment


def _check_digest(value: Any, what: str) -> str:
    if not isinstance(value, str) or not SHA256_HEX.fullmatch(value):
        raise ValueError(f"{what} must be a lowercase hex sha256 digest (64 characters), got {value!r}")
    return value


# --------------------------------------------------------------------------------------------------- keys


@dataclass(frozen=True)
class Signer:
    """One private key and its id; what :func:`sign_envelope` signs with."""

    key_id: str
    private_key: Ed25519PrivateKey = field(repr=False)

    def sign(self, data: bytes) -> bytes:
        return self.private_key.sign(data)


@dataclass(frozen=True)
class _Keyring:
    generation: int
    active: str
    keys: tuple[dict[str, str], ...]  # {"kid", "public_key" (base64 raw), "created"} [+ "retired", "revoked", ...]


@dataclass(frozen=True)
class Revocation:
    """What :meth:`KeyStore.revoke_key` did: ``successor`` is the key that took over signing (None when the revoked
    key was not the active one); ``newly`` is False when the key had been revoked before."""

    kid: str
    revoked: str
    reason: str
    successor: str | None
    newly: bool


class KeyStore:
    """Ed25519 signing keys in one folder; safe to use from several threads and processes at once."""

    def __init__(self, folder: Path | str):
        self.folder = Path(folder)
        self._private: dict[str, Ed25519PrivateKey] = {}

    # ---- public API

    def active_key_id(self) -> str:
        """The id of the key that signs now; makes the first key on first use."""
        return self._keyring().active

    def active_signer(self) -> Signer:
        """The active key, loaded. Retries when a concurrent rotation retires the key between reads."""
        for _ in range(PUBLISH_ATTEMPTS):
            ring = self._keyring()
            try:
                private = self._load_private(ring.active)
            except FileNotFoundError:
                latest = self._latest()
                if latest is not None and latest.generation != ring.generation:
                    continue  # rotated meanwhile: read the new generation
                raise KeyStoreError(f"the private key of the active key {ring.active} is missing") from None
            self._private = {ring.active: private}  # forget retired keys held in memory
            return Signer(ring.active, private)
        raise KeyStoreError("the keyring kept changing while loading the active key")

    def rotate_key(self) -> str:
        """Make a new active key; keep every older public key (old certificates stay verifiable), marked ``retired``
        from now: a certificate it signs that says it was issued later does not verify (issue 22: one forged with the
        old key and dated 2030 verified). The retired private key is deleted: it will never sign again, and a key
        that no longer exists cannot leak.
        Concurrent rotations each take effect, one after the other.
        """
        for _ in range(PUBLISH_ATTEMPTS):
            current = self._keyring()
            kid, entry = self._new_key()
            ring = _Keyring(current.generation + 1, kid, (*_retire(current.keys, current.active, entry), entry))
            if self._publish(ring):
                self._forget_private(current.active)
                log.info("signing key rotated: %s -> %s", current.active, kid)
                return kid
            self._discard(kid)  # another rotation won this generation: rotate again on top of it
        raise KeyStoreError("could not publish a new keyring generation")

    def revoke_key(self, kid: str, reason: str) -> Revocation:
        """Mark a compromised key ``revoked`` (time and reason) in the published keys: the verifier then refuses every
        certificate it signed, whatever its date (retirement refuses only the later ones). Revoking the active key
        first rotates to a new one, in the same keyring generation, so the service keeps signing.

        Revoking a revoked key changes nothing (``newly`` False). Raises ``ValueError`` for an unknown key or an empty
        reason."""
        reason = " ".join((reason or "").split())
        if not reason:
            raise ValueError("say why the key is revoked (--reason)")
        for _ in range(PUBLISH_ATTEMPTS):
            current = self._keyring()
            entry = next((k for k in current.keys if k["kid"] == kid), None)
            if entry is None:
                raise ValueError(f"no signing key {kid!r}; the keys are {', '.join(k['kid'] for k in current.keys)}")
            if entry.get("revoked"):
                return Revocation(kid, entry["revoked"], entry.get("revocation_reason", ""), None, newly=False)
            now = utc_timestamp()
            revoked = {"revoked": now, "revocation_reason": reason}
            if kid == current.active:
                new_kid, new_entry = self._new_key()
                kept = _retire(current.keys, kid, new_entry)
                ring = _Keyring(current.generation + 1, new_kid, (*_mark(kept, kid, revoked), new_entry))
            else:
                new_kid = None
                ring = _Keyring(current.generation + 1, current.active, _mark(current.keys, kid, revoked))
            if self._publish(ring):
                self._forget_private(kid)
                log.warning("signing key %s revoked (%s)%s", kid, reason, f"; {new_kid} signs now" if new_kid else "")
                return Revocation(kid, now, reason, new_kid, newly=True)
            if new_kid is not None:
                self._discard(new_kid)  # another change won this generation: revoke again on top of it
        raise KeyStoreError("could not publish a new keyring generation")

    def public_keys(self) -> dict[str, Any]:
        """The keys document served at ``/.well-known/lethe-keys.json`` (JWK-shaped, RFC 8037 / RFC 9864).

        ``{"keys": [{"kid", "kty": "OKP", "crv": "Ed25519", "alg": "Ed25519", "use": "sig",
        "x": base64url(raw public key, no padding), "created", "retired" (null while it signs), "revoked" and
        "revocation_reason" (null unless compromised), "active"}]}``, oldest first. A key's certificates are valid
        when issued before it was retired; none of a revoked key's are.
        """
        ring = self._keyring()
        return {
            "keys": [
                {
                    "kid": entry["kid"],
                    "kty": JWK_KEY_TYPE,
                    "crv": ALGORITHM,
                    "alg": ALGORITHM,
                    "use": "sig",
                    "x": _b64url_nopad(_b64decode(entry["public_key"])),
                    "created": entry["created"],
                    "retired": entry.get("retired"),
                    "revoked": entry.get("revoked"),
                    "revocation_reason": entry.get("revocation_reason"),
                    "active": entry["kid"] == ring.active,
                }
                for entry in ring.keys
            ]
        }

    def verification_keys(self) -> dict[str, Ed25519PublicKey]:
        """Every key id this store ever signed with, mapped to its public key."""
        return load_public_keys(self.public_keys())

    def sign_envelope(self, statement: Mapping[str, Any]) -> dict[str, Any]:
        return sign_envelope(statement, signer=self.active_signer())

    # ---- files

    def _ensure_folder(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True, mode=FOLDER_MODE)
        mode = self.folder.stat().st_mode & 0o777
        if mode & 0o077:
            try:
                os.chmod(self.folder, FOLDER_MODE)
            except PermissionError:
                log.warning("key folder %s has mode %o and cannot be made 0700", self.folder, mode)

    def _latest(self) -> _Keyring | None:
        try:
            names = os.listdir(self.folder)
        except FileNotFoundError:
            return None
        generations = [int(match.group(1)) for name in names if (match := KEYRING_NAME.fullmatch(name))]
        if not generations:
            return None
        return self._read_keyring(max(generations))

    def _keyring(self) -> _Keyring:
        """The newest keyring; on first use, make the first key (exactly one, however many callers race)."""
        ring = self._latest()
        if ring is not None:
            return ring
        self._ensure_folder()
        for _ in range(PUBLISH_ATTEMPTS):
            ring = self._latest()
            if ring is not None:
                return ring
            kid, entry = self._new_key()
            ring = _Keyring(1, kid, (entry,))
            if self._publish(ring):
                log.info("signing key %s created in %s", kid, self.folder)
                return ring
            self._discard(kid)  # another worker published generation 1 first: use theirs
        raise KeyStoreError("could not create the first signing key")

    def _keyring_path(self, generation: int) -> Path:
        return self.folder / f"keyring.{generation:08d}.json"

    def _read_keyring(self, generation: int) -> _Keyring:
        path = self._keyring_path(generation)
        try:
            document = parse_strict_json(path.read_bytes())
            active = document["active"]
            keys = tuple(
                {"kid": str(k["kid"]), "public_key": str(k["public_key"]), "created": str(k["created"])}
                | {name: str(k[name]) for name in ("retired", "revoked", "revocation_reason") if k.get(name)}
                for k in document["keys"]
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise KeyStoreError(f"{path} is not a valid keyring: {exc}") from exc
        for entry in keys:
            try:
                raw = _b64decode(entry["public_key"])
            except ValueError:
                raw = b""
            if len(raw) != ED25519_PUBLIC_KEY_BYTES or key_id(raw) != entry["kid"]:
                raise KeyStoreError(f"{path}: key {entry['kid']} does not match its public key")
        if active not in {entry["kid"] for entry in keys}:
            raise KeyStoreError(f"{path}: the active key {active} is not in the keyring")
        if any(entry["kid"] == active and entry.get("revoked") for entry in keys):
            raise KeyStoreError(f"{path}: the active key {active} is revoked")
        return _Keyring(generation, active, keys)

    def _new_key(self) -> tuple[str, dict[str, str]]:
        """Generate a key and write its private half with O_EXCL and mode 0600 (never readable by others)."""
        self._ensure_folder()
        private = Ed25519PrivateKey.generate()
        raw = private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        kid = key_id(raw)
        pem = private.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        path = self.folder / f"{kid}{PRIVATE_KEY_SUFFIX}"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, PRIVATE_FILE_MODE)
        with os.fdopen(fd, "wb") as handle:
            handle.write(pem)
            handle.flush()
            os.fsync(handle.fileno())
        self._private[kid] = private
        return kid, {"kid": kid, "public_key": _b64encode(raw), "created": utc_timestamp()}

    def _forget_private(self, kid: str) -> None:
        """Delete a key's private half for good (it was retired or revoked: it must never sign again)."""
        self._private.pop(kid, None)
        with contextlib.suppress(FileNotFoundError):
            (self.folder / f"{kid}{PRIVATE_KEY_SUFFIX}").unlink()

    def _discard(self, kid: str) -> None:
        self._private.pop(kid, None)
        with contextlib.suppress(FileNotFoundError):
            (self.folder / f"{kid}{PRIVATE_KEY_SUFFIX}").unlink()

    def _publish(self, ring: _Keyring) -> bool:
        """Write the keyring generation completely, then give it its name with os.link (fails if taken)."""
        document = {"generation": ring.generation, "active": ring.active, "keys": list(ring.keys)}
        temporary = self.folder / f".keyring.{ring.generation:08d}.{secrets.token_hex(8)}.tmp"
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, PRIVATE_FILE_MODE)
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(json.dumps(document, indent=2).encode())
                handle.flush()
                os.fsync(handle.fileno())
            try:
                os.link(temporary, self._keyring_path(ring.generation))
            except FileExistsError:
                return False
        finally:
            temporary.unlink(missing_ok=True)
        _fsync_folder(self.folder)
        return True

    def _load_private(self, kid: str) -> Ed25519PrivateKey:
        cached = self._private.get(kid)
        if cached is not None:
            return cached
        path = self.folder / f"{kid}{PRIVATE_KEY_SUFFIX}"
        mode = path.stat().st_mode & 0o777
        if mode & 0o077:
            log.warning("private key %s has mode %o; it should be 0600", path, mode)
        private = serialization.load_pem_private_key(path.read_bytes(), password=None)
        if not isinstance(private, Ed25519PrivateKey):
            raise KeyStoreError(f"{path} is not an Ed25519 private key")
        raw = private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        if key_id(raw) != kid:
            raise KeyStoreError(f"{path} holds another key than {kid}")
        self._private[kid] = private
        return private


def _retire(keys: tuple[dict[str, str], ...], kid: str, successor: dict[str, str]) -> tuple[dict[str, str], ...]:
    """``keys`` with ``kid`` retired from the moment its successor exists (it signs nothing issued from then on)."""
    return tuple(k if k["kid"] != kid else {**k, "retired": successor["created"]} for k in keys)


def _mark(keys: tuple[dict[str, str], ...], kid: str, fields: dict[str, str]) -> tuple[dict[str, str], ...]:
    return tuple(k if k["kid"] != kid else {**k, **fields} for k in keys)


def _fsync_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@lru_cache(maxsize=8)
def _keystore_at(folder: str) -> KeyStore:
    return KeyStore(Path(folder))


def default_keystore() -> KeyStore:
    """The key store under ``settings.home / "keys"``."""
    from app.config import get_settings

    return _keystore_at(str(get_settings().home / KEYS_DIRNAME))


def rotate_key() -> str:
    """Rotate the service's signing key; returns the new key id."""
    return default_keystore().rotate_key()


def revoke_key(kid: str, reason: str) -> Revocation:
    """Revoke one of the service's signing keys (see :meth:`KeyStore.revoke_key`)."""
    return default_keystore().revoke_key(kid, reason)


def public_keys() -> dict[str, Any]:
    """The service's keys document (see :meth:`KeyStore.public_keys`)."""
    return default_keystore().public_keys()


def load_public_keys(document: Mapping[str, Any]) -> dict[str, Ed25519PublicKey]:
    """Read a keys document into ``{kid: public key}``, refusing any entry whose id is not its key's hash."""
    entries = document.get("keys") if isinstance(document, Mapping) else None
    if not isinstance(entries, list) or not entries:
        raise InvalidKeys('the keys document has no "keys" list')
    keys: dict[str, Ed25519PublicKey] = {}
    for position, entry in enumerate(entries):
        if not isinstance(entry, Mapping):
            raise InvalidKeys(f"keys[{position}] is not an object")
        kid = entry.get("kid")
        if entry.get("kty") != JWK_KEY_TYPE or entry.get("crv") != ALGORITHM:
            raise InvalidKeys(f"key {kid!r} is not an Ed25519 key (kty {entry.get('kty')!r}, crv {entry.get('crv')!r})")
        try:
            raw = _b64decode(entry.get("x"))
        except ValueError as exc:
            raise InvalidKeys(f'key {kid!r}: "x" is not base64: {exc}') from exc
        if len(raw) != ED25519_PUBLIC_KEY_BYTES:
            raise InvalidKeys(f"key {kid!r}: the public key has {len(raw)} bytes, not {ED25519_PUBLIC_KEY_BYTES}")
        if kid != key_id(raw):
            raise InvalidKeys(
                f"key {kid!r} does not match its public key (whose id is {key_id(raw)}): the document was altered"
            )
        try:
            keys[kid] = Ed25519PublicKey.from_public_bytes(raw)
        except ValueError as exc:
            raise InvalidKeys(f"key {kid!r} is not a valid Ed25519 public key: {exc}") from exc
    return keys


def _key_windows(keys: Mapping[str, Any]) -> dict[str, datetime | None]:
    """``{kid: retired or None}`` from a keys document (a bare ``{kid: key}`` mapping states none)."""
    if not (isinstance(keys, Mapping) and isinstance(keys.get("keys"), list)):
        return {}
    windows = {}
    for entry in keys["keys"]:
        try:
            retired = parse_timestamp(entry["retired"]) if entry.get("retired") else None
        except (TypeError, ValueError) as exc:
            raise InvalidKeys(f"key {entry.get('kid')!r}: bad retired time ({exc})") from exc
        windows[str(entry.get("kid"))] = retired
    return windows


def _revocations(keys: Mapping[str, Any]) -> dict[str, str]:
    """``{kid: why}`` for every key a keys document marks ``revoked`` (compromised: nothing it signed is trusted)."""
    if not (isinstance(keys, Mapping) and isinstance(keys.get("keys"), list)):
        return {}
    revoked = {}
    for entry in keys["keys"]:
        if isinstance(entry, Mapping) and entry.get("revoked"):
            reason = entry.get("revocation_reason") or "no reason given"
            revoked[str(entry.get("kid"))] = f"revoked {entry['revoked']}: {reason}"
    return revoked


def _check_key_window(predicate: Mapping[str, Any], kid: str, retired: datetime | None) -> None:
    """A certificate is valid only when its key could still sign: issued before the key was retired. (No lower
    bound: the first certificate's predicate is built, with its issued_at, just before the key store makes its
    first key.)"""
    issued_text = (predicate.get("timestamps") or {}).get("issued_at") if isinstance(predicate, Mapping) else None
    try:
        issued = parse_timestamp(issued_text)
    except (TypeError, ValueError):
        raise InvalidCertificate("malformed", "the certificate states no valid timestamps.issued_at") from None
    if retired is not None and issued >= retired:
        raise InvalidCertificate(
            "outside-key-window",
            f"issued {issued_text}, after key {kid} was retired ({utc_timestamp(retired)}): it signed nothing then",
        )


def _public_key_map(keys: Mapping[str, Any]) -> dict[str, Ed25519PublicKey]:
    """A keys document, or a mapping ``{kid: Ed25519PublicKey | raw 32 bytes}`` trusted as given."""
    if isinstance(keys, Mapping) and isinstance(keys.get("keys"), list):
        return load_public_keys(keys)
    result: dict[str, Ed25519PublicKey] = {}
    for kid, value in keys.items():
        if isinstance(value, Ed25519PublicKey):
            result[kid] = value
        elif isinstance(value, bytes | bytearray) and len(value) == ED25519_PUBLIC_KEY_BYTES:
            result[kid] = Ed25519PublicKey.from_public_bytes(bytes(value))
        else:
            raise InvalidKeys(f"key {kid!r} is neither an Ed25519 public key nor its 32 raw bytes")
    if not result:
        raise InvalidKeys("no public keys were given")
    return result


# --------------------------------------------------------------------------------------------------- statements


def build_deletion_predicate(
    *,
    request_id: str,
    subject_hash: str,
    model_id: str,
    parent_version_digest: str,
    new_version_digest: str,
    method: str,
    method_settings: Mapping[str, Any],
    erasure_manifest: Mapping[str, Any],
    verification_figures: Mapping[str, Any],
    verdict: str,
    audit_chain_head: Mapping[str, Any],
    requested_at: datetime | str,
    completed_at: datetime | str,
    issued_at: datetime | str | None = None,
) -> dict[str, Any]:
    """The deletion certificate's predicate, with the field names documented at the top of this module."""
    return {
        "request_id": str(request_id),
        "subject_hash": subject_hash,
        "model_id": str(model_id),
        "parent_version_digest": _check_digest(parent_version_digest, "parent_version_digest"),
        "new_version_digest": _check_digest(new_version_digest, "new_version_digest"),
        "method": {"name": method, "settings": dict(method_settings)},
        "erasure_manifest": dict(erasure_manifest),
        "verification": {"figures": dict(verification_figures), "verdict": verdict},
        "audit_chain_head": dict(audit_chain_head),
        "timestamps": {
            "requested_at": utc_timestamp(requested_at),
            "completed_at": utc_timestamp(completed_at),
            "issued_at": utc_timestamp(issued_at),
        },
    }


def build_statement(
    subject_digest_sha256: str,
    predicate: Mapping[str, Any],
    *,
    subject_name: str = DEFAULT_SUBJECT_NAME,
    predicate_type: str = PREDICATE_TYPE,
) -> dict[str, Any]:
    """An in-toto Statement v1 about one subject (the new model version), refusing what is not strict JSON."""
    statement = {
        "_type": STATEMENT_TYPE,
        "subject": [{"name": subject_name, "digest": {"sha256": _check_digest(subject_digest_sha256, "subject")}}],
        "predicateType": predicate_type,
        "predicate": dict(predicate),
    }
    _canonical_json(statement)  # raises now (NaN, non-JSON types) rather than at signing time
    return statement


def sign_envelope(statement: Mapping[str, Any], *, signer: Signer | None = None) -> dict[str, Any]:
    """A DSSE envelope: ``{"payloadType", "payload": base64(JSON), "signatures": [{"keyid", "sig"}]}``."""
    signer = signer or default_keystore().active_signer()
    payload = _canonical_json(statement)
    signature = signer.sign(encode_pae(PAYLOAD_TYPE, payload))
    return {
        "payloadType": PAYLOAD_TYPE,
        "payload": _b64encode(payload),
        "signatures": [{"keyid": signer.key_id, "sig": _b64encode(signature)}],
    }


def issue_certificate(
    subject_digest_sha256: str,
    predicate: Mapping[str, Any],
    *,
    subject_name: str = DEFAULT_SUBJECT_NAME,
    keystore: KeyStore | None = None,
) -> dict[str, Any]:
    """Sign a deletion certificate with the active key, recording that key's id inside the predicate too."""
    signer = (keystore or default_keystore()).active_signer()
    statement = build_statement(
        subject_digest_sha256, {**predicate, "key_id": signer.key_id}, subject_name=subject_name
    )
    return sign_envelope(statement, signer=signer)


def build_subject_erasure_predicate(
    *,
    erasure_id: str,
    subject_hash: str,
    children: list[Mapping[str, Any]],
    audit_chain_head: Mapping[str, Any],
    requested_at: datetime | str,
    completed_at: datetime | str,
    issued_at: datetime | str | None = None,
) -> dict[str, Any]:
    """The combined certificate's predicate: ``children`` holds, per model, ``request_id``, ``model_id``,
    ``certificate_id``, ``certificate_digest`` (sha256 of the child's envelope) and ``new_version_digest``."""
    listed = []
    for child in children:
        listed.append(
            {
                "request_id": str(child["request_id"]),
                "model_id": str(child["model_id"]),
                "certificate_id": str(child["certificate_id"]),
                "certificate_digest": _check_digest(child["certificate_digest"], "certificate_digest"),
                "new_version_digest": _check_digest(child["new_version_digest"], "new_version_digest"),
            }
        )
    return {
        "erasure_id": str(erasure_id),
        "subject_hash": subject_hash,
        "no_data_found": False,
        "children": listed,
        "audit_chain_head": dict(audit_chain_head),
        "timestamps": {
            "requested_at": utc_timestamp(requested_at),
            "completed_at": utc_timestamp(completed_at),
            "issued_at": utc_timestamp(issued_at),
        },
    }


def build_no_data_predicate(
    *,
    erasure_id: str,
    subject_hash: str,
    searched_at: datetime | str,
    models_searched: list[str],
    models_not_searched: list[Mapping[str, Any]],
    received_at: datetime | str,
    due_at: datetime | str,
    audit_chain_head: Mapping[str, Any],
    requested_at: datetime | str,
    completed_at: datetime | str,
    issued_at: datetime | str | None = None,
) -> dict[str, Any]:
    """The combined certificate's predicate when no model held live rows of the subject: ``no_data_found`` true, no
    children, the ``search`` that found nothing, and the ``deadline`` it was answered against (``answered_on_time``:
    completed no later than ``due_at``)."""
    completed, due = utc_timestamp(completed_at), utc_timestamp(due_at)
    on_time = datetime.fromisoformat(completed) <= datetime.fromisoformat(due)
    return {
        "erasure_id": str(erasure_id),
        "subject_hash": subject_hash,
        "no_data_found": True,
        "children": [],
        "search": {
            "searched_at": utc_timestamp(searched_at),
            "models_searched": [str(m) for m in models_searched],
            "models_not_searched": [
                {"model_id": str(m["model_id"]), "status": str(m["status"]), "reason": str(m["reason"])}
                for m in models_not_searched
            ],
        },
        "deadline": {
            "received_at": utc_timestamp(received_at),
            "due_at": due,
            "answered_on_time": on_time,
        },
        "audit_chain_head": dict(audit_chain_head),
        "timestamps": {
            "requested_at": utc_timestamp(requested_at),
            "completed_at": completed,
            "issued_at": utc_timestamp(issued_at),
        },
    }


def search_digest(search: Any) -> str:
    """The sha256 a no-data certificate's subject carries: of its ``search`` record's canonical JSON."""
    return hashlib.sha256(_canonical_json(search)).hexdigest()


def issue_subject_erasure_certificate(
    predicate: Mapping[str, Any], *, keystore: KeyStore | None = None
) -> dict[str, Any]:
    """Sign a combined certificate whose subjects are the child certificates (by the digest of each envelope), or,
    when ``no_data_found``, the search record that found no rows (see :data:`SUBJECT_ERASURE_PREDICATE_TYPE`)."""
    signer = (keystore or default_keystore()).active_signer()
    if predicate.get("no_data_found") is True:
        if predicate["children"]:
            raise ValueError("a no-data certificate lists no child certificate")
        subjects = [
            {
                "name": f"{SEARCH_SUBJECT_PREFIX}{predicate['erasure_id']}",
                "digest": {"sha256": search_digest(predicate["search"])},
            }
        ]
    else:
        subjects = [
            {"name": f"deletion-certificate:{c['certificate_id']}", "digest": {"sha256": c["certificate_digest"]}}
            for c in predicate["children"]
        ]
    if not subjects:
        raise ValueError("a combined certificate lists at least one child certificate")
    statement = {
        "_type": STATEMENT_TYPE,
        "subject": subjects,
        "predicateType": SUBJECT_ERASURE_PREDICATE_TYPE,
        "predicate": {**predicate, "key_id": signer.key_id},
    }
    _canonical_json(statement)
    return sign_envelope(statement, signer=signer)


def _check_children(statement: Mapping[str, Any]) -> None:
    """A combined certificate's subjects and its predicate's children must name the same child certificates; a
    no-data certificate (``no_data_found`` true) lists no child and its one subject is the digest of its search."""
    no_data = statement["predicate"].get("no_data_found", False)
    if not isinstance(no_data, bool):
        raise InvalidCertificate("inconsistent", "no_data_found is not true or false")
    if no_data:
        _check_no_data(statement)
        return
    children = statement["predicate"].get("children")
    if not isinstance(children, list) or not children or not all(isinstance(c, dict) for c in children):
        raise InvalidCertificate("inconsistent", "the combined certificate lists no child certificates")
    listed = sorted(str(c.get("certificate_digest")) for c in children)
    subjects = sorted(s["digest"]["sha256"] for s in statement["subject"])
    if listed != subjects:
        raise InvalidCertificate("inconsistent", "the children's certificate digests are not the statement's subjects")


def _check_no_data(statement: Mapping[str, Any]) -> None:
    predicate = statement["predicate"]
    if predicate.get("children") != []:
        raise InvalidCertificate("inconsistent", "a certificate that found no data lists child certificates")
    search = predicate.get("search")
    if (
        not isinstance(search, dict)
        or not isinstance(search.get("searched_at"), str)
        or not isinstance(search.get("models_searched"), list)
        or not isinstance(search.get("models_not_searched"), list)
    ):
        raise InvalidCertificate("inconsistent", "a certificate that found no data has no search record")
    expected = {"name": f"{SEARCH_SUBJECT_PREFIX}{predicate.get('erasure_id')}", "digest": {"sha256": ""}}
    expected["digest"]["sha256"] = search_digest(search)
    if statement["subject"] != [expected]:
        raise InvalidCertificate("inconsistent", "the statement's subject is not the digest of its search record")


# --------------------------------------------------------------------------------------------------- verification


@dataclass(frozen=True)
class VerifiedCertificate:
    """What a valid certificate says, once its signature and shape have been checked."""

    key_id: str
    subject_name: str
    subject_digest: str
    predicate_type: str
    predicate: dict[str, Any]
    statement: dict[str, Any]


def _parse_envelope(envelope: Mapping[str, Any] | str | bytes) -> tuple[str, str, list[Any]]:
    if isinstance(envelope, str | bytes):
        try:
            envelope = parse_strict_json(envelope)
        except (ValueError, UnicodeDecodeError) as exc:
            raise InvalidCertificate("malformed", f"the certificate is not valid JSON: {exc}") from exc
    if not isinstance(envelope, Mapping):
        raise InvalidCertificate("malformed", "the certificate is not a DSSE envelope (a JSON object)")
    payload_type, payload, signatures = (envelope.get(k) for k in ("payloadType", "payload", "signatures"))
    if not isinstance(payload_type, str) or not isinstance(payload, str):
        raise InvalidCertificate("malformed", 'the envelope needs string "payloadType" and "payload" fields')
    if not isinstance(signatures, list) or not signatures:
        raise InvalidCertificate("malformed", 'the envelope has no "signatures"')
    if len(signatures) > MAX_SIGNATURES:
        raise InvalidCertificate(
            "malformed", f"the envelope has {len(signatures)} signatures (at most {MAX_SIGNATURES})"
        )
    return payload_type, payload, signatures


def _check_signatures(
    payload_type: str, payload: bytes, signatures: list[Any], keys: dict[str, Ed25519PublicKey]
) -> str:
    """DSSE verification with threshold 1: the id of the first known key whose signature verifies."""
    message = encode_pae(payload_type, payload)
    unknown: list[str] = []
    failed: list[str] = []
    for position, entry in enumerate(signatures):
        if not isinstance(entry, Mapping):
            raise InvalidCertificate("malformed", f"signatures[{position}] is not an object")
        kid = entry.get("keyid") or ""
        if not isinstance(kid, str):
            raise InvalidCertificate("malformed", f"signatures[{position}].keyid is not a string")
        if kid and kid not in keys:
            unknown.append(kid)
            continue
        try:
            signature = _b64decode(entry.get("sig"))
        except ValueError as exc:
            raise InvalidCertificate("malformed", f"signatures[{position}].sig is not base64: {exc}") from exc
        for candidate in [kid] if kid else list(keys):
            try:
                keys[candidate].verify(signature, message)
            except InvalidSignature:
                continue
            return candidate
        failed.append(kid or "(no keyid)")
    if failed:
        raise InvalidCertificate(
            "bad-signature",
            f"the signature by key {', '.join(failed)} does not verify: the payload, the signature or the public key "
            "differs from what was signed",
        )
    raise InvalidCertificate(
        "unknown-key",
        f"signed by unknown key id {', '.join(unknown)}; the keys given are {', '.join(sorted(keys)) or 'none'}",
    )


def _parse_statement(payload: bytes, predicate_type: str | tuple[str, ...] | None) -> dict[str, Any]:
    try:
        statement = parse_strict_json(payload)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidCertificate("not-a-statement", f"the signed payload is not valid JSON: {exc}") from exc
    if not isinstance(statement, dict) or statement.get("_type") != STATEMENT_TYPE:
        found = statement.get("_type") if isinstance(statement, dict) else type(statement).__name__
        raise InvalidCertificate("not-a-statement", f"the payload is not an in-toto Statement v1 (_type {found!r})")
    subjects = statement.get("subject")
    if not isinstance(subjects, list) or not subjects:
        raise InvalidCertificate("not-a-statement", "the statement has no subject")
    for subject in subjects:
        if not isinstance(subject, dict) or not isinstance(subject.get("name"), str):
            raise InvalidCertificate("not-a-statement", "a subject is not an object with a name")
        digest = subject.get("digest")
        if not isinstance(digest, dict) or not SHA256_HEX.fullmatch(str(digest.get("sha256", ""))):
            raise InvalidCertificate("not-a-statement", "a subject lacks a sha256 digest (64 lowercase hex)")
    if not isinstance(statement.get("predicateType"), str) or not isinstance(statement.get("predicate"), dict):
        raise InvalidCertificate("not-a-statement", "the statement lacks predicateType or an object predicate")
    accepted = (predicate_type,) if isinstance(predicate_type, str) else predicate_type
    if accepted is not None and statement["predicateType"] not in accepted:
        raise InvalidCertificate(
            "wrong-predicate-type",
            f"predicateType is {statement['predicateType']!r}, expected {' or '.join(map(repr, accepted))}",
        )
    return statement


def _signed_by_unrevoked(
    payload_type: str,
    payload: bytes,
    signatures: list[Any],
    keys: dict[str, Ed25519PublicKey],
    revoked: dict[str, str],
    first: str,
) -> str:
    """A signature by a revoked key counts for nothing, whatever the certificate's date (whoever stole the key can
    sign any date): another signature by a key still trusted may carry the envelope, else ``key-revoked``."""
    trusted = {kid: key for kid, key in keys.items() if kid not in revoked}
    if trusted:
        with contextlib.suppress(InvalidCertificate):
            return _check_signatures(payload_type, payload, signatures, trusted)
    raise InvalidCertificate(
        "key-revoked",
        f"signed by key {first}, which is {revoked[first]}; no certificate it signed is trusted, whatever its date",
    )


def verify_envelope(
    envelope: Mapping[str, Any] | str | bytes,
    keys: Mapping[str, Any],
    *,
    predicate_type: str | tuple[str, ...] | None = PREDICATE_TYPE,
) -> VerifiedCertificate:
    """Check a certificate offline, the DSSE way: signature over PAE first, then parse only authenticated bytes.

    ``keys`` is a keys document (as served at ``/.well-known/lethe-keys.json``) or ``{kid: public key}``. A key
    the document marks ``revoked`` verifies nothing (``key-revoked``), one marked ``retired`` only what was issued
    before (``outside-key-window``); a bare mapping states neither. Raises
    :class:`InvalidCertificate` (with ``code`` and ``reason``) or, for an unusable keys document,
    :class:`InvalidKeys`.
    """
    public = _public_key_map(keys)
    windows = _key_windows(keys)
    revoked = _revocations(keys)
    payload_type, payload_b64, signatures = _parse_envelope(envelope)
    if payload_type != PAYLOAD_TYPE:
        raise InvalidCertificate(
            "wrong-payload-type", f"payloadType is {payload_type!r}; a Lethe certificate has {PAYLOAD_TYPE!r}"
        )
    try:
        payload = _b64decode(payload_b64)
    except ValueError as exc:
        raise InvalidCertificate("malformed", f"the payload is not base64: {exc}") from exc
    signed_by = _check_signatures(payload_type, payload, signatures, public)
    if signed_by in revoked:
        signed_by = _signed_by_unrevoked(payload_type, payload, signatures, public, revoked, signed_by)
    statement = _parse_statement(payload, predicate_type)
    predicate = statement["predicate"]
    subject = statement["subject"][0]
    if "key_id" in predicate and predicate["key_id"] != signed_by:
        raise InvalidCertificate(
            "inconsistent", f"the predicate names key {predicate['key_id']!r} but key {signed_by} signed it"
        )
    if signed_by in windows:
        _check_key_window(predicate, signed_by, windows[signed_by])
    if statement["predicateType"] == SUBJECT_ERASURE_PREDICATE_TYPE:
        _check_children(statement)
    elif "new_version_digest" in predicate and predicate["new_version_digest"] != subject["digest"]["sha256"]:
        raise InvalidCertificate("inconsistent", "the predicate's new_version_digest is not the subject's digest")
    return VerifiedCertificate(
        key_id=signed_by,
        subject_name=subject["name"],
        subject_digest=subject["digest"]["sha256"],
        predicate_type=statement["predicateType"],
        predicate=predicate,
        statement=statement,
    )

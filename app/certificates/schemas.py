"""The certificates domain's answers: a DSSE envelope (a deletion certificate, or a per-person erasure's combined
one) and the public keys document that verifies them."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class DsseSignature(BaseModel):
    keyid: str = Field(..., description="The signing key's id: its ``kid`` in /.well-known/lethe-keys.json.")
    sig: str = Field(..., description="Base64 Ed25519 signature over the DSSE pre-authentication encoding.")


class CertificateEnvelope(BaseModel):
    """A DSSE envelope exactly as signed: ``payload`` is the base64 of an in-toto Statement (JSON) whose subject is
    the new version's digest and whose predicate binds the request, the subject hash, the parent and new versions,
    the method, the erasure manifest, the verification and its verdict, the audit chain's head and the key id.
    Verify it offline with ``lethe verify-certificate FILE --keys URL-or-FILE``."""

    model_config = ConfigDict(extra="allow")
    payloadType: Literal["application/vnd.in-toto+json"]  # DSSE's own member name
    payload: str = Field(..., description="Base64 of the in-toto Statement (canonical JSON).")
    signatures: list[DsseSignature] = Field(..., min_length=1)


class PublicKeyOut(BaseModel):
    """An Ed25519 public key as a JWK (RFC 8037): ``kid`` is its hash, ``active`` marks the one signing now; a
    ``retired`` key verifies what it signed before then, a ``revoked`` one nothing."""

    model_config = ConfigDict(extra="allow")
    kid: str
    kty: Literal["OKP"]
    crv: Literal["Ed25519"]
    alg: Literal["Ed25519"]
    use: Literal["sig"]
    x: str = Field(..., description="The raw public key, base64url without padding.")
    created: datetime
    retired: datetime | None = Field(
        None, description="Rotated out: its certificates issued from this time on are refused (outside-key-window)."
    )
    revoked: datetime | None = Field(
        None, description="Compromised: every certificate it signed is refused, whatever its date (key-revoked)."
    )
    revocation_reason: str | None = Field(None, description="Why the key was revoked (the operator's words).")
    active: bool


class KeysDocument(BaseModel):
    """Every key ever used to sign (old ones keep old certificates verifiable), oldest first."""

    keys: list[PublicKeyOut]

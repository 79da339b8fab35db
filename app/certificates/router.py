"""``GET /.well-known/lethe-keys.json``: the public keys that verify Lethe's deletion certificates.

Public and unauthenticated on purpose: a certificate is only useful if anyone can check it. Mount with
``app.include_router(certificates_router)`` (no prefix: the path is fixed by RFC 8615's well-known URIs).
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from app.certificates.signing import public_keys

KEYS_PATH = "/.well-known/lethe-keys.json"
KEYS_CACHE_SECONDS = 300  # short: after a rotation, verifiers see the new key within minutes

router = APIRouter(tags=["certificates"])


@router.get(KEYS_PATH, summary="Public keys for verifying deletion certificates")
def lethe_keys() -> JSONResponse:
    """Every signing key ever used (old ones keep old certificates verifiable), the active one marked."""
    return JSONResponse(public_keys(), headers={"cache-control": f"public, max-age={KEYS_CACHE_SECONDS}"})

"""``GET /.well-known/lethe-keys.json``: the public keys that verify Lethe's deletion certificates.

Public and unauthenticated on purpose: a certificate is only useful if anyone can check it. Mount with
``app.include_router(certificates_router)`` (no prefix: the path is fixed by RFC 8615's well-known URIs).
"""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse
from sqlalchemy.orm import Session

from app.auth.service import Principal, require_scope
from app.certificates.schemas import CertificateEnvelope, KeysDocument
from app.certificates.service import get_certificate_or_404
from app.certificates.signing import public_keys
from app.db import get_session
from app.openapi import headers

KEYS_PATH = "/.well-known/lethe-keys.json"
KEYS_CACHE_SECONDS = 300  # short: after a rotation, verifiers see the new key within minutes

router = APIRouter(tags=["certificates"])


@router.get(
    KEYS_PATH,
    summary="Public keys for verifying deletion certificates",
    response_model=KeysDocument,
    responses={200: {"headers": headers("Cache-Control")}},
)
def lethe_keys() -> JSONResponse:
    """Every signing key ever used (old ones keep old certificates verifiable), the active one marked."""
    return JSONResponse(public_keys(), headers={"cache-control": f"public, max-age={KEYS_CACHE_SECONDS}"})


@router.get(
    "/v1/certificates/{certificate_id}",
    summary="A deletion certificate (DSSE envelope)",
    response_model=CertificateEnvelope,
    responses={200: {"headers": headers("ETag", "Content-Disposition")}},
)
def get_certificate(
    certificate_id: str,
    _: Principal = Depends(require_scope("requests:read")),
    session: Session = Depends(get_session),
) -> JSONResponse:
    """The DSSE envelope as signed; save it and check it offline with
    ``lethe verify-certificate FILE --keys URL-or-FILE``."""
    certificate = get_certificate_or_404(session, certificate_id)
    return JSONResponse(
        certificate.envelope,
        headers={"ETag": f'"{certificate.digest}"', "Content-Disposition": f'inline; filename="{certificate.id}.json"'},
    )

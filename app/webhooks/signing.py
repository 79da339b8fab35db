"""Standard Webhooks signatures (https://www.standardwebhooks.com/, the ``standardwebhooks`` package).

Why this scheme rather than our own HMAC header: receivers can check deliveries with an off-the-shelf library in
any language. Each endpoint has its own ``whsec_<base64>`` secret (a leaked secret exposes one receiver, not all),
the signature covers ``webhook-id.webhook-timestamp.body`` (so a captured delivery cannot be replayed later, or
with another id), and during a secret rotation a delivery can carry one signature per secret.

The sender must keep each endpoint's secret readable (it signs with it), so the lead stores it encrypted or derives
it; only the secret's owner-facing copy is shown once.
"""

from __future__ import annotations

import base64
import re
import secrets
import uuid
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

import standardwebhooks

SECRET_PREFIX = "whsec_"
SECRET_BYTES = 32  # the spec asks for 24 to 64 random bytes
MESSAGE_ID_PREFIX = "msg_"
MESSAGE_ID = re.compile(r"[A-Za-z0-9_\-]{1,128}")  # goes into a header and into the signed text: no dots, no CR/LF
HEADER_ID = "webhook-id"
HEADER_TIMESTAMP = "webhook-timestamp"
HEADER_SIGNATURE = "webhook-signature"

WebhookVerificationError = standardwebhooks.WebhookVerificationError


def generate_secret() -> str:
    """A new per-endpoint secret, ``whsec_`` + base64 of 32 random bytes."""
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(SECRET_BYTES)).decode("ascii")


def new_message_id() -> str:
    """An id for one event. Reuse it on every retry of that event: receivers deduplicate on it."""
    return MESSAGE_ID_PREFIX + uuid.uuid4().hex


def sign_headers(
    secret: str | Sequence[str],
    payload: bytes,
    *,
    message_id: str | None = None,
    timestamp: datetime | None = None,
) -> dict[str, str]:
    """The ``webhook-id``, ``webhook-timestamp`` and ``webhook-signature`` headers for one delivery.

    ``payload`` is the exact UTF-8 body that will be sent. Several secrets (a rotation) give several signatures,
    space-separated, as the spec allows.
    """
    message_id = message_id or new_message_id()
    if not MESSAGE_ID.fullmatch(message_id):
        raise ValueError("a webhook message id is 1-128 characters of letters, digits, '_' and '-'")
    # whole seconds, aware UTC: the library formats the timestamp with floor() after forcing UTC
    moment = datetime.fromtimestamp(int((timestamp or datetime.now(UTC)).timestamp()), tz=UTC)
    body = payload.decode("utf-8")
    secret_list = [secret] if isinstance(secret, str) else list(secret)
    if not secret_list:
        raise ValueError("at least one secret is needed to sign")
    signatures = [standardwebhooks.Webhook(s).sign(message_id, moment, body) for s in secret_list]
    return {
        HEADER_ID: message_id,
        HEADER_TIMESTAMP: str(int(moment.timestamp())),
        HEADER_SIGNATURE: " ".join(signatures),
    }


def verify(secret: str, payload: bytes | str, headers: Mapping[str, str]) -> Any:
    """Check a delivery like a receiver does (5-minute timestamp tolerance); returns the parsed JSON body.

    Raises :class:`WebhookVerificationError` for every failure, including what the library lets through as other
    exceptions: a correctly signed body that is not JSON, and (before standardwebhooks 1.3) a malformed signature.
    """
    try:
        return standardwebhooks.Webhook(secret).verify(payload, dict(headers))
    except standardwebhooks.WebhookVerificationError:
        raise
    except (ValueError, TypeError, UnicodeDecodeError) as exc:
        raise WebhookVerificationError(f"malformed webhook: {exc}") from exc

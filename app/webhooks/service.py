"""Webhooks per the Standard Webhooks spec, from an outbox (ARCHITECTURE.md, "webhook sender").

The transaction that ends a deletion request writes a :class:`WebhookDelivery` row; the sender (app/webhooks/
sender.py, a loop beside the dispatcher, never the job worker) delivers due rows: it vets the callback URL's resolved
addresses (guard.py), signs with the endpoint's own ``whsec_`` secret (not the master secret), POSTs to exactly the
vetted address without following redirects, and retries with exponential backoff until ``give_up_at``; then the
row is ``dead`` and an operator can redeliver it. A slow or dead receiver never blocks a job.

Per-endpoint secrets are derived, not stored: HMAC-SHA256 of the requesting API key's id and the normalised URL
under the webhook-signing key (HKDF from the master secret, ``settings.derived_key("webhook-signing")``), so the
database never holds them. Bound to the requester, not to the URL alone: a requester who names another receiver's URL
gets its events signed with a secret that receiver does not hold, so they fail its verification.
``POST /v1/webhooks/secret`` or ``lethe keys webhook-secret URL --key ID`` tells an admin the secret to configure a
receiver with for one key's requests.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

import httpx
from sqlalchemy import select
from sqlalchemy.orm import Session

from app.config import get_settings
from app.db import session_scope, utcnow
from app.problems import Problem
from app.webhooks.guard import WebhookTargetRefused, deliver_async
from app.webhooks.signing import SECRET_PREFIX, new_message_id, sign_headers
from app.webhooks.tables import WebhookDelivery

log = logging.getLogger("lethe.webhooks")

FIRST_RETRY_SECONDS = 5.0
MAX_RETRY_SECONDS = 3600.0
"""Backoff doubles from the first retry up to this; the row is given up ``webhook_retry_hours`` after it was written."""
SEND_BATCH = 20
"""Deliveries claimed and attempted at once by one sender tick (in parallel: one slow receiver delays no other)."""
CLAIM_MARGIN_SECONDS = 30.0
"""A claim outlives its attempt's deadline by this much before another sender may take the row again."""


def endpoint_secret(url: str, requester_key_id: str | None) -> str:
    """The ``whsec_`` secret of one requester's events to one callback URL (scheme, host and port normalised; path
    kept). ``None``: a delivery written before deliveries named their requester (revision 0011), signed as then."""
    parts = urlsplit(url)
    normal = f"{parts.scheme.lower()}://{(parts.hostname or '').lower()}:{parts.port or ''}{parts.path or '/'}"
    message = normal if requester_key_id is None else f"{requester_key_id}\n{normal}"
    raw = hmac.new(get_settings().derived_key("webhook-signing"), message.encode(), hashlib.sha256).digest()
    return SECRET_PREFIX + base64.b64encode(raw).decode()


def enqueue(
    session: Session, request_id: str, url: str, event: str, data: dict[str, Any], requester_key_id: str | None
) -> WebhookDelivery:
    """Write one event for delivery (inside the transaction that ends the request), signed later with the
    requester's secret for this URL."""
    now = utcnow()
    message_id = new_message_id()
    delivery = WebhookDelivery(
        request_id=request_id,
        event=event,
        url=url,
        requester_key_id=requester_key_id,
        message_id=message_id,
        payload={"type": event, "timestamp": now.isoformat(), "data": data},
        status="pending",
        attempts=0,
        next_attempt_at=now,
        give_up_at=now + timedelta(hours=get_settings().webhook_retry_hours),
    )
    session.add(delivery)
    return delivery


def _backoff(attempts: int) -> float:
    return min(MAX_RETRY_SECONDS, FIRST_RETRY_SECONDS * 2 ** max(0, attempts - 1))


@dataclass(frozen=True)
class _Claimed:
    """A due delivery taken for one attempt: what the HTTP exchange needs, read before the claim commits."""

    id: str
    url: str
    body: bytes
    headers: dict[str, str]


def send_due(limit: int = SEND_BATCH) -> dict[str, int]:
    """Deliver the due rows once each: claim them (one short transaction), attempt them all in parallel, each within
    ``webhook_timeout_seconds`` of wall-clock time, with no row lock or transaction held over the network, then record
    the outcomes (another short transaction). A sender that dies mid-attempt leaves its rows due again when their
    claim lapses (at-least-once; receivers deduplicate by ``webhook-id``). Returns counts."""
    settings = get_settings()
    claimed = _claim(limit, settings.webhook_timeout_seconds + CLAIM_MARGIN_SECONDS)
    counts = {"delivered": 0, "retrying": 0, "dead": 0}
    if not claimed:
        return counts
    outcomes = asyncio.run(_attempt_all(claimed, settings.webhook_allowed_hosts, settings.webhook_timeout_seconds))
    with session_scope() as session:
        for item, (status_code, error) in zip(claimed, outcomes, strict=True):
            delivery = session.get(WebhookDelivery, item.id)
            if delivery is None or delivery.status != "pending":
                continue
            delivery.last_status_code = status_code
            if error is None:
                delivery.status, delivery.delivered_at, delivery.last_error = "delivered", utcnow(), None
                counts["delivered"] += 1
                continue
            delivery.last_error = error[:500]
            retry_at = utcnow() + timedelta(seconds=_backoff(delivery.attempts))
            if retry_at > delivery.give_up_at:
                delivery.status = "dead"
                counts["dead"] += 1
                log.warning("webhook %s to %s given up after %d attempts", delivery.id, delivery.url, delivery.attempts)
            else:
                delivery.next_attempt_at = retry_at
                counts["retrying"] += 1
    return counts


def _claim(limit: int, lease_seconds: float) -> list[_Claimed]:
    """Take up to ``limit`` due rows (rows another sender is claiming are skipped) and push their next attempt past
    this one's deadline, so no other sender takes them while this one talks to the receivers."""
    now = utcnow()
    with session_scope() as session:
        due = (
            session.execute(
                select(WebhookDelivery)
                .where(WebhookDelivery.status == "pending", WebhookDelivery.next_attempt_at <= now)
                .order_by(WebhookDelivery.next_attempt_at)
                .limit(limit)
                .with_for_update(skip_locked=True)
            )
            .scalars()
            .all()
        )
        claimed = []
        for delivery in due:
            body = json.dumps(delivery.payload, sort_keys=True, separators=(",", ":")).encode()
            headers = {
                "content-type": "application/json",
                **sign_headers(
                    endpoint_secret(delivery.url, delivery.requester_key_id), body, message_id=delivery.message_id
                ),
            }
            delivery.attempts += 1
            delivery.next_attempt_at = now + timedelta(seconds=lease_seconds)
            claimed.append(_Claimed(delivery.id, delivery.url, body, headers))
    return claimed


async def _attempt_all(
    claimed: list[_Claimed], allowlist: list[str], timeout: float
) -> list[tuple[int | None, str | None]]:
    """(status code, error or None when delivered) per claimed delivery, all attempted at once."""

    async def attempt(item: _Claimed) -> tuple[int | None, str | None]:
        try:
            result = await deliver_async(item.url, item.body, item.headers, allowlist=allowlist, timeout=timeout)
        except WebhookTargetRefused as exc:
            return None, f"refused: {exc.reason}"
        except httpx.HTTPError as exc:
            return None, f"{type(exc).__name__}: {exc}"
        return result.status_code, None if result.delivered else f"answered {result.status_code}"

    return list(await asyncio.gather(*(attempt(item) for item in claimed)))


def deliveries_for(session: Session, request_id: str) -> list[WebhookDelivery]:
    return list(
        session.execute(
            select(WebhookDelivery).where(WebhookDelivery.request_id == request_id).order_by(WebhookDelivery.created_at)
        ).scalars()
    )


def delivery_out(delivery: WebhookDelivery) -> dict[str, Any]:
    return {
        "id": delivery.id,
        "event": delivery.event,
        "url": delivery.url,
        "webhook_id": delivery.message_id,
        "status": delivery.status,
        "attempts": delivery.attempts,
        "last_status_code": delivery.last_status_code,
        "last_error": delivery.last_error,
        "next_attempt_at": delivery.next_attempt_at.isoformat() if delivery.status == "pending" else None,
        "delivered_at": delivery.delivered_at.isoformat() if delivery.delivered_at else None,
        "created_at": delivery.created_at.isoformat(),
    }


def redeliver(session: Session, request_id: str, delivery_id: str) -> WebhookDelivery:
    """Send an event again (same webhook-id, so the receiver can deduplicate), with a fresh retry window."""
    delivery = session.get(WebhookDelivery, delivery_id)
    if delivery is None or delivery.request_id != request_id:
        raise Problem(404, "delivery-not-found", "No such webhook delivery for this request", delivery_id)
    now = utcnow()
    delivery.status, delivery.next_attempt_at = "pending", now
    delivery.give_up_at = now + timedelta(hours=get_settings().webhook_retry_hours)
    return delivery

"""Callbacks to the compliance system when a request ends: a signed JSON POST, retried a few times.

The signature is ``X-Lethe-Signature: sha256=<HMAC of the body>`` keyed with the webhook-signing key (derived from
the master secret with HKDF; ``lethe keys webhook-secret`` prints it for receivers), so the receiver can check the
sender without holding the master secret. Delivery is best effort after the commit: the request's status is
already durable and pollable.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import time

import httpx

from app.config import get_settings

log = logging.getLogger("lethe.webhooks")


def sign(body: bytes) -> str:
    return "sha256=" + hmac.new(get_settings().derived_key("webhook-signing"), body, hashlib.sha256).hexdigest()


def deliver_webhook(url: str, payload: dict, attempts: int = 3) -> bool:
    body = json.dumps(payload, sort_keys=True).encode()
    headers = {"content-type": "application/json", "x-lethe-signature": sign(body)}
    for attempt in range(1, attempts + 1):
        try:
            response = httpx.post(url, content=body, headers=headers, timeout=get_settings().webhook_timeout_seconds)
            if response.status_code < 300:
                return True
            log.warning("webhook %s answered %s (attempt %d)", url, response.status_code, attempt)
        except httpx.HTTPError as exc:
            log.warning("webhook %s failed: %s (attempt %d)", url, exc, attempt)
        time.sleep(0.5 * attempt)
    return False

"""The webhooks domain's bodies: the delivery log of a request's events and the receiver's signing secret."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, Field

WEBHOOK_EVENTS = ("deletion.certified", "deletion.failed", "deletion.rejected")
DELIVERY_STATUSES = ("pending", "delivered", "dead")


class SecretIn(BaseModel):
    url: str = Field(max_length=2000, pattern=r"^https?://")
    key: str = Field(
        min_length=1,
        max_length=64,
        pattern=r"^[A-Za-z0-9_-]+$",
        description="The requesting API key (its id, or its prefix from `lethe keys list`): events of its requests "
        "to this URL are signed with this secret, and only they.",
    )


class SecretOut(BaseModel):
    url: str
    key_id: str
    secret: str = Field(..., description="``whsec_`` + base64: configure the receiver with it (Standard Webhooks).")


class DeliveryOut(BaseModel):
    """One event for one request's callback URL: attempts, the last answer and, while pending, the next retry."""

    id: str
    event: Literal[WEBHOOK_EVENTS]  # type: ignore[valid-type]
    url: str
    webhook_id: str = Field(..., description="The Standard Webhooks ``webhook-id``: the same on every retry.")
    status: Literal[DELIVERY_STATUSES]  # type: ignore[valid-type]
    attempts: int
    last_status_code: int | None
    last_error: str | None
    next_attempt_at: datetime | None = Field(..., description="Set while pending.")
    delivered_at: datetime | None
    created_at: datetime


class DeliveryPage(BaseModel):
    items: list[DeliveryOut]

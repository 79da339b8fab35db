from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import Index, Integer, String
from sqlalchemy.orm import Mapped, mapped_column

from app.db import Base, JSONType, UTCDateTime, new_id, utcnow


class WebhookDelivery(Base):
    """The webhook outbox: one event for one request's callback URL, written in the transaction that ends the
    request, delivered by the sender (never by the job worker) with retries until ``give_up_at``."""

    __tablename__ = "webhook_deliveries"
    __table_args__ = (Index("ix_webhook_deliveries_due", "status", "next_attempt_at"),)

    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=new_id)
    request_id: Mapped[str] = mapped_column(String(36), index=True)
    event: Mapped[str] = mapped_column(String(64))  # deletion.certified | deletion.failed | deletion.rejected
    url: Mapped[str] = mapped_column(String(2000))
    requester_key_id: Mapped[str | None] = mapped_column(String(36), nullable=True)  # the secret is bound to it
    message_id: Mapped[str] = mapped_column(String(64))  # Standard Webhooks webhook-id: the same on every retry
    payload: Mapped[dict[str, Any]] = mapped_column(JSONType)
    status: Mapped[str] = mapped_column(String(16), default="pending")  # pending | delivered | dead
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    next_attempt_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    give_up_at: Mapped[datetime] = mapped_column(UTCDateTime())
    last_status_code: Mapped[int | None] = mapped_column(Integer, nullable=True)
    last_error: Mapped[str | None] = mapped_column(String(500), nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    delivered_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import ForeignKey, Index, Integer, String, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from app.db import Base, JSONType, UTCDateTime, new_id, utcnow

REQUEST_STATUSES = (
    "pending-approval",  # on a model that requires approval: no job yet, waiting for an admin
    "received",
    "queued",
    "running",
    "verifying",
    "certified",
    "failed",
    "rejected",
    "cancelled",
)
TERMINAL_STATUSES = ("certified", "failed", "rejected", "cancelled")
ANSWERED_STATUSES = ("certified", "rejected", "cancelled")
"""The data subject has been answered (GDPR Art. 12(3)/(4)): erased, refused with the reason, or withdrawn. Every
other status still owes the erasure — ``failed`` (no job left, the rows not erased) and ``pending-approval`` included
— and its deadline keeps running."""


class DeletionRequest(Base):
    __tablename__ = "deletion_requests"
    __table_args__ = (
        UniqueConstraint("api_key_id", "idempotency_key", name="uq_deletion_requests_key_idem"),
        Index("ix_deletion_requests_status_created", "status", "created_at"),
    )

    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=new_id)
    model_id: Mapped[str] = mapped_column(ForeignKey("models.id"), index=True)
    subject_hash: Mapped[str] = mapped_column(String(64), index=True)  # HMAC of subject_ref, never the raw value
    scope: Mapped[dict[str, Any]] = mapped_column(JSONType)
    method: Mapped[str] = mapped_column(String(64))
    method_settings: Mapped[dict[str, Any]] = mapped_column(JSONType, default=dict)
    callback_url: Mapped[str | None] = mapped_column(String(2000), nullable=True)
    status: Mapped[str] = mapped_column(String(16), default="received")
    progress: Mapped[float] = mapped_column(default=0.0)
    message: Mapped[str | None] = mapped_column(String(2000), nullable=True)
    error: Mapped[dict[str, Any] | None] = mapped_column(JSONType, nullable=True)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    api_key_id: Mapped[str | None] = mapped_column(String(36), nullable=True)
    idempotency_key: Mapped[str | None] = mapped_column(String(200), nullable=True)
    body_hash: Mapped[str] = mapped_column(String(64))
    received_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)  # by the upstream system
    due_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)  # GDPR Art. 12(3): a month
    extensions: Mapped[list[dict[str, Any]] | None] = mapped_column(JSONType, nullable=True)
    notes: Mapped[list[dict[str, Any]] | None] = mapped_column(JSONType, nullable=True)  # approval notes
    overdue_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)  # when it was flagged
    certificate_id: Mapped[str | None] = mapped_column(String(36), nullable=True)
    erasure: Mapped[dict[str, Any] | None] = mapped_column(JSONType, nullable=True)  # the erasure manifest
    result_version_id: Mapped[str | None] = mapped_column(String(36), nullable=True)
    job_id: Mapped[str | None] = mapped_column(String(36), nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    completed_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)


class InflightRow(Base):
    """A sample id (its keyed hash) that an unfinished deletion request holds on a model: a second request for the
    same row is answered with the first (409), never with a second version. Released when the request ends."""

    __tablename__ = "inflight_rows"

    model_id: Mapped[str] = mapped_column(String(36), primary_key=True)
    id_hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    request_id: Mapped[str] = mapped_column(String(36), index=True)

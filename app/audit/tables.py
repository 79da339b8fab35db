from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import BigInteger, Integer, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from app.db import Base, JSONType, UTCDateTime


class AuditEvent(Base):
    """Append-only (triggers in the migration refuse UPDATE and DELETE); ``hash`` chains each row to the one before.

    ``canonical`` is the exact text the hash covers (stored as text: JSONB rewrites numbers, so the hash is never
    recomputed from ``payload``); ``payload`` is the same content as queryable JSON. NULL for rows written before
    revision 0002, whose hash is recomputed from the columns.
    """

    __tablename__ = "audit_events"

    seq: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=False
    )
    at: Mapped[datetime] = mapped_column(UTCDateTime())
    actor: Mapped[str] = mapped_column(String(200))
    action: Mapped[str] = mapped_column(String(64))
    entity_type: Mapped[str] = mapped_column(String(32))
    entity_id: Mapped[str] = mapped_column(String(64), index=True)
    payload: Mapped[dict[str, Any]] = mapped_column(JSONType)
    prev_hash: Mapped[str] = mapped_column(String(64))
    hash: Mapped[str] = mapped_column(String(64))  # not indexed on PostgreSQL (migration 0017): never looked up
    canonical: Mapped[str | None] = mapped_column(Text, nullable=True)


APPEND_ONLY_TABLES = ("audit_events", "audit_checkpoints")
"""What the runtime database role may only INSERT into and SELECT from (``lethe db grant-runtime-role``)."""


class AuditCheckpoint(Base):
    """A signed anchor of the chain's head every N events: Ed25519 (the certificate signing key ``key_id``) over its
    seq, hash, interval ``every`` and the previous checkpoint's seq ``prev_seq`` (app/audit/service.py). Rows written
    before revision 0013 carry an HMAC in ``mac`` instead (``every``, ``prev_seq``, ``signature`` NULL); signed rows
    have ``mac`` empty. Append-only like the log; a chain that ends before a checkpoint's seq lost its tail."""

    __tablename__ = "audit_checkpoints"

    seq: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=False
    )
    hash: Mapped[str] = mapped_column(String(64))
    at: Mapped[datetime] = mapped_column(UTCDateTime())
    key_id: Mapped[str] = mapped_column(String(64))
    mac: Mapped[str] = mapped_column(String(64))
    every: Mapped[int | None] = mapped_column(Integer, nullable=True)
    prev_seq: Mapped[int | None] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), nullable=True)
    signature: Mapped[str | None] = mapped_column(String(128), nullable=True)

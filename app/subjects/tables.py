"""Per-person erasure: the subject index (keyed hashes only) and the erasures that fan out over models.

The subjects domain is the only writer of these tables (app/subjects/service.py)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import BigInteger, ForeignKey, Integer, String
from sqlalchemy.orm import Mapped, mapped_column

from app.db import Base, JSONType, UTCDateTime, new_id, utcnow


class SubjectRow(Base):
    """One data-set row and the keyed hash (HMAC, subject-hash key) of the data subject it is about, read from the
    registration's ``subject_column``. The raw value stays only in the data set's own rows. The entry hangs off the
    row's index entry (``ON DELETE CASCADE``): when a deletion erases the row, its subject entry goes in the same
    statement, on PostgreSQL and on SQLite (foreign keys are on)."""

    __tablename__ = "subject_rows"

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    subject_hash: Mapped[str] = mapped_column(String(64), index=True)
    dataset_id: Mapped[str] = mapped_column(ForeignKey("datasets.id", ondelete="CASCADE"), index=True)
    row_pk: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer, "sqlite"), ForeignKey("dataset_rows.id", ondelete="CASCADE"), index=True
    )


class SubjectErasure(Base):
    """A per-person erasure: one parent over one deletion request per model that held the subject's rows. Its status
    is read from the children; the combined certificate is written once every child is certified."""

    __tablename__ = "subject_erasures"

    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=new_id)
    subject_hash: Mapped[str] = mapped_column(String(64), index=True)
    method: Mapped[str] = mapped_column(String(64))
    api_key_id: Mapped[str | None] = mapped_column(String(36), nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    completed_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    certificate_digest: Mapped[str | None] = mapped_column(String(64), nullable=True)
    certificate: Mapped[dict[str, Any] | None] = mapped_column(JSONType, nullable=True)  # the DSSE envelope


class SubjectErasureChild(Base):
    """One child deletion request of a per-person erasure (a normal deletion request on one model)."""

    __tablename__ = "subject_erasure_children"

    request_id: Mapped[str] = mapped_column(String(36), primary_key=True)
    erasure_id: Mapped[str] = mapped_column(ForeignKey("subject_erasures.id", ondelete="CASCADE"), index=True)
    model_id: Mapped[str] = mapped_column(String(36))

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import BigInteger, Boolean, ForeignKey, Index, Integer, String, UniqueConstraint, false, text
from sqlalchemy.orm import Mapped, mapped_column, validates

from app.db import Base, JSONType, UTCDateTime, new_id, utcnow


class Dataset(Base):
    """A training table the service holds (content-addressed in the artifact store)."""

    __tablename__ = "datasets"

    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=new_id)
    name: Mapped[str] = mapped_column(String(200))
    format: Mapped[str] = mapped_column(String(16))
    digest: Mapped[str] = mapped_column(String(64))
    row_id_column: Mapped[str] = mapped_column(String(200))
    label_column: Mapped[str] = mapped_column(String(200))
    columns: Mapped[list[str]] = mapped_column(JSONType)
    n_rows: Mapped[int | None] = mapped_column(Integer, nullable=True)
    n_positions: Mapped[int | None] = mapped_column(Integer, nullable=True)  # rows at registration; positions keep
    # their meaning after erased rows leave the stored table
    chunks: Mapped[list[str] | None] = mapped_column(JSONType, nullable=True)  # a chunked table's blobs (the
    # digest is its manifest's; app/jobs/chunks.py): live while listed, shredded when an erasure replaces them
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class DatasetRow(Base):
    """One row's id, label and position in the table. An erased row's index entry is deleted with it (only a keyed
    hash of its id stays, in :class:`ErasedRow`); ``deleted_by`` is kept for databases written before erasure."""

    __tablename__ = "dataset_rows"
    __table_args__ = (
        UniqueConstraint("dataset_id", "row_id", name="uq_dataset_rows_dataset_row"),
        Index("ix_dataset_rows_dataset_label", "dataset_id", "label"),
        Index("ix_dataset_rows_dataset_position", "dataset_id", "position"),  # erasure finds rows by position
        Index(  # the rows older databases tombstoned: read per deletion, one index entry each, not a table scan
            "ix_dataset_rows_tombstoned",
            "dataset_id",
            sqlite_where=text("deleted_by IS NOT NULL"),
            postgresql_where=text("deleted_by IS NOT NULL"),
        ),
    )

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    dataset_id: Mapped[str] = mapped_column(ForeignKey("datasets.id", ondelete="CASCADE"))
    row_id: Mapped[str] = mapped_column(String(200))
    position: Mapped[int] = mapped_column(Integer)
    label: Mapped[str] = mapped_column(String(200))
    deleted_by: Mapped[str | None] = mapped_column(String(36), nullable=True)
    deleted_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)


class ModelTag(Base):
    """A label an owner gives a model at registration (team, product, environment): what ``GET /v1/models?tag=``
    filters on. A table, not a JSON column, so the filter is one indexed lookup on PostgreSQL and SQLite alike."""

    __tablename__ = "model_tags"

    model_id: Mapped[str] = mapped_column(ForeignKey("models.id", ondelete="CASCADE"), primary_key=True)
    tag: Mapped[str] = mapped_column(String(64), primary_key=True, index=True)


class Model(Base):
    __tablename__ = "models"

    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=new_id)
    name: Mapped[str] = mapped_column(String(200))
    kind: Mapped[str] = mapped_column(String(32))  # "tabular" | "clip_federated"
    status: Mapped[str] = mapped_column(String(16), default="registering")  # registering | ready | failed
    dataset_id: Mapped[str | None] = mapped_column(ForeignKey("datasets.id"), nullable=True)
    spec: Mapped[dict[str, Any]] = mapped_column(JSONType)  # family, recipe, label column, unlearning methods
    state: Mapped[dict[str, Any]] = mapped_column(JSONType, default=dict)  # encoder, classes, method artifacts
    current_version_id: Mapped[str | None] = mapped_column(String(36), nullable=True)
    requires_approval: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    # an admin approves each deletion request before any work starts (its job is created at approval)
    error: Mapped[str | None] = mapped_column(String(4000), nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow, onupdate=utcnow)

    @validates("error")
    def _first_line(self, _key: str, value: str | None) -> str | None:
        """Only an error's first line is stored (and shown by the API); a worker's traceback stays in its log."""
        return first_line(value)


def first_line(error: str | None, limit: int = 2000) -> str | None:
    if error is None:
        return None
    return error.strip().split("\n", 1)[0].strip()[:limit]


class ModelVersion(Base):
    """An immutable model version: safetensors content-addressed by sha256, with its parent (the lineage)."""

    __tablename__ = "model_versions"
    __table_args__ = (UniqueConstraint("model_id", "number", name="uq_model_versions_model_number"),)

    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=new_id)
    model_id: Mapped[str] = mapped_column(ForeignKey("models.id", ondelete="CASCADE"), index=True)
    number: Mapped[int] = mapped_column(Integer)
    parent_id: Mapped[str | None] = mapped_column(ForeignKey("model_versions.id"), nullable=True)
    digest: Mapped[str] = mapped_column(String(64))
    method: Mapped[str] = mapped_column(String(64))
    job_id: Mapped[str] = mapped_column(String(36), unique=True)  # one version per job, whatever the retries
    request_id: Mapped[str | None] = mapped_column(String(36), nullable=True)
    metrics: Mapped[dict[str, Any]] = mapped_column(JSONType, default=dict)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    retired_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)  # trained on erased rows:
    retired_by: Mapped[str | None] = mapped_column(String(36), nullable=True)  # its weights answer 410 Gone


class ErasedRow(Base):
    """A keyed hash (HMAC, row-id-hash key) of an erased row's id: proves what was erased, answers a second request
    for it with 409, and keeps nothing a reader of the database could reverse."""

    __tablename__ = "erased_rows"
    __table_args__ = (UniqueConstraint("dataset_id", "id_hash", name="uq_erased_rows_dataset_hash"),)

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    dataset_id: Mapped[str] = mapped_column(ForeignKey("datasets.id", ondelete="CASCADE"))
    id_hash: Mapped[str] = mapped_column(String(64))
    request_id: Mapped[str] = mapped_column(String(36))
    erased_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class ShredItem(Base):
    """A blob to delete from the artifact store once ``not_before`` has passed (the retention grace period), unless
    something live still references it (blobs are content-addressed and may be shared)."""

    __tablename__ = "shred_queue"
    __table_args__ = (Index("ix_shred_queue_due", "done_at", "not_before"),)

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    digest: Mapped[str] = mapped_column(String(64))
    reason: Mapped[str] = mapped_column(String(200))
    not_before: Mapped[datetime] = mapped_column(UTCDateTime())
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    done_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    outcome: Mapped[str | None] = mapped_column(String(32), nullable=True)

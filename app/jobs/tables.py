from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import BigInteger, Index, Integer, String
from sqlalchemy.orm import Mapped, mapped_column

from app.db import Base, JSONType, UTCDateTime, new_id, utcnow

JOB_STATUSES = ("pending", "dispatched", "running", "succeeded", "failed", "cancelled")
JOB_KINDS = ("train_model", "deletion", "aggregate_round")
"""The kinds of job app/jobs/pipeline.py has handlers for (the metrics name each, 0 before the first)."""


class Job(Base):
    """The outbox row and the lease: PostgreSQL is the source of truth, Celery only carries the id."""

    __tablename__ = "jobs"
    __table_args__ = (Index("ix_jobs_status_available", "status", "available_at"),)

    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=new_id)
    kind: Mapped[str] = mapped_column(String(32))  # one of JOB_KINDS
    queue: Mapped[str] = mapped_column(String(16), default="cpu")
    model_id: Mapped[str] = mapped_column(String(36), index=True)
    request_id: Mapped[str | None] = mapped_column(String(36), nullable=True, index=True)
    payload: Mapped[dict[str, Any]] = mapped_column(JSONType, default=dict)
    status: Mapped[str] = mapped_column(String(16), default="pending")
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    max_attempts: Mapped[int] = mapped_column(Integer, default=3)
    lease_owner: Mapped[str | None] = mapped_column(String(200), nullable=True)
    lease_expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    available_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    dispatched_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    progress: Mapped[float] = mapped_column(default=0.0)
    message: Mapped[str | None] = mapped_column(String(2000), nullable=True)
    result: Mapped[dict[str, Any] | None] = mapped_column(JSONType, nullable=True)
    error: Mapped[str | None] = mapped_column(String(4000), nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)


class WorkerHeartbeat(Base):
    """A Celery worker's last sign of life and the queues it consumes (app/jobs/heartbeat.py), so that readiness and
    metrics read a row instead of broadcasting to every worker and waiting seconds for replies (issue 23)."""

    __tablename__ = "worker_heartbeats"

    name: Mapped[str] = mapped_column(String(200), primary_key=True)  # node name and process: unique per worker
    queues: Mapped[list[str]] = mapped_column(JSONType, default=list)
    started_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    seen_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class BlobIntent(Base):
    """A blob an attempt is about to write (a write-ahead intent, app/jobs/blobs.py), recorded before its bytes
    reach the artifact store: an attempt that ends without publishing (failed, rejected, lease lost, worker killed)
    has exactly these shredded, unless something else references them. ``owner``: the attempt's lease owner."""

    __tablename__ = "blob_intents"

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    owner: Mapped[str] = mapped_column(String(200), index=True)
    job_id: Mapped[str] = mapped_column(String(36))
    digest: Mapped[str] = mapped_column(String(64), index=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)

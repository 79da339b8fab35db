from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import String
from sqlalchemy.orm import Mapped, mapped_column

from app.db import Base, JSONType, UTCDateTime, new_id, utcnow


class Report(Base):
    """One verification of one unlearning attempt: every figure with its settings and sample sizes, the verdict,
    and the plots (PNG blobs in the artifact store, by name). A request escalated by ``auto`` has two."""

    __tablename__ = "reports"

    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=new_id)
    request_id: Mapped[str] = mapped_column(String(36), index=True)
    model_id: Mapped[str] = mapped_column(String(36))
    verdict: Mapped[str] = mapped_column(String(16))  # pass | fail
    body: Mapped[dict[str, Any]] = mapped_column(JSONType)
    plots: Mapped[dict[str, str]] = mapped_column(JSONType, default=dict)
    etag: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)

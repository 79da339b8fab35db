from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import String, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from app.db import Base, JSONType, UTCDateTime, new_id, utcnow


class Certificate(Base):
    """A signed deletion certificate: a DSSE envelope over an in-toto Statement whose subject is the new version's
    sha256 (app/certificates/signing.py). Issued once per request, never for a failed verdict."""

    __tablename__ = "certificates"
    __table_args__ = (UniqueConstraint("request_id", name="uq_certificates_request"),)

    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=new_id)
    request_id: Mapped[str] = mapped_column(String(36))
    model_id: Mapped[str] = mapped_column(String(36))
    version_id: Mapped[str] = mapped_column(String(36))
    subject_digest: Mapped[str] = mapped_column(String(64))
    key_id: Mapped[str] = mapped_column(String(64))
    digest: Mapped[str] = mapped_column(String(64))  # sha256 of the envelope as served
    envelope: Mapped[dict[str, Any]] = mapped_column(JSONType)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)

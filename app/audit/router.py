from __future__ import annotations

from datetime import datetime
from typing import Any

from fastapi import APIRouter, Depends, Query
from pydantic import BaseModel, Field
from sqlalchemy import select
from sqlalchemy.orm import Session

from app.audit.service import verify_chain
from app.audit.tables import AuditEvent
from app.auth.service import Principal, require_scope
from app.db import get_session

router = APIRouter(prefix="/v1/audit", tags=["audit"])


class AuditEventOut(BaseModel):
    seq: int
    at: datetime
    actor: str
    action: str
    entity_type: str
    entity_id: str
    payload: dict[str, Any]
    prev_hash: str
    hash: str
    canonical: str | None = Field(
        None,
        description="The exact text the row's hash covers: hash = sha256(prev_hash + canonical), so anyone can "
        "recompute the chain (and check a certificate's audit_anchor against it); null for rows written before "
        "revision 0004, whose hash is recomputed from the columns.",
    )


class AuditPage(BaseModel):
    items: list[AuditEventOut]
    next_after_seq: int | None


class ChainVerdictOut(BaseModel):
    ok: bool
    checked: int
    head: dict[str, Any]
    first_broken_seq: int | None
    reason: str | None
    checkpoints: int = 0
    last_checkpoint_seq: int | None = None
    code: str | None = Field(
        None,
        description="Why it failed, stable: row-missing, relinked, row-changed, checkpoint-mismatch, truncated, "
        "checkpoint-forged, checkpoint-missing (first_broken_seq is then the position whose checkpoint is absent).",
    )


@router.get("", response_model=AuditPage)
def list_events(
    _: Principal = Depends(require_scope("audit:read")),
    session: Session = Depends(get_session),
    after_seq: int = Query(0, ge=0, le=2**63 - 1),
    limit: int = Query(100, ge=1, le=1000),
    entity_id: str | None = Query(None),
):
    query = select(AuditEvent).where(AuditEvent.seq > after_seq)
    if entity_id:
        query = query.where(AuditEvent.entity_id == entity_id)
    rows = list(session.execute(query.order_by(AuditEvent.seq).limit(limit + 1)).scalars())
    items = [AuditEventOut.model_validate(r, from_attributes=True) for r in rows[:limit]]
    return AuditPage(items=items, next_after_seq=rows[limit - 1].seq if len(rows) > limit else None)


@router.get("/verify", response_model=ChainVerdictOut)
def verify(_: Principal = Depends(require_scope("audit:read")), session: Session = Depends(get_session)):
    """Recompute the hash chain and check the signed checkpoints; ``first_broken_seq`` names the first row that was
    changed, removed or re-linked, the first row missing from a tail cut short after a checkpoint, or the position of
    a checkpoint that is missing."""
    verdict = verify_chain(session)
    return ChainVerdictOut(
        ok=verdict.ok,
        checked=verdict.checked,
        head=verdict.head,
        first_broken_seq=verdict.first_broken_seq,
        reason=verdict.reason,
        checkpoints=verdict.checkpoints,
        last_checkpoint_seq=verdict.last_checkpoint_seq,
        code=verdict.code,
    )

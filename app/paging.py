"""Keyset paging on ``(created_at, id)``, newest first: one opaque cursor format for every list the API pages.

Offsets skip or repeat rows while new ones arrive; a keyset cursor (the last row's ``created_at`` and ``id``) keeps
pages stable. The cursor is base64 JSON, opaque to clients: they pass back ``next_cursor`` as it came.
"""

from __future__ import annotations

import base64
import json
from datetime import datetime
from typing import Any

from sqlalchemy import Select, and_, or_

from app.problems import Problem


def encode_cursor(created_at: datetime, row_id: str) -> str:
    return base64.urlsafe_b64encode(json.dumps([created_at.isoformat(), row_id]).encode()).decode()


def decode_cursor(cursor: str) -> tuple[datetime, str]:
    try:
        created, row_id = json.loads(base64.urlsafe_b64decode(cursor.encode()))
        moment = datetime.fromisoformat(created)
        if moment.tzinfo is None or not isinstance(row_id, str) or "\x00" in row_id:
            raise ValueError("not a cursor this service wrote")
        return moment, row_id
    except (ValueError, TypeError, json.JSONDecodeError):
        raise Problem(
            400, "invalid-cursor", "The cursor is not valid", "Use `next_cursor` from a previous page."
        ) from None


def keyset_page(session, query: Select, table: Any, limit: int, cursor: str | None) -> tuple[list[Any], str | None]:
    """One page of ``query`` (a select of ``table``, which has ``created_at`` and ``id``), newest first."""
    if cursor:
        created, row_id = decode_cursor(cursor)
        query = query.where(or_(table.created_at < created, and_(table.created_at == created, table.id < row_id)))
    rows = list(session.execute(query.order_by(table.created_at.desc(), table.id.desc()).limit(limit + 1)).scalars())
    next_cursor = encode_cursor(rows[limit - 1].created_at, rows[limit - 1].id) if len(rows) > limit else None
    return rows[:limit], next_cursor

"""Ids: how they are made and how they are shown short (stdlib only, so the CLI can import it without SQLAlchemy)."""

from __future__ import annotations

import os
import threading
import time

SHORT_ID = 8
"""An id is shown by its LAST 8 characters where the width is short (the CLI at 80 columns, the dashboard, the demo's
file names); the CLI takes such a short id back. The last ones, because an id's first 12 characters are its clock."""


def new_id() -> str:
    """A time-ordered UUID (version 7, RFC 9562): 48 bits of Unix milliseconds, then 74 random bits, written as
    ``str(uuid.UUID)`` does. Random (version 4) primary keys put every insert on a random page of each id index, and
    after a checkpoint each such page's first change is a whole 8 KiB page in PostgreSQL's WAL; ids that grow with time
    fill the rightmost pages (issue 21, stop 36's lab: 7.1 -> 5.6 KB of WAL per intake request). The random bytes come
    from a per-thread pool drawn 4 KiB at a time from the OS (``os.urandom``, as ``uuid4`` does, one system call per
    256 ids instead of one per id); a forked child starts with an empty pool, so it never hands out the bytes its
    parent's pool still holds."""
    pool = _ID_POOL.__dict__
    if not pool.get("left"):
        pool["bytes"], pool["left"] = os.urandom(16 * 256), 256
    pool["left"] -= 1
    raw = bytearray(pool["bytes"][16 * pool["left"] : 16 * pool["left"] + 16])
    raw[0:6] = (time.time_ns() // 1_000_000).to_bytes(6, "big")
    raw[6] = (raw[6] & 0x0F) | 0x70  # version 7
    raw[8] = (raw[8] & 0x3F) | 0x80  # RFC 9562 variant
    text = raw.hex()
    return f"{text[:8]}-{text[8:12]}-{text[12:16]}-{text[16:20]}-{text[20:]}"


_ID_POOL = threading.local()
os.register_at_fork(after_in_child=lambda: _ID_POOL.__dict__.clear())


def short_id(value: str) -> str:
    """What a narrow table shows of an id: its last ``SHORT_ID`` characters (random in a version-7 id; its first
    ones are the clock's, alike for every id made within a minute)."""
    return value[-SHORT_ID:] if len(value) > SHORT_ID else value

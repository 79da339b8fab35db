"""What a table owner can do to the audit chain without the signing key: rewrite a span of events and re-link every
hash after it, so that each row's hash is right again (issue 22). Pure: the tests apply the rows with their driver."""

from __future__ import annotations

import hashlib
import json

from app.audit.service import canonical_json


def rewritten_rows(rows: list[tuple[int, str, str]], first: int, last: int) -> list[tuple[int, str, str, str, str]]:
    """``rows``: ``(seq, hash, canonical)`` of the whole chain in order. Returns ``(seq, prev_hash, hash, canonical,
    payload JSON)`` for every row from ``first`` on: the payload of ``first``..``last`` replaced, every later row
    re-linked, each hash recomputed as the service would."""
    prev, out = None, []
    for seq, hash_, canonical in rows:
        if seq < first:
            prev = hash_
            continue
        doc = json.loads(canonical)
        if seq <= last:
            doc["payload"] = {"rewritten": seq}
        body = canonical_json(doc)
        new_hash = hashlib.sha256((prev + body).encode()).hexdigest()
        out.append((seq, prev, new_hash, body, json.dumps(doc["payload"])))
        prev = new_hash
    return out

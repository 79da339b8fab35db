"""API keys with scopes. A key is ``lethe_<prefix>_<secret>``; only HMAC-SHA256(server secret, key) is stored."""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from dataclasses import dataclass

from fastapi import Depends, Request
from sqlalchemy import select
from sqlalchemy.orm import Session

from app.auth.tables import ApiKey
from app.config import get_settings
from app.db import get_sessionmaker
from app.problems import Problem

SCOPES = ("models:write", "requests:write", "requests:read", "audit:read", "admin")


@dataclass(frozen=True)
class Principal:
    key_id: str
    name: str
    scopes: frozenset[str]

    @property
    def actor(self) -> str:
        return f"api-key:{self.key_id}"


def hash_key(key: str) -> str:
    return hmac.new(get_settings().secret(), key.encode(), hashlib.sha256).hexdigest()


def create_key(session: Session, name: str, scopes: list[str]) -> tuple[ApiKey, str]:
    unknown = sorted(set(scopes) - set(SCOPES))
    if unknown or not scopes:
        raise ValueError(f"unknown scopes {unknown}; choose from {list(SCOPES)}")
    prefix = secrets.token_hex(4)
    key = f"lethe_{prefix}_{secrets.token_urlsafe(32)}"
    row = ApiKey(name=name, prefix=prefix, key_hash=hash_key(key), scopes=sorted(set(scopes)))
    session.add(row)
    session.flush()
    return row, key


class _KeyCache:
    """A few seconds of memory for key look-ups: intake is the hot path, a revocation takes effect within ``ttl``."""

    def __init__(self, ttl: float = 5.0):
        self.ttl = ttl
        self._entries: dict[str, tuple[float, Principal | None]] = {}
        self._lock = threading.Lock()

    def get(self, key_hash: str) -> tuple[bool, Principal | None]:
        with self._lock:
            entry = self._entries.get(key_hash)
        if entry and entry[0] > time.monotonic():
            return True, entry[1]
        return False, None

    def put(self, key_hash: str, principal: Principal | None) -> None:
        with self._lock:
            if len(self._entries) > 10_000:
                self._entries.clear()
            self._entries[key_hash] = (time.monotonic() + self.ttl, principal)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


key_cache = _KeyCache()


def _lookup(key_hash: str) -> Principal | None:
    hit, principal = key_cache.get(key_hash)
    if hit:
        return principal
    with get_sessionmaker()() as session:
        row = session.execute(
            select(ApiKey).where(ApiKey.key_hash == key_hash, ApiKey.revoked_at.is_(None))
        ).scalar_one_or_none()
        principal = Principal(row.id, row.name, frozenset(row.scopes)) if row else None
    key_cache.put(key_hash, principal)
    return principal


def _presented_key(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    if header.lower().startswith("bearer "):
        return header[7:].strip()
    return request.headers.get("x-api-key")


async def authenticate(request: Request) -> Principal:
    """Async on purpose: a cache hit is a dict look-up, not worth a thread hop; a miss blocks the loop for one
    indexed query, at most once per key per ``key_cache.ttl``."""
    key = _presented_key(request)
    if not key:
        problem = Problem(401, "unauthorized", "Missing API key", "Send `Authorization: Bearer <key>`.")
        problem.headers = {"WWW-Authenticate": 'Bearer realm="lethe"'}
        raise problem
    principal = _lookup(hash_key(key))
    if principal is None:
        problem = Problem(401, "unauthorized", "Unknown or revoked API key")
        problem.headers = {"WWW-Authenticate": 'Bearer realm="lethe", error="invalid_token"'}
        raise problem
    return principal


def require_scope(scope: str):
    """FastAPI dependency: the key must hold ``scope`` (or ``admin``)."""

    async def _check(principal: Principal = Depends(authenticate)) -> Principal:
        if scope not in principal.scopes and "admin" not in principal.scopes:
            raise Problem(
                403, "forbidden", "The API key lacks a scope", f"This needs the scope `{scope}`.", required_scope=scope
            )
        return principal

    return _check

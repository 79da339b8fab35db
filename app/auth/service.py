"""API keys with scopes. A key is ``lethe_<prefix>_<secret>``; only its HMAC (api-key purpose key) is stored.

A key may be bound to one model and one federated client (``lethe keys create --model ID --client-id c3``): it can
then touch that model only, and only with the scopes a federated client needs (``rounds:write``, ``models:read``).
Keys can expire (``expires_at``) and be revoked; both take effect on the next request: every request looks its key
up in the database (one indexed read, in a worker thread), there is no cache a revoked key could linger in.

Dashboard sessions (issue 22) live here too, next to the keys they stand for: a login makes a row holding the keyed
hash of a random token (the browser's cookie holds the token, never the key) and the key's id; each request looks the
row and its key up again, so logout (the row deleted), a revoked or expired key, an idle or too old session all end
it at once.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta

from fastapi import Depends, Request
from sqlalchemy import delete, or_, select
from sqlalchemy.orm import Session

from app.audit.service import append_event
from app.auth.tables import ApiKey, DashboardSession
from app.config import get_settings, hmac_hex
from app.db import get_sessionmaker, new_id, pipelined, session_scope, utcnow
from app.problems import Problem
from app.registry.tables import Model

SCOPES = (
    "models:write", "models:read", "rounds:write", "requests:write", "requests:read", "audit:read", "metrics:read",
    "admin",
)  # fmt: skip
"""``admin`` implies every other scope. ``models:read``: download weights and forget locks; ``rounds:write``: upload
federated rounds; ``metrics:read``: scrape ``/metrics`` and read ``/readyz``'s details (a Prometheus key holds only
this one). README's "Scopes" table lists what each operation needs; tests/unit/test_route_matrix.py holds the same
table and checks every cell."""

BOUND_SCOPES = frozenset({"rounds:write", "models:read"})
"""The only scopes a key bound to a model (a federated client's key) may hold."""


@dataclass(frozen=True)
class Principal:
    key_id: str
    name: str
    scopes: frozenset[str]
    model_id: str | None = None
    client_id: str | None = None
    expires_at: datetime | None = None

    @property
    def actor(self) -> str:
        return f"api-key:{self.key_id}"

    def has(self, scope: str) -> bool:
        return scope in self.scopes or "admin" in self.scopes

    def may_see_model(self, model_id: str) -> bool:
        return self.model_id is None or self.model_id == model_id


def hash_key(key: str) -> str:
    return hmac_hex(get_settings().derived_key("api-key"), key)


_DURATION = re.compile(r"^\s*(\d+)\s*([smhdw])\s*$")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}


def parse_duration(text: str) -> timedelta:
    """``30d``, ``12h``, ``90m``, ``2w``, ``45s``."""
    match = _DURATION.match(text or "")
    if not match or int(match.group(1)) <= 0:
        raise ValueError(f"not a duration: {text!r} (say 30d, 12h, 90m, 2w or 45s)")
    return timedelta(**{_UNITS[match.group(2)]: int(match.group(1))})


def create_key(
    session: Session,
    name: str,
    scopes: list[str],
    *,
    model_id: str | None = None,
    client_id: str | None = None,
    expires_in: timedelta | None = None,
    actor: str = "operator (cli)",
) -> tuple[ApiKey, str]:
    """A new key (returned once; only its keyed hash is stored), recorded in the audit log (issue 22: key creation
    and revocation were not audited): its name, prefix, scopes, binding and expiry, never the key."""
    unknown = sorted(set(scopes) - set(SCOPES))
    if unknown or not scopes:
        raise ValueError(f"unknown scopes {unknown}; choose from {list(SCOPES)}")
    if client_id is not None and model_id is None:
        raise ValueError("--client-id needs --model: a client key is bound to one model")
    if model_id is not None:
        extra = sorted(set(scopes) - BOUND_SCOPES)
        if extra:
            raise ValueError(f"a key bound to a model may hold only {sorted(BOUND_SCOPES)}, not {extra}")
        model = session.get(Model, model_id)
        if model is None:
            raise ValueError(f"no model {model_id}")
        clients = (model.state or {}).get("clients")
        if client_id is not None and clients is not None and client_id not in clients:
            raise ValueError(f"model {model_id} has no client {client_id!r}; clients: {clients}")
    if expires_in is not None and expires_in <= timedelta(0):
        raise ValueError("the expiry must lie in the future")
    prefix = secrets.token_hex(4)
    key = f"lethe_{prefix}_{secrets.token_urlsafe(32)}"
    row = ApiKey(
        name=name,
        prefix=prefix,
        key_hash=hash_key(key),
        scopes=sorted(set(scopes)),
        model_id=model_id,
        client_id=client_id,
        expires_at=utcnow() + expires_in if expires_in is not None else None,
    )
    session.add(row)
    session.flush()
    _audit(session, actor, "api_key.created", row)
    return row, key


def _audit(session: Session, actor: str, action: str, row: ApiKey) -> None:
    expires = row.expires_at.isoformat() if row.expires_at else None
    payload = {"name": row.name, "prefix": row.prefix, "scopes": list(row.scopes), "model_id": row.model_id,
               "client_id": row.client_id, "expires_at": expires}  # fmt: skip
    append_event(session, actor=actor, action=action, entity_type="api_key", entity_id=row.id, payload=payload)


def list_keys(session: Session) -> list[ApiKey]:
    return list(session.execute(select(ApiKey).order_by(ApiKey.created_at)).scalars())


def find_key(session: Session, key_id: str) -> ApiKey | None:
    """A key by its id or by its prefix (the ``<prefix>`` of ``lethe_<prefix>_...``, shown by ``lethe keys list``)."""
    row = session.get(ApiKey, key_id)
    if row is None:
        row = session.execute(select(ApiKey).where(ApiKey.prefix == key_id)).scalar_one_or_none()
    return row


def revoke_key(session: Session, key_id: str, actor: str = "operator (cli)") -> ApiKey:
    """Revoke by id (or by the key's prefix); refused on the key's next request in every API process; audited."""
    row = find_key(session, key_id)
    if row is None:
        raise ValueError(f"no API key {key_id!r}")
    if row.revoked_at is None:
        row.revoked_at = utcnow()
        _audit(session, actor, "api_key.revoked", row)
    session.execute(delete(DashboardSession).where(DashboardSession.key_id == row.id))  # its dashboard logins end
    return row


def lookup_key(key_hash: str) -> Principal | None:
    """The live principal of a key hash, or None (one indexed read)."""
    with get_sessionmaker()() as session:
        row = session.execute(
            select(ApiKey).where(ApiKey.key_hash == key_hash, ApiKey.revoked_at.is_(None))
        ).scalar_one_or_none()
        if row is None or (row.expires_at is not None and row.expires_at <= utcnow()):
            return None
        return _principal(row)


def principal_for_key(key: str) -> Principal | None:
    """The live principal of a presented key, or None (unknown, revoked, expired): for callers that do not take the
    key from an ``Authorization`` header (the dashboard's login form). Looked up on every call, like
    ``authenticate``."""
    return lookup_key(hash_key(key)) if key else None


SESSION_TOUCH_SECONDS = 30
"""``last_seen_at`` is written at most this often per session: the dashboard polls every second, and an idle timeout
counted in minutes needs no finer clock than this."""


def _token_hash(token: str) -> str:
    return hmac.new(get_settings().derived_key("dashboard-session"), token.encode(), hashlib.sha256).hexdigest()


def open_dashboard_session(principal: Principal) -> str:
    """A new dashboard session for the principal's key; returns its token (for the cookie, and nowhere else: only its
    keyed hash is stored). Sessions that have ended meanwhile are swept away here. Audited (``dashboard.login``, the
    session's id; issue 22) in the same transaction: who could act through the dashboard, and from when."""
    settings = get_settings()
    now = utcnow()
    token = secrets.token_urlsafe(32)
    idle = timedelta(seconds=settings.dashboard_session_idle_seconds)
    with session_scope() as session:
        session.execute(
            delete(DashboardSession).where(
                or_(DashboardSession.expires_at <= now, DashboardSession.last_seen_at <= now - idle)
            )
        )
        row = DashboardSession(
            id=new_id(),
            token_hash=_token_hash(token),
            key_id=principal.key_id,
            created_at=now,
            last_seen_at=now,
            expires_at=now + timedelta(seconds=settings.dashboard_session_max_seconds),
        )
        session.add(row)
        append_event(
            session, actor=principal.actor, action="dashboard.login", entity_type="dashboard_session",
            entity_id=row.id, payload={"key_id": principal.key_id, "expires_at": row.expires_at.isoformat()},
        )  # fmt: skip
    return token


def dashboard_principal(token: str) -> Principal | None:
    """The live principal of a dashboard session token, or None: no such session (never made, or ended at logout or
    by revoking its key), idle too long, past its absolute end, or its key revoked or expired. A session found ended
    is deleted."""
    if not token:
        return None
    settings = get_settings()
    now = utcnow()
    with session_scope() as session:
        found = session.execute(
            select(DashboardSession, ApiKey)
            .join(ApiKey, ApiKey.id == DashboardSession.key_id)
            .where(DashboardSession.token_hash == _token_hash(token))
        ).one_or_none()
        if found is None:
            return None
        row, key = found
        idle_since = now - timedelta(seconds=settings.dashboard_session_idle_seconds)
        key_dead = key.revoked_at is not None or (key.expires_at is not None and key.expires_at <= now)
        if key_dead or row.expires_at <= now or row.last_seen_at <= idle_since:
            session.delete(row)
            return None
        if (now - row.last_seen_at).total_seconds() >= SESSION_TOUCH_SECONDS:
            row.last_seen_at = now
        return _principal(key)


def end_dashboard_session(token: str, reason: str = "logout") -> bool:
    """Logout: delete the session, so its cookie, replayed, opens nothing, and audit it (``dashboard.logout``, with
    ``reason``: ``logout``, or ``replaced`` by a new login in the same browser). True when there was one."""
    if not token:
        return False
    with session_scope() as session:
        row = session.execute(
            select(DashboardSession).where(DashboardSession.token_hash == _token_hash(token))
        ).scalar_one_or_none()
        if row is None:
            return False
        key = session.get(ApiKey, row.key_id)
        session.delete(row)
        append_event(
            session, actor=_principal(key).actor if key else "unknown", action="dashboard.logout",
            entity_type="dashboard_session", entity_id=row.id, payload={"key_id": row.key_id, "reason": reason},
        )  # fmt: skip
        return True


def _principal(row: ApiKey) -> Principal:
    return Principal(row.id, row.name, frozenset(row.scopes), row.model_id, row.client_id, row.expires_at)


LIVE_KEYS = (
    "SELECT key_hash, id, name, scopes, model_id, client_id, expires_at FROM api_keys "
    "WHERE key_hash = ANY(%s) AND revoked_at IS NULL"
)
"""The not-revoked keys among some hashes (psycopg placeholders), whose rows ``live_principals`` reads:
``principals_for`` (the intake batch reads the same columns within its one look-up, app/requests/intake.py)."""


def principals_for(session: Session, key_hashes: list[str]) -> dict[str, Principal]:
    """The live (not revoked, not expired) keys among ``key_hashes``, in one query: the intake batcher authenticates a
    whole batch at once, so a request costs no read of its own and a revoked key is still refused at once. On
    PostgreSQL straight through the driver (``pipelined``: the batch's hot path)."""
    if session.get_bind().dialect.name == "postgresql":
        (rows,) = pipelined(session, (LIVE_KEYS, (key_hashes,)))
    else:
        columns = (ApiKey.key_hash, ApiKey.id, ApiKey.name, ApiKey.scopes, ApiKey.model_id, ApiKey.client_id)
        query = select(*columns, ApiKey.expires_at).where(ApiKey.key_hash.in_(key_hashes), ApiKey.revoked_at.is_(None))
        rows = session.execute(query).all()
    return live_principals(rows)


def live_principals(rows) -> dict[str, Principal]:
    """Key hash → principal, from ``LIVE_KEYS``' rows, the expired ones left out."""
    now = utcnow()
    return {
        key_hash: Principal(key_id, name, frozenset(scopes), model_id, client_id, expires_at)
        for key_hash, key_id, name, scopes, model_id, client_id, expires_at in rows
        if expires_at is None or expires_at > now
    }


def unknown_key_problem() -> Problem:
    problem = Problem(401, "unauthorized", "Unknown, expired or revoked API key")
    problem.headers = {"WWW-Authenticate": 'Bearer realm="lethe", error="invalid_token"'}
    return problem


def scope_problem(principal: Principal, scope: str, *alternatives: str, model_id: str | None = None) -> Problem | None:
    """What ``require_scope`` refuses (403 lacking scope, 403/404 for a key bound to another model), or None."""
    accepted = (scope, *alternatives)
    if not any(principal.has(s) for s in accepted):
        needed = " or ".join(f"`{s}`" for s in accepted)
        return Problem(
            403, "forbidden", "The API key lacks a scope", f"This needs the scope {needed}.", required_scope=scope
        )
    if principal.model_id is not None:
        if model_id is None:
            return Problem(403, "forbidden", "The API key is bound to one model", "It can reach only that model.")
        if model_id != principal.model_id:
            return Problem(404, "model-not-found", "No such model", model_id)
    return None


def missing_key_problem() -> Problem:
    problem = Problem(401, "unauthorized", "Missing API key", "Send `Authorization: Bearer <key>`.")
    problem.headers = {"WWW-Authenticate": 'Bearer realm="lethe"'}
    return problem


def presented_key(request: Request) -> str:
    """The key a request presents, or 401 (no database read): for a route that authenticates later, in a batch
    (``batch_authenticated``); the key is looked up with the rest of its batch."""
    key = _presented_key(request)
    if not key:
        raise missing_key_problem()
    return key


def batch_authenticated(*scopes: str):
    """Marks a route whose key is checked later, with the rest of its batch, for one of ``scopes`` (deletion-request
    intake): before its body is read the API only requires a key to be presented (app/main.py), and /openapi.json
    documents the scopes. A marker, not a dependency: FastAPI's dependency resolution was a tenth of the intake's
    per-request time on the event loop (issue 21), and the route reads its two headers itself."""

    def mark(endpoint):
        endpoint.batch_scopes = scopes
        return endpoint

    return mark


def _presented_key(request: Request) -> str | None:
    return key_in(request.headers.get("authorization", ""), request.headers.get("x-api-key"))


def key_in(authorization: str, api_key: str | None) -> str | None:
    """The key a request presents: ``Authorization: Bearer <key>``, else ``X-API-Key``."""
    return authorization[7:].strip() if authorization.lower().startswith("bearer ") else api_key


CHECKED_PRINCIPAL = "lethe.principal"
"""The ASGI scope key under which BodyLimitMiddleware leaves the principal it looked up for this request."""


def optional_principal(request: Request) -> Principal | None:
    """The live principal of the presented key, or None (no key, or one unknown, expired or revoked): for public
    routes that say more to a caller with the right key (``/readyz``). A plain function: runs in the thread pool."""
    key = _presented_key(request)
    return lookup_key(hash_key(key)) if key else None


def authenticate(request: Request) -> Principal:
    """A plain function on purpose: FastAPI runs it in its thread pool, so the key's database read (every request:
    a revoked or expired key is refused at once) never blocks the event loop. A request whose body the API checked
    the key for before reading it (app/main.py) carries that principal in its scope: not read twice."""
    checked = request.scope.get(CHECKED_PRINCIPAL)
    if checked is not None:
        return checked
    key = _presented_key(request)
    if not key:
        raise missing_key_problem()
    principal = lookup_key(hash_key(key))
    if principal is None:
        raise unknown_key_problem()
    return principal


def require_scope(scope: str, *alternatives: str):
    """FastAPI dependency: the key must hold ``scope`` or one of ``alternatives`` (``admin`` holds them all).

    A key bound to a model reaches only routes about that model (a ``model_id`` path parameter): another model is
    404 (as if it did not exist), a route about no model 403.
    """

    async def _check(request: Request, principal: Principal = Depends(authenticate)) -> Principal:
        problem = scope_problem(principal, scope, *alternatives, model_id=request.path_params.get("model_id"))
        if problem is not None:
            raise problem
        return principal

    _check.scopes = (scope, *alternatives)  # read by app/openapi.py: the operation's documented security
    return _check

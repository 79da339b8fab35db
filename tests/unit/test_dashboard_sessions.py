"""Server-side dashboard sessions (issue 22): the cookie carries a random token, never the API key; logout, revoking
or expiry of the key, idleness and the absolute lifetime each end the session, and a replayed cookie opens nothing."""

from __future__ import annotations

import base64
import binascii
import re
import time
from datetime import timedelta

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select, update

from app.audit.tables import AuditEvent
from app.auth.service import create_key, revoke_key
from app.auth.tables import ApiKey, DashboardSession
from app.db import session_scope, utcnow
from app.main import create_app
from tests.helpers import configure, make_key

BASE = "https://testserver"
IDLE, MAX = 600, 3600


@pytest.fixture
def app(tmp_path):
    configure(tmp_path, dashboard_session_idle_seconds=str(IDLE), dashboard_session_max_seconds=str(MAX))
    return create_app(run_background=False)


def _csrf(page_html: str) -> str:
    return re.search(r'name="csrf" value="([^"]+)"', page_html).group(1)


def _login(client: TestClient, key: str) -> str:
    """Log in; returns the session cookie's value."""
    token = _csrf(client.get("/dashboard/login").text)
    answer = client.post("/dashboard/login", data={"api_key": key, "csrf": token}, follow_redirects=False)
    assert answer.status_code == 303 and answer.headers["location"] == "/dashboard/requests"
    return client.cookies["lethe_dashboard"]


def _refused(client: TestClient) -> None:
    """No page and no data for this client's cookie: the page sends it to the login form, the JSON poll is 401."""
    page = client.get("/dashboard/requests", follow_redirects=False)
    assert page.status_code == 401 and 'action="/dashboard/login"' in page.text
    assert 'action="/dashboard/logout"' not in page.text
    assert client.get("/dashboard/api/requests?ids=x").status_code == 401


def _alive(client: TestClient) -> None:
    page = client.get("/dashboard/requests", follow_redirects=False)
    assert page.status_code == 200 and 'action="/dashboard/logout"' in page.text


def _replay(app, cookie: str) -> TestClient:
    """A fresh browser (an attacker's) holding only a copied cookie."""
    return TestClient(app, base_url=BASE, headers={"cookie": f"lethe_dashboard={cookie}"})


def _decodings(text: str) -> list[bytes]:
    """Every base64/base64url reading of the value and of each of its dot-separated parts (an itsdangerous token is
    ``payload.timestamp.signature``)."""
    found = []
    for part in [text, *text.split(".")]:
        for decode in (base64.urlsafe_b64decode, base64.b64decode):
            for pad in range(4):
                try:
                    found.append(decode(part + "=" * pad))
                except (binascii.Error, ValueError):
                    continue
    return found


def test_the_cookie_carries_a_random_token_never_the_key_and_only_its_keyed_hash_is_stored(app):
    key = make_key(["requests:read"])
    secret = key.rsplit("_", 1)[1]
    with TestClient(app, base_url=BASE) as client:
        cookie = _login(client, key)
        first = client.cookies["lethe_dashboard"]
        assert len(cookie) >= 40  # 32 random bytes, base64url
        pieces = {secret[i : i + 8] for i in range(len(secret) - 7)}
        assert key not in cookie and not any(piece in cookie for piece in pieces)
        for decoded in _decodings(cookie):
            assert secret.encode() not in decoded and key.encode() not in decoded
        _alive(client)
        with session_scope() as session:
            row = session.execute(select(DashboardSession)).scalar_one()
            key_row = session.execute(select(ApiKey)).scalar_one()
            stored = " ".join(str(getattr(row, c.key)) for c in DashboardSession.__table__.columns)
        assert row.key_id == key_row.id and cookie not in stored and key not in stored and secret not in stored
        assert row.expires_at - row.created_at == timedelta(seconds=MAX)
        # a second login gets another token (never derived from the key)
        with TestClient(app, base_url=BASE) as other:
            assert _login(other, key) != first


def test_logout_deletes_the_session_so_a_replayed_cookie_is_refused(app):
    key = make_key(["requests:read"])
    with TestClient(app, base_url=BASE) as client:
        cookie = _login(client, key)
        with _replay(app, cookie) as thief:
            page = thief.get("/dashboard/requests", follow_redirects=False)  # a copied cookie works while logged in
            assert page.status_code == 200 and 'action="/dashboard/logout"' in page.text
        out = client.post("/dashboard/logout", data={"csrf": _csrf(client.get("/dashboard/requests").text)})
        assert out.status_code == 200 and 'action="/dashboard/login"' in out.text
        with _replay(app, cookie) as thief:
            _refused(thief)
        with session_scope() as session:
            assert session.execute(select(DashboardSession)).first() is None
        second = _login(client, key)
        _login(client, key)  # again in the same browser: the earlier session is replaced
        assert client.cookies["lethe_dashboard"] != second
    with session_scope() as session:  # issue 22: who could act through the dashboard, from when to when
        key_id = session.execute(select(ApiKey.id)).scalar_one()
        events = (
            session.execute(
                select(AuditEvent).where(AuditEvent.entity_type == "dashboard_session").order_by(AuditEvent.seq)
            )
            .scalars()
            .all()
        )
    assert [(e.action, e.payload.get("reason")) for e in events] == [
        ("dashboard.login", None), ("dashboard.logout", "logout"), ("dashboard.login", None),
        ("dashboard.logout", "replaced"), ("dashboard.login", None),
    ]  # fmt: skip
    assert {e.payload["key_id"] for e in events} == {key_id} and events[0].entity_id == events[1].entity_id
    assert all(cookie not in str(e.payload) for e in events)  # never the token


def test_revoking_the_key_ends_every_dashboard_session_of_it(app):
    key, other = make_key(["requests:read"], name="a"), make_key(["requests:read"], name="b")
    a1, a2, b = (TestClient(app, base_url=BASE) for _ in range(3))
    with a1, a2, b:
        _login(a1, key), _login(a2, key), _login(b, other)
        with session_scope() as session:
            key_id = session.execute(select(ApiKey.id).where(ApiKey.name == "a")).scalar_one()
            revoke_key(session, key_id)
        with session_scope() as session:  # the rows are gone, not only refused
            assert session.execute(select(DashboardSession).where(DashboardSession.key_id == key_id)).first() is None
        _refused(a1)
        _refused(a2)
        _alive(b)  # another key's session lives on


def test_a_revoked_or_expired_key_is_refused_even_while_its_session_row_exists(app):
    """The session is checked against its key on every request, not only deleted when the key is revoked."""
    key = make_key(["requests:read"], name="revoked")
    with session_scope() as session:
        short = create_key(session, "short", ["requests:read"], expires_in=timedelta(seconds=2))[1]
    with TestClient(app, base_url=BASE) as client, TestClient(app, base_url=BASE) as brief:
        _login(client, key)
        _login(brief, short)
        _alive(brief)
        with session_scope() as session:  # revoked_at set without revoke_key (an older process, a restore)
            session.execute(update(ApiKey).where(ApiKey.name == "revoked").values(revoked_at=utcnow()))
        _refused(client)
        time.sleep(2.1)
        _refused(brief)


def test_idle_and_absolute_timeouts_end_a_session_and_use_keeps_it_alive(app):
    key = make_key(["requests:read"])
    with TestClient(app, base_url=BASE) as idle, TestClient(app, base_url=BASE) as old:
        _login(idle, key)
        _login(old, key)
        with session_scope() as session:
            rows = list(session.execute(select(DashboardSession).order_by(DashboardSession.created_at)).scalars())
            idle_id, old_id = rows[0].id, rows[1].id
            # used 100 s short of the idle limit: the next request counts as use and moves last_seen_at
            recently = utcnow() - timedelta(seconds=IDLE - 100)
            session.execute(update(DashboardSession).filter_by(id=idle_id).values(last_seen_at=recently))
        _alive(idle)
        with session_scope() as session:
            assert session.get(DashboardSession, idle_id).last_seen_at > utcnow() - timedelta(seconds=10)
            unused = utcnow() - timedelta(seconds=IDLE + 1)
            session.execute(update(DashboardSession).filter_by(id=idle_id).values(last_seen_at=unused))
            past = utcnow() - timedelta(seconds=1)  # busy (just seen) but at its absolute end
            session.execute(update(DashboardSession).filter_by(id=old_id).values(expires_at=past))
        _refused(idle)
        _refused(old)
        with session_scope() as session:  # an ended session found is deleted
            assert session.execute(select(DashboardSession)).first() is None


def test_the_cookie_lasts_as_long_as_the_absolute_timeout_and_csrf_stays_bound(app):
    key = make_key(["admin", "requests:read"])
    with TestClient(app, base_url=BASE) as a, TestClient(app, base_url=BASE) as b:
        token = _csrf(a.get("/dashboard/login").text)
        answer = a.post("/dashboard/login", data={"api_key": key, "csrf": token}, follow_redirects=False)
        cookie = [c for c in answer.headers.get_list("set-cookie") if c.startswith("lethe_dashboard=")][0].lower()
        assert f"max-age={MAX}" in cookie and "httponly" in cookie and "samesite=strict" in cookie
        _login(b, key)
        token_a, token_b = _csrf(a.get("/dashboard/requests").text), _csrf(b.get("/dashboard/requests").text)
        target = "/dashboard/requests/no-such-request/cancel"
        assert a.post(target, data={"csrf": token_b}).status_code == 403  # the other session's token
        assert a.post(target, data={"csrf": token_a}).status_code == 404  # past the guards

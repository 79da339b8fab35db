"""The dashboard's session cookie and CSRF tokens (itsdangerous, keys derived from the master secret).

The session cookie holds a random session token and nothing else (issue 22: it used to carry the API key, signed but
readable, and logout ended nothing): the session lives server-side (``app.auth.service``: the token's keyed hash,
the key's id, idle and absolute timeouts), so logout and revoking the key end it for good, and a lifted cookie
yields no key. The cookie is HttpOnly (no script reads it), SameSite=Strict (no other site's page sends it) and
Secure (never sent over plain http; browsers treat http://127.0.0.1 and http://localhost as secure origins, so a
local dashboard and the browser tests work with it on). A browser drops a Secure cookie set over plain http from any
other host, so there every form would expire: ``LETHE_DASHBOARD_INSECURE_COOKIES=true`` (off by default) drops the
flag for an operator who serves the dashboard over plain http on a network they trust.

CSRF: every form carries a token signed with the ``dashboard-csrf`` key and bound to the session it was issued for
(a hash of the session cookie), so a token is useless in another session and cannot be forged without the secret.
The login form, which has no session yet, is bound to a random pre-session cookie instead (a signed double submit).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from fastapi import Request, Response
from itsdangerous import BadSignature, URLSafeTimedSerializer

from app.config import get_settings

SESSION_COOKIE = "lethe_dashboard"
LOGIN_COOKIE = "lethe_dashboard_login"
COOKIE_PATH = "/dashboard"
LOGIN_SECONDS = 3600


def _serializer(purpose: str, salt: str) -> URLSafeTimedSerializer:
    return URLSafeTimedSerializer(get_settings().derived_key(purpose), salt=salt)


def secure_cookies() -> bool:
    """Whether the cookies carry ``Secure``: always, unless the operator allowed plain http."""
    return not get_settings().dashboard_insecure_cookies


def _set_cookie(response: Response, name: str, value: str, max_age: int) -> None:
    response.set_cookie(
        name,
        value,
        max_age=max_age,
        path=COOKIE_PATH,
        secure=secure_cookies(),
        httponly=True,
        samesite="strict",
    )


def session_seconds() -> int:
    """The absolute lifetime of a session (the cookie's ``Max-Age`` and its CSRF tokens')."""
    return get_settings().dashboard_session_max_seconds


def start_session(response: Response, token: str) -> None:
    """Hand the browser the session token (made by ``app.auth.service.open_dashboard_session``)."""
    _set_cookie(response, SESSION_COOKIE, token, session_seconds())
    response.delete_cookie(LOGIN_COOKIE, path=COOKIE_PATH)


def end_session(response: Response) -> None:
    response.delete_cookie(SESSION_COOKIE, path=COOKIE_PATH, secure=secure_cookies(), httponly=True, samesite="strict")


def session_token(request: Request) -> str | None:
    """The session token the browser sent, or None; only the server-side session says whether it is still live."""
    return request.cookies.get(SESSION_COOKIE) or None


def _binding(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()[:32]


def csrf_token(request: Request) -> str:
    """A token for the forms of this session."""
    return _serializer("dashboard-csrf", "csrf").dumps(_binding(request.cookies.get(SESSION_COOKIE, "")))


def csrf_ok(request: Request, token: str | None) -> bool:
    session = request.cookies.get(SESSION_COOKIE)
    if not token or not session or not _same_origin(request):
        return False
    try:
        bound = _serializer("dashboard-csrf", "csrf").loads(token, max_age=session_seconds())
    except BadSignature:
        return False
    return isinstance(bound, str) and hmac.compare_digest(bound, _binding(session))


def login_token() -> tuple[str, str]:
    """A fresh (nonce, token) for the login form: the nonce goes in the pre-session cookie, the token in the form."""
    nonce = secrets.token_urlsafe(24)
    return nonce, _serializer("dashboard-csrf", "login").dumps(_binding(nonce))


def set_login_cookie(response: Response, nonce: str) -> None:
    _set_cookie(response, LOGIN_COOKIE, nonce, LOGIN_SECONDS)


def login_token_ok(request: Request, token: str | None) -> bool:
    nonce = request.cookies.get(LOGIN_COOKIE)
    if not token or not nonce or not _same_origin(request):
        return False
    try:
        bound = _serializer("dashboard-csrf", "login").loads(token, max_age=LOGIN_SECONDS)
    except BadSignature:
        return False
    return isinstance(bound, str) and hmac.compare_digest(bound, _binding(nonce))


def plain_http_hint(request: Request) -> str | None:
    """Why a login form "expired" when the browser sent no login cookie back over plain http from a host that is not
    loopback: it dropped the Secure cookie (None when the cookies are not Secure, or the page came another way)."""
    if request.cookies.get(LOGIN_COOKIE) or not secure_cookies() or request.url.scheme != "http":
        return None
    host = (request.url.hostname or "").lower().rstrip(".")
    if host == "localhost" or host.endswith(".localhost") or host == "::1" or host.startswith("127."):
        return None
    return (
        "The form expired: your browser did not send its cookie back. Over plain http from a host other than "
        "localhost a browser drops the dashboard's Secure cookies: serve it over https, or set "
        "LETHE_DASHBOARD_INSECURE_COOKIES=true (on a network you trust)."
    )


def _same_origin(request: Request) -> bool:
    """A browser sends ``Origin`` with every POST; when it is there it must name this host (defence in depth)."""
    origin = request.headers.get("origin")
    if origin is None:
        return True
    host = request.headers.get("host", "")
    return origin.split("://", 1)[-1].rstrip("/") == host

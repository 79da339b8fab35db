"""The intake's fast path: ``POST /v1/deletion-requests`` answered without FastAPI's routing and request machinery.

At intake rates the framework, not the intake, was the API's main cost: the body-limit middleware, Starlette's
exception middleware, the router's matching of every route, FastAPI's request wrapping and Response plumbing took
about two thirds of the event loop's time per accepted request (bench/intake.py under py-spy, issue 21), against a
third for the route's own work (read two headers, parse and validate the body, hand it to the batcher, answer).

This ASGI middleware sits inside the metrics and request-id middlewares (every answer is still counted, carries its
``X-Request-ID`` and is logged as before) and takes only a request it can answer exactly as the full stack would:
the method and path of the intake, one ``Content-Type: application/json``, one presented key, one Idempotency-Key at
most, a declared or read body within ``max_body_bytes``, and a body the route's own checks accept (schema, key
length, method settings). Anything else, every refusal included, goes down the full stack with the body replayed
byte for byte, so each error is the one the route and ``BodyLimitMiddleware`` give (same status, same problem
document, same order of checks: key before body). What it answers itself: the 202, and the problems the batcher
sets (401/403 for a refused key, a request the registry refuses, 503), rendered by the same ``problem_response``.
"""

from __future__ import annotations

from pydantic import ValidationError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.auth.service import key_in
from app.config import get_settings
from app.openapi import _api_routes
from app.problems import Problem, problem_response
from app.requests.policy import check_request_settings
from app.requests.router import _bad_idempotency_key, accept, accepted_headers
from app.requests.schemas import DeletionRequestCreate

PATH = "/v1/deletion-requests"
_WANTED = frozenset({b"content-type", b"authorization", b"x-api-key", b"idempotency-key", b"content-length"})


class IntakeFastPath:
    def __init__(self, app: ASGIApp):
        self.app = app
        self.route = None  # the intake's APIRoute (the metrics' label), found on the first request

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] != PATH:
            await self.app(scope, receive, send)
            return
        settings = get_settings()
        taken = _taken(scope, settings.max_body_bytes)
        if taken is None:
            await self.app(scope, receive, send)
            return
        api_key, idempotency_key = taken
        messages: list[Message] = []
        body = await _read(receive, messages, settings.max_body_bytes)
        if body is None:  # past the limit, or the client left: the full stack answers from the same bytes
            await self.app(scope, _replay(messages, receive), send)
            return
        try:
            request = _parse(body, idempotency_key)
        except (Problem, ValidationError, ValueError):  # the route's own refusal, in the route's words
            await self.app(scope, _replay(messages, receive), send)
            return
        if self.route is None:
            self.route = _route(scope)
        scope["route"] = self.route  # the metrics' route label, as the router would have set it
        try:
            out = await accept(api_key, request, idempotency_key, scope.get("client"))
        except Problem as problem:  # refused by the batch (the key, the registry, the database) or timed out
            await problem_response(problem, PATH)(scope, receive, send)
            return
        payload = out.model_dump_json().encode()
        headers = [(b"content-length", str(len(payload)).encode()), (b"content-type", b"application/json")]
        headers += [(name.lower().encode(), value.encode()) for name, value in accepted_headers(out).items()]
        await send({"type": "http.response.start", "status": 202, "headers": headers})
        await send({"type": "http.response.body", "body": payload})


def _taken(scope: Scope, limit: int) -> tuple[str, str | None] | None:
    """(API key, Idempotency-Key) of a request the fast path can serve, or None: any header it reads twice, no key,
    a content type other than exactly JSON (the route's ``require_json``), a declared length past ``limit`` (or
    not a number), or a NUL in the query string."""
    query = scope.get("query_string") or b""
    if b"\x00" in query or b"%00" in query:
        return None
    seen: dict[bytes, bytes] = {}
    for name, value in scope["headers"]:
        if name in _WANTED:
            if name in seen:
                return None
            seen[name] = value
    if seen.get(b"content-type", b"").split(b";")[0].strip().lower() != b"application/json":
        return None
    key = key_in(seen.get(b"authorization", b"").decode("latin-1"), seen.get(b"x-api-key", b"").decode("latin-1"))
    if not key or (b"authorization" in seen and b"x-api-key" in seen):
        return None
    declared = seen.get(b"content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        return None
    idempotency_key = seen.get(b"idempotency-key")
    return key, None if idempotency_key is None else idempotency_key.decode("latin-1")


async def _read(receive: Receive, messages: list[Message], limit: int) -> bytes | None:
    """The whole body (each message kept in ``messages``), or None past ``limit`` bytes or on a disconnect."""
    size = 0
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            return None
        size += len(message.get("body", b""))
        if size > limit:
            return None
        if not message.get("more_body", False):
            return b"".join(m.get("body", b"") for m in messages)


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """A receive that gives back ``messages`` in order, then the client's own."""
    pending = list(messages)

    async def replay() -> Message:
        return pending.pop(0) if pending else await receive()

    return replay


def _parse(body: bytes, idempotency_key: str | None) -> DeletionRequestCreate:
    """The route's checks after the content type (app/requests/router.py ``_parse``): the Idempotency-Key, the
    schema, the method settings; any refusal raises."""
    problem = _bad_idempotency_key(idempotency_key)
    if problem is not None:
        raise problem
    request = DeletionRequestCreate.model_validate_json(body)
    check_request_settings(request.method, request.method_settings)
    return request


def _route(scope: Scope):
    """The intake's APIRoute in the app serving this request (the one the router would have matched)."""
    return _api_routes(scope["app"]).get(("post", PATH))

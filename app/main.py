"""create_app(): routers, problem+json handlers, body limits, and (optionally) the dispatcher in the lifespan."""

from __future__ import annotations

import gc
import logging
import re
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI
from fastapi.params import Form
from fastapi.routing import APIRoute
from sqlalchemy import text
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from app.apidocs import install as install_docs
from app.audit.router import router as audit_router
from app.certificates.router import router as certificates_router
from app.config import get_settings
from app.dashboard.router import router as dashboard_router
from app.db import get_engine
from app.jobs.router import router as jobs_router
from app.logs import RequestIdMiddleware, configure_logging
from app.openapi import install as install_openapi
from app.ops.http import HttpMetricsMiddleware
from app.ops.router import router as ops_router
from app.ops.schemas import HealthOut
from app.problems import Problem, install_problem_handlers, problem_response
from app.registry.router import router as registry_router
from app.reports.router import router as reports_router
from app.requests.fastpath import IntakeFastPath
from app.requests.intake import reset_batcher
from app.requests.router import add_body_schemas
from app.requests.router import router as requests_router
from app.subjects.router import router as subjects_router
from app.validation import load_json
from app.webhooks.router import router as webhooks_router

log = logging.getLogger("lethe")


_ROUNDS_PATH = re.compile(r"^/v1/models/[^/]+/rounds/?$")
_UPLOAD_PATH = re.compile(r"^/v1/models/?$")


class BodyLimitMiddleware:
    """The key first, then the body (issue 22): for every route that takes a body, the caller's key is checked for
    the route's scopes (401/403, and 404 for a key bound to another model) before any byte of the body is read or
    parsed — FastAPI parses a declared JSON body before it runs the route's dependencies, so a caller without a key
    was told 400 about its malformed JSON. Then oversized bodies get 413: JSON bodies a small limit, the data-set
    upload (``POST /v1/models``, multipart) a large one, federated rounds their own (``max_round_bytes``). A JSON
    body is parsed once here (:func:`app.validation.load_json`): malformed, not UTF-8 or nested deeper than the
    parser's limit is a 400 ``malformed-json`` (200k-deep JSON was a 500); a route that parses JSON refuses any other
    media type (415). Also refuses a NUL anywhere in the path or query string (422): no identifier holds one, and
    PostgreSQL cannot store or compare it."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        query = scope.get("query_string") or b""
        if "\x00" in path or b"\x00" in query or b"%00" in query:
            problem = Problem(
                422,
                "validation-error",
                "The request is not valid",
                "A NUL character is not allowed in the path or query string.",
                errors=[{"location": ["path"], "message": "NUL character", "type": "nul_character"}],
            )
            await problem_response(problem, Request(scope).url.path.replace("\x00", "")[:200])(scope, receive, send)
            return
        settings = get_settings()
        headers = dict(scope.get("headers") or [])
        content_type = headers.get(b"content-type", b"").decode("latin-1").split(";")[0].strip().lower()
        guard = _guard(scope) if scope.get("method") in _BODY_METHODS else None
        if guard is not None:
            refusal = await _refusal(scope, headers, guard)
            if refusal is not None:
                await problem_response(refusal, Request(scope).url.path)(scope, receive, send)
                return
        post = guard is not None and scope.get("method") == "POST"  # a large limit only once the key was checked
        large = True
        if post and _ROUNDS_PATH.match(path):
            limit = settings.max_round_bytes
        elif post and _UPLOAD_PATH.match(path) and content_type.startswith("multipart/"):
            limit = settings.max_upload_bytes
        else:
            large, limit = False, settings.max_body_bytes
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await self._reject(scope, receive, send, limit)
            return
        json_type = content_type == "application/json" or content_type.endswith("+json")
        if guard is not None and guard.scopes and not large and (guard.json_body or json_type):
            body = await _read_body(receive, limit)
            if body is None:
                await self._reject(scope, receive, send, limit)
                return
            problem = None
            if body and not json_type and guard.json_body:
                problem = Problem(415, "unsupported-media-type", "Unsupported media type", "Send application/json.")
            elif body and json_type:
                try:
                    load_json(body)
                except Problem as refused:
                    problem = refused
            if problem is not None:
                await problem_response(problem, Request(scope).url.path)(scope, receive, send)
                return
            await self.app(scope, _replay(body, receive), send)
            return
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise _TooLarge()
            return message

        try:
            await self.app(scope, limited_receive, send)
        except _TooLarge:
            await self._reject(scope, receive, send, limit)

    @staticmethod
    async def _reject(scope, receive, send, limit: int) -> None:
        problem = Problem(
            413, "payload-too-large", "Request body too large", f"The limit is {limit} bytes.", limit_bytes=limit
        )
        response = problem_response(problem, Request(scope).url.path)
        await response(scope, receive, send)


class _TooLarge(Exception):
    pass


_BODY_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})


@dataclass(frozen=True)
class _Guard:
    """What a body-taking route needs before its body is read: ``scopes`` (any one; from ``require_scope``), or
    only a presented key (``key_only``: intake authenticates in a batch), and whether FastAPI parses it as JSON."""

    scopes: tuple[str, ...]
    key_only: bool
    json_body: bool
    model_id: str | None = None


def _guard(scope: Scope) -> _Guard | None:
    """The guard of the API route this request goes to (path and method), or None (public, dashboard, unknown).
    The table is built once per app, from the routes' own dependencies (as /openapi.json's security is): a route
    without path parameters is found by one dict look-up (the intake's, on every request), the others by their
    regular expressions."""
    app = scope.get("app")
    if app is None:
        return None
    table = getattr(app.state, "body_guards", None)
    if table is None:
        table = app.state.body_guards = _guards(app)
    fixed, parametrised = table
    method, path = scope.get("method"), scope.get("path", "")
    hit = fixed.get((method, path))
    if hit is not None:
        scope["route"] = hit[0]  # the metrics' route label, also for an answer given here, before the router
        return hit[1]
    for route, guard in parametrised:
        match = route.path_regex.match(path)
        if match and method in route.methods:
            scope["route"] = route
            return _Guard(guard.scopes, guard.key_only, guard.json_body, match.groupdict().get("model_id"))
    return None


def _guards(app: FastAPI) -> tuple[dict[tuple[str, str], tuple[APIRoute, _Guard]], list[tuple[APIRoute, _Guard]]]:
    """(method, path) → (route, guard) for the routes without path parameters; (route, guard) for the others, in
    the router's order."""
    from app.openapi import _api_routes, _dependency_calls

    fixed: dict[tuple[str, str], tuple[APIRoute, _Guard]] = {}
    parametrised: list[tuple[APIRoute, _Guard]] = []
    seen: set[int] = set()
    for route in _api_routes(app).values():
        if id(route) in seen:
            continue
        seen.add(id(route))
        calls = _dependency_calls(route.dependant)
        scopes = next((tuple(c.scopes) for c in calls if getattr(c, "scopes", None)), ())
        if scopes or getattr(route.endpoint, "batch_scopes", None):
            json_body = bool(route.dependant.body_params) and not isinstance(route.body_field.field_info, Form)
            guard = _Guard(scopes, not scopes, json_body)
            if route.param_convertors:
                parametrised.append((route, guard))
            else:
                for method in route.methods:
                    fixed.setdefault((method, route.path_format), (route, guard))
    return fixed, parametrised


async def _refusal(scope: Scope, headers: dict[bytes, bytes], guard: _Guard) -> Problem | None:
    """401/403/404 for a caller the route would refuse (one indexed read, in the thread pool), before its body is
    read: the route itself refuses it too, but only after FastAPI has read and parsed the body. A ``key_only`` route
    (intake) checks the key with its batch: here only that one is presented. The principal found is left in the
    scope for the route's own dependency (one read per request, not two)."""
    from starlette.concurrency import run_in_threadpool

    from app.auth.service import (
        CHECKED_PRINCIPAL,
        hash_key,
        key_in,
        lookup_key,
        missing_key_problem,
        scope_problem,
        unknown_key_problem,
    )

    key = key_in(headers.get(b"authorization", b"").decode("latin-1"), headers.get(b"x-api-key", b"").decode())
    if not key:
        return missing_key_problem()
    if guard.key_only:
        return None
    principal = await run_in_threadpool(lookup_key, hash_key(key))
    if principal is None:
        return unknown_key_problem()
    scope[CHECKED_PRINCIPAL] = principal
    return scope_problem(principal, *guard.scopes, model_id=guard.model_id)


async def _read_body(receive: Receive, limit: int) -> bytes | None:
    """The whole body, or None past ``limit`` bytes (only JSON-sized bodies are read this way)."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(chunks)
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # after the body: the disconnect, when it comes

    return replay


def create_app(run_background: bool | None = None) -> FastAPI:
    settings = get_settings()
    background = settings.run_dispatcher if run_background is None else run_background
    configure_logging(settings.log_level, json_lines=settings.log_json)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        handles = None
        if background:
            from app.jobs.dispatcher import start_background

            handles = start_background(settings)
            app.state.executor = handles[1]
        # what the process holds once started (modules, routes, schemas, ~190,000 objects) lives as long as it:
        # frozen, it is never scanned again. A full collection otherwise walked all of it, ~70 ms with the GIL
        # held, and stalled every request in flight in the process (issue 21: the intake's p99 tail)
        gc.collect()
        gc.freeze()
        yield
        gc.unfreeze()  # a process that starts several apps (the tests) lets the cycles of this one be collected
        reset_batcher()
        if handles:
            dispatcher, executor = handles
            dispatcher.stop()
            if executor:
                executor.stop()

    app = FastAPI(
        title="Lethe",
        version="0.1.0",
        description="Unlearning as a service: deletion requests, unlearning jobs, audit log.",
        lifespan=lifespan,
        docs_url=None,  # FastAPI's pages load from a CDN: app/apidocs.py serves them from installed assets
        redoc_url=None,
        telemetry=None if settings.opentelemetry else {"tracing": False, "metrics": False, "logs": False},
    )
    install_problem_handlers(app)
    app.add_middleware(BodyLimitMiddleware)
    app.add_middleware(IntakeFastPath)  # POST /v1/deletion-requests without the framework; refusals go down the stack
    app.add_middleware(RequestIdMiddleware)  # even a 413 or a 500 carries its request id
    app.add_middleware(HttpMetricsMiddleware)  # outermost: counts every answer, with the route the router matched
    app.include_router(registry_router)
    app.include_router(requests_router)
    app.include_router(subjects_router)
    app.include_router(audit_router)
    app.include_router(jobs_router)
    app.include_router(reports_router)
    app.include_router(certificates_router)
    app.include_router(webhooks_router)
    app.include_router(ops_router)
    app.include_router(dashboard_router)
    install_docs(app)  # /docs and /redoc, their assets served by the app itself
    install_openapi(app)  # bearer scheme, problem+json answers and request examples in /openapi.json

    default_openapi = app.openapi
    app.openapi = lambda: add_body_schemas(default_openapi())

    @app.get("/healthz", tags=["health"], response_model=HealthOut)
    def healthz():
        with get_engine().connect() as connection:
            connection.execute(text("SELECT 1"))
        return {"status": "ok", "executor": "in-process" if settings.embedded_executor else "celery"}

    return app

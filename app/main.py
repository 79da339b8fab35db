"""create_app(): routers, problem+json handlers, body limits, and (optionally) the dispatcher in the lifespan."""

from __future__ import annotations

import logging
import re
from contextlib import asynccontextmanager

from fastapi import FastAPI
from sqlalchemy import text
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
from app.requests.intake import reset_batcher
from app.requests.router import add_body_schemas
from app.requests.router import router as requests_router
from app.subjects.router import router as subjects_router
from app.webhooks.router import router as webhooks_router

log = logging.getLogger("lethe")


_ROUNDS_PATH = re.compile(r"^/v1/models/[^/]+/rounds/?$")
_UPLOAD_PATH = re.compile(r"^/v1/models/?$")
_LARGE_BODY_SCOPES = {"upload": ("models:write",), "rounds": ("rounds:write",)}


class BodyLimitMiddleware:
    """Refuse oversized bodies with 413 before they are read: JSON bodies get a small limit, the data-set upload route
    (``POST /v1/models``, multipart) a large one, federated rounds their own (``max_round_bytes``: a LoRA round is
    several MB). The two large limits are granted only after the caller's key is checked for the route's scope, before
    any byte of the body is read (issue 22: any multipart body used to get 512 MB before authentication — 300 MB of
    zeros with no key took the API from 187 to 769 MB). Also refuses a NUL anywhere in the path or query string
    (422): no identifier holds one, and PostgreSQL cannot store or compare it."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        query = scope.get("query_string") or b""
        if "\x00" in scope.get("path", "") or b"\x00" in query or b"%00" in query:
            from starlette.requests import Request

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
        content_type = headers.get(b"content-type", b"").decode("latin-1").lower()
        post, path = scope.get("method") == "POST", scope.get("path", "")
        if post and _ROUNDS_PATH.match(path):
            route, limit = "rounds", settings.max_round_bytes
        elif post and _UPLOAD_PATH.match(path) and content_type.startswith("multipart/"):
            route, limit = "upload", settings.max_upload_bytes
        else:
            route, limit = None, settings.max_body_bytes
        if route is not None:
            refusal = await _large_body_refusal(headers, _LARGE_BODY_SCOPES[route])
            if refusal is not None:
                from starlette.requests import Request

                await problem_response(refusal, Request(scope).url.path)(scope, receive, send)
                return
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await self._reject(scope, receive, send, limit)
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
        from starlette.requests import Request

        problem = Problem(
            413, "payload-too-large", "Request body too large", f"The limit is {limit} bytes.", limit_bytes=limit
        )
        response = problem_response(problem, Request(scope).url.path)
        await response(scope, receive, send)


class _TooLarge(Exception):
    pass


async def _large_body_refusal(headers: dict[bytes, bytes], scopes: tuple[str, ...]) -> Problem | None:
    """401/403 for a caller whose key may not send this route's large body (one indexed read, in the thread pool):
    the route would refuse it anyway, but only after reading the body."""
    from starlette.concurrency import run_in_threadpool

    from app.auth.service import hash_key, lookup_key, scope_problem, unknown_key_problem

    header = headers.get(b"authorization", b"").decode("latin-1")
    key = header[7:].strip() if header.lower().startswith("bearer ") else headers.get(b"x-api-key", b"").decode()
    if not key:
        problem = Problem(401, "unauthorized", "Missing API key", "Send `Authorization: Bearer <key>`.")
        problem.headers = {"WWW-Authenticate": 'Bearer realm="lethe"'}
        return problem
    principal = await run_in_threadpool(lookup_key, hash_key(key))
    if principal is None:
        return unknown_key_problem()
    return scope_problem(principal, *scopes, model_id=principal.model_id)


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
        yield
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
    )
    install_problem_handlers(app)
    app.add_middleware(BodyLimitMiddleware)
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

"""RFC 9457 problem details: every error the API returns is ``application/problem+json`` with a stable ``type``.

``type`` is a URI under ``https://lethe.dev/problems/`` naming the kind of problem; clients switch on it, never on
``detail``. Unhandled exceptions become a generic 500 problem without a stack trace (the trace goes to the log).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import SQLAlchemyError
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.config import get_settings
from app.db import is_unavailable

PROBLEM_BASE = "https://lethe.dev/problems/"
PROBLEM_MEDIA_TYPE = "application/problem+json"
log = logging.getLogger("lethe.problems")


class Problem(Exception):
    """Raise anywhere in a request to answer with a problem document."""

    def __init__(self, status: int, slug: str, title: str, detail: str | None = None, **extensions: Any):
        super().__init__(detail or title)
        self.status = status
        self.slug = slug
        self.title = title
        self.detail = detail
        self.extensions = extensions
        self.headers: dict[str, str] = {}

    def to_dict(self, instance: str | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"type": PROBLEM_BASE + self.slug, "title": self.title, "status": self.status}
        if self.detail:
            body["detail"] = self.detail
        if instance:
            body["instance"] = instance
        body.update(self.extensions)
        return body


def problem_response(problem: Problem, instance: str | None = None) -> JSONResponse:
    return JSONResponse(
        problem.to_dict(instance), status_code=problem.status, media_type=PROBLEM_MEDIA_TYPE, headers=problem.headers
    )


_STATUS_SLUGS = {
    400: ("bad-request", "Bad request"),
    401: ("unauthorized", "Missing or unknown API key"),
    403: ("forbidden", "The API key lacks the scope this needs"),
    404: ("not-found", "Not found"),
    405: ("method-not-allowed", "Method not allowed"),
    406: ("not-acceptable", "Not acceptable"),
    409: ("conflict", "Conflict"),
    413: ("payload-too-large", "Request body too large"),
    415: ("unsupported-media-type", "Unsupported media type"),
    422: ("validation-error", "The request is not valid"),
}
GENERIC_SLUGS = frozenset({slug for slug, _ in _STATUS_SLUGS.values()} | {"http-error"})
"""The ``type`` slugs of the answers no route raises itself (an unknown path, a wrong method...)."""


def database_unavailable() -> Problem:
    """503 for a request that met the database away (refused, timed out, lost, or the pool exhausted): nothing in it
    is wrong, so the client retries after Retry-After (issue 22: these were 500s)."""
    problem = Problem(
        503,
        "database-unavailable",
        "The service's database is unavailable",
        "The database did not answer in time; retry after Retry-After seconds (a POST with the same Idempotency-Key).",
    )
    problem.headers["Retry-After"] = str(get_settings().retry_after_seconds)
    return problem


def _unavailable(request: Request, exc: BaseException) -> JSONResponse:
    log.warning("database unavailable on %s %s: %s", request.method, request.url.path, type(exc).__name__)
    return problem_response(database_unavailable(), request.url.path)


def install_problem_handlers(app: FastAPI) -> None:
    @app.exception_handler(Problem)
    async def _problem(request: Request, exc: Problem):
        return problem_response(exc, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        errors = []
        malformed = False
        for error in exc.errors():
            if error.get("type") == "json_invalid":
                malformed = True
            errors.append(
                {
                    "location": [str(part) for part in error.get("loc", ())],
                    "message": error.get("msg", ""),
                    "type": error.get("type", ""),
                }
            )
        if malformed:
            problem = Problem(400, "malformed-json", "The body is not valid JSON", errors[0]["message"])
        else:
            problem = Problem(422, "validation-error", "The request is not valid", errors=errors)
        return problem_response(problem, request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        slug, title = _STATUS_SLUGS.get(exc.status_code, ("http-error", "HTTP error"))
        detail = exc.detail if isinstance(exc.detail, str) and exc.detail != title else None
        problem = Problem(exc.status_code, slug, title, detail)
        problem.headers = dict(exc.headers or {})
        return problem_response(problem, request.url.path)

    @app.exception_handler(SQLAlchemyError)
    async def _database(request: Request, exc: SQLAlchemyError):
        if is_unavailable(exc):
            return _unavailable(request, exc)
        return await _unhandled(request, exc)

    @app.exception_handler(Exception)
    async def _unhandled(request: Request, exc: Exception):
        if is_unavailable(exc):  # raised where only this handler sees it: a middleware's key look-up
            return _unavailable(request, exc)
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return problem_response(
            Problem(500, "internal-error", "Internal error", "The error was logged; no details are exposed."),
            request.url.path,
        )

"""Structured JSON logs (structlog) with a request id per HTTP request.

One JSON object per line. Every line written while an HTTP request is served carries its ``request_id`` (taken from
the caller's ``X-Request-ID`` when it is a sane token, generated otherwise, and sent back in the response header); a
worker's lines carry the ``job_id`` and ``deletion_request_id`` of the job it runs. The ids live in context variables
(``structlog.contextvars``): an asyncio task, and a thread-pool call made from it, sees its own request's id only.

Lines from the standard ``logging`` module (``logging.getLogger("lethe....")``, SQLAlchemy, Celery) go through the
same formatter, so they are JSON with the same ids. What is never logged: headers (the API key), query strings,
bodies, and SQL parameters (the engine is created with ``hide_parameters=True``).

Cost on the hot path: a successful request's access line is at DEBUG, a no-op at the default INFO
(``make_filtering_bound_logger``); writing one JSON line per request through ``logging`` costs about a fifth of the
API process's time at intake rates (bench/intake.py, profiled), so only 4xx/5xx answers are logged at INFO and above.
The request-id middleware is a pure ASGI middleware (a header scan, 128 random bits and a context variable).
"""

from __future__ import annotations

import logging
import random
import re
import sys
import time
from typing import IO, Any

import structlog
from starlette.types import ASGIApp, Message, Receive, Scope, Send

REQUEST_ID_HEADER = "X-Request-ID"
_SANE_REQUEST_ID = re.compile(rb"^[A-Za-z0-9][A-Za-z0-9._:@/+=-]{0,127}$")
"""An incoming id is kept when it is a plain token of at most 128 characters (no spaces, quotes or control
characters: it is copied into a response header and into every log line); anything else is replaced."""

_SHARED = [
    structlog.contextvars.merge_contextvars,
    structlog.processors.add_log_level,
    structlog.processors.TimeStamper(fmt="iso", utc=True),
]


def configure_logging(level: str | int = "INFO", stream: IO[str] | None = None, json_lines: bool = True) -> None:
    """Route structlog and the standard library's ``logging`` into one handler on the root logger that writes JSON
    lines (or, ``json_lines=False``, readable key=value lines for a terminal). Idempotent: a second call replaces the
    handler it installed before."""
    numeric = logging.getLevelName(level.upper()) if isinstance(level, str) else level
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}")
    renderer = structlog.processors.JSONRenderer() if json_lines else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            *_SHARED,
            structlog.stdlib.add_logger_name,
            structlog.processors.format_exc_info,
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        cache_logger_on_first_use=False,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*_SHARED, structlog.stdlib.add_logger_name, structlog.processors.format_exc_info],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
    )
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(formatter)
    handler.set_name("lethe-structlog")
    root = logging.getLogger()
    for old in [h for h in root.handlers if h.get_name() == "lethe-structlog"]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(numeric)
    # a line per outgoing call at INFO (the client's polls; the API logs its own); httpx2 is Starlette's TestClient's
    for chatty in ("httpx", "httpx2", "httpcore"):
        logging.getLogger(chatty).setLevel(max(numeric, logging.WARNING))


def get_logger(name: str) -> Any:
    return structlog.get_logger(name)


def request_id_from(headers: list[tuple[bytes, bytes]]) -> str:
    """The caller's ``X-Request-ID`` if it is a sane token, else a new one (32 hex digits)."""
    for name, value in headers:
        if name == b"x-request-id":
            if _SANE_REQUEST_ID.match(value):
                return value.decode("ascii")
            break
    # a correlation id, not a secret: 128 bits of the process's Mersenne Twister (reseeded in a forked child) cost
    # no system call; uuid4 read os.urandom per request, a syscall that released the GIL on the event loop's hot path
    return f"{random.getrandbits(128):032x}"


class RequestIdMiddleware:
    """Give every HTTP request an id: bound in the log context while it is served, returned in ``X-Request-ID``, and
    one access line (method, path without its query string, status, duration) when it is answered: at DEBUG for a
    success, INFO for a 4xx, WARNING for a 5xx, so that at INFO a busy intake writes no line per accepted request."""

    def __init__(self, app: ASGIApp):
        self.app = app
        self.log = structlog.get_logger("lethe.access").bind()  # built once, with the configuration of that moment

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = request_id_from(scope.get("headers") or [])
        header = (b"x-request-id", request_id.encode("ascii"))
        status = 500
        started = time.perf_counter()

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", []), header]
            await send(message)

        tokens = structlog.contextvars.bind_contextvars(request_id=request_id)
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            # a success is logged at DEBUG: nothing on the hot path at INFO (the intake benchmark measures this)
            level = "debug" if status < 400 else ("info" if status < 500 else "warning")
            getattr(self.log, level)(
                "request",
                method=scope.get("method"),
                path=scope.get("path", "")[:200],
                status=status,
                duration_ms=round((time.perf_counter() - started) * 1000, 2),
            )
            structlog.contextvars.reset_contextvars(**tokens)

"""HTTP request metrics (issue 23): a counter and a duration histogram per method, route template and status.

A pure ASGI middleware, outermost, so every answer is counted (a 413 refused before routing, a 500 included). The
route is the template the router matched (``/v1/models/{model_id}``, read from ``scope["route"]`` once the app has
answered), never the raw path: its cardinality is the app's routes. What matched no route (404s, and the few answers
given before routing: an oversized declared body, a NUL in the path) counts under ``UNMATCHED``; an unknown method
under ``other``. Per request: one dict lookup for the label set's children (cached, no lock of ours) and the
prometheus_client increments; no logging (the intake benchmark measures this path).
"""

from __future__ import annotations

import time

from prometheus_client import Counter, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

UNMATCHED = "unmatched"
"""The route label of a request no route matched."""
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
"""Methods labelled as themselves; any other token a client sends is ``other`` (bounded label values)."""
LATENCY_BUCKETS = (0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
"""Seconds: from the intake's few milliseconds to a large data-set upload."""

# registry=None: app/ops/metrics.py puts them on the exposed registry, or reads their files in multiprocess mode
HTTP_REQUESTS = Counter(
    "lethe_http_requests",
    "HTTP requests answered, by method, route template and status code.",
    ["method", "route", "status"],
    registry=None,
)
HTTP_DURATION = Histogram(
    "lethe_http_request_duration_seconds",
    "Time from a request's arrival at the app to the end of its answer, by method, route template and status code.",
    ["method", "route", "status"],
    buckets=LATENCY_BUCKETS,
    registry=None,
)

_children: dict[tuple[str, str, int], tuple] = {}
"""(method, route, status) → (counter child, histogram child): ``.labels()`` takes a lock and validates; this does
neither after the first request of a label set. Two threads filling the same key store the same children."""


def _observe(method: str, route: str, status: int, seconds: float) -> None:
    key = (method, route, status)
    children = _children.get(key)
    if children is None:
        label = str(status)
        children = _children[key] = (
            HTTP_REQUESTS.labels(method, route, label),
            HTTP_DURATION.labels(method, route, label),
        )
    children[0].inc()
    children[1].observe(seconds)


class HttpMetricsMiddleware:
    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # an exception that escapes before an answer started becomes a 500 (ServerErrorMiddleware)
        started = time.perf_counter()

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = scope.get("route")
            method = scope["method"]
            _observe(
                method if method in METHODS else "other",
                getattr(route, "path_format", None) or UNMATCHED,
                status,
                time.perf_counter() - started,
            )

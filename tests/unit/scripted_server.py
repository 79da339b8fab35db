"""A loopback HTTP server (127.0.0.1 only) whose answers a test scripts call by call, and which can go away and
come back on the same port: a restart, a 503 with Retry-After, a dropped connection, as a client sees them."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LOOPBACK = "127.0.0.1"
Answer = tuple[int, dict[str, str], bytes]


@dataclass
class Arrival:
    at: float  # time.monotonic()
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


def json_answer(status: int, body: object, **headers: str) -> Answer:
    content_type = "application/problem+json" if status >= 400 else "application/json"
    return status, {"content-type": content_type, **headers}, json.dumps(body).encode()


def problem(status: int, slug: str, **headers: str) -> Answer:
    body = {"type": f"https://lethe.dev/problems/{slug}", "title": slug, "status": status, "detail": slug}
    return json_answer(status, body, **headers)


@dataclass
class ScriptedServer:
    """``answer(arrival, index)`` gives each call's (status, headers, body); every call is kept in ``arrivals``."""

    answer: Callable[[Arrival, int], Answer]
    port: int = 0
    arrivals: list[Arrival] = field(default_factory=list)
    _server: ThreadingHTTPServer | None = None
    _thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def start(self) -> ScriptedServer:
        state = self

        class Handler(BaseHTTPRequestHandler):  # HTTP/1.0: one call per connection, so a stopped server is gone
            def _serve(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length) if length else b""
                headers = {k.lower(): v for k, v in self.headers.items()}
                arrival = Arrival(time.monotonic(), self.command, self.path, headers, body)
                state.arrivals.append(arrival)
                status, extra, content = state.answer(arrival, len(state.arrivals) - 1)
                self.send_response(status)
                for name, value in extra.items():
                    self.send_header(name, value)
                self.send_header("content-length", str(len(content)))
                self.end_headers()
                self.wfile.write(content)

            do_GET = do_POST = do_PATCH = _serve

            def log_message(self, *args) -> None:
                pass

        self._server = ThreadingHTTPServer((LOOPBACK, self.port), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Close the listening socket: a client now gets "connection refused" on this port."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(timeout=5)
            self._server = None

    def __enter__(self) -> ScriptedServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

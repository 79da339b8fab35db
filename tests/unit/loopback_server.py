"""A tiny HTTP server on 127.0.0.1 for tests that need a real socket (tests talk only to loopback)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LOOPBACK = "127.0.0.1"


@dataclass
class Received:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class LoopbackServer:
    port: int
    routes: dict[str, tuple[int, dict[str, str], bytes]]
    received: list[Received] = field(default_factory=list)

    def url(self, path: str = "/") -> str:
        return f"http://{LOOPBACK}:{self.port}{path}"


@contextmanager
def loopback_server(routes: dict[str, tuple[int, dict[str, str], bytes]]) -> Iterator[LoopbackServer]:
    """Serve ``routes`` ({path: (status, headers, body)}) on 127.0.0.1; record every request."""
    state = LoopbackServer(0, routes)

    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            length = int(self.headers.get("content-length") or 0)
            body = self.rfile.read(length) if length else b""
            headers = {name.lower(): value for name, value in self.headers.items()}
            state.received.append(Received(self.command, self.path, headers, body))
            status, headers, content = state.routes.get(self.path, (404, {}, b"not found"))
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("content-length", str(len(content)))
            self.end_headers()
            self.wfile.write(content)

        do_GET = do_POST = _answer

        def log_message(self, *args) -> None:  # keep test output quiet
            pass

    server = ThreadingHTTPServer((LOOPBACK, 0), Handler)
    state.port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)

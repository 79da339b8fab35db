"""Several API processes on one port, each listening on its own socket (``lethe serve --workers N``).

uvicorn's own supervisor hands every worker the same listening socket. Whichever worker wakes first accepts every
connection waiting (the event loop drains the backlog), so a client that opens its connection pool at once can land on
one worker while the others idle: ``bench/intake.py``'s 32 wrk connections all went to one of two workers in about one
run in five, and the intake then ran on one serial chain at ~0.15 of the trivial endpoint instead of ~0.25 (issue 21).
Here each worker binds its own ``SO_REUSEPORT`` socket, and the kernel spreads new connections over the listening
sockets by their address hash, whoever is awake. The parent keeps the port bound (not listening) so that the port is
held between worker restarts; Linux admits to a ``SO_REUSEPORT`` group only sockets of the same user.

The supervision is uvicorn's in small: a worker that dies is started again; one that fails while starting (the app does
not import, the port is taken) stops them all; SIGINT/SIGTERM stop the workers gracefully. Where the platform has no
``SO_REUSEPORT`` spreading connections (anything but Linux: Windows has no such option, and on BSD and macOS the
last socket bound takes every connection), uvicorn's supervisor runs instead.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import signal
import socket
import sys
import threading
from typing import Any

from uvicorn.config import STARTUP_FAILURE  # uvicorn's exit status for a server that could not start

log = logging.getLogger("lethe.serving")

_BALANCED = sys.platform.startswith("linux") and hasattr(socket, "SO_REUSEPORT")
"""Linux spreads connections over a SO_REUSEPORT group; BSD and macOS give them all to one socket of it."""


def serve(app: str, host: str, port: int, workers: int = 1, **options: Any) -> int:
    """Run ``app`` (an import string) with uvicorn on ``host``:``port``; ``options`` are ``uvicorn.Config``'s.
    Returns the exit status (0: stopped by a signal)."""
    import uvicorn

    if workers <= 1 or not _BALANCED:
        uvicorn.run(app, host=host, port=port, workers=workers, **options)
        return 0
    try:
        held = _reuseport_socket(host, port)  # bound, never listening: it takes no connection
    except OSError as exc:  # the port taken by a socket outside the group, or an address not of this host
        print(f"cannot listen on {host}:{port}: {exc}", file=sys.stderr)
        return STARTUP_FAILURE
    port = held.getsockname()[1]
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    context = multiprocessing.get_context("spawn")
    children: list[multiprocessing.process.BaseProcess] = []

    def start() -> multiprocessing.process.BaseProcess:
        child = context.Process(target=_worker, args=(app, host, port, options), daemon=False)
        child.start()
        return child

    status = 0
    try:
        children = [start() for _ in range(workers)]
        while not stop.wait(0.5):
            for index, child in enumerate(children):
                if child.is_alive():
                    continue
                if child.exitcode == STARTUP_FAILURE:  # it would fail the same way again
                    log.error("API worker %s failed to start (exit %s); stopping", child.pid, child.exitcode)
                    status = STARTUP_FAILURE
                    stop.set()
                    break
                log.warning("API worker %s died (exit %s); starting another", child.pid, child.exitcode)
                children[index] = start()
    finally:
        for child in children:
            if child.is_alive():
                child.terminate()  # SIGTERM: uvicorn finishes the requests in flight
        for child in children:
            child.join(timeout=options.get("timeout_graceful_shutdown") or 30)
            if child.is_alive():
                child.kill()
                child.join()
        held.close()
    return status


def _reuseport_socket(host: str, port: int) -> socket.socket:
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    if family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    sock.bind(address)
    return sock


def _worker(app: str, host: str, port: int, options: dict[str, Any]) -> None:
    """One API process: its own listening socket in the port's SO_REUSEPORT group, then uvicorn's server on it."""
    import uvicorn

    try:
        sock = _reuseport_socket(host, port)
    except OSError as exc:
        print(f"cannot listen on {host}:{port}: {exc}", file=sys.stderr)
        sys.exit(STARTUP_FAILURE)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, **options))
    try:
        server.run(sockets=[sock])
    except SystemExit:  # uvicorn exits 1 when the app does not import: not worth a restart
        if not server.started:
            sys.exit(STARTUP_FAILURE)
        raise
    if not server.started:
        sys.exit(STARTUP_FAILURE)


def main(argv: list[str] | None = None) -> int:
    """``python -m app.serving APP``: what ``lethe serve`` runs, for any ASGI app (bench/intake.py serves the API
    and its trivial ceiling alike)."""
    parser = argparse.ArgumentParser(prog="python -m app.serving")
    parser.add_argument("app")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)
    return serve(args.app, args.host, args.port, args.workers, log_level=args.log_level, access_log=False)


if __name__ == "__main__":
    raise SystemExit(main())

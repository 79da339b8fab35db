"""A real Lethe API on a loopback port for the dashboard's browser tests and ``scripts/screenshots.py``.

The embedded default (SQLite + the in-process executor) served by uvicorn in a thread of this process, so the test
can make keys and read the database directly. ``serve(background=False)`` restarts it without the executor (the
same database), so requests stay waiting: that is how a request is kept cancellable and how one stays overdue.
"""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path

import httpx
import uvicorn

from app.main import create_app
from tests.helpers import configure, make_key, wait_for, wait_model, write_table

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu"]
ADMIN_SCOPES = ["models:write", "requests:write", "requests:read", "audit:read", "admin"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Stack:
    def __init__(self, home: Path, poll_seconds: str = "0.1"):
        # callbacks may go to loopback (the tests' webhook URLs point at a closed local port)
        configure(home, poll_seconds=poll_seconds, webhook_allowed_hosts='["127.0.0.1"]')
        self.home = home
        self.admin_key = make_key(ADMIN_SCOPES, name="operator")
        self.reader_key = make_key(["requests:read"], name="officer")
        self.server: uvicorn.Server | None = None
        self.thread: threading.Thread | None = None
        self.background: bool | None = None
        self.port = free_port()  # kept across restarts: an open page goes on polling the same origin
        self.base_url = f"http://127.0.0.1:{self.port}"

    def serve(self, background: bool = True) -> str:
        """The API's base URL, (re)started with or without the in-process executor."""
        if self.server is not None and self.background == background:
            return self.base_url
        self.stop()
        config = uvicorn.Config(
            create_app(run_background=background), host="127.0.0.1", port=self.port, log_level="warning", lifespan="on"
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="lethe-api", daemon=True)
        self.thread.start()
        self.background = background
        wait_for(lambda: self.server.started or not self.thread.is_alive(), timeout=60, interval=0.05, what="the API")
        if not self.server.started:
            raise RuntimeError(f"the API did not start on port {self.port}")
        return self.base_url

    def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True
            self.thread.join(timeout=60)
        self.server = self.thread = self.background = None

    def api(self, key: str | None = None) -> httpx.Client:
        return httpx.Client(
            base_url=self.base_url, headers={"authorization": f"Bearer {key or self.admin_key}"}, timeout=30
        )

    def register_model(
        self,
        name: str = "credit-lr",
        shadows: int = 8,
        unlearning: list[str] | None = None,
        people: dict[str, list[int]] | None = None,
        **extra,
    ) -> str:
        """A small tabular model (200 rows, a few shadows for the audit), ready for deletions. ``people``: a
        ``person`` column registered as the subject column, these people on these rows (everyone else a stranger);
        ``extra``: more registration fields (``requires_approval``, ``tags``)."""
        source = self.home / "data" / f"{name}.csv"
        frame = write_table(source, n=200, seed=5)
        dataset = {"row_id_column": "row_id", "label_column": "label"}
        if people is not None:
            frame["person"] = [f"{name}-other-{i}" for i in range(len(frame))]
            for person, rows in people.items():
                frame.loc[rows, "person"] = person
            frame.to_csv(source, index=False)
            dataset["subject_column"] = "person"
        metadata = {
            "name": name,
            "verification": {"shadows": shadows},
            "dataset": dataset,
            "unlearning": unlearning or [],
            **extra,
        }
        with self.api() as client, source.open("rb") as handle:
            response = client.post(
                "/v1/models", data={"metadata": json.dumps(metadata)}, files={"file": (source.name, handle, "text/csv")}
            )
            assert response.status_code == 202, response.text
            model_id = response.json()["id"]
            model = wait_model(
                client,
                model_id,
                timeout=300,
                interval=0.2,
                what="model training",
            )
        assert model["status"] == "ready", model
        return model_id

    def delete(self, model_id: str, ids: list[str], **extra) -> dict:
        scope = {"kind": "samples", "sample_ids": ids}
        body = {"subject_ref": f"subject-{ids[0]}", "model_id": model_id, "scope": scope}
        with self.api() as client:
            response = client.post("/v1/deletion-requests", json={**body, **extra})
        assert response.status_code == 202, response.text
        return response.json()

    def wait_done(self, request_id: str, timeout: float = 300) -> dict:
        with self.api() as client:
            return wait_for(
                lambda: (
                    (b := client.get(f"/v1/deletion-requests/{request_id}").json())["status"]
                    in ("certified", "failed", "rejected", "cancelled")
                    and b
                ),
                timeout=timeout,
                interval=0.2,
                what=f"deletion request {request_id}",
            )


def log_in(page, base_url: str, key: str) -> None:
    page.goto(f"{base_url}/dashboard/login")
    page.fill("#api_key", key)
    page.click("#login")
    page.wait_for_load_state()

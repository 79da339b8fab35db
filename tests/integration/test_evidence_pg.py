"""Evidence issue end to end on PostgreSQL + Redis + a Celery worker: a tabular deletion goes from POST to a
certificate, and its webhook reaches a local receiver (loopback only) that checks the Standard Webhooks signature
with the `standardwebhooks` package — also when the receiver was down when the request ended."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import standardwebhooks

from tests.helpers import make_key, wait_for, wait_request, write_table


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _receiver(port: int, received: list):
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("content-length") or 0))
            received.append(({k.lower(): v for k, v in self.headers.items()}, body))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_deletion_to_certificate_and_a_webhook_that_arrives_late(stack, tmp_path):
    source = tmp_path / "t.csv"
    write_table(source, n=300, seed=9)
    metadata = {
        "name": "evidence-pg",
        "holdout_fraction": 0.25,
        "verification": {"shadows": 8},
        "dataset": {"row_id_column": "row_id", "label_column": "label"},
    }
    with source.open("rb") as handle:
        response = stack.client.post(
            "/v1/models", data={"metadata": json.dumps(metadata)}, files={"file": ("t.csv", handle, "text/csv")}
        )
    model_id = response.json()["id"]
    wait_for(lambda: stack.client.get(f"/v1/models/{model_id}").json()["status"] == "ready", timeout=300, what="ready")

    port = _free_port()  # the receiver is down when the request ends
    url = f"http://127.0.0.1:{port}/hooks/lethe"
    admin = make_key(["admin"], name="admin")
    secret = stack.client.post(
        "/v1/webhooks/secret",
        json={"url": url, "key": stack.key.split("_")[1]},  # the requester's prefix: its events, its secret
        headers={"authorization": f"Bearer {admin}"},
    ).json()["secret"]
    response = stack.client.post(
        "/v1/deletion-requests",
        json={
            "subject_ref": "dana",
            "model_id": model_id,
            "method": "retrain",
            "scope": {"kind": "samples", "sample_ids": ["r1", "r2"]},
            "callback_url": url,
        },
    )
    assert response.status_code == 202, response.text
    done = wait_request(stack.client, response.json()["id"], timeout=300)
    assert done["status"] == "certified", done
    envelope = stack.client.get(done["links"]["certificate"])
    assert envelope.status_code == 200 and envelope.json()["signatures"][0]["keyid"]

    log = wait_for(
        lambda: (
            (items := stack.client.get(done["links"]["webhooks"]).json()["items"])
            and items[0]["attempts"] >= 1
            and items[0]["last_error"]  # the attempt is counted when claimed, its error recorded when it ends
            and items
        ),
        timeout=30,
        what="a first, failed delivery attempt",
    )
    assert log[0]["status"] == "pending" and log[0]["last_error"]

    received: list = []
    server = _receiver(port, received)
    try:
        wait_for(lambda: received, timeout=60, what="the retried webhook")
    finally:
        server.shutdown()
    headers, body = received[0]
    event = standardwebhooks.Webhook(secret).verify(body.decode(), headers)
    assert event["type"] == "deletion.certified" and event["data"]["id"] == done["id"]
    assert event["data"]["links"]["certificate"] == done["links"]["certificate"]
    delivered = wait_for(
        lambda: (
            (items := stack.client.get(done["links"]["webhooks"]).json()["items"])[0]["status"] == "delivered" and items
        ),
        timeout=30,
        what="the delivery log",
    )
    assert delivered[0]["attempts"] >= 2 and delivered[0]["webhook_id"] == headers["webhook-id"]

"""The webhook sender's retry paths (app/webhooks/service.py) against a scripted receiver on 127.0.0.1: a non-2xx
answer is retried, with backoff (5 s, then 10 s) and nothing sent before it is due; a delivery still failing when its
retry window (``webhook_retry_hours``) ends is dead and never sent again; an operator's redelivery (the API route)
sends it again with the same ``webhook-id`` and a fresh window."""

from __future__ import annotations

from datetime import timedelta

import pytest
import standardwebhooks
from fastapi.testclient import TestClient
from sqlalchemy import update

from app.db import session_scope, utcnow
from app.main import create_app
from app.webhooks.service import endpoint_secret, enqueue, send_due
from app.webhooks.tables import WebhookDelivery
from tests.helpers import configure, make_key
from tests.unit.scripted_server import ScriptedServer

NOTHING = {"delivered": 0, "retrying": 0, "dead": 0}


def _answers(*statuses: int):
    return lambda arrival, i: (statuses[min(i, len(statuses) - 1)], {}, b"")


def _row(delivery_id: str) -> WebhookDelivery:
    with session_scope() as session:
        row = session.get(WebhookDelivery, delivery_id)
        session.expunge(row)
        return row


def _make_due(delivery_id: str) -> None:
    """Skip the wait (the backoff itself is asserted from next_attempt_at)."""
    with session_scope() as session:
        session.execute(
            update(WebhookDelivery).where(WebhookDelivery.id == delivery_id).values(next_attempt_at=utcnow())
        )


def _enqueue(url: str, request_id: str = "req-1") -> str:
    with session_scope() as session:
        delivery = enqueue(session, request_id, url, "deletion.certified", {"id": request_id}, "key-1")
        session.flush()
        return delivery.id


@pytest.fixture
def home(tmp_path):
    configure(tmp_path, webhook_allowed_hosts="127.0.0.1", webhook_timeout_seconds="3")
    return tmp_path


def test_a_non_2xx_answer_is_retried_with_backoff_and_nothing_is_sent_before_it_is_due(home):
    with ScriptedServer(_answers(500, 503, 204)) as receiver:
        delivery_id = _enqueue(f"{receiver.url}/hook")

        started = utcnow()
        assert send_due() == {**NOTHING, "retrying": 1}
        row = _row(delivery_id)
        assert (row.status, row.attempts, row.last_status_code, row.last_error) == ("pending", 1, 500, "answered 500")
        assert timedelta(seconds=5) <= row.next_attempt_at - started <= timedelta(seconds=7)  # the first backoff: 5 s
        assert send_due() == NOTHING and len(receiver.arrivals) == 1  # not due yet: not sent

        _make_due(delivery_id)
        started = utcnow()
        assert send_due() == {**NOTHING, "retrying": 1}
        row = _row(delivery_id)
        assert (row.attempts, row.last_status_code) == (2, 503)
        assert timedelta(seconds=10) <= row.next_attempt_at - started <= timedelta(seconds=12)  # doubled: 10 s

        _make_due(delivery_id)
        assert send_due() == {**NOTHING, "delivered": 1}
        row = _row(delivery_id)
        assert (row.status, row.attempts, row.last_status_code, row.last_error) == ("delivered", 3, 204, None)
        assert send_due() == NOTHING and len(receiver.arrivals) == 3

    ids = {a.headers["webhook-id"] for a in receiver.arrivals}
    assert ids == {row.message_id}  # one event: the receiver deduplicates the retries by it
    secret = endpoint_secret(f"{receiver.url}/hook", "key-1")
    for arrival in receiver.arrivals:
        assert standardwebhooks.Webhook(secret).verify(arrival.body.decode(), arrival.headers)["type"] == (
            "deletion.certified"
        )


def test_a_delivery_failing_past_its_retry_window_is_dead_and_redelivery_sends_it_again(home):
    configure(home, webhook_allowed_hosts="127.0.0.1", webhook_timeout_seconds="3", webhook_retry_hours="0.002")
    admin = make_key(["admin"], name="operator")  # redelivery is admin-only
    with ScriptedServer(_answers(502, 500, 204)) as receiver:
        delivery_id = _enqueue(f"{receiver.url}/hook", "req-dead")
        window = _row(delivery_id).give_up_at - _row(delivery_id).created_at
        assert timedelta(seconds=7) <= window <= timedelta(seconds=7.3)  # 0.002 h

        assert send_due() == {**NOTHING, "retrying": 1}  # the next try, 5 s on, is inside the 7.2 s window
        _make_due(delivery_id)
        assert send_due() == {**NOTHING, "dead": 1}  # the next, 10 s on, would not be: given up
        row = _row(delivery_id)
        assert (row.status, row.attempts, row.last_status_code) == ("dead", 2, 500)
        _make_due(delivery_id)
        assert send_due() == NOTHING and len(receiver.arrivals) == 2  # dead: never sent again

        with TestClient(create_app(run_background=False)) as api:
            auth = {"authorization": f"Bearer {admin}"}
            wrong = api.post(f"/v1/deletion-requests/another/webhooks/{delivery_id}/redeliver", headers=auth)
            assert wrong.status_code == 404 and wrong.headers["content-type"] == "application/problem+json"
            again = api.post(f"/v1/deletion-requests/req-dead/webhooks/{delivery_id}/redeliver", headers=auth)
            assert again.status_code == 202, again.text
            assert again.json()["status"] == "pending" and again.json()["webhook_id"] == row.message_id
        redelivered = _row(delivery_id)
        assert redelivered.give_up_at - redelivered.next_attempt_at >= timedelta(seconds=7)  # a fresh window

        assert send_due() == {**NOTHING, "delivered": 1}
        assert _row(delivery_id).status == "delivered" and len(receiver.arrivals) == 3
    assert {a.headers["webhook-id"] for a in receiver.arrivals} == {row.message_id}

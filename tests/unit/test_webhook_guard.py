"""Webhook primitives: Standard Webhooks signatures and the callback-address guard.

Network rule: every refusal is tested on resolved addresses from a fake resolver, sending nothing; the only real
deliveries go to a server on 127.0.0.1, reached because the allowlist names it.
"""

from __future__ import annotations

import base64
import json
import socket
import threading
import time
from datetime import UTC, datetime, timedelta

import httpx
import pytest
import standardwebhooks

from app.webhooks import guard
from app.webhooks.guard import (
    Allowlist,
    AttemptDeadlineExceeded,
    WebhookTargetRefused,
    build_request,
    deliver,
    pinned_client,
    vet_callback_url,
)
from app.webhooks.signing import WebhookVerificationError, generate_secret, sign_headers, verify
from tests.unit.loopback_server import LOOPBACK, loopback_server

PUBLIC_V4 = "93.184.216.34"
PUBLIC_V6 = "2606:4700:4700::1111"


def fake_dns(answers: dict[str, list[str]]):
    """A getaddrinfo stand-in: name -> addresses, shaped like the real answer; unknown names fail like NXDOMAIN."""
    asked: list[str] = []

    def resolve(host, port, family=0, type=0, proto=0, flags=0):
        asked.append(host)
        if host not in answers:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        result = []
        for address in answers[host]:
            if ":" in address:
                result.append((socket.AF_INET6, socket.SOCK_STREAM, 6, "", (address, port, 0, 0)))
            else:
                result.append((socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, port)))
        return result

    resolve.asked = asked
    return resolve


@pytest.fixture(autouse=True)
def no_real_dns(monkeypatch):
    """Unit tests here never reach a real resolver: only 127.0.0.1 / ::1 literals, which resolve without DNS."""
    real = socket.getaddrinfo

    def guarded(host, *args, **kwargs):
        if host in (LOOPBACK, "::1"):
            return real(host, *args, **kwargs)
        raise AssertionError(f"a test tried to resolve {host!r} for real")

    monkeypatch.setattr(guard.socket, "getaddrinfo", guarded)


# ------------------------------------------------------------------------------------------ Standard Webhooks


def test_secrets_are_whsec_with_32_random_bytes():
    secret = generate_secret()
    assert secret.startswith("whsec_")
    assert len(base64.b64decode(secret.removeprefix("whsec_"))) == 32
    assert generate_secret() != secret


def test_signature_round_trips_through_the_library():
    secret = generate_secret()
    body = json.dumps({"type": "deletion.completed", "data": {"request_id": "r1"}}).encode()
    headers = sign_headers(secret, body, message_id="msg_1")
    assert set(headers) == {"webhook-id", "webhook-timestamp", "webhook-signature"}
    assert headers["webhook-id"] == "msg_1" and headers["webhook-signature"].startswith("v1,")
    assert standardwebhooks.Webhook(secret).verify(body, headers) == json.loads(body)
    assert verify(secret, body, headers)["data"]["request_id"] == "r1"


def test_rotation_signs_with_every_secret():
    old, new = generate_secret(), generate_secret()
    body = b'{"a":1}'
    headers = sign_headers([old, new], body)
    assert len(headers["webhook-signature"].split(" ")) == 2
    for secret in (old, new):
        assert standardwebhooks.Webhook(secret).verify(body, headers) == {"a": 1}


def test_tampering_and_replay_are_detected():
    secret = generate_secret()
    body = b'{"a":1}'
    headers = sign_headers(secret, body)
    with pytest.raises(WebhookVerificationError):
        verify(secret, b'{"a":2}', headers)
    with pytest.raises(WebhookVerificationError):
        verify(generate_secret(), body, headers)
    with pytest.raises(WebhookVerificationError):
        verify(secret, body, {**headers, "webhook-id": "msg_other"})
    stale = sign_headers(secret, body, timestamp=datetime.now(UTC) - timedelta(hours=1))
    with pytest.raises(WebhookVerificationError, match="too old"):
        verify(secret, body, stale)
    # a garbage signature header: standardwebhooks < 1.3 raised ValueError here, 1.3 its own error; either way ours
    with pytest.raises(WebhookVerificationError):
        verify(secret, body, {**headers, "webhook-signature": "garbage"})
    with pytest.raises(WebhookVerificationError, match="Missing required headers"):
        verify(secret, body, {k: v for k, v in headers.items() if k != "webhook-signature"})
    # a correctly signed body that is not JSON: the library's json.loads error becomes ours
    with pytest.raises(WebhookVerificationError, match="malformed"):
        verify(secret, b"not json", sign_headers(secret, b"not json"))
    with pytest.raises(ValueError):
        sign_headers(secret, body, message_id="a.b\r\nx: y")


# ------------------------------------------------------------------------------------------ address guard

REFUSED = [
    ("127.0.0.1", "loopback"),
    ("127.1.2.3", "loopback"),
    ("::1", "loopback"),
    ("169.254.10.1", "link-local"),
    ("fe80::1", "link-local"),
    ("10.0.0.1", "private"),
    ("172.16.5.4", "private"),
    ("192.168.1.1", "private"),
    ("fd12:3456::1", "private"),
    ("224.0.0.251", "multicast"),
    ("ff02::1", "multicast"),
    ("240.0.0.1", "reserved"),
    ("255.255.255.255", "reserved"),
    ("0.0.0.0", "unspecified"),
    ("::", "unspecified"),
    ("100.64.0.1", "not a globally routable"),
    ("fec0::1", "site-local"),
    ("169.254.169.254", "metadata"),
    ("169.254.170.2", "metadata"),
    ("fd00:ec2::254", "metadata"),
    ("168.63.129.16", "metadata"),
    ("100.100.100.200", "metadata"),
    ("::ffff:127.0.0.1", "loopback"),
    ("::ffff:10.1.1.1", "private"),
    ("::ffff:169.254.169.254", "metadata"),
    ("64:ff9b::a00:1", "private"),
    ("2002:7f00:1::", "loopback"),
    ("::7f00:1", "reserved"),
    ("2001:db8::1", "private"),
]


@pytest.mark.parametrize(("address", "category"), REFUSED)
def test_refused_addresses(address, category):
    resolver = fake_dns({"hooks.example.com": [address]})
    with pytest.raises(WebhookTargetRefused) as caught:
        vet_callback_url("https://hooks.example.com/lethe", resolver=resolver)
    assert category in caught.value.reason and address in caught.value.reason
    assert resolver.asked == ["hooks.example.com"]


@pytest.mark.parametrize("address", [PUBLIC_V4, PUBLIC_V6, "::ffff:93.184.216.34", "64:ff9b::5db8:d822"])
def test_public_addresses_pass_and_are_returned(address):
    target = vet_callback_url(
        "https://hooks.example.com/lethe?x=1", resolver=fake_dns({"hooks.example.com": [address]})
    )
    assert target.address == address and target.port == 443 and target.host == "hooks.example.com"


def test_literal_addresses_in_the_url_are_judged_too():
    """A unit on the guard with a fake resolver: nothing is ever sent. The hosts are address literals (a private
    one, the IPv6 loopback, 127.0.0.1 written as one integer) built from the addresses the resolver returns."""
    private, integer_loopback = "10.0.0.7", str(0x7F000001)
    resolver = fake_dns({private: [private], "::1": ["::1"], integer_loopback: ["127.0.0.1"]})
    for host in (private, "[::1]:8080", integer_loopback):
        with pytest.raises(WebhookTargetRefused):
            vet_callback_url(f"http://{host}/", resolver=resolver)


def test_every_resolved_address_must_pass():
    resolver = fake_dns({"mixed.example.com": [PUBLIC_V4, "10.0.0.5"], "mixed6.example.com": [PUBLIC_V6, "fe80::5"]})
    with pytest.raises(WebhookTargetRefused, match="10.0.0.5: a private"):
        vet_callback_url("https://mixed.example.com/", resolver=resolver)
    with pytest.raises(WebhookTargetRefused, match="link-local"):
        vet_callback_url("https://mixed6.example.com/", resolver=resolver)


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("ftp://hooks.example.com/", "only http and https"),
        ("file:///etc/passwd", "only http and https"),
        ("gopher://hooks.example.com/", "only http and https"),
        ("https://user:pass@hooks.example.com/", "credentials"),
        ("https://nxdomain.example.com/", "cannot resolve"),
        ("not a url", "only http and https"),
    ],
)
def test_refused_urls(url, reason):
    with pytest.raises(WebhookTargetRefused, match=reason):
        vet_callback_url(url, resolver=fake_dns({"hooks.example.com": [PUBLIC_V4]}))


def test_allowlist_of_addresses_networks_and_hosts():
    resolver = fake_dns(
        {
            LOOPBACK: [LOOPBACK],
            "internal.example.com": ["10.1.2.3"],
            "other.example.com": ["192.168.0.9"],
            "receiver.internal": ["172.20.0.4"],
            "mapped.example.com": ["::ffff:127.0.0.1"],
            "imds.example.com": ["169.254.169.254"],
        }
    )
    allow = ["127.0.0.1", "10.0.0.0/8", "Receiver.Internal."]
    assert vet_callback_url(f"http://{LOOPBACK}:9000/", allowlist=allow, resolver=resolver).address == LOOPBACK
    assert vet_callback_url("http://internal.example.com/", allowlist=allow, resolver=resolver).address == "10.1.2.3"
    assert vet_callback_url("http://receiver.internal/", allowlist=allow, resolver=resolver).address == "172.20.0.4"
    assert vet_callback_url("http://mapped.example.com/", allowlist=allow, resolver=resolver).port == 80
    with pytest.raises(WebhookTargetRefused, match="private"):
        vet_callback_url("http://other.example.com/", allowlist=allow, resolver=resolver)
    # cloud metadata stays refused, whatever the allowlist says
    for broad in (["169.254.0.0/16"], ["0.0.0.0/0"], ["imds.example.com"]):
        with pytest.raises(WebhookTargetRefused, match="metadata"):
            vet_callback_url("http://imds.example.com/", allowlist=broad, resolver=resolver)
    assert Allowlist.parse(["", " 127.0.0.1 ", "::1"]).allows_address(guard.ipaddress.ip_address("::1"))


def test_request_goes_to_the_vetted_address_with_the_name_kept():
    resolver = fake_dns({"hooks.example.com": [PUBLIC_V6]})
    target = vet_callback_url("https://hooks.example.com:8443/in?x=1#frag", resolver=resolver)
    request = build_request(target, content=b"{}", headers={"content-type": "application/json"})
    assert request.url.host == PUBLIC_V6 and request.url.port == 8443
    assert request.url.path == "/in" and request.url.query == b"x=1" and not request.url.fragment
    assert request.headers["host"] == "hooks.example.com:8443"
    assert request.extensions["sni_hostname"] == "hooks.example.com"
    client = pinned_client()
    try:
        assert client.follow_redirects is False and client.trust_env is False
    finally:
        client.close()


# ------------------------------------------------------------------------------------------ loopback deliveries


def test_delivery_to_an_allowlisted_loopback_receiver_verifies():
    secret = generate_secret()
    body = json.dumps({"type": "deletion.completed", "data": {"request_id": "r9"}}).encode()
    with loopback_server({"/hook": (204, {}, b"")}) as server:
        headers = {"content-type": "application/json", **sign_headers(secret, body)}
        result = deliver(server.url("/hook"), body, headers, allowlist=[LOOPBACK])
    assert result.delivered and result.status_code == 204 and result.address == LOOPBACK
    (received,) = server.received
    assert received.body == body
    assert standardwebhooks.Webhook(secret).verify(received.body, received.headers)["data"]["request_id"] == "r9"


def test_loopback_is_refused_without_the_allowlist():
    with loopback_server({"/hook": (204, {}, b"")}) as server, pytest.raises(WebhookTargetRefused, match="loopback"):
        deliver(server.url("/hook"), b"{}", {})
    assert server.received == []


def test_the_connection_goes_to_the_address_that_was_vetted():
    """DNS rebinding: the name is resolved once; the sender connects to that answer, not to a second lookup."""
    with loopback_server({"/hook": (200, {}, b"ok")}) as server:
        resolver = fake_dns({"hooks.example.test": [LOOPBACK]})
        result = deliver(
            f"http://hooks.example.test:{server.port}/hook", b"{}", {}, allowlist=[LOOPBACK], resolver=resolver
        )
    assert result.delivered and result.body_excerpt == b"ok"
    assert resolver.asked == ["hooks.example.test"]
    assert server.received[0].headers["host"] == f"hooks.example.test:{server.port}"


def test_redirects_are_not_followed():
    routes = {"/hook": (307, {"location": "/elsewhere"}, b""), "/elsewhere": (200, {}, b"")}
    with loopback_server(routes) as server:
        result = deliver(server.url("/hook"), b"{}", {}, allowlist=[LOOPBACK])
    assert result.status_code == 307 and not result.delivered
    assert [r.path for r in server.received] == ["/hook"]


def test_a_refused_target_raises_before_any_http():
    with pytest.raises(WebhookTargetRefused):
        deliver("http://hooks.example.com/", b"{}", {}, resolver=fake_dns({"hooks.example.com": ["10.9.9.9"]}))
    with pytest.raises(httpx.InvalidURL):
        httpx.URL("http://[::1")  # the parser the guard relies on refuses broken URLs


# ------------------------------------------------------------------------------ slow receivers (issue 22, MEDIUM)
class DribblingReceiver:
    """A receiver on 127.0.0.1 that reads the request, then answers one byte every ``interval`` seconds: per-read
    timeouts never fire on it. Counts connections open at once and answers sent in full."""

    ANSWER = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok"

    def __init__(self, interval: float):
        self.interval = interval
        self.open = self.max_open = self.finished = 0
        self.lock = threading.Lock()
        self.sock = socket.create_server((LOOPBACK, 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def url(self, path: str = "/hook") -> str:
        return f"http://{LOOPBACK}:{self.port}{path}"

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with self.lock:
            self.open += 1
            self.max_open = max(self.max_open, self.open)
        try:
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            for i in range(len(self.ANSWER)):
                conn.sendall(self.ANSWER[i : i + 1])
                time.sleep(self.interval)
            with self.lock:
                self.finished += 1
        except OSError:  # the sender hung up: its deadline passed
            pass
        finally:
            conn.close()
            with self.lock:
                self.open -= 1

    def close(self) -> None:
        self.sock.close()


def test_a_receiver_that_dribbles_its_answer_cannot_hold_an_attempt_past_its_deadline():
    """Before, httpx's timeout bounded each read, so a byte every 0.2 s (66 bytes: ~13 s) was waited for in full."""
    receiver = DribblingReceiver(0.2)
    try:
        with pytest.raises(AttemptDeadlineExceeded, match="wall clock"):
            deliver(receiver.url(), b"{}", {}, allowlist=[LOOPBACK], timeout=1.0)
        assert receiver.finished == 0  # the attempt ended before the answer did
    finally:
        receiver.close()


def test_the_sender_claims_then_attempts_every_due_delivery_at_once_without_holding_the_rows(tmp_path):
    """Three dribbling receivers and one quick one: the claim is committed before any HTTP (another session sees the
    attempt counted and the next attempt pushed past the deadline while the receivers are still talking), the four
    attempts run at once (three connections open together), the quick one is delivered and the slow ones are retried
    with their error, each ended by its own deadline."""
    from app.db import session_scope, utcnow
    from app.webhooks.service import enqueue, send_due
    from app.webhooks.tables import WebhookDelivery
    from tests.helpers import configure

    configure(tmp_path, webhook_timeout_seconds="1.5", webhook_allowed_hosts="127.0.0.1")
    slow = DribblingReceiver(0.2)
    seen_during: list[tuple[int, bool]] = []
    try:
        with loopback_server({"/hook": (204, {}, b"")}) as quick:
            with session_scope() as session:
                for i in range(3):
                    enqueue(session, f"r{i}", slow.url(), "deletion.certified", {"i": i}, "k1")
                enqueue(session, "r-quick", quick.url("/hook"), "deletion.certified", {}, "k1")

            def watch() -> None:  # reads the rows while the attempts are in flight (never, if they run one by one)
                give_up = time.monotonic() + 10
                while slow.max_open < 3:
                    if time.monotonic() > give_up:
                        return
                    time.sleep(0.02)
                with session_scope() as session:
                    for row in session.query(WebhookDelivery).filter(WebhookDelivery.request_id.like("r_")):
                        seen_during.append((row.attempts, row.next_attempt_at > utcnow()))

            watcher = threading.Thread(target=watch, daemon=True)
            watcher.start()
            counts = send_due()
            watcher.join(timeout=10)
            assert len(quick.received) == 1
        assert counts == {"delivered": 1, "retrying": 3, "dead": 0}
        assert slow.max_open == 3 and slow.finished == 0
        assert seen_during == [(1, True)] * 3
        with session_scope() as session:
            errors = [r.last_error for r in session.query(WebhookDelivery).filter(WebhookDelivery.status == "pending")]
        assert len(errors) == 3 and all("AttemptDeadlineExceeded" in e for e in errors), errors
    finally:
        slow.close()


def test_a_callback_secret_is_bound_to_the_requesting_key_not_to_the_url_alone(tmp_path):
    """Two keys' requests name the same receiver: each event verifies with its own requester's secret only, so a
    requester who names another receiver's URL cannot get events that receiver accepts as its own."""
    from app.db import session_scope
    from app.webhooks.service import endpoint_secret, enqueue, send_due
    from tests.helpers import configure

    configure(tmp_path, webhook_allowed_hosts="127.0.0.1")
    with loopback_server({"/hook": (204, {}, b"")}) as receiver:
        url = receiver.url("/hook")
        with session_scope() as session:
            enqueue(session, "ra", url, "deletion.certified", {"request": "ra"}, "key-a")
            enqueue(session, "rb", url, "deletion.certified", {"request": "rb"}, "key-b")
        assert send_due() == {"delivered": 2, "retrying": 0, "dead": 0}
        received = {json.loads(r.body)["data"]["request"]: r for r in receiver.received}
    secrets = {"ra": endpoint_secret(url, "key-a"), "rb": endpoint_secret(url, "key-b")}
    assert secrets["ra"] != secrets["rb"]
    for request, delivery in received.items():
        standardwebhooks.Webhook(secrets[request]).verify(delivery.body, delivery.headers)
        other = secrets["rb" if request == "ra" else "ra"]
        with pytest.raises(standardwebhooks.WebhookVerificationError):
            standardwebhooks.Webhook(other).verify(delivery.body, delivery.headers)

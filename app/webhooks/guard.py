"""Server-side request forgery guard for webhook callbacks.

A callback URL is chosen by a client, so without a guard the sender would POST wherever it is told: to the cloud
metadata service (credentials), to an admin port on loopback, to the private network. Here:

1. only ``http``/``https``, no credentials in the URL;
2. the host is resolved once (``socket.getaddrinfo``, injectable for tests) and **every** address it resolves to
   must be a public unicast address: loopback, link-local, private, shared (CGNAT), multicast, reserved,
   unspecified and cloud-metadata addresses are refused; IPv4-mapped, NAT64 and 6to4 IPv6 addresses are judged by
   the IPv4 address inside them;
3. an allowlist (settings-style strings: host names, addresses, CIDRs) lets an operator reach a known internal
   receiver (tests use ``"127.0.0.1"``); cloud-metadata addresses stay refused even when allowlisted;
4. the sender connects to exactly the vetted address (the URL's host replaced by it, ``Host`` and TLS SNI /
   certificate check keep the name), so a second DNS answer cannot swap in another address (DNS rebinding);
5. redirects are never followed (a 3xx is a failed delivery), and no proxy from the environment is used.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import httpx

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
Resolver = Callable[..., list[tuple]]

DEFAULT_PORTS = {"http": 80, "https": 443}
MAX_RESPONSE_BYTES = 4096  # a receiver's answer is only logged: never read more
DEFAULT_TIMEOUT_SECONDS = 5.0

# Instance-metadata and host-service endpoints. Most are link-local or private anyway; listing them names the
# danger in the refusal and keeps them refused when an operator allowlists a broad range.
METADATA_ADDRESSES = frozenset(
    ipaddress.ip_address(text)
    for text in (
        "169.254.169.254",  # AWS, GCP, Azure, OpenStack, DigitalOcean, Oracle instance metadata
        "169.254.170.2",  # AWS ECS task metadata and credentials
        "169.254.169.253",  # AWS VPC DNS resolver
        "169.254.169.123",  # AWS time sync
        "168.63.129.16",  # Azure WireServer (a public address)
        "100.100.100.200",  # Alibaba Cloud metadata
        "192.0.0.192",  # Oracle Cloud legacy metadata
        "fd00:ec2::254",  # AWS instance metadata over IPv6
        "fd00:ec2::253",  # AWS VPC DNS over IPv6
        "fd00:ec2::123",  # AWS time sync over IPv6
        "fd20:ce::254",  # GCP metadata over IPv6
    )
)
NAT64_NETWORKS = (ipaddress.ip_network("64:ff9b::/96"), ipaddress.ip_network("64:ff9b:1::/48"))  # RFC 6052, 8215


class WebhookTargetRefused(ValueError):
    """A callback URL the sender must not call; ``reason`` says why (safe to show to the client)."""

    def __init__(self, url: str, reason: str):
        super().__init__(f"refused callback {url}: {reason}")
        self.url = url
        self.reason = reason


@dataclass(frozen=True)
class Allowlist:
    """Host names and networks that may be called although they are not public (an operator's choice)."""

    hosts: frozenset[str] = frozenset()
    networks: tuple[IPNetwork, ...] = ()

    @classmethod
    def parse(cls, entries: Iterable[str] | Allowlist | None) -> Allowlist:
        """From settings strings: ``"127.0.0.1"``, ``"10.0.0.0/8"``, ``"::1"``, ``"receiver.internal"``."""
        if isinstance(entries, Allowlist):
            return entries
        hosts: set[str] = set()
        networks: list[IPNetwork] = []
        for entry in entries or ():
            text = entry.strip()
            if not text:
                continue
            try:
                networks.append(ipaddress.ip_network(text, strict=False))
            except ValueError:
                hosts.add(_normal_host(text))
        return cls(frozenset(hosts), tuple(networks))

    def allows_host(self, host: str) -> bool:
        return _normal_host(host) in self.hosts

    def allows_address(self, address: IPAddress) -> bool:
        return any(address in network for network in self.networks if network.version == address.version)


@dataclass(frozen=True)
class VettedTarget:
    """A callback URL that passed the guard, with the addresses it resolved to (connect to ``address``)."""

    url: str
    scheme: str
    host: str
    port: int
    address: str
    addresses: tuple[str, ...]

    @property
    def host_header(self) -> str:
        name = f"[{self.host}]" if ":" in self.host else self.host
        return name if self.port == DEFAULT_PORTS[self.scheme] else f"{name}:{self.port}"


@dataclass(frozen=True)
class DeliveryResult:
    """What a receiver answered; only a 2xx counts as delivered (a 3xx is a refused redirect)."""

    status_code: int
    body_excerpt: bytes
    address: str

    @property
    def delivered(self) -> bool:
        return 200 <= self.status_code < 300


def _normal_host(host: str) -> str:
    return host.strip().lower().rstrip(".")


def _embedded_ipv4(address: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address stands for (IPv4-mapped, NAT64, 6to4), if any."""
    if not isinstance(address, ipaddress.IPv6Address):
        return None
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if any(address in network for network in NAT64_NETWORKS):
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return address.sixtofour


def _is_nat64(address: IPAddress) -> bool:
    return isinstance(address, ipaddress.IPv6Address) and any(address in network for network in NAT64_NETWORKS)


def refusal_reason(address: IPAddress) -> str | None:
    """Why a callback must not go to ``address``, or None for a public unicast address."""
    embedded = _embedded_ipv4(address)
    if embedded is not None:
        inner = refusal_reason(embedded)
        if inner:
            return f"{inner} (inside the IPv6 address {address})"
        if address.ipv4_mapped is not None or _is_nat64(address):
            return None  # it stands for a public IPv4 address
        # 6to4 around a public IPv4 address: the IPv6 address itself is judged too
    if address in METADATA_ADDRESSES:
        return "a cloud metadata address"
    checks = (
        (address.is_unspecified, "an unspecified address"),
        (address.is_loopback, "a loopback address"),
        (address.is_link_local, "a link-local address"),
        (address.is_multicast, "a multicast address"),
        (address.is_reserved, "a reserved address"),
        (address.is_private, "a private or special-purpose address"),
        (isinstance(address, ipaddress.IPv6Address) and address.is_site_local, "a site-local address"),
        (not address.is_global, "not a globally routable address"),
    )
    for refused, reason in checks:
        if refused:
            return reason
    return None


def _judge(address: IPAddress, allowlist: Allowlist, host_allowed: bool) -> str | None:
    """Metadata: always refused. Allowlisted host or address: allowed. Otherwise: public addresses only."""
    inner = _embedded_ipv4(address)
    if address in METADATA_ADDRESSES or inner in METADATA_ADDRESSES:
        return "a cloud metadata address (never allowed)"
    mapped = address.ipv4_mapped if isinstance(address, ipaddress.IPv6Address) else None
    if host_allowed or allowlist.allows_address(address) or (mapped is not None and allowlist.allows_address(mapped)):
        return None
    return refusal_reason(address)


def vet_callback_url(
    url: str,
    *,
    allowlist: Iterable[str] | Allowlist | None = None,
    resolver: Resolver | None = None,
) -> VettedTarget:
    """Resolve and vet a callback URL; raise :class:`WebhookTargetRefused` unless every address is allowed."""
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError) as exc:
        raise WebhookTargetRefused(str(url), f"not a valid URL ({exc})") from exc
    if parsed.scheme not in DEFAULT_PORTS:
        raise WebhookTargetRefused(url, f"only http and https callbacks are allowed, not {parsed.scheme or 'none'!r}")
    if parsed.userinfo:
        raise WebhookTargetRefused(url, "credentials in the URL are not allowed")
    host = parsed.raw_host.decode("ascii")  # IDNA-encoded: what DNS and the Host header see
    if not host:
        raise WebhookTargetRefused(url, "the URL has no host")
    port = parsed.port or DEFAULT_PORTS[parsed.scheme]
    rules = Allowlist.parse(allowlist)
    try:
        answers = (resolver or socket.getaddrinfo)(host, port, 0, socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise WebhookTargetRefused(url, f"cannot resolve {host} ({exc})") from exc
    addresses: list[str] = []
    for answer in answers:
        text = str(answer[4][0]).split("%", 1)[0]  # drop an IPv6 zone id
        if text not in addresses:
            addresses.append(text)
    if not addresses:
        raise WebhookTargetRefused(url, f"{host} resolves to no address")
    host_allowed = rules.allows_host(host)
    for text in addresses:
        try:
            address = ipaddress.ip_address(text)
        except ValueError as exc:
            raise WebhookTargetRefused(url, f"{host} resolves to {text!r}, not an IP address") from exc
        reason = _judge(address, rules, host_allowed)
        if reason:
            raise WebhookTargetRefused(url, f"{host} resolves to {text}: {reason}")
    return VettedTarget(str(parsed), parsed.scheme, host, port, addresses[0], tuple(addresses))


def build_request(
    target: VettedTarget,
    *,
    content: bytes,
    headers: dict[str, str] | None = None,
    method: str = "POST",
) -> httpx.Request:
    """A request to exactly the vetted address; ``Host`` and TLS SNI (and so the certificate check) keep the name.

    Send it with :func:`pinned_client` (``client.send(request, follow_redirects=False)``), never with a client
    that follows redirects or reads proxies from the environment.
    """
    pinned = httpx.URL(target.url).copy_with(host=target.address, port=target.port, fragment=None)
    request_headers = {**(headers or {}), "host": target.host_header}
    extensions = {"sni_hostname": target.host} if target.scheme == "https" else {}
    return httpx.Request(method, pinned, content=content, headers=request_headers, extensions=extensions)


def _client_options(timeout: float) -> dict:
    """One delivery's client: no redirects, no environment proxies, no connection reuse.

    Connections are pooled by address, so a pooled TLS connection verified for one host name could carry a request
    for another name on the same address; one client per delivery rules that out.
    """
    return {
        "timeout": timeout,
        "follow_redirects": False,
        "trust_env": False,
        "limits": httpx.Limits(max_connections=1, max_keepalive_connections=0),
    }


def pinned_client(timeout: float = DEFAULT_TIMEOUT_SECONDS) -> httpx.Client:
    """A client for one delivery (_client_options)."""
    return httpx.Client(**_client_options(timeout))


class AttemptDeadlineExceeded(httpx.TimeoutException):
    """The whole attempt (resolution, connection, request, answer) took longer than its wall-clock deadline."""


async def deliver_async(
    url: str,
    content: bytes,
    headers: dict[str, str],
    *,
    allowlist: Iterable[str] | Allowlist | None = None,
    resolver: Resolver | None = None,
    timeout: float = DEFAULT_TIMEOUT_SECONDS,
) -> DeliveryResult:
    """Vet, pin and POST once, the whole attempt within ``timeout`` seconds of wall-clock time: httpx's timeouts bound
    each read, so a receiver answering a byte every second would otherwise hold an attempt as long as it likes
    (issue 22). Raises :class:`WebhookTargetRefused`, :class:`AttemptDeadlineExceeded` or ``httpx.HTTPError``."""
    try:
        async with asyncio.timeout(timeout):
            # the resolver blocks (getaddrinfo): in a thread, so the deadline bounds the wait for it too
            target = await asyncio.to_thread(vet_callback_url, url, allowlist=allowlist, resolver=resolver)
            request = build_request(target, content=content, headers=headers)
            async with httpx.AsyncClient(**_client_options(timeout)) as client:
                response = await client.send(request, follow_redirects=False, stream=True)
                try:
                    excerpt = bytearray()
                    async for chunk in response.aiter_bytes():
                        excerpt += chunk
                        if len(excerpt) >= MAX_RESPONSE_BYTES:
                            break
                finally:
                    await response.aclose()
    except TimeoutError as exc:
        raise AttemptDeadlineExceeded(f"the attempt took longer than {timeout:g} s (wall clock)") from exc
    return DeliveryResult(response.status_code, bytes(excerpt[:MAX_RESPONSE_BYTES]), target.address)


def deliver(
    url: str,
    content: bytes,
    headers: dict[str, str],
    *,
    allowlist: Iterable[str] | Allowlist | None = None,
    resolver: Resolver | None = None,
    timeout: float = DEFAULT_TIMEOUT_SECONDS,
) -> DeliveryResult:
    """:func:`deliver_async` from synchronous code (not from a running event loop)."""
    return asyncio.run(deliver_async(url, content, headers, allowlist=allowlist, resolver=resolver, timeout=timeout))

"""``lethe verify-certificate FILE --keys SOURCE [--audit-log LOG]``: check a deletion certificate offline.

A certificate carries the latest signed audit checkpoint at issue (``audit_anchor``); given the audit log (``lethe
export audit --format json``, or ``GET /v1/audit`` pages), the check recomputes the log up to that position and
compares the hash there with the anchored one: a rewrite of earlier events, however well re-linked, shows.

Only the keys are fetched (from a file, or from ``/.well-known/lethe-keys.json`` over http(s)); the check itself
needs nothing else. The keys are the trust anchor, so plain ``http://`` is accepted only from a loopback host: from
anywhere else a man in the middle could hand over his own keys and make a forged certificate look valid.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Any

import httpx

from app.certificates.signing import (
    PREDICATE_TYPES,
    SUBJECT_ERASURE_PREDICATE_TYPE,
    InvalidCertificate,
    InvalidKeys,
    VerifiedCertificate,
    load_public_keys,
    parse_strict_json,
    verify_envelope,
)

MAX_CERTIFICATE_BYTES = 64 * 1024 * 1024
MAX_KEYS_BYTES = 1024 * 1024
MAX_AUDIT_LOG_BYTES = 1024 * 1024 * 1024
KEYS_TIMEOUT_SECONDS = 10.0
URL_SCHEMES = ("http://", "https://")


class InputUnavailable(Exception):
    """The certificate or the keys could not be read, so nothing was checked (the CLI exits 2)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def _is_loopback(host: str) -> bool:
    if host.lower().rstrip(".") == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def _fetch_keys(url: str, timeout: float) -> bytes:
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as exc:
        raise InputUnavailable(f"{url} is not a valid URL: {exc}") from exc
    loopback = _is_loopback(parsed.host)
    if parsed.scheme == "http" and not loopback:
        raise InputUnavailable(
            f"refusing keys over plain http from {parsed.host}: use https, or download the keys and pass the file"
        )
    try:
        # a proxy from the environment would see (and could change) the keys; a loopback fetch never uses one
        with (
            httpx.Client(timeout=timeout, follow_redirects=False, trust_env=not loopback) as client,
            client.stream("GET", url, headers={"accept": "application/json"}) as response,
        ):
            if response.status_code != httpx.codes.OK:
                where = response.headers.get("location")
                hint = f" (redirect to {where}: pass that URL)" if where else ""
                raise InputUnavailable(f"{url} answered HTTP {response.status_code}{hint}")
            body = bytearray()
            for chunk in response.iter_bytes():
                body += chunk
                if len(body) > MAX_KEYS_BYTES:
                    raise InputUnavailable(f"the keys document at {url} is larger than {MAX_KEYS_BYTES} bytes")
            return bytes(body)
    except httpx.HTTPError as exc:
        raise InputUnavailable(f"could not fetch keys from {url}: {exc}") from exc


def _read_file(path: Path, limit: int, what: str) -> bytes:
    try:
        size = path.stat().st_size
        if size > limit:
            raise InputUnavailable(f"the {what} {path} is larger than {limit} bytes")
        return path.read_bytes()
    except OSError as exc:
        raise InputUnavailable(f"cannot read the {what} {path}: {exc.strerror or exc}") from exc


def load_keys(source: str, *, timeout: float = KEYS_TIMEOUT_SECONDS) -> dict[str, Any]:
    """The keys document from a file or an http(s) URL, checked (every ``kid`` is its key's hash). The document
    itself, not only its keys: its ``retired`` and ``revoked`` marks are what the verifier refuses by."""
    if source.lower().startswith(URL_SCHEMES):
        raw = _fetch_keys(source, timeout)
    else:
        raw = _read_file(Path(source), MAX_KEYS_BYTES, "keys file")
    try:
        document = parse_strict_json(raw)
        load_public_keys(document)
        return document
    except (ValueError, UnicodeDecodeError) as exc:
        reason = exc.reason if isinstance(exc, InvalidKeys) else f"not valid JSON: {exc}"
        raise InputUnavailable(f"the keys from {source} are unusable: {reason}") from exc


def describe(certificate: VerifiedCertificate) -> str:
    """One human-readable summary of a valid certificate."""
    predicate = certificate.predicate
    if certificate.predicate_type == SUBJECT_ERASURE_PREDICATE_TYPE and predicate.get("no_data_found") is True:
        return _describe_no_data(certificate)
    if certificate.predicate_type == SUBJECT_ERASURE_PREDICATE_TYPE:
        children = predicate.get("children") or []
        timestamps = predicate.get("timestamps") if isinstance(predicate.get("timestamps"), dict) else {}
        lines = [
            f"VALID: combined erasure certificate {predicate.get('erasure_id')} for subject hash "
            f"{predicate.get('subject_hash')}: {len(children)} model(s), each with its own certificate"
        ]
        lines += [
            f"  model {c.get('model_id')}: request {c.get('request_id')}, certificate {c.get('certificate_id')} "
            f"sha256:{c.get('certificate_digest')}"
            for c in children
        ]
        lines.append(f"  issued {timestamps.get('issued_at')}, signed by key {certificate.key_id}")
        return "\n".join(lines)
    method = predicate.get("method") if isinstance(predicate.get("method"), dict) else {}
    verification = predicate.get("verification") if isinstance(predicate.get("verification"), dict) else {}
    timestamps = predicate.get("timestamps") if isinstance(predicate.get("timestamps"), dict) else {}
    figures = verification.get("figures") if isinstance(verification.get("figures"), dict) else {}
    lines = [
        f"VALID: deletion certificate for {certificate.subject_name} sha256:{certificate.subject_digest}",
        f"  request {predicate.get('request_id')}, model {predicate.get('model_id')}, "
        f"method {method.get('name')}, verdict {verification.get('verdict')}",
        f"  evidence class: {', '.join(map(str, figures.get('evidence_class') or [])) or 'none stated'}",
    ]
    for item in figures.get("evidence") or []:
        if isinstance(item, dict):
            lines.append(
                f"    {item.get('name')}: figure {_num(item.get('figure'))} threshold {_num(item.get('threshold'))} "
                f"power {_num(item.get('power'))}x informative {item.get('informative')} passed {item.get('passed')}"
            )
    guarantee = figures.get("certified_removal")
    if isinstance(guarantee, dict):
        lines.append(
            f"  certified removal (Guo et al. 2020): epsilon {guarantee.get('epsilon')}, delta {guarantee.get('delta')}"
            f", residual budget used {_num(guarantee.get('spent'))} of {_num(guarantee.get('budget'))}"
        )
    lines.append(f"  issued {timestamps.get('issued_at')}, signed by key {certificate.key_id}")
    return "\n".join(lines)


def _describe_no_data(certificate: VerifiedCertificate) -> str:
    """A combined certificate that found no data (its shape is checked by the verifier): says so first."""
    predicate = certificate.predicate
    search, deadline, timestamps = (
        predicate.get(k) if isinstance(predicate.get(k), dict) else {} for k in ("search", "deadline", "timestamps")
    )
    searched = [str(m) for m in search.get("models_searched") or []]
    skipped = [m for m in search.get("models_not_searched") or [] if isinstance(m, dict)]
    lines = [
        f"VALID: combined erasure certificate {predicate.get('erasure_id')} for subject hash "
        f"{predicate.get('subject_hash')}: NO DATA FOUND",
        f"  no model held rows of this subject when searched at {search.get('searched_at')}; nothing was erased "
        "and no child certificate exists",
        f"  models searched ({len(searched)}): {', '.join(searched) or 'none (no model has a subject index)'}",
    ]
    if skipped:
        lines.append(f"  models NOT searched ({len(skipped)}):")
        lines += [f"    model {m.get('model_id')} (status {m.get('status')}): {m.get('reason')}" for m in skipped]
    else:
        lines.append("  every model registered with a subject column was searched")
    if deadline:
        verdict = "on time" if deadline.get("answered_on_time") is True else "LATE"
        lines.append(
            f"  received {deadline.get('received_at')}, due {deadline.get('due_at')}, answered "
            f"{timestamps.get('completed_at')}: {verdict}"
        )
    lines.append(f"  issued {timestamps.get('issued_at')}, signed by key {certificate.key_id}")
    return "\n".join(lines)


def _num(value: Any) -> str:
    """A figure from a certificate, short: numbers to 3 significant digits, anything else as it is."""
    return f"{value:.3g}" if isinstance(value, int | float) and not isinstance(value, bool) else str(value)


def load_audit_log(path: Path | str) -> list[dict[str, Any]]:
    """Audit events from a file: a JSON list of events (``lethe export audit --format json``), one ``/v1/audit``
    page (``{"items": [...]}``) or a list of pages."""
    try:
        document = parse_strict_json(_read_file(Path(path), MAX_AUDIT_LOG_BYTES, "audit log"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise InputUnavailable(f"the audit log {path} is not valid JSON: {exc}") from exc
    pages = document if isinstance(document, list) else [document]
    events: list[dict[str, Any]] = []
    for entry in pages:
        items = entry.get("items") if isinstance(entry, dict) and "items" in entry else [entry]
        if not isinstance(items, list) or not all(isinstance(e, dict) and "seq" in e for e in items):
            raise InputUnavailable(f"the audit log {path} is not a list of audit events")
        events.extend(items)
    return events


def check_anchor(
    certificate: VerifiedCertificate, keys: dict[str, Any], audit_log: list[dict[str, Any]] | None
) -> tuple[bool, str]:
    """The certificate's ``audit_anchor``: its signature, and (given the log) that the log still leads to it."""
    from app.audit.service import check_anchor_against_log, check_anchor_signature

    anchor = certificate.predicate.get("audit_anchor")
    if not isinstance(anchor, dict):
        if audit_log is not None:
            return False, "INVALID (no-anchor): the certificate carries no audit anchor to check the log against"
        return True, "  audit anchor: none (issued before the log's first checkpoint)"
    problem = check_anchor_signature(anchor, keys)
    if problem is not None:
        return False, f"INVALID (anchor-bad-signature): the audit anchor at event {anchor.get('seq')}: {problem}"
    where = f"event {anchor['seq']} hash {str(anchor['hash'])[:16]}…, signed by key {anchor['key_id']}"
    if audit_log is None:
        return True, f"  audit anchor: {where} (check the log against it with --audit-log)"
    problem = check_anchor_against_log(anchor, audit_log)
    if problem is not None:
        return False, f"INVALID (anchor-mismatch): the audit log does not match the certificate's anchor: {problem}"
    return True, f"  audit anchor: {where}; the log matches it (events 1-{anchor['seq']} recomputed)"


def verify_file(path: Path | str, keys_source: str, audit_log: Path | str | None = None) -> tuple[bool, str]:
    """``(True, summary)`` for a valid certificate, ``(False, "INVALID (code): reason")`` otherwise; with
    ``audit_log``, also invalid when that log no longer leads to the certificate's audit anchor.

    Raises :class:`InputUnavailable` when the certificate file, the keys or the log cannot be read at all.
    """
    data = _read_file(Path(path), MAX_CERTIFICATE_BYTES, "certificate")
    keys = load_keys(keys_source)
    events = load_audit_log(audit_log) if audit_log is not None else None
    try:
        certificate = verify_envelope(data, keys, predicate_type=PREDICATE_TYPES)
    except InvalidCertificate as exc:
        return False, f"INVALID ({exc.code}): {exc.reason}"
    except InvalidKeys as exc:  # a mark the document states badly (a retired or revoked time that is no time)
        raise InputUnavailable(f"the keys from {keys_source} are unusable: {exc.reason}") from exc
    ok, anchor_line = check_anchor(certificate, keys, events)
    if not ok:
        return False, anchor_line
    return True, describe(certificate) + "\n" + anchor_line

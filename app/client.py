"""A typed Python client for Lethe's HTTP API (httpx, synchronous), used by the CLI, the demo and the simulated
federation.

It imports nothing of the server (an import-linter contract keeps it so): it can be copied into another code base
with httpx and pydantic alone. Every error answer raises :class:`LetheProblem`, carrying the RFC 9457 fields
(``type``, ``title``, ``status``, ``detail``, ``instance`` and the extensions); scripts switch on ``problem.slug``.

    from app.client import LetheClient
    with LetheClient("http://127.0.0.1:8000", api_key="lethe_...") as lethe:
        request = lethe.submit_deletion(model_id, {"kind": "samples", "sample_ids": ["P0003"]}, subject_ref="alice")
        done = lethe.wait(request.id, on_progress=lambda r: print(r.status, r.progress))

The returned models accept fields a newer server adds (``extra="allow"``), so an older client keeps working.

Retries: a call that is safe to repeat (GET, HEAD, and a POST carrying an ``Idempotency-Key``) is retried with
exponential backoff when the API cannot be reached, or answers 503 or 429, honouring ``Retry-After``; any call is
retried when the connection could not be made at all (nothing was sent). :meth:`LetheClient.submit_deletion` makes
up an ``Idempotency-Key`` when none is given, so its retry is answered with the request the first try created.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import IO, Any

import httpx
from pydantic import BaseModel, ConfigDict, Field

PROBLEM_BASE = "https://lethe.dev/problems/"
TERMINAL_STATUSES = ("certified", "failed", "rejected", "cancelled")
"""A deletion request in one of these states will not change again (unless an admin retries a failed one)."""
DEFAULT_URL = "http://127.0.0.1:8000"
RETRY_STATUSES = (429, 503)
"""Answers that say "try again later": a retryable call waits (``Retry-After`` when given) and tries again."""
SAFE_METHODS = ("GET", "HEAD", "OPTIONS")
ERASURE_END_STATUSES = ("certified", "failed")
"""A per-person erasure in one of these states will not change again."""


class LetheProblem(Exception):
    """An error answer from the API: its problem document (RFC 9457), or one made up for a non-problem answer."""

    def __init__(self, status: int, type: str, title: str, detail: str | None = None, instance: str | None = None,
                 extensions: dict[str, Any] | None = None, headers: dict[str, str] | None = None):  # fmt: skip
        self.status, self.type, self.title, self.detail, self.instance = status, type, title, detail, instance
        self.extensions = extensions or {}
        self.headers = headers or {}
        super().__init__(f"{status} {self.slug}: {detail or title}")

    @property
    def slug(self) -> str:
        """The last part of ``type`` (``model-not-found``, ``unauthorized``...): what scripts switch on."""
        return self.type.removeprefix(PROBLEM_BASE).rsplit("/", 1)[-1] if self.type else "about:blank"

    @classmethod
    def from_response(cls, response: httpx.Response) -> LetheProblem:
        body: Any = None
        with contextlib.suppress(json.JSONDecodeError, UnicodeDecodeError):
            body = response.json()
        headers = dict(response.headers)
        if isinstance(body, dict) and "type" in body and "status" in body:
            known = {"type", "title", "status", "detail", "instance"}
            return cls(
                int(body["status"]),
                str(body["type"]),
                str(body.get("title") or ""),
                body.get("detail"),
                body.get("instance"),
                {k: v for k, v in body.items() if k not in known},
                headers,
            )
        text = response.text[:500] if response.content else None
        return cls(response.status_code, "about:blank", response.reason_phrase or "HTTP error", text, None, {}, headers)


class _Out(BaseModel):
    model_config = ConfigDict(extra="allow")


class ModelVersion(_Out):
    id: str
    number: int
    parent_id: str | None = None
    digest: str
    method: str
    request_id: str | None = None
    metrics: dict[str, Any] = Field(default_factory=dict)
    created_at: datetime
    retired_at: datetime | None = None
    retired_by: str | None = None


class Model(_Out):
    id: str
    name: str
    kind: str
    status: str
    family: str | None = None
    dataset_id: str | None = None
    current_version: ModelVersion | None = None
    unlearning: dict[str, Any] = Field(default_factory=dict)
    error: str | None = None
    created_at: datetime
    links: dict[str, str] = Field(default_factory=dict)
    federation: dict[str, Any] | None = None
    requires_approval: bool = False
    subject_column: str | None = None
    batch: dict[str, int] | None = None
    """The batch bounds (``max_requests``, ``max_rows``) of a tabular model; None for one registered before batches."""
    tags: list[str] = Field(default_factory=list)
    inputs: dict[str, str] | None = None
    """A trained tabular model's feature columns in order, each ``number`` or ``text``: what a row given to
    :meth:`LetheClient.predict` names."""


class ModelPage(_Out):
    items: list[Model]
    next_cursor: str | None = None


class ForgetLock(_Out):
    model_id: str
    request_id: str
    version_id: str
    alpha: float
    rank: int
    n_params: int
    digest: str
    links: dict[str, str] = Field(default_factory=dict)


class DeletionRequest(_Out):
    id: str
    model_id: str
    subject_hash: str
    scope: dict[str, Any]
    method: str
    status: str
    progress: float = 0.0
    message: str | None = None
    attempts: int = 0
    error: dict[str, Any] | None = None
    received_at: datetime | None = None
    due_at: datetime | None = None
    days_left: float | None = None
    overdue: bool = False
    answered_late: bool = False
    extensions: list[dict[str, Any]] = Field(default_factory=list)
    stuck: bool = False
    erasure: dict[str, Any] | None = None
    result_version_id: str | None = None
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None = None
    completed_at: datetime | None = None
    links: dict[str, str] = Field(default_factory=dict)
    location: str | None = Field(None, exclude=True, description="The Location header of a 202 (client side only).")

    @property
    def done(self) -> bool:
        return self.status in TERMINAL_STATUSES


class DeletionRequestPage(_Out):
    items: list[DeletionRequest]
    next_cursor: str | None = None


class Check(_Out):
    name: str | None = None
    figure: float | None = None
    threshold: float | None = None
    passed: bool | None = None
    message: str | None = None
    evidence: bool = False
    """True for a piece of evidence (app/ml/verification/evidence.py, or the membership attack)."""
    informative: bool | None = None
    power: float | None = None
    """How many times above the threshold doing nothing would sit: the check's power to fail."""


class Report(_Out):
    """A verification report: the verdict, its checks, the audit's power, every figure, the plots' links."""

    id: str
    request_id: str
    model_id: str
    verdict: str
    created_at: datetime
    method: str | None = None
    checks: list[Check] = Field(default_factory=list)
    evidence: list[str] = Field(default_factory=list)
    """The evidence class: the informative evidence that passed (empty on a failed verdict)."""
    reasons: list[str] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)
    informative: bool | None = None
    informative_detail: str | None = None
    plots: dict[str, str] = Field(default_factory=dict)


class Job(_Out):
    id: str
    kind: str
    queue: str
    model_id: str
    request_id: str | None = None
    status: str
    attempts: int = 0
    progress: float = 0.0
    message: str | None = None
    result: dict[str, Any] | None = None
    error: str | None = None
    created_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None


class AuditEvent(_Out):
    seq: int
    at: datetime
    actor: str
    action: str
    entity_type: str
    entity_id: str
    payload: dict[str, Any] = Field(default_factory=dict)
    prev_hash: str
    hash: str


class AuditPage(_Out):
    items: list[AuditEvent]
    next_after_seq: int | None = None


class ChainVerdict(_Out):
    ok: bool
    checked: int
    head: dict[str, Any] = Field(default_factory=dict)
    first_broken_seq: int | None = None
    reason: str | None = None
    checkpoints: int = 0
    last_checkpoint_seq: int | None = None


class WebhookDelivery(_Out):
    id: str
    event: str
    url: str
    status: str
    attempts: int = 0
    last_status_code: int | None = None
    last_error: str | None = None


class Readiness(_Out):
    ready: bool
    checks: dict[str, Any] = Field(default_factory=dict)


class BulkResult(_Out):
    id: str
    outcome: str
    """``done`` or ``skipped``."""
    status: str | None = None
    """The request's status after the action (``done``)."""
    reason: str | None = None
    """Why it was skipped (the refusal's detail)."""
    problem_type: str | None = None

    @property
    def problem_slug(self) -> str | None:
        return self.problem_type.removeprefix(PROBLEM_BASE) if self.problem_type else None


class BulkOutcome(_Out):
    """A bulk action's answer: how many requests were selected, acted on and skipped, and each one's outcome."""

    action: str
    selected: int
    done: int
    skipped: int
    results: list[BulkResult] = Field(default_factory=list)


class PredictedVersion(_Out):
    id: str
    number: int
    digest: str


class Prediction(_Out):
    """``POST /v1/models/{id}/predict``'s answer: each row's label and its class probabilities (in ``classes``
    order), and the version that answered (every row of one call, split or not, by the same version)."""

    model_id: str
    version: PredictedVersion
    classes: list[str]
    labels: list[str]
    probabilities: list[list[float]]


@dataclass
class ExportedVersion:
    """A version's weights written to ``path`` by :meth:`LetheClient.export_version`: its size and sha256, and the
    model card its safetensors header carries (``format`` ``lethe.tabular/1`` and ``card``, a tabular version's; both
    None for a federated CLIP version's LoRA vector). ``app/ml/export.py``'s ``load`` reads the file back."""

    path: Path
    size: int
    sha256: str
    format: str | None
    card: dict[str, Any] | None


def safetensors_metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file's header (its first 8 bytes give the header's length, then JSON),
    read without loading a tensor; ``{}`` when there is none. ValueError for bytes that are not safetensors."""
    if len(data) < 8:
        raise ValueError("not a safetensors file: too short")
    size = int.from_bytes(data[:8], "little")
    if size <= 0 or 8 + size > len(data):
        raise ValueError("not a safetensors file: bad header length")
    try:
        header = json.loads(data[8 : 8 + size])
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ValueError("not a safetensors file: the header is not JSON") from None
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    return dict(metadata) if isinstance(metadata, dict) else {}


class ErasureChild(_Out):
    request_id: str
    model_id: str
    status: str
    n_samples: int = 0
    certificate_id: str | None = None
    certificate_digest: str | None = None
    links: dict[str, str] = Field(default_factory=dict)


class Erasure(_Out):
    """A per-person erasure: one deletion request (child) per model holding the subject's rows."""

    id: str
    subject_hash: str
    method: str
    status: str
    """``in-progress``, ``certified`` (every child certified, the combined certificate issued) or ``failed``."""
    children_by_status: dict[str, int] = Field(default_factory=dict)
    children: list[ErasureChild] = Field(default_factory=list)
    certificate_digest: str | None = None
    no_data_found: bool = False
    """No model held rows of the subject: certified at once, with a certificate that says so."""
    created_at: datetime
    completed_at: datetime | None = None
    links: dict[str, str] = Field(default_factory=dict)
    location: str | None = Field(None, exclude=True, description="The Location header of a 202 (client side only).")

    @property
    def done(self) -> bool:
        return self.status in ERASURE_END_STATUSES

    # the shape _poll watches: (status, progress, message)
    @property
    def progress(self) -> float:
        ended = sum(n for status, n in self.children_by_status.items() if status in TERMINAL_STATUSES)
        return ended / len(self.children) if self.children else 0.0

    @property
    def message(self) -> str | None:
        return ", ".join(f"{n} {status}" for status, n in sorted(self.children_by_status.items())) or None


class SubjectErasureRef(_Out):
    id: str
    created_at: datetime
    certificate_digest: str | None = None
    links: dict[str, str] = Field(default_factory=dict)


class SubjectRequests(_Out):
    """A data subject's deletion requests and erasures, found by the keyed hash (``subject_hash``)."""

    subject_hash: str
    requests: list[DeletionRequest] = Field(default_factory=list)
    erasures: list[SubjectErasureRef] = Field(default_factory=list)


@dataclass(frozen=True)
class RetryNotice:
    """What ``on_retry`` is told before the client waits and tries a call again."""

    method: str
    url: str
    attempt: int
    """1 for the first retry."""
    delay: float
    """Seconds the client waits before it (``Retry-After`` when the answer gave one)."""
    reason: str
    """``503 unavailable``, ``429 ...`` or the connection error's name."""


class LetheClient:
    """Lethe's API. ``base_url`` and ``api_key`` default to ``LETHE_URL`` and ``LETHE_API_KEY``. ``transport`` (an
    httpx transport) or ``http`` (a ready ``httpx.Client``, such as FastAPI's TestClient, used as it is) point it at
    an app in the same process.

    ``retries`` (default 4) is how many times a retryable call is tried again, after ``backoff`` seconds doubled at
    each try (with jitter) up to ``max_backoff``; a ``Retry-After`` is waited as given, and one longer than
    ``max_backoff`` ends the retries (the problem is raised). ``on_retry`` sees a :class:`RetryNotice` before each
    wait. ``retries=0`` turns retrying off."""

    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        *,
        timeout: float = 60.0,
        transport: httpx.BaseTransport | None = None,
        http: httpx.Client | None = None,
        retries: int = 4,
        backoff: float = 0.5,
        max_backoff: float = 30.0,
        on_retry: Callable[[RetryNotice], None] | None = None,
    ):
        self.retries, self.backoff, self.max_backoff, self.on_retry = retries, backoff, max_backoff, on_retry
        if http is not None:  # its headers are the caller's: only an explicit api_key is added
            self.api_key, self.http, self._owned = api_key, http, False
            if api_key:
                http.headers["authorization"] = f"Bearer {api_key}"
            return
        self.api_key = api_key if api_key is not None else os.environ.get("LETHE_API_KEY")
        headers = {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        self.http = httpx.Client(
            base_url=base_url or os.environ.get("LETHE_URL", DEFAULT_URL),
            headers=headers,
            timeout=timeout,
            transport=transport,
        )
        self._owned = True

    def __enter__(self) -> LetheClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._owned:
            self.http.close()

    # ------------------------------------------------------------------------------------------------ plumbing
    def request(self, method: str, url: str, *, repeatable: bool = False, **kwargs: Any) -> httpx.Response:
        """Any call; an answer of 400 or more raises :class:`LetheProblem` (304 is not an error). Retried as the
        class says: a safe method or an ``Idempotency-Key`` makes a call repeatable, as does ``repeatable`` (a POST
        that changes nothing, such as a prediction)."""
        method = method.upper()
        headers = kwargs.get("headers") or {}
        repeatable = repeatable or method in SAFE_METHODS or any(k.lower() == "idempotency-key" for k in headers)
        attempt = 0
        while True:
            try:
                response = self.http.request(method, url, **kwargs)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:  # nothing was sent: any call may go again
                if attempt >= self.retries:
                    raise
                delay, reason = self._backoff_delay(attempt), f"cannot connect ({type(exc).__name__})"
            except httpx.TransportError as exc:  # sent, perhaps acted on: only a repeatable call goes again
                if not repeatable or attempt >= self.retries:
                    raise
                delay, reason = self._backoff_delay(attempt), f"connection lost ({type(exc).__name__})"
            else:
                if response.status_code < 400:
                    return response
                problem = LetheProblem.from_response(response)
                # a 429 was refused before any work; a 503 may follow work that still commits (the intake's timeout)
                if response.status_code not in RETRY_STATUSES or attempt >= self.retries:
                    raise problem
                if response.status_code == 503 and not repeatable:
                    raise problem
                told = retry_after_seconds(response.headers.get("retry-after"))
                if told is not None and told > self.max_backoff:
                    raise problem  # waiting less than the server asked would be impolite; waiting longer, a hang
                delay = told if told is not None else self._backoff_delay(attempt)
                reason = f"{response.status_code} {problem.slug}"
            attempt += 1
            if self.on_retry is not None:
                self.on_retry(RetryNotice(method, str(url), attempt, delay, reason))
            time.sleep(delay)

    def _backoff_delay(self, attempt: int) -> float:
        """``backoff`` doubled per attempt, capped, with "equal jitter" (half fixed, half random)."""
        ceiling = min(self.max_backoff, self.backoff * 2**attempt)
        return ceiling / 2 + random.uniform(0, ceiling / 2)

    def _json(self, method: str, url: str, **kwargs: Any) -> Any:
        return self.request(method, url, **kwargs).json()

    @staticmethod
    def _params(**params: Any) -> dict[str, Any]:
        return {k: (str(v).lower() if isinstance(v, bool) else v) for k, v in params.items() if v not in (None, False)}

    # ------------------------------------------------------------------------------------------------ health
    def healthz(self) -> dict[str, Any]:
        return self._json("GET", "/healthz")

    def readyz(self) -> Readiness:
        """Readiness (a 503 is an answer here, not an error: ``ready`` is false and ``checks`` say why)."""
        response = self.http.get("/readyz")
        if response.status_code not in (200, 503):
            raise LetheProblem.from_response(response)
        return Readiness.model_validate(response.json())

    # ------------------------------------------------------------------------------------------------ models
    def list_models(
        self,
        *,
        name: str | None = None,
        name_contains: str | None = None,
        kind: str | None = None,
        status: str | None = None,
        tags: list[str] | None = None,
        limit: int = 50,
        cursor: str | None = None,
    ) -> ModelPage:
        """A page of models; ``tags``: only models carrying every one."""
        params = self._params(name=name, name_contains=name_contains, kind=kind, status=status, tag=tags or None,
                              limit=limit, cursor=cursor)  # fmt: skip
        return ModelPage.model_validate(self._json("GET", "/v1/models", params=params))

    def iter_models(self, **filters: Any) -> Iterator[Model]:
        """Every model matching the filters, following ``next_cursor``."""
        return _follow_cursor(self.list_models, filters)

    def get_model(self, model_id: str) -> Model:
        return Model.model_validate(self._json("GET", f"/v1/models/{model_id}"))

    def update_model(
        self,
        model_id: str,
        *,
        requires_approval: bool | None = None,
        tags: list[str] | None = None,
        batch: dict[str, int] | None = None,
    ) -> Model:
        """Change a model's settings (admin, each change audited): ``requires_approval``, ``tags`` (replaces them
        all; ``[]`` clears them) and ``batch`` (``{"max_requests": n, "max_rows": m}``; a bound left out takes the
        API's default, so give both). At least one."""
        body: dict[str, Any] = {}
        if requires_approval is not None:
            body["requires_approval"] = requires_approval
        if tags is not None:
            body["tags"] = list(tags)
        if batch is not None:
            body["batch"] = dict(batch)
        if not body:
            raise ValueError("give requires_approval, tags or batch")
        return Model.model_validate(self._json("PATCH", f"/v1/models/{model_id}", json=body))

    def register_model(
        self,
        metadata: dict[str, Any],
        file: str | Path | bytes | IO[bytes] | None = None,
        filename: str | None = None,
    ) -> Model:
        """Register a model: with ``file`` (a path, bytes or a binary file) as multipart ``metadata`` + ``file``;
        without, as JSON (a federated CLIP model, or a tabular one whose ``dataset.path`` the server may read)."""
        if file is None:
            return Model.model_validate(self._json("POST", "/v1/models", json=metadata))
        if isinstance(file, str | Path):
            path = Path(file)
            with path.open("rb") as handle:
                return self.register_model(metadata, handle.read(), filename or path.name)
        content = file if isinstance(file, bytes) else file.read()
        files = {"file": (filename or "data.csv", content, "application/octet-stream")}
        return Model.model_validate(
            self._json("POST", "/v1/models", data={"metadata": json.dumps(metadata)}, files=files)
        )

    def wait_model(
        self,
        model_id: str,
        until: Callable[[Model], bool] | None = None,
        *,
        timeout: float = 900,
        interval: float = 0.25,
        on_progress: Callable[[Model], None] | None = None,
    ) -> Model:
        """Poll a model until ``until`` holds (default: it is no longer registering); ``on_progress`` sees each
        changed state. TimeoutError after ``timeout`` seconds. An API that goes away meanwhile is waited for, as in
        :meth:`wait`."""
        until = until or (lambda m: m.status != "registering")
        return _poll(lambda: self.get_model(model_id), until, timeout, interval, on_progress, f"model {model_id}",
                     None, self.max_backoff)  # fmt: skip

    def versions(self, model_id: str) -> list[ModelVersion]:
        return [ModelVersion.model_validate(v) for v in self._json("GET", f"/v1/models/{model_id}/versions")]

    def version_weights(self, model_id: str, number: int) -> bytes:
        """A version's parameters (safetensors, key ``theta``; needs ``models:read``)."""
        return self.request("GET", f"/v1/models/{model_id}/versions/{number}/weights").content

    def export_version(self, model_id: str, number: int, path: str | Path) -> ExportedVersion:
        """Download a version's weights to ``path`` (``models:read``): a tabular version's is a safetensors file
        carrying its model card (README "Taking a model out"). Written whole or not at all (a partial download
        never takes the name), checked against the ``ETag`` (its sha256) when the API gives one. A retired version is
        ``410 version-retired``, an unknown one ``404``."""
        response = self.request("GET", f"/v1/models/{model_id}/versions/{number}/weights")
        data = response.content
        digest = hashlib.sha256(data).hexdigest()
        etag = response.headers.get("etag", "").strip('"')
        if len(etag) == 64 and all(c in "0123456789abcdef" for c in etag) and etag != digest:
            raise LetheProblem(502, "about:blank", "The download does not match its ETag",
                               f"sha256 {digest}, ETag {etag}: try again")  # fmt: skip
        try:
            metadata = safetensors_metadata(data)
        except ValueError:
            metadata = {}
        card = json.loads(metadata["lethe.card"]) if "lethe.card" in metadata else None
        target = Path(path)
        partial = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}.part")
        try:
            partial.write_bytes(data)
            partial.replace(target)
        finally:
            partial.unlink(missing_ok=True)
        return ExportedVersion(target, len(data), digest, metadata.get("format"), card)

    def predict(self, model_id: str, rows: list[dict[str, Any]], *, version: int | None = None) -> Prediction:
        """Labels and class probabilities for ``rows`` (dicts naming every feature column: the model's ``inputs``;
        ``None`` is a missing value) from ``version`` or the current one (``models:read``). More rows than the API
        takes in one call (``413 too-many-rows`` says its ``max_rows``) are sent in parts of that size, every part to
        the version the first one was answered by, and the answers joined in order; a part's ``invalid-rows``
        problem counts its ``row_errors`` from the first row given. Repeated like a GET (a prediction changes
        nothing)."""
        rows = list(rows)
        if not rows:
            raise ValueError("give at least one row")
        size, start, parts = len(rows), 0, []
        while start < len(rows):
            part = rows[start : start + size]
            body: dict[str, Any] = {"rows": part} | ({"version": version} if version is not None else {})
            try:
                answer = Prediction.model_validate(
                    self._json("POST", f"/v1/models/{model_id}/predict", json=body, repeatable=True)
                )
            except LetheProblem as problem:
                most = problem.extensions.get("max_rows")
                if problem.slug == "too-many-rows" and isinstance(most, int) and 0 < most < len(part):
                    size = most
                    continue
                for error in problem.extensions.get("row_errors") or []:
                    if isinstance(error, dict) and isinstance(error.get("row"), int):
                        error["row"] += start
                raise
            version = answer.version.number
            parts.append(answer)
            start += len(part)
        first = parts[0]
        return first.model_copy(update={
            "labels": [label for p in parts for label in p.labels],
            "probabilities": [row for p in parts for row in p.probabilities],
        })  # fmt: skip

    def forget_lock(self, model_id: str) -> ForgetLock | None:
        """A federated model's forget lock after an EASE unlearning, or None when it has none."""
        try:
            return ForgetLock.model_validate(self._json("GET", f"/v1/models/{model_id}/forget-lock"))
        except LetheProblem as problem:
            if problem.slug == "no-forget-lock":
                return None
            raise

    def forget_lock_tensors(self, model_id: str) -> bytes:
        return self.request("GET", f"/v1/models/{model_id}/forget-lock.safetensors").content

    def live_pairs(self, model_id: str) -> dict[str, list[str]]:
        """A federated model's pairs each client may still train on: ``{client_id: [pair ids]}``."""
        return self._json("GET", f"/v1/models/{model_id}/pairs")["clients"]

    def submit_round(self, model_id: str, safetensors_blob: bytes) -> str:
        """Upload one FedAvg round (safetensors ``updates`` and optional ``weights``); returns the aggregation job's
        id."""
        headers = {"content-type": "application/octet-stream"}
        return self._json("POST", f"/v1/models/{model_id}/rounds", content=safetensors_blob, headers=headers)["job_id"]

    def get_job(self, job_id: str) -> Job:
        return Job.model_validate(self._json("GET", f"/v1/jobs/{job_id}"))

    def wait_job(self, job_id: str, *, timeout: float = 600, interval: float = 0.1) -> Job:
        return _poll(lambda: self.get_job(job_id), lambda j: j.status in ("succeeded", "failed", "cancelled"),
                     timeout, interval, None, f"job {job_id}")  # fmt: skip

    # ------------------------------------------------------------------------------------------- deletion requests
    def submit_deletion(
        self,
        model_id: str,
        scope: dict[str, Any],
        subject_ref: str,
        *,
        method: str = "retrain",
        method_settings: dict[str, Any] | None = None,
        callback_url: str | None = None,
        received_at: datetime | str | None = None,
        idempotency_key: str | None = None,
    ) -> DeletionRequest:
        """``scope``: ``{"kind": "samples", "sample_ids": [...]}``, ``{"kind": "class", "label": ...}`` or
        ``{"kind": "client", "client_id": ...}``. Answers once the request is durable (202). Without an
        ``idempotency_key`` one is made up (``lethe-client-<uuid4>``) and sent on every try, so a retry after a lost
        answer is answered with the request the first try created."""
        body: dict[str, Any] = {"subject_ref": subject_ref, "model_id": model_id, "scope": scope, "method": method}
        if method_settings:
            body["method_settings"] = method_settings
        if callback_url:
            body["callback_url"] = callback_url
        if received_at is not None:
            body["received_at"] = received_at.isoformat() if isinstance(received_at, datetime) else received_at
        headers = {"Idempotency-Key": idempotency_key or f"lethe-client-{uuid.uuid4()}"}
        response = self.request("POST", "/v1/deletion-requests", json=body, headers=headers)
        out = DeletionRequest.model_validate(response.json())
        out.location = response.headers.get("location")
        return out

    def get_deletion(self, request_id: str) -> DeletionRequest:
        return DeletionRequest.model_validate(self._json("GET", f"/v1/deletion-requests/{request_id}"))

    def list_deletions(
        self,
        *,
        status: str | None = None,
        model_id: str | None = None,
        stuck: bool = False,
        overdue: bool = False,
        limit: int = 50,
        cursor: str | None = None,
    ) -> DeletionRequestPage:
        params = self._params(status=status, model_id=model_id, stuck=stuck, overdue=overdue, limit=limit,
                              cursor=cursor)  # fmt: skip
        return DeletionRequestPage.model_validate(self._json("GET", "/v1/deletion-requests", params=params))

    def iter_deletions(self, **filters: Any) -> Iterator[DeletionRequest]:
        return _follow_cursor(self.list_deletions, filters)

    def wait(
        self,
        request_id: str,
        *,
        timeout: float = 900,
        interval: float = 0.25,
        on_progress: Callable[[DeletionRequest], None] | None = None,
        on_reconnect: Callable[[Exception, float], None] | None = None,
    ) -> DeletionRequest:
        """Poll a deletion request until it ends (certified, failed, rejected or cancelled). ``on_progress`` is
        called with each changed state (status, progress or message). TimeoutError after ``timeout`` seconds.

        Once the request has been read, an API that goes away (unreachable, 503, 429: a restart) does not end the
        wait: it is polled again with backoff until ``timeout``, ``on_reconnect`` told of each failed poll."""
        return _poll(lambda: self.get_deletion(request_id), lambda r: r.done, timeout, interval, on_progress,
                     f"deletion request {request_id}", on_reconnect, self.max_backoff)  # fmt: skip

    def cancel(self, request_id: str) -> DeletionRequest:
        """Cancel a request no worker has started (admin)."""
        return DeletionRequest.model_validate(self._json("POST", f"/v1/deletion-requests/{request_id}/cancel"))

    def approve(self, request_id: str, note: str | None = None) -> DeletionRequest:
        """Approve a request waiting for approval (its model requires it): its job is created now (admin, audited)."""
        body = {"note": note} if note else None
        return DeletionRequest.model_validate(
            self._json("POST", f"/v1/deletion-requests/{request_id}/approve", json=body)
        )

    def reject(self, request_id: str, reason: str) -> DeletionRequest:
        """Refuse a request waiting for approval, with the reason told to the data subject (admin, audited)."""
        return DeletionRequest.model_validate(
            self._json("POST", f"/v1/deletion-requests/{request_id}/reject", json={"reason": reason})
        )

    def retry(self, request_id: str, method: str | None = None) -> DeletionRequest:
        """Run a failed request again (admin), with its own method or ``method`` (e.g. ``retrain``)."""
        body = {"method": method} if method else None
        return DeletionRequest.model_validate(
            self._json("POST", f"/v1/deletion-requests/{request_id}/retry", json=body)
        )

    def extend(self, request_id: str, months: int, reason: str) -> DeletionRequest:
        """Extend the deadline by one or two months in all, with the reason told to the data subject (admin)."""
        body = {"months": months, "reason": reason}
        return DeletionRequest.model_validate(
            self._json("POST", f"/v1/deletion-requests/{request_id}/extend", json=body)
        )

    def bulk(
        self,
        action: str,
        *,
        ids: list[str] | None = None,
        filter: dict[str, Any] | None = None,
        months: int | None = None,
        reason: str | None = None,
    ) -> BulkOutcome:
        """One operator action (``cancel``, ``retry``, ``approve``, ``reject`` with ``reason``, ``extend`` with
        ``months`` and ``reason``) over explicit ``ids`` or the list endpoint's ``filter`` (``status``, ``model_id``,
        ``overdue``, ``stuck``, ``created_after``, ``created_before``) (admin). Each request is acted on and audited
        on its own; one that cannot take the action is skipped with the reason. Not retried once sent (the API
        takes no Idempotency-Key here)."""
        body: dict[str, Any] = {"action": action}
        if ids is not None:
            body["ids"] = list(ids)
        if filter is not None:
            body["filter"] = {k: (v.isoformat() if isinstance(v, datetime) else v) for k, v in filter.items()
                              if v not in (None, False)}  # fmt: skip
        if months is not None:
            body["months"] = months
        if reason is not None:
            body["reason"] = reason
        return BulkOutcome.model_validate(self._json("POST", "/v1/deletion-requests/bulk", json=body))

    def webhook_deliveries(self, request_id: str) -> list[WebhookDelivery]:
        items = self._json("GET", f"/v1/deletion-requests/{request_id}/webhooks")["items"]
        return [WebhookDelivery.model_validate(d) for d in items]

    def redeliver(self, request_id: str, delivery_id: str) -> WebhookDelivery:
        url = f"/v1/deletion-requests/{request_id}/webhooks/{delivery_id}/redeliver"
        return WebhookDelivery.model_validate(self._json("POST", url))

    # ------------------------------------------------------------------------------------------ per-person erasure
    def erase_subject(
        self, subject_ref: str, *, method: str = "auto", received_at: datetime | str | None = None
    ) -> Erasure:
        """Erase one data subject from every model registered with a ``subject_column`` holding rows of theirs:
        one deletion request per model, followed together (202). A subject no model holds rows of is answered the
        same way, certified at once with ``no_data_found`` and no children. Not retried once sent (the API takes no
        Idempotency-Key here; a second erasure of the same subject while the first runs is a 409)."""
        body: dict[str, Any] = {"subject_ref": subject_ref, "method": method}
        if received_at is not None:
            body["received_at"] = received_at.isoformat() if isinstance(received_at, datetime) else received_at
        response = self.request("POST", "/v1/subjects/erasures", json=body)
        out = Erasure.model_validate(response.json())
        out.location = response.headers.get("location")
        return out

    def get_erasure(self, erasure_id: str) -> Erasure:
        return Erasure.model_validate(self._json("GET", f"/v1/subjects/erasures/{erasure_id}"))

    def wait_erasure(
        self,
        erasure_id: str,
        *,
        timeout: float = 900,
        interval: float = 0.5,
        on_progress: Callable[[Erasure], None] | None = None,
        on_reconnect: Callable[[Exception, float], None] | None = None,
    ) -> Erasure:
        """Poll an erasure until it is certified (every child certified, the combined certificate issued) or
        failed; as :meth:`wait` (``progress`` is the share of children that ended)."""
        return _poll(lambda: self.get_erasure(erasure_id), lambda e: e.done, timeout, interval, on_progress,
                     f"erasure {erasure_id}", on_reconnect, self.max_backoff)  # fmt: skip

    def erasure_certificate(self, erasure_id: str) -> dict[str, Any]:
        """The combined certificate (a DSSE envelope, as signed) once issued; ``404 certificate-not-issued``
        before. Verify it offline with ``lethe verify-certificate``."""
        return self._json("GET", f"/v1/subjects/erasures/{erasure_id}/certificate")

    def subject_requests(self, subject_hash: str, *, limit: int = 100) -> SubjectRequests:
        """A data subject's deletion requests and erasures, newest first, by the keyed hash every request and
        erasure reports as ``subject_hash`` (the raw reference is never stored: the API cannot search for it)."""
        return SubjectRequests.model_validate(
            self._json("GET", f"/v1/subjects/{subject_hash}/requests", params={"limit": limit})
        )

    def lookup_subject(self, subject_ref: str, *, limit: int = 100) -> SubjectRequests:
        """The same, by the person's reference: the server computes the keyed hash (POST /v1/subjects/lookup, so
        the reference stays out of URLs and logs). Writes nothing, so it is repeated like a GET."""
        body = {"subject_ref": subject_ref, "limit": limit}
        return SubjectRequests.model_validate(self._json("POST", "/v1/subjects/lookup", json=body, repeatable=True))

    # ------------------------------------------------------------------------------------------------ evidence
    def reports(self, request_id: str) -> list[Report]:
        """A request's verification reports, in order (``auto`` may have escalated: two)."""
        items = self._json("GET", "/v1/reports", params={"request_id": request_id})["items"]
        return [Report.model_validate(r) for r in items]

    def get_report(self, report_id: str) -> Report:
        return Report.model_validate(self._json("GET", f"/v1/reports/{report_id}"))

    def report_plot(self, report_id: str, name: str) -> bytes:
        """A report's plot (PNG bytes)."""
        return self.request("GET", f"/v1/reports/{report_id}/plots/{name}").content

    def certificate(self, certificate_id_or_url: str) -> dict[str, Any]:
        """A deletion certificate's DSSE envelope, as signed (save it as JSON and verify it offline). Takes the
        certificate's id or the ``links.certificate`` path of a request."""
        path = certificate_id_or_url
        if not path.startswith("/"):
            path = f"/v1/certificates/{path}"
        return self._json("GET", path)

    def signing_keys(self) -> dict[str, Any]:
        """The public keys document (``/.well-known/lethe-keys.json``) that verifies certificates."""
        return self._json("GET", "/.well-known/lethe-keys.json")

    # ------------------------------------------------------------------------------------------------ audit
    def audit_events(self, *, after_seq: int = 0, limit: int = 100, entity_id: str | None = None) -> AuditPage:
        params = self._params(after_seq=after_seq, limit=limit, entity_id=entity_id)
        return AuditPage.model_validate(self._json("GET", "/v1/audit", params=params))

    def iter_audit(self, *, entity_id: str | None = None, page_size: int = 1000) -> Iterator[AuditEvent]:
        after = 0
        while True:
            page = self.audit_events(after_seq=after, limit=page_size, entity_id=entity_id)
            yield from page.items
            if page.next_after_seq is None:
                return
            after = page.next_after_seq

    def verify_audit(self) -> ChainVerdict:
        """Recompute the audit log's hash chain on the server."""
        return ChainVerdict.model_validate(self._json("GET", "/v1/audit/verify"))

    def webhook_secret(self, url: str, key: str | None = None) -> str:
        """The ``whsec_`` secret one requesting key's events to this callback URL are signed with (admin). ``key``:
        that key's id or prefix; default this client's own key."""
        if key is None:
            parts = (self.api_key or "").split("_")
            if len(parts) < 3 or parts[0] != "lethe":
                raise ValueError("give key= (an API key's id or prefix): this client's own key is not known")
            key = parts[1]
        return self._json("POST", "/v1/webhooks/secret", json={"url": url, "key": key})["secret"]


def retry_after_seconds(value: str | None) -> float | None:
    """A ``Retry-After`` header as seconds from now: delay-seconds or an HTTP date (RFC 9110); None when absent or
    unreadable."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        moment = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return max(0.0, (moment - datetime.now(UTC)).total_seconds())


def unavailable(exc: BaseException) -> bool:
    """True for a failure that says "the API is away, try later": no connection, or a 503 or 429 answer."""
    if isinstance(exc, LetheProblem):
        return exc.status in RETRY_STATUSES
    return isinstance(exc, httpx.TransportError)


def _poll(fetch, until, timeout: float, interval: float, on_progress, what: str, on_reconnect=None,
          max_backoff: float = 30.0):  # fmt: skip
    """Fetch until ``until`` holds. After the first answer, an unavailable API (see :func:`unavailable`) is polled
    again with backoff (``Retry-After`` when given) until the deadline, ``on_reconnect(error, delay)`` told each
    time: a restarted server does not end a wait; ``on_progress`` sees the first answer after an outage even when
    nothing changed."""
    deadline = time.monotonic() + timeout
    last = None
    seen = False
    outage = 0
    while True:
        try:
            value = fetch()
        except Exception as exc:
            if not seen or not unavailable(exc) or time.monotonic() > deadline:
                raise
            told = retry_after_seconds(exc.headers.get("retry-after")) if isinstance(exc, LetheProblem) else None
            delay = min(told if told is not None else interval * 2 ** min(outage, 10), max_backoff)
            delay = max(0.0, min(delay, deadline - time.monotonic()))
            outage += 1
            if on_reconnect is not None:
                on_reconnect(exc, delay)
            time.sleep(delay)
            continue
        state = (getattr(value, "status", None), getattr(value, "progress", None), getattr(value, "message", None))
        if on_progress is not None and (state != last or outage):
            on_progress(value)
        seen, outage = True, 0
        last = state
        if until(value):
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not finish in {timeout:g} s")
        time.sleep(interval)


def _follow_cursor(list_page: Callable[..., Any], filters: dict[str, Any]) -> Iterator[Any]:
    """Every item of a keyset-paged list, page after page (``next_cursor`` passed back as ``cursor``)."""
    cursor = None
    while True:
        page = list_page(cursor=cursor, **filters)
        yield from page.items
        if not page.next_cursor:
            return
        cursor = page.next_cursor

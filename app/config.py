"""Settings, read from the environment with the prefix ``LETHE_`` (pydantic-settings).

With nothing set, Lethe runs on the embedded default: a SQLite file and a local artifact folder under ``./var``, and
an in-process executor instead of Celery, so that ``make demo`` needs no server.

Secrets: one master secret (``LETHE_SECRET_KEY``, at least 32 bytes, or a generated ``home/secret.key``); every use
gets its own key derived from it with HKDF-SHA256 (``Settings.derived_key(purpose)``), so a key leaked from one use
(a webhook receiver's) says nothing about the others (API-key hashes, subject hashes).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import secrets
import time
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

MIN_SECRET_BYTES = 32

KEY_PURPOSES = frozenset(
    {
        "api-key",
        "subject-hash",
        "row-id-hash",
        "request-fingerprint",
        "webhook-signing",
        "audit-checkpoint",
        "audit-text",
        "dashboard-session",
        "dashboard-csrf",
    }
)
"""Every use of the master secret; ``derived_key`` refuses any other name (a typo must not yield a working key)."""


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LETHE_", env_file=".env", extra="ignore")

    home: Path = Field(Path("var"), description="Folder for the embedded database, artifacts and the secret key.")
    database_url: str | None = Field(None, description="SQLAlchemy URL; default a SQLite file in `home`.")
    migration_database_url: str | None = Field(
        None,
        description="PostgreSQL: the tables' owner, for `lethe migrate` only; the service then runs as the role in "
        "`database_url`, which `lethe migrate` grants INSERT and SELECT but no UPDATE or DELETE on the audit log "
        "(README, the audit log). Default: `database_url` does both.",
    )
    broker_url: str | None = Field(None, description="Celery broker (redis://...); none = in-process executor.")
    artifact_url: str | None = Field(None, description="fsspec URL of the artifact store; default `home`/artifacts.")
    secret_key: SecretStr | None = Field(
        None,
        description="Master secret (>= 32 bytes) the per-purpose keys are derived from; default a generated file "
        "in `home`.",
    )
    data_roots: Annotated[list[Path], NoDecode] = Field(
        default_factory=list,
        description="Folders a registered data-set path may lie under; none by default (uploads only). A root may "
        "not contain the service's home, the artifact store or a `.env` file.",
    )
    max_body_bytes: int = Field(1_000_000, description="Largest JSON body accepted (uploads: max_upload_bytes).")
    max_upload_bytes: int = Field(512 * 1024 * 1024, description="Largest data-set upload accepted.")
    max_form_field_bytes: int = Field(
        64 * 1024, ge=1024, description="Largest non-file multipart field (the registration's `metadata`)."
    )
    max_round_bytes: int = Field(
        256 * 1024 * 1024, ge=1024, description="Largest federated round upload (raw or multipart)."
    )
    max_table_cells: int = Field(
        200_000_000, ge=1, description="Most rows x columns of an uploaded or registered table (Parquet and CSV)."
    )
    max_table_bytes: int = Field(
        1024**3,
        ge=1024,
        description="Most bytes a registered table may hold once decoded (Parquet: decompressed and its dictionaries "
        "expanded; CSV: the file).",
    )
    max_sample_ids: int = Field(100_000, description="Most sample ids in one deletion request.")
    batch_max_requests: int = Field(
        10_000, ge=1, description="The operator's cap on a model's batch.max_requests (its registration sets its own)."
    )
    batch_max_rows: int = Field(100_000, ge=1, description="The operator's cap on a model's batch.max_rows.")
    intake_batch_max: int = Field(64, description="Most deletion requests committed together (group commit).")
    intake_batch_wait_ms: float = Field(2.0, description="Longest a request waits for others to share a commit.")
    intake_batch_gap_ms: float = Field(
        0.5,
        ge=0,
        description="A batch is cut once no request has joined it for this long (the burst is over). Under load the "
        "event loop hands requests to the batcher ~50 us apart (p99 ~0.3 ms) and bursts come ~5-12 ms apart "
        "(bench/intake.py, issue 21), so 0.5 ms separates them.",
    )
    intake_threads: int = Field(
        1, ge=1, le=16, description="Intake threads per API process, each committing its own batches (group commit)."
    )
    intake_timeout_seconds: float = Field(
        30.0, gt=0, description="Longest a POST waits for its commit before a 503 (retry: same Idempotency-Key)."
    )
    lease_seconds: float = Field(
        30.0,
        gt=0,
        description="How long a worker's lease on a job lasts unless renewed; a running job's heartbeat renews it "
        "every sixth of this, so a killed worker's model is free again after at most this long.",
    )
    db_connect_timeout_seconds: int = Field(
        5, ge=2, description="PostgreSQL: longest wait for a new connection (a database away or frozen: 503)."
    )
    db_statement_timeout_seconds: float = Field(
        60.0, ge=0, description="PostgreSQL: longest one statement may run, lock waits included (0: no limit)."
    )
    db_pool_timeout_seconds: float = Field(
        10.0, gt=0, description="Longest wait for a free pooled database connection before a 503."
    )
    transient_backoff_seconds: float = Field(
        5.0,
        gt=0,
        description="A job that met the infrastructure away (a full or read-only artifact disk, the database or broker "
        "down) waits this long, doubled at each further such failure; it spends no attempt.",
    )
    transient_backoff_max_seconds: float = Field(
        300.0, gt=0, description="The longest wait between two tries of a job held up by the infrastructure."
    )
    transient_give_up_seconds: float = Field(
        6 * 3600.0,
        gt=0,
        description="A job held up by the infrastructure for longer than this (since its first such failure) fails.",
    )
    dispatch_timeout_seconds: float = Field(600.0, description="Re-offer a dispatched job no worker took by then.")
    max_attempts: int = Field(3, description="Attempts before a job fails for good.")
    poll_seconds: float = Field(0.5, description="How often the dispatcher and in-process executor poll the outbox.")
    run_dispatcher: bool = Field(True, description="Run the dispatcher/reconciler loop inside the API process.")
    retry_after_seconds: int = Field(5, description="Retry-After sent with 202 Accepted.")
    webhook_timeout_seconds: float = Field(5.0, gt=0, description="Total time one webhook delivery attempt may take.")
    webhook_retry_hours: float = Field(24.0, gt=0, description="How long a webhook is retried before it is dead.")
    webhook_allowed_hosts: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Hosts, addresses or CIDRs a callback may reach although private or loopback (e.g. 127.0.0.1).",
    )
    auto_max_param_ratio: float = Field(
        0.1,
        gt=0,
        description='method "auto" takes a fast method only if its validated median param_ratio '
        "||theta' - theta_r|| / ||theta - theta_r|| is at most this; else exact retraining.",
    )
    retired_version_grace_seconds: float = Field(
        0.0, ge=0, description="How long a version trained on erased rows stays stored (410 at once) before shredding."
    )
    orphan_blob_grace_seconds: float = Field(
        3600.0,
        ge=0,
        description="The sweep shreds a blob nothing references (and a temp file) once it is older than this.",
    )
    blob_sweep_interval_seconds: float = Field(
        3600.0, gt=0, description="How often the dispatcher sweeps the artifact store for unreferenced blobs."
    )
    max_job_seconds: dict[str, float] = Field(
        default_factory=lambda: {"deletion": 3600.0, "aggregate_round": 3600.0, "train_model": 6 * 3600.0},
        description="Longest one attempt of a job kind may run: its lease is no longer renewed and the job fails.",
    )
    deadline_months: int = Field(1, ge=1, le=3, description="GDPR Art. 12(3): answer within one month of receipt.")
    max_extension_months: int = Field(2, ge=0, le=2, description="Art. 12(3): extendable by two further months.")
    stuck_after_seconds: float = Field(
        600.0, gt=0, description="A request still received/queued after this long is reported as stuck."
    )
    subject_calls_per_minute: int = Field(
        30,
        ge=1,
        description="Most per-person erasures and subject look-ups one API key may make per minute, per API "
        "process (429 with Retry-After beyond): each answers about a named person, so guessing people is slowed.",
    )
    bulk_max_requests: int = Field(
        500, ge=1, le=10_000, description="Most deletion requests one bulk operator action may select."
    )
    dashboard_insecure_cookies: bool = Field(
        False,
        description="Allow the dashboard over plain http from a host other than localhost: its cookies lose the "
        "Secure flag (browsers drop a Secure cookie set over http, and every form then expires). Off: always Secure.",
    )
    dashboard_session_idle_seconds: int = Field(
        1800,
        gt=0,
        description="A dashboard session unused this long ends (the operator logs in again); each page or poll "
        "counts as use.",
    )
    dashboard_session_max_seconds: int = Field(
        8 * 3600,
        gt=0,
        description="A dashboard session ends this long after its login, however busy. Logout, and revoking or "
        "expiry of the API key it logged in with, end it at once.",
    )
    log_level: str = Field("INFO", description="Log level of the API and workers (DEBUG, INFO, WARNING, ERROR).")
    log_json: bool = Field(True, description="JSON log lines (structlog); false: key=value lines for a terminal.")
    opentelemetry: bool = Field(
        False,
        description="FastAPI's native OpenTelemetry (spans, metrics and logs through the globally configured "
        "providers). Off by default: Lethe's metrics are Prometheus's (/metrics), its logs structlog's; on, every "
        "request asks the global providers whether they are configured (issue 21: ~5 % of the event loop).",
    )
    audit_checkpoint_every: int = Field(
        100,
        ge=1,
        description="Write a signed checkpoint of the audit chain's head every N events (each records N; the "
        "verifier requires every one).",
    )

    @field_validator("data_roots", "webhook_allowed_hosts", mode="before")
    @classmethod
    def _comma_separated(cls, value: Any) -> Any:
        """A list setting as people write it: ``a,b`` (or one value), or a JSON list ``["a", "b"]``."""
        if not isinstance(value, str):
            return value
        text = value.strip()
        if text.startswith("["):
            try:
                return json.loads(text)
            except json.JSONDecodeError:
                raise ValueError('a JSON list that does not parse; write "a,b" or ["a", "b"]') from None
        return [part.strip() for part in text.split(",") if part.strip()]

    @field_validator("secret_key")
    @classmethod
    def _long_enough(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and len(value.get_secret_value().encode()) < MIN_SECRET_BYTES:
            raise ValueError(
                f"LETHE_SECRET_KEY must be at least {MIN_SECRET_BYTES} bytes (generate one with "
                "`python -c 'import secrets; print(secrets.token_urlsafe(48))'`), or leave it unset to have one "
                "generated in LETHE_HOME/secret.key"
            )
        return value

    @model_validator(mode="after")
    def _safe_data_roots(self) -> Settings:
        """A data root that holds the service's own files, or lies among them, would let a registration read them
        back (the signing keys and the master secret live in the home): refused both ways, on resolved paths."""
        protected = {"the service's home (LETHE_HOME)": self.home.expanduser().resolve()}
        artifacts = self.local_artifact_path
        if artifacts is not None:
            protected["the artifact store (LETHE_ARTIFACT_URL)"] = artifacts
        database = self.local_database_path
        if database is not None:
            protected["the SQLite database (LETHE_DATABASE_URL)"] = database.parent
        env_file = (Path.cwd() / ".env").resolve()
        for raw in self.data_roots:
            root = raw.expanduser().resolve()
            for what, path in protected.items():
                if path.is_relative_to(root):
                    raise ValueError(
                        f"LETHE_DATA_ROOTS: {str(root)!r} contains {what} ({path}); choose a folder "
                        "that holds only data sets"
                    )
                if root.is_relative_to(path):
                    raise ValueError(
                        f"LETHE_DATA_ROOTS: {str(root)!r} lies inside {what} ({path}); choose a folder "
                        "outside it that holds only data sets"
                    )
            if (env_file.exists() and env_file.is_relative_to(root)) or (root / ".env").exists():
                raise ValueError(
                    f"LETHE_DATA_ROOTS: {str(root)!r} contains a .env file; choose a folder that holds only data sets"
                )
        return self

    @property
    def local_artifact_path(self) -> Path | None:
        """The artifact store's folder when it is on the local disk (a plain path or file://), else None."""
        url = self.resolved_artifact_url
        if url.startswith("file://"):
            return Path(url[len("file://") :]).expanduser().resolve()
        if "://" in url:
            return None
        return Path(url).expanduser().resolve()

    @property
    def local_database_path(self) -> Path | None:
        if self.database_url is None:
            return (self.home / "lethe.db").expanduser().resolve()
        if self.database_url.startswith("sqlite:///") and self.database_url != "sqlite:///:memory:":
            return Path(self.database_url[len("sqlite:///") :]).expanduser().resolve()
        return None

    def _private_home(self) -> None:
        """The home holds the secret and (by default) the database and artifacts: owner only (0700)."""
        if not self.home.exists():
            self.home.mkdir(parents=True, exist_ok=True, mode=0o700)
            with contextlib.suppress(OSError):
                os.chmod(self.home, 0o700)

    @property
    def resolved_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        self._private_home()
        path = (self.home / "lethe.db").resolve()
        if not path.exists():  # created here, owner-only; SQLite gives its -wal and -shm files the same mode
            with contextlib.suppress(FileExistsError):
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        return f"sqlite:///{path}"

    @property
    def resolved_artifact_url(self) -> str:
        return self.artifact_url or str((self.home / "artifacts").resolve())

    @property
    def embedded_executor(self) -> bool:
        return not self.broker_url

    def secret(self) -> bytes:
        """The master secret; generated once into ``home/secret.key`` (mode 0600) when not configured.

        Race-free: the new secret is written to a private temporary file and linked into place (link fails if the
        name exists, and the name never points at a half-written file); everyone then reads the one that won.
        """
        if self.secret_key is not None:
            return self.secret_key.get_secret_value().encode()
        return _file_secret(str(self.home.expanduser().resolve()))

    def derived_key(self, purpose: str) -> bytes:
        """A 32-byte key for one purpose, derived from the master secret with HKDF-SHA256 (RFC 5869)."""
        if purpose not in KEY_PURPOSES:
            raise ValueError(f"unknown key purpose {purpose!r}; one of {sorted(KEY_PURPOSES)}")
        return _derive(self.secret(), purpose)


def hmac_hex(key: bytes, text: str) -> str:
    """HMAC-SHA256 of ``text`` under ``key``, in hex: the key's padded inner and outer states are hashed once per key
    and copied (the intake hashes four values per request: half the time of a fresh ``hmac.new`` each, issue 21)."""
    keyed = _keyed(key).copy()
    keyed.update(text.encode())
    return keyed.hexdigest()


@lru_cache(maxsize=64)
def _keyed(key: bytes) -> hmac.HMAC:
    return hmac.new(key, digestmod=hashlib.sha256)


@lru_cache(maxsize=64)
def _derive(master: bytes, purpose: str) -> bytes:
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    return HKDF(algorithm=hashes.SHA256(), length=32, salt=b"lethe-kdf-v1", info=f"lethe:{purpose}".encode()).derive(
        master
    )


def _read_secret(path: Path) -> bytes:
    value = b""
    for _ in range(50):  # only the no-hard-link fallback below can expose a file still being written
        value = path.read_text().strip().encode()
        if len(value) >= MIN_SECRET_BYTES:
            return value
        time.sleep(0.02)
    raise RuntimeError(f"{path} holds a secret shorter than {MIN_SECRET_BYTES} bytes; remove it or replace it")


def _file_secret(home: str) -> bytes:
    folder = Path(home)
    path = folder / "secret.key"
    if path.exists():
        return _read_secret(path)
    if not folder.exists():
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    value = secrets.token_urlsafe(48)
    tmp = folder / f".secret.key.{os.getpid()}.{secrets.token_hex(8)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(value)
            handle.flush()
            os.fsync(handle.fileno())
        try:
            os.link(tmp, path)  # atomic, and fails if the name exists: another process's secret wins
        except FileExistsError:
            pass
        except OSError:  # a file system without hard links: exclusive create, then everyone re-reads
            with contextlib.suppress(FileExistsError):
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "w") as handle:
                    handle.write(value)
    finally:
        tmp.unlink(missing_ok=True)
    return _read_secret(path)


class SettingsError(SystemExit):
    """Settings that cannot be used, as one line naming each variable and what it accepts — never its value (it may
    be a secret). A SystemExit, so that every process (the CLI, the API, a worker) stops with that line, not a
    105-line traceback (issue 23)."""


def describe(error: ValidationError) -> str:
    parts = []
    for item in error.errors(include_input=False, include_url=False):
        name = f"LETHE_{str(item['loc'][0]).upper()}" if item["loc"] else "settings"
        parts.append(f"{name}: {item['msg'].removeprefix('Value error, ')}")
    return "lethe: invalid settings: " + "; ".join(parts)


@lru_cache
def get_settings() -> Settings:
    try:
        return Settings()
    except ValidationError as exc:
        raise SettingsError(describe(exc)) from None

"""Settings, read from the environment with the prefix ``LETHE_`` (pydantic-settings).

With nothing set, Lethe runs on the embedded default: a SQLite file and a local artifact folder under ``./var``, and
an in-process executor instead of Celery, so that ``make demo`` needs no server.
"""

from __future__ import annotations

import os
import secrets
from functools import lru_cache
from pathlib import Path

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LETHE_", env_file=".env", extra="ignore")

    home: Path = Field(Path("var"), description="Folder for the embedded database, artifacts and the secret key.")
    database_url: str | None = Field(None, description="SQLAlchemy URL; default a SQLite file in `home`.")
    broker_url: str | None = Field(None, description="Celery broker (redis://...); none = in-process executor.")
    artifact_url: str | None = Field(None, description="fsspec URL of the artifact store; default `home`/artifacts.")
    secret_key: SecretStr | None = Field(
        None, description="Key for HMACs of API keys and subject references; default a generated file in `home`."
    )
    data_roots: list[Path] = Field(
        default_factory=lambda: [Path.cwd()], description="Folders a registered data-set path may lie under."
    )
    max_body_bytes: int = Field(1_000_000, description="Largest JSON body accepted (uploads: max_upload_bytes).")
    max_upload_bytes: int = Field(512 * 1024 * 1024, description="Largest data-set upload accepted.")
    max_sample_ids: int = Field(100_000, description="Most sample ids in one deletion request.")
    intake_batch_max: int = Field(64, description="Most deletion requests committed together (group commit).")
    intake_batch_wait_ms: float = Field(2.0, description="How long a request waits for others to share a commit.")
    lease_seconds: float = Field(300.0, description="How long a worker's lease on a job lasts between heartbeats.")
    dispatch_timeout_seconds: float = Field(600.0, description="Re-offer a dispatched job no worker took by then.")
    max_attempts: int = Field(3, description="Attempts before a job fails for good.")
    poll_seconds: float = Field(0.5, description="How often the dispatcher and in-process executor poll the outbox.")
    run_dispatcher: bool = Field(True, description="Run the dispatcher/reconciler loop inside the API process.")
    retry_after_seconds: int = Field(5, description="Retry-After sent with 202 Accepted.")
    webhook_timeout_seconds: float = 5.0
    auto_max_param_ratio: float = Field(
        0.1,
        gt=0,
        description='method "auto" takes a fast method only if its validated median param_ratio '
        "||theta' - theta_r|| / ||theta - theta_r|| is at most this; else exact retraining.",
    )
    retired_version_grace_seconds: float = Field(
        0.0, ge=0, description="How long a version trained on erased rows stays stored (410 at once) before shredding."
    )

    @property
    def resolved_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        self.home.mkdir(parents=True, exist_ok=True)
        return f"sqlite:///{(self.home / 'lethe.db').resolve()}"

    @property
    def resolved_artifact_url(self) -> str:
        return self.artifact_url or str((self.home / "artifacts").resolve())

    @property
    def embedded_executor(self) -> bool:
        return not self.broker_url

    def secret(self) -> bytes:
        """The HMAC key; generated once into ``home/secret.key`` (mode 0600) when not configured."""
        if self.secret_key is not None:
            return self.secret_key.get_secret_value().encode()
        path = self.home / "secret.key"
        if not path.exists():
            self.home.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as handle:
                handle.write(secrets.token_urlsafe(48))
        return path.read_text().strip().encode()


@lru_cache
def get_settings() -> Settings:
    return Settings()

"""The operations endpoints' bodies (``/readyz``, ``/healthz``)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class ReadinessOut(BaseModel):
    """200 when ``ready``, else 503 with the same body: ``checks`` name what is missing (to a ``metrics:read`` key
    only; anyone else gets ``ready`` alone)."""

    ready: bool
    checks: dict[str, str] | None = Field(
        None,
        description='What this process needs, each "ok" or why not: database, executor (embedded default). Only '
        "with a `metrics:read` key.",
    )
    workers: dict[str, int] | None = Field(
        None,
        description="Celery workers whose heartbeat is fresh, per queue (reported, never required; only with a "
        "`metrics:read` key).",
    )


class HealthOut(BaseModel):
    status: Literal["ok"]
    executor: Literal["in-process", "celery"]

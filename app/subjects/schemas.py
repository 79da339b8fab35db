from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field

from app.registry.schemas import MethodName
from app.requests.schemas import DeletionRequestOut
from app.requests.tables import REQUEST_STATUSES
from app.validation import NoNulModel


class ErasureCreate(NoNulModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    subject_ref: str = Field(
        ...,
        min_length=1,
        max_length=500,
        description="The data subject's value in the models' `subject_column`. Used only to compute its keyed hash.",
    )
    method: MethodName = Field(
        "auto", min_length=1, max_length=64, description="Each child's method (auto: chosen per model)."
    )
    received_at: AwareDatetime | None = Field(
        None, description="When the data subject's request reached the controller (each child's deadline runs from it)."
    )


class ErasureChildOut(BaseModel):
    request_id: str
    model_id: str
    status: Literal[REQUEST_STATUSES]  # type: ignore[valid-type]
    n_samples: int
    error: dict[str, Any] | None = Field(
        None, description="Why this model's request failed (e.g. it could not start: model not ready, rows held)."
    )
    certificate_id: str | None = None
    certificate_digest: str | None = None
    links: dict[str, str]


class ErasureOut(BaseModel):
    id: str
    subject_hash: str
    method: MethodName
    status: Literal["in-progress", "certified", "failed"] = Field(
        ...,
        description="certified: every child certified and the combined certificate issued (at once when no model "
        "held rows of the subject).",
    )
    no_data_found: bool = Field(
        False,
        description="No model held live rows of the subject when it was looked up: the erasure has no children and "
        "was certified at once, by a combined certificate that says so.",
    )
    children_by_status: dict[str, int]
    children: list[ErasureChildOut]
    certificate_digest: str | None = None
    created_at: datetime
    completed_at: datetime | None = None
    links: dict[str, str]


class ErasureSummary(BaseModel):
    id: str
    created_at: datetime
    certificate_digest: str | None = None
    links: dict[str, str]


class SubjectLookup(NoNulModel):
    model_config = ConfigDict(extra="forbid")
    subject_ref: str = Field(
        ..., min_length=1, max_length=500, description="The data subject's reference; only its keyed hash is used."
    )
    limit: int = Field(100, ge=1, le=500)


class SubjectRequestsOut(BaseModel):
    subject_hash: str
    requests: list[DeletionRequestOut]
    erasures: list[ErasureSummary]

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field

from app.requests.schemas import DeletionRequestOut
from app.validation import NoNulModel


class ErasureCreate(NoNulModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    subject_ref: str = Field(
        ...,
        min_length=1,
        max_length=500,
        description="The data subject's value in the models' `subject_column`. Used only to compute its keyed hash.",
    )
    method: str = Field("auto", min_length=1, max_length=64, description="Each child's method: auto | retrain | ...")
    received_at: AwareDatetime | None = Field(
        None, description="When the data subject's request reached the controller (each child's deadline runs from it)."
    )


class ErasureChildOut(BaseModel):
    request_id: str
    model_id: str
    status: str
    n_samples: int
    certificate_id: str | None = None
    certificate_digest: str | None = None
    links: dict[str, str]


class ErasureOut(BaseModel):
    id: str
    subject_hash: str
    method: str
    status: str  # in-progress | certified (every child certified and the combined certificate issued) | failed
    children_by_status: dict[str, int]
    children: list[ErasureChildOut]
    certificate_digest: str | None = None
    created_at: datetime
    completed_at: datetime | None = None
    links: dict[str, str]


class SubjectRequestsOut(BaseModel):
    subject_hash: str
    requests: list[DeletionRequestOut]
    erasures: list[dict[str, Any]]

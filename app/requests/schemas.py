from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, Literal

from pydantic import AnyHttpUrl, AwareDatetime, BaseModel, ConfigDict, Field, field_validator

from app.registry.schemas import MethodName
from app.requests.tables import REQUEST_STATUSES
from app.validation import NoNulModel

SampleId = Annotated[str, Field(min_length=1, max_length=200)]
RECEIVED_AT_SKEW = timedelta(minutes=5)
"""How far ahead of the service's clock a ``received_at`` may be (the caller's clock may run fast)."""


class SamplesScope(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: Literal["samples"]
    sample_ids: list[SampleId] = Field(..., min_length=1)
    client_id: str | None = Field(None, description="Federated models: the client holding the samples.")

    @field_validator("sample_ids", mode="before")
    @classmethod
    def _ids_as_strings(cls, value: Any) -> Any:
        if isinstance(value, list):
            return [str(v) if isinstance(v, int) and not isinstance(v, bool) else v for v in value]
        return value


class ClassScope(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: Literal["class"]
    label: str = Field(..., min_length=1, max_length=200)

    @field_validator("label", mode="before")
    @classmethod
    def _label_as_string(cls, value: Any) -> Any:
        return str(value) if isinstance(value, int | float) and not isinstance(value, bool) else value


class ClientScope(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: Literal["client"]
    client_id: str = Field(..., min_length=1, max_length=200)


Scope = Annotated[SamplesScope | ClassScope | ClientScope, Field(discriminator="kind")]


class DeletionRequestCreate(NoNulModel):
    """No NUL in any string and no non-finite number anywhere (NoNulModel): refused here, one request alone."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    subject_ref: str = Field(..., min_length=1, max_length=500, description="Stored only as a keyed hash.")
    model_id: str = Field(..., min_length=1, max_length=64)
    scope: Scope
    method: MethodName = Field(
        "retrain", min_length=1, max_length=64, description="A registered method, or auto (the service chooses)."
    )
    method_settings: dict[str, Any] = Field(
        default_factory=dict, max_length=64, description="Only the keys the method allows requests to set."
    )
    callback_url: AnyHttpUrl | None = Field(None, description="At most 2000 characters.")
    received_at: AwareDatetime | None = Field(
        None, description="When the data subject's request reached the controller (the deadline runs from it)."
    )

    @field_validator("received_at")
    @classmethod
    def _not_in_the_future(cls, value: datetime | None) -> datetime | None:
        """The deadline runs from it: a date ahead of now would push the deadline away (2999 evaded "overdue") or
        past the calendar's end (9999-12-31 answered 500). A few minutes of clock skew are allowed."""
        if value is not None and value > datetime.now(UTC) + RECEIVED_AT_SKEW:
            raise ValueError("received_at cannot be in the future (it is when the subject's request reached you)")
        return value

    @field_validator("callback_url", mode="before")
    @classmethod
    def _url_fits(cls, value: Any) -> Any:
        if isinstance(value, str) and len(value) > 2000:
            raise ValueError("callback_url must be at most 2000 characters")
        return value


class DeletionRequestOut(BaseModel):
    id: str
    model_id: str
    subject_hash: str
    scope: dict[str, Any] = Field(
        ..., description="kind, and sample_id_hashes + n_samples (keyed hashes, never the ids), label or client_id."
    )
    method: MethodName
    status: Literal[REQUEST_STATUSES]  # type: ignore[valid-type]
    progress: float
    message: str | None
    attempts: int
    error: dict[str, Any] | None
    received_at: datetime | None = None
    due_at: datetime | None = None
    days_left: float | None = None  # negative once overdue
    overdue: bool = False  # past its deadline with the erasure still owed (failed and pending-approval included)
    answered_late: bool = False  # certified or rejected after its deadline
    extensions: list[dict[str, Any]] = []
    notes: list[dict[str, Any]] = Field(
        [], description="Operators' notes (approval): the text lives here, the audit log keeps a keyed digest of it."
    )
    stuck: bool = False  # still received/queued after LETHE_STUCK_AFTER_SECONDS: no worker has taken it
    erasure: dict[str, Any] | None = None  # the erasure manifest: every store rewritten, with digests and counts
    result_version_id: str | None
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None
    completed_at: datetime | None
    links: dict[str, str]


class DeletionRequestPage(BaseModel):
    items: list[DeletionRequestOut]
    next_cursor: str | None

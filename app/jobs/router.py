from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from fastapi import APIRouter, Depends
from pydantic import BaseModel
from sqlalchemy.orm import Session

from app.auth.service import Principal, require_scope
from app.db import get_session
from app.jobs.heartbeat import QUEUES
from app.jobs.tables import JOB_STATUSES, Job
from app.problems import Problem

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])


class JobOut(BaseModel):
    id: str
    kind: str
    queue: Literal[QUEUES]  # type: ignore[valid-type]
    model_id: str
    request_id: str | None
    status: Literal[JOB_STATUSES]  # type: ignore[valid-type]
    attempts: int
    progress: float
    message: str | None
    result: dict[str, Any] | None
    error: str | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None


@router.get("/{job_id}", response_model=JobOut)
def get_job(
    job_id: str, _: Principal = Depends(require_scope("requests:read")), session: Session = Depends(get_session)
):
    """Progress of any job: model training, method preparation, round aggregation, deletion."""
    job = session.get(Job, job_id)
    if job is None:
        raise Problem(404, "job-not-found", "No such job", job_id)
    out = JobOut.model_validate(job, from_attributes=True)
    if out.error:  # the last lines of a worker's traceback stay in the log, not in the API
        out.error = out.error.split("\n", 1)[0]
    return out

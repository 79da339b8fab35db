"""Thin glue: a Celery task that runs one job by id (app.jobs.pipeline does the work)."""

from __future__ import annotations

from app.jobs.dispatcher import worker_identity
from app.jobs.pipeline import execute_job as run_job
from workers.celery_app import celery_app


@celery_app.task(name="workers.tasks.execute_job")
def execute_job(job_id: str) -> str:
    return run_job(job_id, worker_identity())

"""Celery configuration: Celery carries job ids only; the job row's lease, not broker redelivery, recovers crashes.

- ``task_acks_late=False``: the message is acknowledged on receipt. If the worker dies mid-job, the lease on the job
  row expires and the reconciler re-offers it (ARCHITECTURE.md), so Redis's visibility timeout never has to exceed the
  longest job.
- ``worker_prefetch_multiplier=1`` and one process per GPU (``--concurrency 1``): ML jobs use the whole device.
"""

from __future__ import annotations

from celery import Celery
from kombu import Queue

from app.config import get_settings

settings = get_settings()
celery_app = Celery("lethe", broker=settings.broker_url or "redis://127.0.0.1:6379/0", include=["workers.tasks"])
celery_app.conf.update(
    task_acks_late=False,
    worker_prefetch_multiplier=1,
    task_queues=(Queue("cpu"), Queue("gpu")),
    task_default_queue="cpu",
    task_serializer="json",
    accept_content=["json"],
    task_ignore_result=True,
    broker_connection_retry_on_startup=True,
    task_time_limit=None,
    worker_hijack_root_logger=False,
)

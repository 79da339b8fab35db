"""Celery configuration: Celery carries job ids only; the job row's lease, not broker redelivery, recovers crashes.

- ``task_acks_late=False``: the message is acknowledged on receipt. If the worker dies mid-job, the lease on the job
  row expires and the reconciler re-offers it (ARCHITECTURE.md), so Redis's visibility timeout never has to exceed the
  longest job.
- ``worker_prefetch_multiplier=1`` and one process per GPU (``--concurrency 1``): ML jobs use the whole device.
"""

from __future__ import annotations

import os

from celery import Celery
from celery.signals import setup_logging, worker_process_init, worker_ready, worker_shutdown
from kombu import Queue

from app.config import get_settings
from app.logs import configure_logging

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


@setup_logging.connect
def _structured_logs(loglevel=None, **_) -> None:
    """Celery leaves logging to us: the same JSON lines as the API, each with the job's ids (app/jobs/pipeline.py)."""
    configure_logging(loglevel or settings.log_level, json_lines=settings.log_json)


_heartbeat = None


@worker_process_init.connect
def _hard_stop_in_pool_children(**_) -> None:
    """A prefork pool's child runs jobs: an attempt past its maximum runtime ends it (app/jobs/lease.py)."""
    from app.jobs.lease import enable_hard_stop

    enable_hard_stop()


@worker_ready.connect
def _start_heartbeat(sender=None, **_) -> None:
    """Write this worker's heartbeat row (app/jobs/heartbeat.py): what /readyz and /metrics count, per queue."""
    global _heartbeat
    from app.jobs.heartbeat import Heartbeat
    from app.jobs.lease import enable_hard_stop

    enable_hard_stop()  # the solo pool runs jobs in this process (prefork children: _hard_stop_in_pool_children)
    queues = sorted(q.name for q in getattr(getattr(sender, "task_consumer", None), "queues", []) or [])
    _heartbeat = Heartbeat(f"{getattr(sender, 'hostname', 'worker')}:{os.getpid()}", queues).start()


@worker_shutdown.connect
def _stop_heartbeat(**_) -> None:
    if _heartbeat is not None:
        _heartbeat.stop()

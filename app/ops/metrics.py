"""Prometheus metrics: the service's state, read from PostgreSQL (the source of truth) at scrape time, and this API
process's HTTP metrics (app/ops/http.py).

A custom collector rather than in-process counters for the state: requests are written by API processes and finished
by Celery workers on other machines, so only the database knows the totals; a scrape is a handful of aggregate
queries. The HTTP metrics are the API process's own; with several API processes behind one port (``lethe serve
--workers N``) they live in prometheus_client's multiprocess files (``PROMETHEUS_MULTIPROC_DIR``) and a scrape of any
process sums them all.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector
from sqlalchemy import func, select

from app.db import session_scope, utcnow
from app.jobs.heartbeat import listening
from app.jobs.tables import Job
from app.ops.http import HTTP_DURATION, HTTP_REQUESTS
from app.reports.tables import Report
from app.requests.service import ANSWERED_STATUSES, APPROVAL_STATUS, WAITING_STATUSES
from app.requests.tables import REQUEST_STATUSES, DeletionRequest
from app.webhooks.tables import WebhookDelivery

DURATION_WINDOW = 10_000
"""Finished jobs a scrape sums durations over (newest first): bounded work per scrape."""


def multiprocess_dir() -> str | None:
    """prometheus_client's multiprocess directory when this process writes its metrics there."""
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR")


def build_registry() -> CollectorRegistry:
    """What /metrics exposes: the database collector, and the HTTP metrics of this process or (multiprocess mode)
    of every process writing to the directory."""
    registry = CollectorRegistry()
    if multiprocess_dir():
        MultiProcessCollector(registry)
    else:
        registry.register(HTTP_REQUESTS)
        registry.register(HTTP_DURATION)
    registry.register(LetheCollector())
    return registry


class LetheCollector(Collector):
    def collect(self) -> Iterator:
        now = utcnow()
        with session_scope() as session:
            by_status = dict(
                session.execute(select(DeletionRequest.status, func.count()).group_by(DeletionRequest.status)).all()
            )
            requests = GaugeMetricFamily("lethe_deletion_requests", "Deletion requests by status.", labels=["status"])
            for status in REQUEST_STATUSES:
                requests.add_metric([status], by_status.get(status, 0))
            yield requests

            durations = SummaryMetricFamily(
                "lethe_job_duration_seconds",
                f"Wall time of the last {DURATION_WINDOW} finished jobs (last attempt) by kind.",
                labels=["kind"],
            )
            totals: dict[str, list[float]] = {}
            for kind, started, finished in session.execute(
                select(Job.kind, Job.started_at, Job.finished_at)
                .where(Job.status == "succeeded", Job.finished_at.is_not(None), Job.started_at.is_not(None))
                .order_by(Job.finished_at.desc())
                .limit(DURATION_WINDOW)
            ).all():
                entry = totals.setdefault(kind, [0, 0.0])
                entry[0] += 1
                entry[1] += (finished - started).total_seconds()
            for kind, (count, total) in sorted(totals.items()):
                durations.add_metric([kind], count_value=count, sum_value=total)
            yield durations

            verdicts = CounterMetricFamily("lethe_verdicts", "Verification verdicts by outcome.", labels=["verdict"])
            for verdict, count in session.execute(select(Report.verdict, func.count()).group_by(Report.verdict)):
                verdicts.add_metric([verdict], count)
            yield verdicts

            depth = GaugeMetricFamily("lethe_queue_depth", "Jobs waiting for a worker by queue.", labels=["queue"])
            for queue, count in session.execute(
                select(Job.queue, func.count()).where(Job.status.in_(("pending", "dispatched"))).group_by(Job.queue)
            ):
                depth.add_metric([queue], count)
            yield depth

            oldest = session.execute(
                select(func.min(DeletionRequest.created_at)).where(
                    DeletionRequest.status.in_((APPROVAL_STATUS, *WAITING_STATUSES))
                )
            ).scalar()
            yield GaugeMetricFamily(
                "lethe_oldest_pending_request_age_seconds",
                "Age of the oldest deletion request no worker has started (pending approval included).",
                value=(now - oldest).total_seconds() if oldest else 0.0,
            )
            workers = GaugeMetricFamily(
                "lethe_workers", "Celery workers whose heartbeat is fresh, by queue they consume.", labels=["queue"]
            )
            for queue, count in sorted(listening(session).items()):
                workers.add_metric([queue], count)
            yield workers
            overdue = session.execute(
                select(func.count()).where(
                    DeletionRequest.status.notin_(ANSWERED_STATUSES), DeletionRequest.due_at < now
                )
            ).scalar()
            yield GaugeMetricFamily(
                "lethe_overdue_requests",
                "Deletion requests past their GDPR deadline whose erasure is still owed (failed and pending approval "
                "included).",
                value=overdue,
            )
            failures = session.execute(
                select(func.count()).where(WebhookDelivery.attempts > 0, WebhookDelivery.status != "delivered")
            ).scalar()
            dead = session.execute(select(func.count()).where(WebhookDelivery.status == "dead")).scalar()
            webhook = GaugeMetricFamily(
                "lethe_webhook_deliveries_failing",
                "Webhook events not delivered yet after an attempt.",
                labels=["state"],
            )
            webhook.add_metric(["retrying"], failures - dead)
            webhook.add_metric(["dead"], dead)
            yield webhook

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
from itertools import accumulate

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString
from sqlalchemy import ARRAY, BigInteger, case, cast, func, select
from sqlalchemy.dialects.postgresql import array as pg_array
from sqlalchemy.orm import Session

from app.db import session_scope, utcnow
from app.jobs.heartbeat import QUEUES, listening
from app.jobs.tables import JOB_KINDS, Job
from app.ops.http import HTTP_DURATION, HTTP_REQUESTS
from app.reports.tables import Report
from app.requests.service import ANSWERED_STATUSES, APPROVAL_STATUS, WAITING_STATUSES
from app.requests.tables import REQUEST_STATUSES, DeletionRequest
from app.webhooks.tables import WebhookDelivery

JOB_DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)
"""Seconds, upper bounds of lethe_job_duration_seconds: from a one-row Newton deletion to a long training."""
VERDICTS = ("fail", "pass")
"""A report's verdicts (app/ml/verification/policy.py), named with 0 before the first."""
FINISHED_JOB_STATUSES = ("succeeded", "failed", "cancelled")
"""A job's terminal statuses: final (a retried request gets a new job; no job row is ever deleted)."""


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


def _milliseconds(session: Session, start, end):
    """SQL for ``end - start`` in whole milliseconds on this database, never negative (workers' clocks may disagree).
    Whole: a sum of integers is exact in any order, where a float sum may differ by an ulp between two scrapes with
    no new job, and a counter that goes down is read by rate() as a reset."""
    if session.get_bind().dialect.name == "postgresql":
        seconds = func.date_part("epoch", end - start)  # double precision (EXTRACT is numeric: slower)
    else:  # SQLite: julianday() parses the stored text, to the millisecond
        seconds = (func.julianday(end) - func.julianday(start)) * 86400.0
    return cast(func.round(case((seconds < 0, 0.0), else_=seconds) * 1000.0), BigInteger)


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

            yield from _jobs(session)

            verdicts = CounterMetricFamily("lethe_verdicts", "Verification verdicts by outcome.", labels=["verdict"])
            by_verdict = dict.fromkeys(VERDICTS, 0)
            by_verdict.update(session.execute(select(Report.verdict, func.count()).group_by(Report.verdict)).all())
            for verdict, count in sorted(by_verdict.items()):
                verdicts.add_metric([verdict], count)
            yield verdicts

            depth = GaugeMetricFamily("lethe_queue_depth", "Jobs waiting for a worker by queue.", labels=["queue"])
            waiting = dict.fromkeys(QUEUES, 0)
            waiting.update(
                session.execute(
                    select(Job.queue, func.count()).where(Job.status.in_(("pending", "dispatched"))).group_by(Job.queue)
                ).all()
            )
            for queue, count in sorted(waiting.items()):
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


def _jobs(session: Session) -> Iterator:
    """lethe_job_duration_seconds, a histogram of succeeded jobs' wall time (their last attempt) by kind, and
    lethe_jobs_finished_total by kind and terminal status: one aggregate query over the jobs table.

    From the table, not in-process: jobs end in workers nobody scrapes; terminal rows only accumulate (monotonic).
    """
    # each duration computed once (OFFSET 0: the subquery is not merged into the outer query, where the database
    # would compute it again in each comparison), then its bucket's index: the first bound it fits under, len(bounds)
    # above the last
    millis = _milliseconds(session, Job.started_at, Job.finished_at)  # NULL for a job cancelled before it started
    jobs = (
        select(Job.kind, Job.status, millis.label("millis"))
        .where(Job.status.in_(FINISHED_JOB_STATUSES))
        .offset(0)
        .subquery()
    )
    bounds_ms = [round(bound * 1000) for bound in JOB_DURATION_BUCKETS]
    if session.get_bind().dialect.name == "postgresql":  # how many bounds lie below: millis <= b is millis < b + 1
        bucket = func.width_bucket(jobs.c.millis, cast(pg_array([b + 1 for b in bounds_ms]), ARRAY(BigInteger)))
    else:
        bucket = case(*((jobs.c.millis <= b, i) for i, b in enumerate(bounds_ms)), else_=len(bounds_ms))
    query = select(
        jobs.c.kind, jobs.c.status, bucket, func.count(), func.count(jobs.c.millis), func.sum(jobs.c.millis)
    ).group_by(jobs.c.kind, jobs.c.status, bucket)
    finished = CounterMetricFamily(
        "lethe_jobs_finished", "Jobs that reached a terminal status, by kind and status.", labels=["kind", "status"]
    )
    durations = HistogramMetricFamily(
        "lethe_job_duration_seconds",
        "Wall time of succeeded jobs (their last attempt, claim to finish) by kind.",
        labels=["kind"],
    )
    counts = {(kind, status): 0 for kind in JOB_KINDS for status in FINISHED_JOB_STATUSES}
    histograms = {kind: ([0] * (len(JOB_DURATION_BUCKETS) + 1), [0]) for kind in JOB_KINDS}
    for kind, status, index, total, timed, millis_sum in session.execute(query).all():
        counts[(kind, status)] = counts.get((kind, status), 0) + total
        if status == "succeeded":
            per_bucket, total_millis = histograms.setdefault(kind, ([0] * (len(JOB_DURATION_BUCKETS) + 1), [0]))
            per_bucket[index] += timed
            total_millis[0] += int(millis_sum or 0)
    for (kind, status), total in sorted(counts.items()):
        finished.add_metric([kind, status], total)
    yield finished
    bounds = [*(floatToGoString(bound) for bound in JOB_DURATION_BUCKETS), "+Inf"]
    for kind, (per_bucket, total_millis) in sorted(histograms.items()):
        durations.add_metric([kind], list(zip(bounds, accumulate(per_bucket), strict=True)), total_millis[0] / 1000)
    yield durations

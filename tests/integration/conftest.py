"""Integration tests: a fresh PostgreSQL database per module, Redis as the Celery broker, and real processes
(uvicorn for the API, `celery worker` for jobs). They fail, not skip, when PostgreSQL or Redis is not there."""

from __future__ import annotations

import os

import pytest

from tests.stack import REDIS_URL, api_stack, claimed_redis_db, fresh_database, worker_redis_url


@pytest.fixture(scope="module")
def pg_url():
    """Each test module its own PostgreSQL database, dropped afterwards."""
    with fresh_database() as url:
        yield url


@pytest.fixture(scope="module")
def redis_url():
    """Each test module starts on an empty Redis database (``LETHE_TEST_REDIS``; under pytest-xdist, worker gwN takes
    the database N below it, so that two processes never share a broker) and leaves it empty; one holding anybody
    else's keys is refused, never flushed."""
    with claimed_redis_db(worker_redis_url(REDIS_URL, os.environ.get("PYTEST_XDIST_WORKER", ""))) as url:
        yield url


@pytest.fixture(scope="module")
def stack(pg_url, redis_url, tmp_path_factory):
    """PostgreSQL + Redis + API process + one Celery worker, migrated, with an all-scopes key."""
    home = tmp_path_factory.mktemp("lethe")
    with api_stack(
        home,
        database_url=pg_url,
        broker_url=redis_url,
        poll_seconds="0.2",
        lease_seconds="3",
        webhook_allowed_hosts='["127.0.0.1"]',  # the tests' own receivers listen on loopback only
    ) as services:
        services.worker = services.start_worker("w1")
        yield services

"""The test stack's own isolation: under pytest-xdist each worker process gets a Redis database of its own, so that
two integration modules running side by side never share a Celery broker (tests/integration/conftest.py)."""

import pytest

from tests.stack import worker_redis_url


def test_each_xdist_worker_takes_its_own_redis_database():
    url = "redis://127.0.0.1:6379/15"
    assert worker_redis_url(url, "") == url
    assert worker_redis_url(url, "gw0") == url
    assert worker_redis_url(url, "gw1") == "redis://127.0.0.1:6379/14"
    assert len({worker_redis_url(url, f"gw{n}") for n in range(4)}) == 4


def test_a_worker_with_no_database_left_below_the_base_is_refused():
    with pytest.raises(RuntimeError, match="too few Redis databases"):
        worker_redis_url("redis://127.0.0.1:6379/1", "gw2")

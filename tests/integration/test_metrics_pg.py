"""The job metrics' aggregate query on PostgreSQL (its own bucket expression: width_bucket over whole milliseconds).
Its own database: the counts must see only the jobs it wrote."""

from __future__ import annotations

import pytest

from tests.helpers import configure
from tests.stack import fresh_database
from tests.unit.test_metrics import assert_job_metrics_from_the_table


@pytest.fixture
def own_pg_url():
    with fresh_database("lethe_metrics") as url:
        yield url


def test_job_durations_are_a_cumulative_histogram_of_the_jobs_table_on_postgresql(own_pg_url, tmp_path):
    configure(tmp_path / "home", database_url=own_pg_url)
    assert_job_metrics_from_the_table()

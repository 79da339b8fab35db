"""`GET /v1/models` on PostgreSQL: the same paging and filters as on SQLite (keyset on timestamptz + id,
case-insensitive matching with escaped wildcards). Its own database: the listing must see only the rows it wrote."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from app.main import create_app
from tests.helpers import configure, make_key
from tests.model_listing import check_listing, seed_models
from tests.stack import fresh_database


@pytest.fixture
def own_pg_url():
    with fresh_database("lethe_models") as url:
        yield url


def test_list_models_on_postgresql(own_pg_url, tmp_path):
    configure(tmp_path, database_url=own_pg_url)
    ids = seed_models()
    with TestClient(create_app(run_background=False)) as http:
        http.headers["authorization"] = f"Bearer {make_key(['models:read'])}"
        check_listing(http, ids)

"""`GET /v1/models` on the embedded default (SQLite): keyset paging, name/kind/status filters, problems."""

from __future__ import annotations

from fastapi.testclient import TestClient

from app.main import create_app
from tests.helpers import configure, make_key
from tests.model_listing import check_listing, seed_models


def test_list_models_pages_and_filters(tmp_path):
    configure(tmp_path)
    ids = seed_models()
    with TestClient(create_app(run_background=False)) as http:
        http.headers["authorization"] = f"Bearer {make_key(['models:read'])}"
        check_listing(http, ids)


def test_list_models_needs_a_reading_scope(tmp_path):
    configure(tmp_path)
    seed_models()
    with TestClient(create_app(run_background=False)) as http:
        writer = make_key(["requests:write"], name="writer")
        response = http.get("/v1/models", headers={"authorization": f"Bearer {writer}"})
        assert response.status_code == 403 and response.json()["type"].endswith("/forbidden")
        reader = make_key(["requests:read"], name="reader")
        assert http.get("/v1/models", headers={"authorization": f"Bearer {reader}"}).status_code == 200

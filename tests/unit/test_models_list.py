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


def test_tags_at_registration_and_by_an_admin(tmp_path):
    """Tags given at registration are listed and filtered on; an admin replaces them (audited); bad tags are 422."""
    configure(tmp_path)
    with TestClient(create_app(run_background=False)) as http:
        admin = {"authorization": f"Bearer {make_key(['models:write', 'models:read', 'admin', 'audit:read'])}"}
        body = {"name": "fed", "kind": "clip_federated", "tags": ["team:vision", "prod"]}
        registered = http.post("/v1/models", json=body, headers=admin)
        assert registered.status_code == 202, registered.text
        model_id = registered.json()["id"]
        assert sorted(registered.json()["tags"]) == ["prod", "team:vision"]
        listed = http.get("/v1/models", params={"tag": "team:vision"}, headers=admin).json()["items"]
        assert [m["id"] for m in listed] == [model_id]

        bad = http.post("/v1/models", json={**body, "tags": ["Not A Tag"]}, headers=admin)
        assert bad.status_code == 422 and bad.json()["type"].endswith("/validation-error")
        assert http.patch(f"/v1/models/{model_id}", json={}, headers=admin).status_code == 422

        patched = http.patch(f"/v1/models/{model_id}", json={"tags": ["staging"]}, headers=admin)
        assert patched.status_code == 200 and patched.json()["tags"] == ["staging"]
        assert http.get("/v1/models", params={"tag": "prod"}, headers=admin).json()["items"] == []
        events = http.get("/v1/audit", params={"entity_id": model_id}, headers=admin).json()
        rows = events["items"] if isinstance(events, dict) else events
        updated = [e for e in rows if e["action"] == "model.updated"]
        assert updated and updated[-1]["payload"]["tags"] == ["staging"]

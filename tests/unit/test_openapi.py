"""`/openapi.json` is usable by a client generator: a valid OpenAPI 3.1 document with the bearer scheme, per-operation
security, problem+json answers naming their types (and the types the API really answers with are among them), and
request examples that the API's own schemas accept."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from openapi_spec_validator import validate

from app.main import create_app
from app.openapi import PROBLEM_TYPES
from app.problems import PROBLEM_BASE, PROBLEM_MEDIA_TYPE
from app.registry.schemas import ClipModelCreate, ModelCreate
from app.requests.schemas import DeletionRequestCreate
from tests.helpers import configure, make_key
from tests.model_listing import seed_models

PUBLIC = {("get", "/healthz"), ("get", "/readyz"), ("get", "/.well-known/lethe-keys.json")}


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    configure(tmp_path_factory.mktemp("openapi"))
    seed_models()
    with TestClient(create_app(run_background=False)) as http:
        http.headers["authorization"] = f"Bearer {make_key(['requests:read', 'requests:write', 'models:read'])}"
        spec = http.get("/openapi.json").json()
        yield http, spec


def _operations(spec):
    for path, item in spec["paths"].items():
        for method, operation in item.items():
            yield method, path, operation


def test_the_document_is_valid_openapi(api):
    _, spec = api
    assert spec["openapi"].startswith("3.1")
    validate(spec)  # openapi-spec-validator: structure and every $ref
    ids = [op["operationId"] for _, _, op in _operations(spec)]
    assert len(ids) == len(set(ids))
    assert {"list_models", "create_deletion_request", "get_deletion_request", "register_model"} <= set(ids)


def test_bearer_scheme_and_per_operation_security(api):
    _, spec = api
    assert spec["components"]["securitySchemes"]["bearerAuth"] == {
        **spec["components"]["securitySchemes"]["bearerAuth"],
        "type": "http",
        "scheme": "bearer",
    }
    for method, path, operation in _operations(spec):
        assert "security" in operation, (method, path)
        if (method, path) in PUBLIC:
            assert operation["security"] == [], (method, path)
        elif path.startswith("/v1/"):  # every API operation needs a key
            assert operation["security"] and all(set(r) == {"bearerAuth"} for r in operation["security"]), path
    ops = {(m, p): o for m, p, o in _operations(spec)}
    assert ops[("get", "/v1/deletion-requests")]["security"] == [{"bearerAuth": ["requests:read"]}]
    assert ops[("post", "/v1/deletion-requests")]["security"] == [{"bearerAuth": ["requests:write"]}]
    assert ops[("post", "/v1/deletion-requests/{request_id}/cancel")]["security"] == [{"bearerAuth": ["admin"]}]
    assert ops[("get", "/v1/models")]["security"] == [
        {"bearerAuth": ["requests:read"]},
        {"bearerAuth": ["models:read"]},
    ]


def test_every_error_answer_is_a_documented_problem(api):
    _, spec = api
    problem = spec["components"]["schemas"]["Problem"]
    assert set(problem["required"]) == {"type", "title", "status"}
    assert "HTTPValidationError" not in spec["components"]["schemas"]
    for method, path, operation in _operations(spec):
        for status, response in operation["responses"].items():
            if int(status) < 400:
                continue
            assert list(response["content"]) == [PROBLEM_MEDIA_TYPE], (method, path, status)
            assert response["content"][PROBLEM_MEDIA_TYPE]["schema"] == {"$ref": "#/components/schemas/Problem"}
            types = response["x-problem-types"]
            assert types and all(PROBLEM_TYPES[t.removeprefix(PROBLEM_BASE)][0] == int(status) for t in types)
        assert "500" in operation["responses"], (method, path)
        if path.startswith("/v1/"):
            assert {"401", "403"} <= set(operation["responses"]), (method, path)


def _documented(spec, method: str, path: str, status: int) -> list[str]:
    response = spec["paths"][path][method]["responses"][str(status)]
    return [t.removeprefix(PROBLEM_BASE) for t in response["x-problem-types"]]


def test_the_real_answers_are_among_the_documented_types(api):
    http, spec = api
    model_id = http.get("/v1/models").json()["items"][0]["id"]
    cases = [
        ("get", "/v1/deletion-requests/{request_id}", http.get("/v1/deletion-requests/nope")),
        ("get", "/v1/deletion-requests", http.get("/v1/deletion-requests", params={"cursor": "bad"})),
        ("get", "/v1/deletion-requests", http.get("/v1/deletion-requests", params={"status": "bad"})),
        ("get", "/v1/models", http.get("/v1/models", headers={"authorization": "Bearer lethe_x_y"})),
        ("get", "/v1/models/{model_id}", http.get("/v1/models/nope")),
        ("get", "/v1/models/{model_id}/forget-lock", http.get(f"/v1/models/{model_id}/forget-lock")),
        ("get", "/v1/reports/{report_id}", http.get("/v1/reports/nope")),
        ("get", "/v1/audit", http.get("/v1/audit")),  # this key lacks audit:read
        (
            "post",
            "/v1/deletion-requests",
            http.post("/v1/deletion-requests", content=b"{", headers={"content-type": "application/json"}),
        ),
        (
            "post",
            "/v1/deletion-requests",
            http.post(
                "/v1/deletion-requests",
                json={"subject_ref": "s", "model_id": "nope", "scope": {"kind": "samples", "sample_ids": ["1"]}},
            ),
        ),
        (
            "post",
            "/v1/deletion-requests",
            http.post(
                "/v1/deletion-requests",
                json={"subject_ref": "s", "model_id": model_id, "scope": {"kind": "samples", "sample_ids": ["1"]}},
            ),
        ),
        ("post", "/v1/deletion-requests", http.post("/v1/deletion-requests", data={"x": "1"})),
        ("post", "/v1/models", http.post("/v1/models", content=b"x", headers={"content-type": "text/plain"})),
    ]
    seen = set()
    for method, path, response in cases:
        assert response.status_code >= 400 and response.headers["content-type"] == PROBLEM_MEDIA_TYPE
        slug = response.json()["type"].removeprefix(PROBLEM_BASE)
        assert slug in _documented(spec, method, path, response.status_code), (method, path, response.json())
        seen.add(slug)
    assert {"request-not-found", "invalid-cursor", "unauthorized", "forbidden", "malformed-json",
            "unsupported-media-type", "no-forget-lock"} <= seen  # fmt: skip


def test_request_examples_are_accepted_by_the_api_schemas(api):
    _, spec = api
    body = spec["paths"]["/v1/deletion-requests"]["post"]["requestBody"]["content"]["application/json"]
    assert body["schema"] == {"$ref": "#/components/schemas/DeletionRequestCreate"}
    assert len(body["examples"]) >= 2
    for example in body["examples"].values():
        DeletionRequestCreate.model_validate(example["value"])
    registration = spec["paths"]["/v1/models"]["post"]["requestBody"]["content"]
    assert {"multipart/form-data", "application/json"} <= set(registration)
    ModelCreate.model_validate(registration["multipart/form-data"]["example"]["metadata"])
    for example in registration["application/json"]["examples"].values():
        schema = ClipModelCreate if example["value"].get("kind") == "clip_federated" else ModelCreate
        schema.model_validate(example["value"])
    extend = spec["paths"]["/v1/deletion-requests/{request_id}/extend"]["post"]["requestBody"]["content"]
    assert all(e["value"]["months"] in (1, 2) for e in extend["application/json"]["examples"].values())
    rounds = spec["paths"]["/v1/models/{model_id}/rounds"]["post"]["requestBody"]["content"]
    assert rounds["application/octet-stream"]["schema"]["format"] == "binary"

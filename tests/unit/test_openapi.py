"""`/openapi.json` is usable by a client generator: a valid OpenAPI 3.1 document with the bearer scheme, per-operation
security, problem+json answers naming their types (and the types the API really answers with are among them), every
success body typed (a JSON schema, or bytes of a declared media type), the headers the API sends, enums where the
code has a fixed set, and request examples that the API's own schemas accept. A generated client used for a whole
deletion: tests/unit/test_generated_client.py."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient
from openapi_spec_validator import validate

from app.main import create_app
from app.ml.unlearning.base import AUTO, available_methods
from app.openapi import PROBLEM_TYPES, _api_routes, problem_type_uris
from app.problems import GENERIC_SLUGS, PROBLEM_BASE, PROBLEM_MEDIA_TYPE
from app.registry.schemas import ClipModelCreate, ModelCreate
from app.requests.schemas import DeletionRequestCreate
from app.requests.tables import REQUEST_STATUSES
from tests.helpers import configure, make_key
from tests.model_listing import seed_models

PUBLIC = {("get", "/healthz"), ("get", "/readyz"), ("get", "/.well-known/lethe-keys.json")}
NOT_PROBLEMS = {("get", "/readyz", "503")}
"""Error statuses whose body is not a problem: a readiness probe's 503 is its report (``ready: false``)."""
BINARY = {"type": "string", "format": "binary"}
ROOT = Path(__file__).resolve().parents[2]


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
            if int(status) < 400 or (method, path, status) in NOT_PROBLEMS:
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


def _resolve(spec, schema):
    while "$ref" in schema:
        schema = spec["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
    return schema


def _typed(spec, schema) -> bool:
    """A JSON body's schema names its members: an object with properties, or an array of such."""
    schema = _resolve(spec, schema)
    if schema.get("type") == "array":
        return _typed(spec, schema["items"])
    return schema.get("type") == "object" and bool(schema.get("properties"))


def test_every_success_body_is_typed(api):
    """No operation answers 2xx with an untyped body: JSON is a schema with named members (a model), bytes are
    declared with their media type; 304 and 204 carry no body."""
    _, spec = api
    for method, path, operation in _operations(spec):
        successes = {s: r for s, r in operation["responses"].items() if s.startswith("2")}
        assert successes, (method, path)
        for status, response in successes.items():
            content = response.get("content")
            assert content, (method, path, status)
            for media_type, body in content.items():
                if media_type == "application/json":
                    assert _typed(spec, body["schema"]), (method, path, status, body)
                else:
                    assert body["schema"] == BINARY, (method, path, status, media_type)
        for status in ("304", "204"):
            assert "content" not in operation["responses"].get(status, {}), (method, path, status)


def test_raw_answers_declare_their_media_type(api):
    """Every route that answers raw bytes (``response_class=Response``) declares its media type, not JSON; the plot
    is a PNG, the safetensors downloads octet-stream."""
    http, spec = api
    raw = {
        (method, path)
        for (method, path), route in _api_routes(http.app).items()
        if route.include_in_schema and not issubclass(getattr(route.response_class, "value", route.response_class),
                                                      JSONResponse)  # a DefaultPlaceholder holds JSONResponse
    }  # fmt: skip
    assert {("get", "/v1/reports/{report_id}/plots/{name}"), ("get", "/v1/models/{model_id}/versions/{number}/weights"),
            ("get", "/v1/models/{model_id}/forget-lock.safetensors")} <= raw  # fmt: skip
    for method, path in raw:
        content = spec["paths"][path][method]["responses"]["200"]["content"]
        assert "application/json" not in content and all(c["schema"] == BINARY for c in content.values()), path
    plot = spec["paths"]["/v1/reports/{report_id}/plots/{name}"]["get"]["responses"]
    assert list(plot["200"]["content"]) == ["image/png"]
    assert {"ETag", "Cache-Control"} <= set(plot["200"]["headers"]) and "304" in plot
    for path in ("/v1/models/{model_id}/versions/{number}/weights", "/v1/models/{model_id}/forget-lock.safetensors"):
        assert list(spec["paths"][path]["get"]["responses"]["200"]["content"]) == ["application/octet-stream"]


def test_the_headers_sent_are_declared(api):
    """202s name where to poll (Location) and when (Retry-After); a 503 intake problem says when to retry; the
    conditional GETs declare their ETag. The real 202 sends what is declared."""
    http, spec = api
    for path in ("/v1/deletion-requests", "/v1/models", "/v1/subjects/erasures", "/v1/models/{model_id}/rounds"):
        declared = spec["paths"][path]["post"]["responses"]["202"]["headers"]
        assert {"Location", "Retry-After"} <= set(declared), path
        assert declared["Retry-After"]["schema"] == {"type": "integer"}
    unavailable = spec["paths"]["/v1/deletion-requests"]["post"]["responses"]["503"]
    assert unavailable["x-problem-types"] == [
        PROBLEM_BASE + "intake-unavailable",
        PROBLEM_BASE + "database-unavailable",
    ]
    assert "Retry-After" in unavailable["headers"]
    for path in ("/v1/reports/{report_id}", "/v1/certificates/{certificate_id}"):
        assert "ETag" in spec["paths"][path]["get"]["responses"]["200"]["headers"], path
    report = spec["paths"]["/v1/reports/{report_id}"]["get"]
    assert any(p["in"] == "header" and p["name"] == "If-None-Match" for p in report["parameters"])


def _enum(spec, schema_name: str, prop: str) -> list[str]:
    schema = _resolve(spec, spec["components"]["schemas"][schema_name]["properties"][prop])
    return schema["enum"]


def test_fixed_sets_are_enums_with_their_wire_values(api):
    _, spec = api
    assert _enum(spec, "DeletionRequestOut", "status") == list(REQUEST_STATUSES)
    methods = {AUTO, *(m.name for m in available_methods())}
    assert set(_enum(spec, "DeletionRequestCreate", "method")) == methods
    assert set(_enum(spec, "DeletionRequestOut", "method")) == methods
    assert set(_enum(spec, "ErasureCreate", "method")) == methods
    assert "retrain" in _enum(spec, "ReportOut", "method")
    assert set(_enum(spec, "ModelOut", "status")) == {"registering", "ready", "failed"}
    assert set(_enum(spec, "ErasureOut", "status")) == {"in-progress", "certified", "failed"}
    assert set(_enum(spec, "ReportOut", "verdict")) == {"pass", "fail"}
    assert set(_enum(spec, "DeliveryOut", "status")) == {"pending", "delivered", "dead"}
    problem_types = _enum(spec, "Problem", "type")
    assert problem_types == problem_type_uris()
    assert {PROBLEM_BASE + slug for slug in PROBLEM_TYPES} <= set(problem_types)
    for _, _, operation in _operations(spec):  # every documented answer's type is in the enum
        for response in operation["responses"].values():
            assert set(response.get("x-problem-types", ())) <= set(problem_types)


def _raised_slugs() -> dict[str, set[int]]:
    """Every literal problem slug the code raises, with its status: ``Problem(status, "slug", ...)`` and the caption
    files' ``_invalid("slug", ...)`` (always 422)."""
    found: dict[str, set[int]] = {}
    for file in (ROOT / "app").rglob("*.py"):
        for node in ast.walk(ast.parse(file.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = getattr(node.func, "id", getattr(node.func, "attr", None))
            args = node.args
            if name == "Problem" and len(args) >= 2 and isinstance(args[1], ast.Constant):
                status = args[0].value if isinstance(args[0], ast.Constant) else None
                found.setdefault(args[1].value, set()).add(status)
            elif name == "_invalid" and args and isinstance(args[0], ast.Constant):
                found.setdefault(args[0].value, set()).add(422)
    return found


def test_every_problem_the_code_raises_is_catalogued():
    """A generated client parses ``type`` as an enum: a slug raised but not catalogued would make it throw."""
    raised = _raised_slugs()
    assert {"request-not-found", "intake-unavailable", "unknown-image"} <= set(raised)  # the scan sees them
    for slug, statuses in raised.items():
        assert slug in PROBLEM_TYPES or slug in GENERIC_SLUGS, slug
        if slug in PROBLEM_TYPES:
            assert statuses - {None} <= {PROBLEM_TYPES[slug][0]}, (slug, statuses)

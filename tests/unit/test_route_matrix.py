"""The route x scope x input matrix (issue 22, item 3): every operation of ``/openapi.json`` (read at test time, so a
new route is covered the day it is added) against no key, a wrong key, each single scope, a key bound to another
model, and bad inputs (wrong types, NUL, huge, deeply nested, non-JSON, wrong content type).

:data:`REQUIRED` is the specification: the scopes each operation accepts (any one suffices; ``admin`` holds them
all). It is written here by hand, not read from the code, so lowering a route's scope in the code turns
``test_each_scope_reaches_exactly_its_operations`` red (before this test, /v1/audit/verify and /v1/webhooks/secret
could be lowered to ``requests:read`` with every test green). Every answer must be one its operation documents
(status and problem ``type``), never a 5xx, and the key is checked before the body is read: a refused caller's
malformed body is answered 401/403, not 400.

Each test walks the whole table and reports every cell that failed at once. Embedded SQLite, no background executor:
nothing trains, the run takes a few seconds.
"""

from __future__ import annotations

import json
import re

import pytest
from fastapi.testclient import TestClient

from app.auth.service import BOUND_SCOPES, SCOPES, create_key
from app.db import session_scope
from app.main import create_app
from app.openapi import problem_type_uris
from app.problems import PROBLEM_BASE, PROBLEM_MEDIA_TYPE
from app.registry.tables import Model
from tests.helpers import configure

R, W, MR, MW, RW, AR, MET = (
    "requests:read", "requests:write", "models:read", "models:write", "rounds:write", "audit:read", "metrics:read"
)  # fmt: skip
ADMIN = ("admin",)

REQUIRED: dict[tuple[str, str], tuple[str, ...]] = {
    ("post", "/v1/models"): (MW,),
    ("get", "/v1/models"): (R, MR),
    ("get", "/v1/models/{model_id}"): (R, MR),
    ("patch", "/v1/models/{model_id}"): ADMIN,
    ("get", "/v1/models/{model_id}/versions"): (R, MR),
    ("post", "/v1/models/{model_id}/rounds"): (RW,),
    ("get", "/v1/models/{model_id}/forget-lock"): (MR, R),
    ("get", "/v1/models/{model_id}/forget-lock.safetensors"): (MR,),
    ("get", "/v1/models/{model_id}/pairs"): (R,),
    ("get", "/v1/models/{model_id}/versions/{number}/weights"): (MR,),
    ("post", "/v1/models/{model_id}/predict"): (MR,),
    ("post", "/v1/deletion-requests"): (W,),
    ("get", "/v1/deletion-requests"): (R,),
    ("get", "/v1/deletion-requests/{request_id}"): (R,),
    ("post", "/v1/deletion-requests/{request_id}/extend"): ADMIN,
    ("post", "/v1/deletion-requests/{request_id}/cancel"): ADMIN,
    ("post", "/v1/deletion-requests/{request_id}/retry"): ADMIN,
    ("post", "/v1/deletion-requests/{request_id}/approve"): ADMIN,
    ("post", "/v1/deletion-requests/{request_id}/reject"): ADMIN,
    ("post", "/v1/deletion-requests/bulk"): ADMIN,
    ("post", "/v1/subjects/erasures"): (W,),
    ("get", "/v1/subjects/erasures/{erasure_id}"): (R,),
    ("get", "/v1/subjects/erasures/{erasure_id}/certificate"): (R,),
    ("get", "/v1/subjects/{subject_hash}/requests"): (R,),
    ("post", "/v1/subjects/lookup"): (R,),
    ("get", "/v1/audit"): (AR,),
    ("get", "/v1/audit/verify"): (AR,),
    ("get", "/v1/jobs/{job_id}"): (R,),
    ("get", "/v1/reports"): (R,),
    ("get", "/v1/reports/{report_id}"): (R,),
    ("get", "/v1/reports/{report_id}/plots/{name}"): (R,),
    ("get", "/v1/certificates/{certificate_id}"): (R,),
    ("get", "/v1/deletion-requests/{request_id}/webhooks"): (R,),
    ("post", "/v1/deletion-requests/{request_id}/webhooks/{delivery_id}/redeliver"): ADMIN,
    ("post", "/v1/webhooks/secret"): ADMIN,
    ("get", "/metrics"): (MET,),
}
"""Operation: the scopes that reach it. The specification; the code must match it, never the other way round."""

PUBLIC = {
    ("get", "/healthz"): "liveness: says only that the process answers and reaches its database",
    ("get", "/readyz"): "readiness for a load balancer: ready or not, details only with a metrics:read key",
    ("get", "/.well-known/lethe-keys.json"): "the public keys certificates are verified with",
    ("get", "/openapi.json"): "the API's contract, the same for every install (no data, no settings)",
    ("get", "/docs"): "a page that renders /openapi.json",
    ("get", "/redoc"): "a page that renders /openapi.json",
}
"""Operations that need no key, and why. Anything else that answers without a key is a finding."""

UNDOCUMENTED = {("get", "/metrics"), ("get", "/openapi.json"), ("get", "/docs"), ("get", "/redoc")}
"""Routes left out of /openapi.json (not part of the client API); the matrix covers them from here."""

DEEP = 100_000
"""Nesting depth of the deep-JSON input: Python's ``json`` raises RecursionError past about 1000."""


def _nested(depth: int) -> str:
    return '{"a":' * depth + "1" + "}" * depth


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    configure(tmp_path_factory.mktemp("matrix"), max_body_bytes="1000000", max_round_bytes="2000000")
    with session_scope() as session:
        mine, other = (
            Model(name=name, kind="clip_federated", status="ready", spec={}, state={"clients": ["c0"], "n_params": 4})
            for name in ("mine", "other")
        )
        session.add_all([mine, other])
        session.flush()
        keys = {scope: create_key(session, scope, [scope])[1] for scope in SCOPES}
        keys["bound"] = create_key(session, "bound", sorted(BOUND_SCOPES), model_id=mine.id)[1]
        ids = {"mine": mine.id, "other": other.id}
    with TestClient(create_app(run_background=False)) as http:
        spec = http.get("/openapi.json").json()
        yield http, spec, keys, ids


def _operations(spec) -> list[tuple[str, str]]:
    documented = [(m, p) for p, item in spec["paths"].items() for m in item]
    return documented + sorted(UNDOCUMENTED)


def _url(path: str, model: str, /, **override: str) -> str:
    values = {
        "model_id": model,
        "number": "1",
        "name": "forgetting.png",
        "subject_hash": "a" * 64,
        "request_id": "00000000-0000-0000-0000-000000000000",
        "delivery_id": "00000000-0000-0000-0000-000000000001",
        **override,
    }
    return re.sub(r"\{(\w+)\}", lambda m: values.get(m.group(1), "00000000-0000-0000-0000-00000000000f"), path)


def _body_types(spec, method: str, path: str) -> list[str]:
    operation = spec["paths"].get(path, {}).get(method, {})
    return list(operation.get("requestBody", {}).get("content", {}))


def _send(http, method, url, key=None, content=None, content_type=None, headers=None, **kwargs):
    sent = dict(headers or {})
    if key is not None:
        sent["authorization"] = f"Bearer {key}"
    if content_type is not None:
        sent["content-type"] = content_type
    return http.request(method.upper(), url, content=content, headers=sent, **kwargs)


def _junk(spec, method, path) -> dict:
    """A malformed body in the operation's own media type: what must not be parsed before the key is checked."""
    types = _body_types(spec, method, path)
    if not types:
        return {}
    if "application/json" in types:
        return {"content": b'{"not json', "content_type": "application/json"}
    return {"content": b"\x00junk", "content_type": types[0]}


def _slug(response) -> str | None:
    if response.headers.get("content-type") != PROBLEM_MEDIA_TYPE:
        return None
    return response.json().get("type", "").removeprefix(PROBLEM_BASE)


def _documented(spec, method, path, response) -> str | None:
    """Why ``response`` is not an answer the operation documents (status, problem type), or None."""
    status = response.status_code
    if status >= 500:
        return f"{status} {response.text[:200]}"
    if status < 400:
        return None
    slug = _slug(response)
    if slug is None:
        return f"{status} is not problem+json: {response.text[:200]}"
    operation = spec["paths"].get(path, {}).get(method)
    if operation is None:  # an undocumented route: at least a catalogued type
        return None if PROBLEM_BASE + slug in problem_type_uris() else f"{status} {slug}: not catalogued"
    documented = operation["responses"].get(str(status), {}).get("x-problem-types", [])
    return None if PROBLEM_BASE + slug in documented else f"{status} {slug}: not documented ({documented})"


def _report(failures: list[str]) -> None:
    assert not failures, f"{len(failures)} cells failed:\n" + "\n".join(failures)


# ---------------------------------------------------------------- the table is complete and the document agrees


def test_the_table_names_every_operation_and_the_document_agrees(matrix):
    http, spec, _, _ = matrix
    operations = set(_operations(spec))
    assert operations == set(REQUIRED) | set(PUBLIC), (
        f"new: {sorted(operations - set(REQUIRED) - set(PUBLIC))}; gone: {sorted(set(REQUIRED) - operations)}"
    )
    assert not set(REQUIRED) & set(PUBLIC)
    for path, item in spec["paths"].items():
        for method, operation in item.items():
            documented = {scope for requirement in operation["security"] for scope in requirement.get("bearerAuth")}
            expected = set(REQUIRED.get((method, path), ()))
            assert documented == expected, (method, path, documented, expected)


# ---------------------------------------------------------------- no key, a wrong key: 401 before the body is read


@pytest.mark.parametrize("key", [None, "lethe_0badc0de_not-a-key", ""], ids=["no-key", "wrong-key", "empty-key"])
def test_every_protected_operation_refuses_a_missing_or_wrong_key_before_reading_the_body(matrix, key):
    http, spec, keys, ids = matrix
    failures = []
    for method, path in REQUIRED:
        response = _send(http, method, _url(path, ids["mine"]), key=key, **_junk(spec, method, path))
        if response.status_code != 401 or _slug(response) != "unauthorized":
            failures.append(f"{method.upper()} {path}: {response.status_code} {response.text[:160]}")
        elif not response.headers.get("www-authenticate", "").startswith("Bearer"):
            failures.append(f"{method.upper()} {path}: 401 without WWW-Authenticate")
    _report(failures)


def test_a_huge_body_without_a_key_is_refused_for_the_key_not_its_size(matrix):
    """No route reads (or sizes up) the body of a caller it will refuse: 401, not 413."""
    http, spec, _, ids = matrix
    failures = []
    for method, path in REQUIRED:
        types = _body_types(spec, method, path)
        if not types:
            continue
        response = _send(http, method, _url(path, ids["mine"]), content=b" " * 3_000_000, content_type=types[0])
        if response.status_code != 401:
            failures.append(f"{method.upper()} {path}: {response.status_code} {response.text[:160]}")
    # the large upload and round limits go to a checked key only, not to a path that merely looks like their routes
    for path, content_type in (("/v1/models/", "multipart/form-data; boundary=x"),
                               (f"/v1/models/{ids['mine']}/rounds/", "application/octet-stream")):  # fmt: skip
        response = http.post(path, content=b" " * 3_000_000, headers={"content-type": content_type},
                             follow_redirects=False)  # fmt: skip
        if response.status_code not in (401, 413):
            failures.append(f"POST {path}: {response.status_code} {response.text[:160]}")
    _report(failures)


def test_public_operations_answer_without_a_key(matrix):
    http, _, _, _ = matrix
    for method, path in PUBLIC:
        response = _send(http, method, path)
        assert response.status_code in (200, 503), (path, response.status_code)


# ---------------------------------------------------------------- each scope reaches exactly its operations


@pytest.mark.parametrize("scope", SCOPES)
def test_each_scope_reaches_exactly_its_operations(matrix, scope):
    """A key holding only ``scope``: 403 ``forbidden`` naming the required scope on every operation the table does not
    grant it (before the body is read: the body sent is malformed), and never 401/403 on those it does."""
    http, spec, keys, ids = matrix
    failures = []
    for (method, path), accepted in REQUIRED.items():
        response = _send(http, method, _url(path, ids["mine"]), key=keys[scope], **_junk(spec, method, path))
        granted = scope in accepted or scope == "admin"
        cell = f"{method.upper()} {path} with {scope}:"
        if granted:
            if response.status_code == 401 or _slug(response) == "forbidden":
                failures.append(f"{cell} refused although the table grants it: {response.text[:160]}")
        elif response.status_code != 403 or _slug(response) != "forbidden":
            failures.append(f"{cell} expected 403 forbidden, got {response.status_code} {response.text[:160]}")
        elif response.json().get("required_scope") != accepted[0]:
            failures.append(f"{cell} names {response.json().get('required_scope')}, not {accepted[0]}")
        problem = _documented(spec, method, path, response)
        if problem:
            failures.append(f"{cell} {problem}")
    _report(failures)


# ---------------------------------------------------------------- a key bound to one model


def test_a_key_bound_to_a_model_reaches_that_model_only(matrix):
    """The bound key holds ``rounds:write`` and ``models:read``. Where the table grants neither: 403 ``forbidden``.
    Where it grants one: another model's path is 404 ``model-not-found`` (as if it did not exist), a route about no
    model 403 ``forbidden``, its own model's path is not refused."""
    http, spec, keys, ids = matrix
    failures = []
    for (method, path), accepted in REQUIRED.items():
        junk = _junk(spec, method, path)
        reaches = bool(BOUND_SCOPES & set(accepted))
        cell = f"{method.upper()} {path}:"
        other = _send(http, method, _url(path, ids["other"]), key=keys["bound"], **junk)
        if not reaches or "{model_id}" not in path:
            expected = (403, "forbidden")
        else:
            expected = (404, "model-not-found")
            own = _send(http, method, _url(path, ids["mine"]), key=keys["bound"], **junk)
            if own.status_code == 401 or _slug(own) in ("forbidden", "model-not-found"):
                failures.append(f"{cell} its own model refused: {own.status_code} {own.text[:160]}")
        if (other.status_code, _slug(other)) != expected:
            failures.append(f"{cell} expected {expected}, got {other.status_code} {other.text[:160]}")
        problem = _documented(spec, method, path, other)
        if problem:
            failures.append(f"{cell} {problem}")
    _report(failures)


# ---------------------------------------------------------------- bad inputs, with a key that may call everything


JSON_CASES = [
    ("non-json", b'{"subject_ref": ', "application/json", (400, "malformed-json")),
    ("not-utf8", b'{"a": "\xff\xfe"}', "application/json", (400, "malformed-json")),
    ("array", b"[]", "application/json", (422, "validation-error")),
    ("number", b"42", "application/json", (422, "validation-error")),
    ("string", b'"x"', "application/json", (422, "validation-error")),
    ("null", b"null", "application/json", (422, "validation-error")),
    ("nul", json.dumps({"a\x00": "b\x00", "subject_ref": "\x00"}).encode(), "application/json", (422, None)),
    ("deep-array", b"[" * DEEP + b"]" * DEEP, "application/json", (None, None)),
    ("deep-object", _nested(DEEP).encode(), "application/json", (None, None)),
    ("huge", b'{"a": "' + b"x" * 1_100_000 + b'"}', "application/json", (413, "payload-too-large")),
    ("text", b"subject_ref=x", "text/plain", (415, "unsupported-media-type")),
    ("xml", b"<a/>", "application/xml", (415, "unsupported-media-type")),
    ("no-type", b"{}", None, (None, None)),
]
"""(name, body, content type, (status, type) expected; None: any documented 4xx)."""


@pytest.mark.parametrize("name, body, content_type, expected", JSON_CASES, ids=[c[0] for c in JSON_CASES])
def test_bad_json_bodies_get_their_documented_problem(matrix, name, body, content_type, expected):
    http, spec, keys, ids = matrix
    failures = []
    for method, path in REQUIRED:
        if "application/json" not in _body_types(spec, method, path):
            continue
        response = _send(http, method, _url(path, ids["mine"]), key=keys["admin"], content=body,
                         content_type=content_type)  # fmt: skip
        cell = f"{method.upper()} {path} ({name}):"
        status, slug = expected
        if name == "null" and not spec["paths"][path][method]["requestBody"].get("required"):
            status = slug = None  # an optional body: null is no body (approve, reject)
        if not 400 <= response.status_code < 500:
            failures.append(f"{cell} {response.status_code} {response.text[:160]}")
        elif status is not None and response.status_code != status:
            failures.append(f"{cell} expected {status}, got {response.status_code} {response.text[:160]}")
        elif slug is not None and _slug(response) != slug:
            failures.append(f"{cell} expected {slug}, got {_slug(response)}")
        problem = _documented(spec, method, path, response)
        if problem:
            failures.append(f"{cell} {problem}")
    _report(failures)


def test_bad_multipart_metadata_and_raw_bodies_get_their_documented_problem(matrix):
    """The registration's multipart ``metadata`` is JSON parsed by hand: malformed, deep or wrongly typed, it is a
    4xx; a round upload's raw body that is not safetensors is a 4xx."""
    http, spec, keys, ids = matrix
    admin = keys["admin"]
    file = {"file": ("t.csv", b"row_id,label\nr1,yes\n", "text/csv")}
    cases = [
        ("non-json", "{", (400, "malformed-json")),
        ("deep", _nested(5_000), (400, "malformed-json")),
        ("deep-array", "[" * 20_000 + "]" * 20_000, (400, "malformed-json")),
        ("array", "[]", (422, "validation-error")),
        ("nul", json.dumps({"name": "a\x00"}), (422, "validation-error")),
    ]
    failures = []
    for name, metadata, expected in cases:
        response = http.post("/v1/models", data={"metadata": metadata}, files=file,
                             headers={"authorization": f"Bearer {admin}"})  # fmt: skip
        if (response.status_code, _slug(response)) != expected:
            failures.append(f"metadata {name}: expected {expected}, got {response.status_code} {response.text[:160]}")
        problem = _documented(spec, "post", "/v1/models", response)
        if problem:
            failures.append(f"metadata {name}: {problem}")
    rounds = _url("/v1/models/{model_id}/rounds", ids["mine"])
    for name, body, content_type, expected in [
        ("garbage", b"\x00\x01garbage", "application/octet-stream", (422, "invalid-round")),
        ("huge", b"\x00" * 2_100_000, "application/octet-stream", (413, "payload-too-large")),
        ("json", b"{}", "application/json", (415, "unsupported-media-type")),
    ]:
        response = _send(http, "post", rounds, key=admin, content=body, content_type=content_type)
        if (response.status_code, _slug(response)) != expected:
            failures.append(f"round {name}: expected {expected}, got {response.status_code} {response.text[:160]}")
        problem = _documented(spec, "post", "/v1/models/{model_id}/rounds", response)
        if problem:
            failures.append(f"round {name}: {problem}")
    _report(failures)


def test_bad_path_and_query_parameters_get_their_documented_problem(matrix):
    """Every operation's parameters: a NUL in the path or query (422), a wrongly typed query value (422), a huge path
    segment or query value (a documented 4xx, never a 5xx)."""
    http, spec, keys, ids = matrix
    failures = []
    for method, path in REQUIRED:
        operation = spec["paths"].get(path, {}).get(method, {})
        params = operation.get("parameters", [])
        cases = []
        path_params = [p["name"] for p in params if p["in"] == "path"]
        for param in path_params:
            cases.append((f"{param} NUL", _url(path, ids["mine"], **{param: "a%00b"}), {}, (422, "validation-error")))
            cases.append((f"{param} huge", _url(path, ids["mine"], **{param: "x" * 8000}), {}, (None, None)))
            cases.append((f"{param} odd", _url(path, ids["mine"], **{param: "é%20;'<>\\%25"}), {}, (None, None)))
        for param in (p for p in params if p["in"] == "query"):
            schema = json.dumps(param.get("schema", {}))
            name = param["name"]
            cases.append((f"{name} NUL", _url(path, ids["mine"]), {name: "a\x00b"}, (422, "validation-error")))
            cases.append((f"{name} huge", _url(path, ids["mine"]), {name: "9" * 5000}, (None, None)))
            if '"integer"' in schema or '"boolean"' in schema:
                cases.append((f"{name} type", _url(path, ids["mine"]), {name: "abc"}, (422, "validation-error")))
        for name, url, query, (status, slug) in cases:
            junk = _junk(spec, method, path)
            response = _send(http, method, url, key=keys["admin"], params=query, **junk)
            cell = f"{method.upper()} {path} ({name}):"
            if status is not None and (response.status_code, _slug(response)) != (status, slug):
                failures.append(f"{cell} expected {status} {slug}, got {response.status_code} {response.text[:160]}")
            problem = _documented(spec, method, path, response)
            if problem:
                failures.append(f"{cell} {problem}")
    _report(failures)

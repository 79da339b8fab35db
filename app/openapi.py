"""The OpenAPI document, made usable by client generators.

FastAPI's own document misses what a generator needs here: the bearer scheme (authentication is a plain dependency),
the error answers (every one is RFC 9457 ``application/problem+json``, not FastAPI's ``HTTPValidationError``), the
bodies read by hand (model registration: JSON or multipart; round uploads: raw safetensors) and request examples.
:func:`install` replaces ``app.openapi`` with a builder that adds them from the routes themselves:

- ``securitySchemes.bearerAuth`` and, per operation, ``security``: one requirement per accepted scope (``require_scope``
  records its scopes on the dependency), ``[]`` on the public routes;
- per operation, the problem answers it can give with their ``type`` slugs: 401/403 when a key is needed, 404 for
  each path entity, 422/400 for parameters and bodies, plus the domain's own from :data:`OPERATION_PROBLEMS` — one
  shared catalogue (:data:`PROBLEM_TYPES`), each answer pointing at ``#/components/schemas/Problem``;
- request bodies and examples for the main POSTs (:data:`REQUEST_BODIES`);
- the Problem schema's ``type`` as an enum of every catalogued URI (with ``x-enum-varnames``), and the headers a
  problem is sent with (:data:`PROBLEM_HEADERS`: ``Retry-After`` on a 503).

What the routes declare themselves, with the helpers here (:func:`accepted`, :func:`binary`, :func:`not_modified`,
:func:`headers`): every success body's model (``response_model``, also where the route returns a ``JSONResponse``
to keep its bytes), raw bodies with their media type (the plot's ``image/png``, safetensors as
``application/octet-stream``), and the headers they send (``Location``/``Retry-After`` on a 202, ``ETag``...).
tests/unit/test_openapi.py checks the document; tests/unit/test_generated_client.py generates a client from it and
runs a whole deletion with it.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field

from app.auth.service import authenticate
from app.problems import GENERIC_SLUGS, PROBLEM_BASE, PROBLEM_MEDIA_TYPE

SCHEME = "bearerAuth"

HEADERS: dict[str, dict[str, Any]] = {
    "Location": {"description": "The path to poll for what was accepted.", "schema": {"type": "string"}},
    "Retry-After": {"description": "Seconds to wait before polling (or retrying).", "schema": {"type": "integer"}},
    "ETag": {
        "description": "The representation's entity tag (send it back as If-None-Match).",
        "schema": {"type": "string"},
    },
    "Cache-Control": {"description": "How long the answer may be cached.", "schema": {"type": "string"}},
    "Content-Disposition": {"description": "A file name to save the document under.", "schema": {"type": "string"}},
}
"""The response headers the API sends, as OpenAPI header objects (see :func:`headers`)."""

BINARY = {"type": "string", "format": "binary"}


def headers(*names: str) -> dict[str, dict[str, Any]]:
    """OpenAPI header objects for a route's ``responses={status: {"headers": headers("Location", ...)}}``."""
    return {name: HEADERS[name] for name in names}


def accepted(description: str, *names: str) -> dict[int, dict[str, Any]]:
    """A 202 that names where to poll: ``Location`` and ``Retry-After`` (or the headers given)."""
    return {202: {"description": description, "headers": headers(*(names or ("Location", "Retry-After")))}}


def binary(media_type: str, description: str, *names: str) -> dict[int, dict[str, Any]]:
    """A 200 whose body is bytes of ``media_type`` (a PNG, safetensors), for ``response_class=Response`` routes."""
    return {200: {"description": description, "content": {media_type: {"schema": BINARY}}, "headers": headers(*names)}}


def not_modified(*names: str) -> dict[int, dict[str, Any]]:
    """``304 Not Modified``: the ``If-None-Match`` ETag still matches; no body."""
    return {304: {"description": "Not Modified: If-None-Match matched the current ETag.", "headers": headers(*names)}}


class ProblemDetails(BaseModel):
    """An RFC 9457 problem document. Clients switch on ``type``; extensions (``errors``, ``unknown_sample_ids``,
    ``limit_bytes``...) sit beside the standard members."""

    model_config = ConfigDict(extra="allow", title="Problem")
    type: str = Field(
        ...,
        description=f"A URI naming the kind of problem, under {PROBLEM_BASE} (each operation's answers list theirs).",
        json_schema_extra=lambda schema: schema.update(
            {"enum": problem_type_uris(), "x-enum-varnames": [_varname(uri) for uri in problem_type_uris()]}
        ),
    )
    title: str = Field(..., description="A short summary of the kind of problem.")
    status: int = Field(..., description="The HTTP status code.")
    detail: str | None = Field(None, description="What went wrong this time (never a stack trace).")
    instance: str | None = Field(None, description="The path that answered.")
    errors: list[dict[str, Any]] | None = Field(
        None, description="Validation errors: location, message, type (422 validation-error)."
    )


PROBLEM_TYPES: dict[str, tuple[int, str]] = {
    "malformed-json": (400, "The body is not valid JSON"),
    "invalid-cursor": (400, "The cursor is not valid"),
    "unauthorized": (401, "Missing, unknown, expired or revoked API key"),
    "forbidden": (403, "The API key lacks the scope this needs"),
    "client-removed": (403, "The client was forgotten and may not send updates"),
    "model-not-found": (404, "No such model (or not one this key may reach)"),
    "request-not-found": (404, "No such deletion request"),
    "api-key-not-found": (404, "No API key has this id or prefix"),
    "report-not-found": (404, "No such report"),
    "job-not-found": (404, "No such job"),
    "certificate-not-found": (404, "No such certificate"),
    "delivery-not-found": (404, "No such webhook delivery for this request"),
    "version-not-found": (404, "No such version"),
    "plot-not-found": (404, "No such plot"),
    "no-forget-lock": (404, "The model has no forget lock"),
    "not-federated": (404, "The model is not federated"),
    "already-deleted": (409, "Some rows were already erased"),
    "deletion-in-progress": (409, "An unfinished request holds some of these rows"),
    "model-not-ready": (409, "The model is not ready"),
    "method-not-prepared": (409, "The method is not prepared for this model"),
    "method-refused": (409, "The method's validation refused it for this model"),
    "request-started": (409, "A worker has started the request: it can no longer be cancelled"),
    "request-finished": (409, "The request has finished"),
    "not-failed": (409, "Only a failed request can be retried"),
    "version-retired": (410, "This version was trained on erased rows and is retired"),
    "payload-too-large": (413, "Request body too large"),
    "table-too-large": (413, "The table has too many cells"),
    "unsupported-media-type": (415, "Unsupported media type"),
    "validation-error": (422, "The request is not valid"),
    "unknown-sample-ids": (422, "Some sample ids are not in the model's data set"),
    "unknown-label": (422, "The label is not one of the model's classes"),
    "unknown-client": (422, "The client is not in the federation"),
    "unknown-method": (422, "No such unlearning method"),
    "method-not-supported": (422, "The method cannot serve this model kind or scope"),
    "method-setting-not-allowed": (422, "A request may not set this method setting"),
    "scope-not-supported": (422, "The model kind does not support this scope"),
    "too-many-sample-ids": (422, "More sample ids than LETHE_MAX_SAMPLE_IDS"),
    "idempotency-key-reused": (422, "The Idempotency-Key was used with another body"),
    "extension-too-long": (422, "At most two further months in all"),
    "invalid-dataset": (422, "The file is not a readable table"),
    "dataset-not-found": (422, "The data set path is not a readable file"),
    "dataset-path-not-allowed": (422, "The data set path is outside the allowed roots"),
    "unknown-column": (422, "A named column is not in the table"),
    "invalid-round": (422, "The round upload is not a valid safetensors file for this model"),
    "not-awaiting-approval": (409, "Only a request waiting for approval can be approved or rejected"),
    "bulk-selection-empty": (422, "The bulk selection is empty"),
    "bulk-selection-too-large": (422, "The bulk selection is larger than LETHE_BULK_MAX_REQUESTS"),
    "invalid-subject-column": (422, "The subject column must be a column of its own"),
    "identifier-column": (422, "A feature column looks like an identifier"),
    "prediction-not-supported": (422, "This model kind has no predict endpoint"),
    "invalid-rows": (422, "Some rows do not fit the model's feature columns"),
    "too-many-rows": (413, "Too many rows in one call"),
    "rate-limited": (429, "Too many calls about data subjects"),
    "erasure-not-found": (404, "No such subject erasure"),
    "certificate-not-issued": (404, "The combined certificate is not issued yet"),
    "invalid-subject-hash": (422, "Not a subject hash (64 lowercase hex)"),
    "approval-by-submitter": (403, "A request cannot be approved by the key that submitted it"),
    "checkpoint-required": (422, "This architecture needs a local checkpoint"),
    "client-without-data": (422, "A client of the caption files has no pairs"),
    "conflicting-assignment": (422, "An image is assigned to two clients"),
    "image-not-found": (422, "An image of the caption files is not a readable file"),
    "image-outside-root": (422, "An image lies outside the allowed roots"),
    "invalid-client-id": (422, "Not a client id"),
    "invalid-splits": (422, "The caption files' splits are not valid"),
    "no-test-images": (422, "The caption files have no test images"),
    "too-few-clients": (422, "The federation needs more clients"),
    "unknown-image": (422, "A caption names an image that is not in the files"),
    "intake-unavailable": (503, "The request could not be recorded now (retry with the same Idempotency-Key)"),
    "database-unavailable": (503, "The service's database is unavailable (retry after Retry-After)"),
    "internal-error": (500, "Internal error (logged; no details exposed)"),
}
"""Every problem ``type`` a route answers with (slug: status, title); :data:`app.problems.GENERIC_SLUGS` are the
others (an unknown path, a wrong method)."""

PROBLEM_HEADERS: dict[str, tuple[str, ...]] = {
    "intake-unavailable": ("Retry-After",),
    "database-unavailable": ("Retry-After",),
}
"""The headers a problem is sent with (``Retry-After``: when to try again)."""


def problem_type_uris() -> list[str]:
    """Every ``type`` the API answers with, as the Problem schema's enum."""
    return [PROBLEM_BASE + slug for slug in sorted(set(PROBLEM_TYPES) | GENERIC_SLUGS)]


def _varname(uri: str) -> str:
    """A generated client's name for a problem type (``x-enum-varnames``): ``UNKNOWN_SAMPLE_IDS``, not the URI."""
    return uri.removeprefix(PROBLEM_BASE).upper().replace("-", "_")


_PATH_ENTITIES = {
    "model_id": "model-not-found",
    "request_id": "request-not-found",
    "report_id": "report-not-found",
    "job_id": "job-not-found",
    "certificate_id": "certificate-not-found",
    "delivery_id": "delivery-not-found",
    "erasure_id": "erasure-not-found",
}
_SAMPLES = {"kind": "samples", "sample_ids": ["P0003", "P0010"]}

OPERATION_PROBLEMS: dict[tuple[str, str], list[str]] = {
    ("post", "/v1/deletion-requests"): [
        "model-not-found", "model-not-ready", "already-deleted", "deletion-in-progress", "method-not-prepared",
        "method-refused", "unknown-sample-ids", "unknown-label", "unknown-client", "unknown-method",
        "method-not-supported", "method-setting-not-allowed", "scope-not-supported", "too-many-sample-ids",
        "idempotency-key-reused", "intake-unavailable",
    ],
    ("post", "/v1/models"): [
        "invalid-dataset", "dataset-not-found", "dataset-path-not-allowed", "unknown-column", "unknown-method",
        "method-not-supported", "table-too-large", "invalid-subject-column", "identifier-column", "checkpoint-required",
        "client-without-data", "conflicting-assignment", "image-not-found", "image-outside-root",
        "invalid-client-id", "invalid-splits", "no-test-images", "too-few-clients", "unknown-client", "unknown-image",
    ],
    ("post", "/v1/models/{model_id}/rounds"): ["client-removed", "model-not-ready", "not-federated", "invalid-round"],
    ("post", "/v1/deletion-requests/{request_id}/extend"): ["request-finished", "extension-too-long"],
    ("post", "/v1/deletion-requests/{request_id}/cancel"): ["request-started", "request-finished"],
    ("post", "/v1/deletion-requests/{request_id}/retry"): ["not-failed", "deletion-in-progress"],
    ("get", "/v1/models/{model_id}/forget-lock"): ["no-forget-lock"],
    ("get", "/v1/models/{model_id}/forget-lock.safetensors"): ["no-forget-lock"],
    ("get", "/v1/models/{model_id}/pairs"): ["not-federated"],
    ("post", "/v1/webhooks/secret"): ["api-key-not-found"],
    ("get", "/v1/models/{model_id}/versions/{number}/weights"): ["version-not-found", "version-retired"],
    ("post", "/v1/models/{model_id}/predict"): [
        "model-not-ready", "version-not-found", "version-retired", "prediction-not-supported", "invalid-rows",
        "too-many-rows",
    ],
    ("get", "/v1/reports/{report_id}/plots/{name}"): ["plot-not-found"],
    ("post", "/v1/deletion-requests/{request_id}/approve"): ["not-awaiting-approval", "approval-by-submitter"],
    ("post", "/v1/deletion-requests/{request_id}/reject"): ["not-awaiting-approval"],
    ("post", "/v1/deletion-requests/bulk"): ["bulk-selection-empty", "bulk-selection-too-large"],
    ("post", "/v1/subjects/erasures"): ["unknown-method", "method-not-supported", "rate-limited"],
    ("post", "/v1/subjects/lookup"): ["rate-limited"],
    ("get", "/v1/subjects/erasures/{erasure_id}/certificate"): ["certificate-not-issued"],
    ("get", "/v1/subjects/{subject_hash}/requests"): ["invalid-subject-hash"],
}  # fmt: skip
"""The domain's own problems per operation (the generic ones are derived from the route)."""


def _model_registration_body() -> dict[str, Any]:
    tabular = {
        "name": "breast-cancer-lr",
        "family": "logistic_regression",
        "dataset": {"row_id_column": "patient_id", "label_column": "target"},
        "unlearning": ["newton", "l2ul"],
    }
    return {
        "required": True,
        "description": "A tabular model as multipart (`metadata` JSON + `file` CSV/Parquet), or JSON: a tabular "
        "model whose `dataset.path` lies under LETHE_DATA_ROOTS, or a federated CLIP model (`kind: clip_federated`).",
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["metadata", "file"],
                    "properties": {
                        "metadata": {"type": "string", "description": "ModelCreate as a JSON string."},
                        "file": {"type": "string", "format": "binary", "description": "The table (CSV or Parquet)."},
                    },
                },
                "encoding": {"metadata": {"contentType": "application/json"}},
                "example": {"metadata": tabular, "file": "<breast_cancer.csv>"},
            },
            "application/json": {
                "schema": {
                    "oneOf": [
                        {"$ref": "#/components/schemas/ModelCreate"},
                        {"$ref": "#/components/schemas/ClipModelCreate"},
                    ]
                },
                "examples": {
                    "tabular-from-path": {
                        "summary": "A tabular model from a server-side file",
                        "value": tabular | {"dataset": tabular["dataset"] | {"path": "/data/breast_cancer.csv"}},
                    },
                    "federated-clip": {
                        "summary": "A federated tiny CLIP + LoRA over five simulated clients",
                        "value": {
                            "name": "federated-clip",
                            "kind": "clip_federated",
                            "data": {"kind": "synthetic", "seed": 0, "n_clients": 5, "pairs_per_client": 200},
                            "fed_settings": {"rounds": 20},
                        },
                    },
                },
            },
        },
    }


REQUEST_EXAMPLES: dict[tuple[str, str], dict[str, Any]] = {
    ("post", "/v1/deletion-requests"): {
        "samples": {
            "summary": "A data subject's rows, exact retraining, with a callback",
            "value": {
                "subject_ref": "alice@example.org",
                "model_id": "0b8e6d0c-3f7e-4c52-9a53-6f1f0d9a1e21",
                "scope": _SAMPLES,
                "method": "retrain",
                "callback_url": "https://compliance.example.org/lethe-events",
                "received_at": "2026-11-28T09:30:00+00:00",
            },
        },
        "client": {
            "summary": "A federated client leaves (EASE)",
            "value": {
                "subject_ref": "federated client c3",
                "model_id": "5d2c1a8e-77b0-4f7e-8d43-0e6b1c9f4a10",
                "scope": {"kind": "client", "client_id": "c3"},
                "method": "ease",
            },
        },
        "class": {
            "summary": "A whole class, the fastest prepared method",
            "value": {
                "subject_ref": "label recall 2026-11",
                "model_id": "0b8e6d0c-3f7e-4c52-9a53-6f1f0d9a1e21",
                "scope": {"kind": "class", "label": "benign"},
                "method": "auto",
            },
        },
    },
    ("post", "/v1/deletion-requests/{request_id}/extend"): {
        "one-month": {
            "summary": "Extend by one month",
            "value": {"months": 1, "reason": "The request covers three models and a federated retraining."},
        }
    },
    ("post", "/v1/webhooks/secret"): {
        "receiver": {"value": {"url": "https://compliance.example.org/lethe-events", "key": "3f9c2a1b"}},
    },
}

REQUEST_BODIES: dict[tuple[str, str], Any] = {
    ("post", "/v1/models"): _model_registration_body,
    ("post", "/v1/models/{model_id}/rounds"): lambda: {
        "required": True,
        "description": "One FedAvg round: safetensors with `updates` [clients, params] float32 and optionally "
        "`weights` [clients]; raw, or as multipart field `file`.",
        "content": {
            "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file"],
                    "properties": {"file": {"type": "string", "format": "binary"}},
                }  # fmt: skip
            },
        },
    },
}


def _dependency_calls(dependant) -> list:
    calls = []
    for dep in dependant.dependencies:
        calls.append(dep.call)
        calls.extend(_dependency_calls(dep))
    return calls


def _api_routes(app: FastAPI) -> dict[tuple[str, str], APIRoute]:
    """``(method, path): route`` for every API route, included routers too (FastAPI >= 0.130 keeps an included
    router as one entry of ``app.routes``; ``iter_route_contexts`` walks into it)."""
    try:
        from fastapi.routing import iter_route_contexts

        pairs = [(c.path_format, c.original_route) for c in iter_route_contexts(app.routes)]
    except ImportError:  # older FastAPI: the routes are copied into app.routes
        pairs = [(r.path_format, r) for r in app.routes]
    return {
        (method.lower(), path): route
        for path, route in pairs
        if isinstance(route, APIRoute)
        for method in route.methods
    }


def _security(route: APIRoute, method: str, path: str) -> list[dict[str, list[str]]] | None:
    """One requirement per accepted scope (any one suffices), or None for a public route."""
    calls = _dependency_calls(route.dependant)
    for call in calls:
        scopes = getattr(call, "scopes", None)
        if scopes:
            return [{SCHEME: [scope]} for scope in scopes]
    batch_scopes = getattr(route.endpoint, "batch_scopes", None)  # checked later, in a batch (batch_authenticated)
    if batch_scopes:
        return [{SCHEME: [scope]} for scope in batch_scopes]
    if authenticate in calls:
        return [{SCHEME: []}]
    return None


def _problem_response(slugs: list[str]) -> dict[str, Any]:
    status = PROBLEM_TYPES[slugs[0]][0]
    examples = {
        slug: {
            "summary": PROBLEM_TYPES[slug][1],
            "value": {"type": PROBLEM_BASE + slug, "title": PROBLEM_TYPES[slug][1], "status": status},
        }
        for slug in slugs
    }
    response = {
        "description": "Problem types: " + ", ".join(f"`{slug}`" for slug in slugs),
        "content": {PROBLEM_MEDIA_TYPE: {"schema": {"$ref": "#/components/schemas/Problem"}, "examples": examples}},
        "x-problem-types": [PROBLEM_BASE + slug for slug in slugs],
    }
    sent = [name for slug in slugs for name in PROBLEM_HEADERS.get(slug, ())]
    if sent:
        response["headers"] = headers(*dict.fromkeys(sent))
    return response


def _problems_for(route: APIRoute, method: str, path: str, operation: dict[str, Any], secured: bool) -> list[str]:
    slugs: list[str] = []
    if secured:
        slugs += ["unauthorized", "forbidden"]
    for name in route.param_convertors:
        if name in _PATH_ENTITIES:
            slugs.append(_PATH_ENTITIES[name])
    params = [p.get("name") for p in operation.get("parameters", [])]
    has_body = "requestBody" in operation or (method, path) in REQUEST_BODIES
    if params or has_body:
        slugs.append("validation-error")
    if "cursor" in params:
        slugs.append("invalid-cursor")
    if has_body:
        slugs += ["malformed-json", "payload-too-large", "unsupported-media-type"]
    slugs += OPERATION_PROBLEMS.get((method, path), [])
    slugs += ["database-unavailable", "internal-error"]
    return list(dict.fromkeys(slugs))


def build_openapi(app: FastAPI) -> dict[str, Any]:
    from app.registry.schemas import ClipModelCreate, ModelCreate

    spec = get_openapi(
        title=app.title,
        version=app.version,
        description=app.description,
        routes=app.routes,
        tags=app.openapi_tags,
    )
    components = spec.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    for model in (ProblemDetails, ModelCreate, ClipModelCreate):
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        for name, definition in schema.pop("$defs", {}).items():
            schemas.setdefault(name, definition)
        schemas[schema.get("title", model.__name__) if model is ProblemDetails else model.__name__] = schema
    components["securitySchemes"] = {
        SCHEME: {
            "type": "http",
            "scheme": "bearer",
            "bearerFormat": "lethe_<prefix>_<secret>",
            "description": "An API key from `lethe keys create`, sent as `Authorization: Bearer <key>`. The scopes "
            "listed on each operation are alternatives: the key needs one of them (`admin` holds them all).",
        }
    }
    routes = _api_routes(app)
    names = [r.name for r in routes.values() if r.include_in_schema]
    for path, operations in spec["paths"].items():
        for method, operation in operations.items():
            route = routes.get((method, path))
            if route is None:
                continue
            if names.count(route.name) == 1:  # the function's name: `list_models`, not `list_models_v1_models_get`
                operation["operationId"] = route.name
            security = _security(route, method, path)
            operation["security"] = security or []
            if (method, path) in REQUEST_BODIES:
                operation["requestBody"] = REQUEST_BODIES[(method, path)]()
            examples = REQUEST_EXAMPLES.get((method, path))
            if examples and "requestBody" in operation:
                operation["requestBody"]["content"]["application/json"]["examples"] = examples
            responses = operation.setdefault("responses", {})
            by_status: dict[int, list[str]] = {}
            for slug in _problems_for(route, method, path, operation, security is not None):
                by_status.setdefault(PROBLEM_TYPES[slug][0], []).append(slug)
            for status, slugs in sorted(by_status.items()):
                responses[str(status)] = _problem_response(slugs)
    for unused in ("HTTPValidationError", "ValidationError"):
        schemas.pop(unused, None)
    return spec


def install(app: FastAPI) -> None:
    """Serve :func:`build_openapi`'s document at ``/openapi.json`` (built once, on first use)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

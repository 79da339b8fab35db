"""Which method settings a deletion request may carry: an allowlist per method, empty by default.

The model's owner tunes a method at registration (``method_settings``, with bounds: app/registry/settings.py); a
requester may only adjust the keys listed here, so no request can switch off a purge, resize a process pool or
stretch a training run. A key outside the list is ``422 method-setting-not-allowed`` naming it; an allowed key's
value is checked against the same bounds as at registration.

This table belongs with each method's registration (``register_method(..., request_settings=frozenset())`` in
app/ml/unlearning/base.py); it lives here until that argument exists.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from app.problems import Problem
from app.registry.settings import METHOD_SETTINGS

REQUEST_SETTINGS: dict[str, frozenset[str]] = {"ease": frozenset({"leaving_client"})}
"""Method name → the settings keys a deletion request may set. None by default (``auto`` too); EASE's
``leaving_client`` ("offline": the server-only path, issue 11 item 6 — already the client-scope default, so it only
matters for a model registered with ``client_excision="bke"``) is a fact about this request — whether the leaving
client can take part — not a tuning of the method."""


def check_request_settings(method: str, settings: dict[str, Any]) -> None:
    allowed = REQUEST_SETTINGS.get(method, frozenset())
    for key in settings:
        if key not in allowed:
            raise Problem(
                422,
                "method-setting-not-allowed",
                "A deletion request may not set this method setting",
                f"{key!r} is not a setting a request may change for {method!r}"
                + (f"; allowed: {sorted(allowed)}" if allowed else "; it takes none (the model's registration does)"),
                setting=key,
                method=method,
                allowed_settings=sorted(allowed),
            )
    schema = METHOD_SETTINGS.get(method)
    if settings and schema is not None:
        try:
            schema.model_validate(settings)
        except ValidationError as exc:
            errors = [
                {"location": ["body", "method_settings", *map(str, e["loc"])], "message": e["msg"], "type": e["type"]}
                for e in exc.errors()
            ]
            raise Problem(422, "validation-error", "The request is not valid", errors=errors) from None

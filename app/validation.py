"""Input hygiene shared by every request schema: no NUL character in any string (PostgreSQL can store none, and no
identifier needs one) and no non-finite number (JSON has none; PostgreSQL's JSONB refuses them). One malformed
request is a 422 at the schema, before it can reach a database batch shared with other requests."""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, model_validator
from pydantic_core import PydanticCustomError, from_json

from app.problems import Problem


def load_json(raw: bytes | str, what: str = "The body") -> Any:
    """``raw`` parsed by pydantic-core's parser (jiter), or a 400 ``malformed-json``: broken syntax, bytes that are not
    UTF-8, or nesting past its depth limit (200). Python's ``json`` raised RecursionError on a deeply nested document,
    an unhandled 500 (issue 22: 200k-deep JSON at registration)."""
    try:
        return from_json(raw)
    except ValueError as exc:
        raise Problem(400, "malformed-json", f"{what} is not valid JSON", str(exc)) from None


def find_bad_value(value: Any, path: str = "") -> tuple[str, str] | None:
    """(location, what is wrong) of the first NUL-bearing string (value or key) or non-finite float, or None."""
    if isinstance(value, str):
        return (path or "body", "a NUL character is not allowed") if "\x00" in value else None
    if isinstance(value, float):
        return None if math.isfinite(value) else (path or "body", "a number must be finite")
    if isinstance(value, dict):
        for key, item in value.items():
            here = f"{path}.{key}" if path else str(key)
            if isinstance(key, str) and "\x00" in key:
                return here.replace("\x00", "\\0"), "a NUL character is not allowed (in a key)"
            found = find_bad_value(item, here)
            if found:
                return found
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            found = find_bad_value(item, f"{path}[{index}]")
            if found:
                return found
    return None


def check_clean(value: Any) -> Any:
    found = find_bad_value(value)
    if found:
        location, message = found
        raise PydanticCustomError("bad_character", "{location}: {message}", {"location": location, "message": message})
    return value


class NoNulModel(BaseModel):
    """A request body schema that refuses a NUL in any string, nested keys included, and non-finite numbers."""

    @model_validator(mode="before")
    @classmethod
    def _no_nul(cls, data: Any) -> Any:
        return check_clean(data)

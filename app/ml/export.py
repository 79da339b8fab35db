"""A tabular model version taken out of the service: one safetensors file that carries its own model card.

The file is the version's parameters (one float32 tensor ``theta``, exactly as stored) with, in the safetensors
header's ``__metadata__``, ``format = "lethe.tabular/1"`` and ``lethe.card``: a JSON document holding everything
needed to use the model anywhere —

- ``model`` / ``version``: ids, name, number, parent, method, the deletion request that made it, ``created_at``,
  ``digest`` (the service's content address: sha256 of the stored safetensors file holding ``theta`` alone, the
  digest certificates sign) and ``theta_sha256`` (sha256 of theta's raw little-endian float32 bytes, checkable
  without re-serialising);
- ``recipe``: family, l2, hidden units, seed, solver settings;
- ``encoder``: the fitted encoding (app/ml/data/tabular.py's ``TableEncoder.to_dict``): feature columns in order,
  numeric columns with their training mean and standard deviation, categorical columns with their categories in
  one-hot order, the label classes in order; ``features``: the encoded feature names in column order;
- ``layout``: how theta unpacks (``params``: name, shape and offset of each matrix and bias inside one member,
  row-major), how many members it concatenates (SISA's ensemble: their class probabilities are averaged), the
  hidden activation and the output rule;
- ``quality``: the version's measured accuracy (held-out and trained-on rows).

:func:`load` rebuilds a :class:`Predictor` from the file alone. This module imports only the standard library, numpy
and safetensors — no torch, no pandas, nothing of the service — so it can be copied next to an exported file and
used as it is (tests/unit/test_export.py runs a copy of it in a separate interpreter). The service's own predict
endpoint runs the same code, so what the API answers and what a taken-out file answers are one computation.

Encoding (identical to ``TableEncoder.transform``, bit for bit): a numeric value x becomes float32((x - mean) / std)
computed in float64, a missing one (None, NaN) 0; a categorical value is stripped of surrounding spaces and sets its
category's slot to 1, a missing or unseen one leaves its block all zero. Forward pass in float64, as the service's
``predict_proba``: logistic regression ``z = X W^T + b`` (binary: logits ``[0, z]``), MLP
``softmax(sigmoid(X W1^T + b1) W2^T + b2)``; probabilities are the softmax, averaged over members.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load as load_arrays
from safetensors.numpy import save as save_arrays

FORMAT = "lethe.tabular/1"
CARD_KEY = "lethe.card"
WEIGHTS_KEY = "theta"
FAMILIES = ("logistic_regression", "mlp")


class ExportError(ValueError):
    """The file is not an exported Lethe tabular model, or it does not hold together (sizes, checksum)."""


class RowsError(ValueError):
    """Rows that cannot be encoded: ``unknown_columns`` (not features), ``missing_columns`` (a feature no value was
    given for: send null for a missing value), ``errors`` (a value of the wrong type: row index, column, expected)."""

    def __init__(self, unknown: list[str], missing: list[str], errors: list[dict[str, Any]]):
        self.unknown_columns, self.missing_columns, self.errors = unknown, missing, errors
        parts = []
        if unknown:
            parts.append(f"unknown columns {unknown}")
        if missing:
            parts.append(f"missing columns {missing}")
        if errors:
            first = errors[0]
            more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
            parts.append(f"row {first['row']} column {first['column']!r}: {first['message']}{more}")
        super().__init__("; ".join(parts))


# ---------------------------------------------------------------------------------------------- layout
def param_layout(family: str, hidden_units: int, n_features: int, n_classes: int) -> list[dict[str, Any]]:
    """One member's parameters in theta order: name, shape, offset (app/ml/tabular.py's ``param_shapes``)."""
    if family not in FAMILIES:
        raise ExportError(f"unknown family {family!r}; expected one of {FAMILIES}")
    if n_classes < 2:
        raise ExportError("a model needs at least two classes")
    d, h = int(n_features), int(hidden_units)
    k = 1 if family == "logistic_regression" and n_classes == 2 else int(n_classes)
    if family == "logistic_regression":
        shapes = [("weight", (k, d)), ("bias", (k,))]
    else:
        shapes = [("hidden.weight", (h, d)), ("hidden.bias", (h,)), ("output.weight", (k, h)), ("output.bias", (k,))]
    out, offset = [], 0
    for name, shape in shapes:
        out.append({"name": name, "shape": list(shape), "offset": offset})
        offset += math.prod(shape)
    return out


def member_size(layout: Sequence[Mapping[str, Any]]) -> int:
    return sum(math.prod(p["shape"]) for p in layout)


def feature_names(encoder: Mapping[str, Any]) -> list[str]:
    """The encoded columns in order: a numeric column's name, a categorical column's ``column=category`` each."""
    names: list[str] = []
    for column in encoder["feature_columns"]:
        if column in encoder["categories"]:
            names.extend(f"{column}={category}" for category in encoder["categories"][column])
        else:
            names.append(column)
    return names


def theta_sha256(theta: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(theta, dtype="<f4").tobytes()).hexdigest()


def make_card(
    *,
    model: Mapping[str, Any],
    version: Mapping[str, Any],
    recipe: Mapping[str, Any],
    encoder: Mapping[str, Any],
    theta: np.ndarray,
    quality: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The card of one version: the service's facts (``model``, ``version``, ``recipe``, ``encoder``, ``quality``)
    plus what follows from them and theta (the feature names, the layout, the members, theta's checksum)."""
    family = recipe["family"]
    layout = param_layout(family, int(recipe.get("hidden_units", 10)), _n_features(encoder), len(encoder["classes"]))
    size = member_size(layout)
    members, rem = divmod(int(np.asarray(theta).size), size)
    if rem or members < 1:
        raise ExportError(f"theta has {np.asarray(theta).size} values, not a multiple of the model size {size}")
    return {
        "format": FORMAT,
        "model": dict(model),
        "version": {**version, "theta_sha256": theta_sha256(theta)},
        "recipe": dict(recipe),
        "encoder": json.loads(json.dumps(encoder)),
        "features": feature_names(encoder),
        "layout": {
            "tensor": WEIGHTS_KEY,
            "dtype": "float32",
            "members": members,
            "member_params": size,
            "params": layout,
            "hidden_activation": "sigmoid" if family == "mlp" else None,
            "output": "binary: logits [0, z] of the one output z, softmax (= sigmoid(z))"
            if layout[-1]["shape"] == [1]
            else "softmax over the output logits",
            "combine": "mean of the members' class probabilities",
        },
        "quality": dict(quality) if quality else None,
    }


def export_bytes(theta: np.ndarray, card: Mapping[str, Any]) -> bytes:
    """The exported file: theta (float32) with the card in the safetensors header metadata."""
    array = np.ascontiguousarray(theta, dtype=np.float32).reshape(-1)
    if card.get("version", {}).get("theta_sha256") not in (None, theta_sha256(array)):
        raise ExportError("the card does not describe this theta")
    metadata = {"format": FORMAT, CARD_KEY: json.dumps(card, sort_keys=True, separators=(",", ":"))}
    return save_arrays({WEIGHTS_KEY: array}, metadata=metadata)


# ---------------------------------------------------------------------------------------------- reading
def read_metadata(data: bytes) -> dict[str, str]:
    """The safetensors header's ``__metadata__`` (strings), read without loading the tensors."""
    if len(data) < 8:
        raise ExportError("not a safetensors file: too short")
    size = int.from_bytes(data[:8], "little")
    if size <= 0 or 8 + size > len(data):
        raise ExportError("not a safetensors file: bad header length")
    try:
        header = json.loads(data[8 : 8 + size])
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ExportError("not a safetensors file: the header is not JSON") from None
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    return dict(metadata) if isinstance(metadata, dict) else {}


def load(source: bytes | str | Path, verify: bool = True) -> Predictor:
    """A predictor from an exported file (its bytes or its path). ``verify``: theta's checksum must match the
    card's ``theta_sha256`` (a file changed since export is refused)."""
    data = Path(source).read_bytes() if isinstance(source, str | Path) else bytes(source)
    metadata = read_metadata(data)
    if metadata.get("format") != FORMAT or CARD_KEY not in metadata:
        raise ExportError(f"not an exported Lethe tabular model (format {metadata.get('format')!r}, want {FORMAT!r})")
    card = json.loads(metadata[CARD_KEY])
    theta = load_arrays(data)[WEIGHTS_KEY]
    if verify and theta_sha256(theta) != card["version"]["theta_sha256"]:
        raise ExportError("theta does not match the card's theta_sha256: the file was changed")
    return Predictor(card, theta)


def _n_features(encoder: Mapping[str, Any]) -> int:
    return len(encoder["numeric_columns"]) + sum(len(v) for v in encoder["categories"].values())


def _is_missing(value: Any) -> bool:
    return value is None or (isinstance(value, float | np.floating) and math.isnan(value))


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float | np.integer | np.floating | np.bool_)  # bool is an int


def _softmax(Z: np.ndarray) -> np.ndarray:
    E = np.exp(Z - Z.max(axis=1, keepdims=True))
    return E / E.sum(axis=1, keepdims=True)


def _sigmoid(U: np.ndarray) -> np.ndarray:
    return np.exp(-np.logaddexp(0.0, -U))


@dataclass
class Predictor:
    """An exported version: ``encode`` rows (dicts, column -> value) into features, ``predict_proba`` /
    ``predict`` them. ``card`` is the file's card, ``theta`` its parameters."""

    card: dict[str, Any]
    theta: np.ndarray

    def __post_init__(self) -> None:
        if self.card.get("format") != FORMAT:
            raise ExportError(f"unknown card format {self.card.get('format')!r}")
        self.encoder = self.card["encoder"]
        self.classes: list[str] = list(self.encoder["classes"])
        self.feature_columns: list[str] = list(self.encoder["feature_columns"])
        self.n_features = _n_features(self.encoder)
        layout = self.card["layout"]
        recipe = self.card["recipe"]
        expected = param_layout(recipe["family"], recipe.get("hidden_units", 10), self.n_features, len(self.classes))
        if layout["params"] != expected:
            raise ExportError("the card's layout does not match its recipe and encoder")
        self.theta = np.asarray(self.theta, dtype=np.float32).reshape(-1)
        size = member_size(expected)
        if self.theta.size != size * int(layout["members"]):
            raise ExportError(f"theta has {self.theta.size} values; the card says {layout['members']} x {size}")
        self._members = [
            {
                p["name"]: self.theta[m * size + p["offset"] : m * size + p["offset"] + math.prod(p["shape"])]
                .astype(np.float64)
                .reshape(p["shape"])
                for p in expected
            }
            for m in range(int(layout["members"]))
        ]
        self._index = {c: {cat: i for i, cat in enumerate(cats)} for c, cats in self.encoder["categories"].items()}

    @property
    def n_params(self) -> int:
        return int(self.theta.size)

    def check_rows(self, rows: Sequence[Mapping[str, Any]]) -> None:
        """Raise :class:`RowsError` unless every row names exactly the feature columns, numbers (or null) for the
        numeric ones and text (or null) for the categorical ones."""
        wanted = set(self.feature_columns)
        unknown: dict[str, None] = {}
        missing: dict[str, None] = {}
        errors: list[dict[str, Any]] = []
        for i, row in enumerate(rows):
            for column in row:
                if column not in wanted:
                    unknown[str(column)] = None
            for column in self.feature_columns:
                if column not in row:
                    missing[column] = None
                    continue
                value = row[column]
                if _is_missing(value):
                    continue
                categorical = column in self._index
                if categorical and not isinstance(value, str):
                    errors.append({"row": i, "column": column, "message": "expected text (a category) or null"})
                elif not categorical and (isinstance(value, str) or not _is_number(value)):
                    errors.append({"row": i, "column": column, "message": "expected a number or null"})
        if unknown or missing or errors:
            raise RowsError(sorted(unknown), [c for c in self.feature_columns if c in missing], errors[:100])

    def encode(self, rows: Sequence[Mapping[str, Any]]) -> np.ndarray:
        """Rows -> float32 features [n, n_features] (checked first: see :meth:`check_rows`)."""
        self.check_rows(rows)
        out = np.zeros((len(rows), self.n_features), dtype=np.float32)
        j = 0
        for column in self.feature_columns:
            if column in self._index:
                index = self._index[column]
                for i, row in enumerate(rows):
                    value = row[column]
                    if not _is_missing(value):
                        k = index.get(value.strip())
                        if k is not None:
                            out[i, j + k] = 1.0
                j += len(index)
            else:
                v = np.array([np.nan if _is_missing(r[column]) else float(r[column]) for r in rows], dtype=np.float64)
                v = (v - float(self.encoder["means"][column])) / float(self.encoder["stds"][column])
                out[:, j] = np.nan_to_num(v, nan=0.0, posinf=0.0, neginf=0.0)
                j += 1
        return out

    def _member_logits(self, params: Mapping[str, np.ndarray], X: np.ndarray) -> np.ndarray:
        if "weight" in params:
            Z = X @ params["weight"].T + params["bias"]
            return np.concatenate([np.zeros_like(Z), Z], axis=1) if Z.shape[1] == 1 else Z
        A = _sigmoid(X @ params["hidden.weight"].T + params["hidden.bias"])
        return A @ params["output.weight"].T + params["output.bias"]

    def predict_proba(self, rows_or_X: Sequence[Mapping[str, Any]] | np.ndarray) -> np.ndarray:
        """Class probabilities [n, C] (float64, columns in ``classes`` order) for rows or encoded features."""
        X = rows_or_X if isinstance(rows_or_X, np.ndarray) else self.encode(rows_or_X)
        X = np.asarray(X, dtype=np.float64)
        if X.ndim != 2 or X.shape[1] != self.n_features:
            raise ValueError(f"features must be [n, {self.n_features}]; got {X.shape}")
        probs = np.zeros((len(X), len(self.classes)))
        for params in self._members:
            probs += _softmax(self._member_logits(params, X))
        return probs / len(self._members)

    def predict(self, rows_or_X: Sequence[Mapping[str, Any]] | np.ndarray) -> list[str]:
        """The most probable class of each row, as its label."""
        return [self.classes[int(k)] for k in self.predict_proba(rows_or_X).argmax(axis=1)]

"""Tables in, float32 feature matrices out.

``load_table`` reads CSV or Parquet (path, bytes or file-like). ``TableEncoder`` turns a DataFrame into the
features every tabular model and the Isolation Kernel see: numeric columns standardised with the training mean/std,
categorical columns one-hot over their sorted training categories, labels mapped to 0..C-1 over their sorted string
values. The encoder is fitted once per registered data set and stored as JSON (``to_dict``), so every later retrain,
meta-training task and verification run encodes rows identically.

Missing values (NaN/None, and ``?`` in CSV, the UCI convention used by Adult):
- numeric: imputed with the training mean, i.e. 0 after standardisation;
- categorical: an all-zero one-hot block (no "missing" category), the same as a category unseen at fit time.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import pandas as pd

CSV_NA_VALUES = ["?"]
_PARQUET_MAGIC = b"PAR1"


def _sniff_format(source: Any) -> str:
    if isinstance(source, str | os.PathLike):
        suffixes = [s.lower() for s in Path(source).suffixes]
        if any(s in (".parquet", ".pq") for s in suffixes):
            return "parquet"
        if any(s in (".csv", ".tsv", ".txt") for s in suffixes):
            return "csv"
        with open(source, "rb") as fh:
            head = fh.read(4)
    elif isinstance(source, bytes | bytearray | memoryview):
        head = bytes(source[:4])
    else:
        pos = source.tell()
        head = source.read(4)
        source.seek(pos)
        if isinstance(head, str):
            return "csv"
    return "parquet" if head == _PARQUET_MAGIC else "csv"


def load_table(
    source: str | os.PathLike | bytes | BinaryIO, fmt: str | None = None, text_columns: Iterable[str] = ()
) -> pd.DataFrame:
    """Read a CSV or Parquet table.

    ``fmt`` ("csv" | "parquet") defaults to the file suffix, or to the Parquet magic bytes for bytes/file-likes.
    CSV is read with ``skipinitialspace=True`` (Adult separates with comma + space), ``?`` as missing, blank lines
    skipped; column names are stripped of surrounding spaces.

    ``text_columns`` (identifiers: the row-id and subject columns) are kept exactly as written: no type inference
    and no missing-value markers, so ``0077777`` stays ``0077777`` (not 77777), ``NA`` and ``null`` stay names, and an
    id past 2^53 keeps its digits (issue 22: a re-typed subject id made its erasure miss the person). A Parquet
    file's own types are the writer's: integer ids become their decimal text.
    """
    fmt = (fmt or _sniff_format(source)).lower()
    if isinstance(source, bytes | bytearray | memoryview):
        source = io.BytesIO(bytes(source))
    start = source.tell() if hasattr(source, "tell") else None
    if fmt == "parquet":
        df = pd.read_parquet(source)
    elif fmt == "csv":
        df = pd.read_csv(source, skipinitialspace=True, na_values=CSV_NA_VALUES, skip_blank_lines=True)
    else:
        raise ValueError(f"unknown table format {fmt!r}; expected 'csv' or 'parquet'")
    df.columns = [str(c).strip() for c in df.columns]
    wanted = [c for c in dict.fromkeys(text_columns) if c in df.columns]
    if wanted and fmt == "csv":
        if start is not None:
            source.seek(start)
        exact = pd.read_csv(  # a second pass over the id columns only, as text
            source, skipinitialspace=True, skip_blank_lines=True, dtype=str, keep_default_na=False, na_filter=False,
            usecols=lambda c: str(c).strip() in wanted,
        )  # fmt: skip
        exact.columns = [str(c).strip() for c in exact.columns]
        if len(exact) != len(df):
            raise ValueError("the table's id columns could not be read row for row as text")
        for column in wanted:
            df[column] = exact[column].to_numpy(dtype=object)
    elif wanted:
        for column in wanted:
            if not pd.api.types.is_string_dtype(df[column]):  # already text (a checked C loop): kept as it is
                df[column] = [_id_text(v) for v in df[column]]
    return df


def _id_text(value: Any) -> str:
    """A typed identifier cell (Parquet) as text: integral numbers without a fractional part, bytes decoded."""
    if value is None or (isinstance(value, float) and not np.isfinite(value)):
        return ""
    if isinstance(value, float | np.floating) and float(value).is_integer():
        return str(int(value))
    if isinstance(value, bytes):
        return value.decode()
    return str(value)


def _label_str(value: Any) -> str:
    """Canonical string of a label, so 1, 1.0 and "1" are the same class whatever the file format made of them."""
    if isinstance(value, float | np.floating) and float(value).is_integer():
        return str(int(value))
    if isinstance(value, bytes):
        return value.decode()
    return str(value).strip()


def _category_codes(s: pd.Series, cats: list[str]) -> np.ndarray:
    """Each value's index in ``cats`` (-1: missing or unseen), the value read as ``str(x).strip()``. A column of
    strings is factorised and each distinct value mapped once (a Python call per value cost a worker that re-encodes
    a chunk of 8,192 Adult rows 0.09 s on a deletion's path); for strings, equal values are equal text, so it is the
    same mapping. Anything else (numbers, mixed types: 1 and 1.0 are equal but print differently) value by value."""
    index = pd.Index(cats)
    if pd.api.types.infer_dtype(s, skipna=True) == "string":
        codes, uniques = pd.factorize(s, use_na_sentinel=True)  # -1: missing
        mapped = index.get_indexer([str(u).strip() for u in uniques])
        return np.where(codes >= 0, mapped[np.maximum(codes, 0)] if len(mapped) else -1, -1)
    return index.get_indexer([str(x).strip() if pd.notna(x) else None for x in s.tolist()])


@dataclass
class TableEncoder:
    """Fitted encoding of one table; see the module docstring for the rules."""

    label_column: str
    feature_columns: list[str]
    numeric_columns: list[str]
    means: dict[str, float]
    stds: dict[str, float]
    categories: dict[str, list[str]]
    classes: list[str]
    version: int = 1
    _class_index: dict[str, int] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._class_index = {c: i for i, c in enumerate(self.classes)}

    # ------------------------------------------------------------------ fit / properties
    @classmethod
    def fit(
        cls,
        df: pd.DataFrame,
        label_column: str,
        feature_columns: Sequence[str] | None = None,
        exclude: Iterable[str] = (),
    ) -> TableEncoder:
        if label_column not in df.columns:
            raise ValueError(f"label column {label_column!r} not in table columns {list(df.columns)}")
        excluded = set(exclude) | {label_column}
        if feature_columns is None:
            feature_columns = [c for c in df.columns if c not in excluded]
        else:
            missing = [c for c in feature_columns if c not in df.columns]
            if missing:
                raise ValueError(f"feature columns {missing} not in table")
            feature_columns = [c for c in feature_columns if c not in excluded]
        if not feature_columns:
            raise ValueError("no feature columns left")
        numeric, means, stds, categories = [], {}, {}, {}
        for col in feature_columns:
            s = df[col]
            if pd.api.types.is_numeric_dtype(s) or pd.api.types.is_bool_dtype(s):
                v = s.astype("float64")
                mean = float(v.mean()) if v.notna().any() else 0.0
                std = float(v.std(ddof=0)) if v.notna().sum() > 1 else 0.0
                numeric.append(col)
                means[col] = mean
                stds[col] = std if np.isfinite(std) and std > 0 else 1.0
            else:
                categories[col] = sorted({str(x).strip() for x in s.dropna()})
        labels = df[label_column].dropna()
        if len(labels) != len(df):
            raise ValueError(f"label column {label_column!r} has {len(df) - len(labels)} missing values")
        classes = sorted({_label_str(x) for x in labels})
        if len(classes) < 2:
            raise ValueError(f"label column {label_column!r} has fewer than two classes: {classes}")
        return cls(label_column, list(feature_columns), numeric, means, stds, categories, classes)

    @property
    def n_features(self) -> int:
        return len(self.numeric_columns) + sum(len(v) for v in self.categories.values())

    @property
    def n_classes(self) -> int:
        return len(self.classes)

    @property
    def feature_names(self) -> list[str]:
        names = []
        for col in self.feature_columns:
            if col in self.categories:
                names.extend(f"{col}={cat}" for cat in self.categories[col])
            else:
                names.append(col)
        return names

    # ------------------------------------------------------------------ transform
    def transform(self, df: pd.DataFrame) -> np.ndarray:
        """Encode ``df`` (extra columns ignored; a missing feature column is an error) as float32 [n, n_features]."""
        missing = [c for c in self.feature_columns if c not in df.columns]
        if missing:
            raise ValueError(f"table lacks feature columns {missing}")
        out = np.zeros((len(df), self.n_features), dtype=np.float32)
        j = 0
        for col in self.feature_columns:
            s = df[col]
            if col in self.categories:
                cats = self.categories[col]
                codes = _category_codes(s, cats)
                rows = np.nonzero(codes >= 0)[0]  # -1: missing or unseen category -> all-zero block
                out[rows, j + codes[rows]] = 1.0
                j += len(cats)
            else:
                v = pd.to_numeric(s, errors="coerce").to_numpy(dtype=np.float64)
                v = (v - self.means[col]) / self.stds[col]
                out[:, j] = np.nan_to_num(v, nan=0.0, posinf=0.0, neginf=0.0)
                j += 1
        return out

    def encode_labels(self, series: pd.Series | Sequence[Any]) -> np.ndarray:
        """Labels -> int64 class indices; an unknown label is an error (a model cannot learn a class it never saw)."""
        values = series if isinstance(series, pd.Series) else pd.Series(list(series), dtype=object)
        codes, uniques = pd.factorize(values, use_na_sentinel=False)
        try:  # each distinct value mapped once (a Python call per row cost a 1M-row table a second per load)
            index = np.asarray([self._class_index[_label_str(v)] for v in uniques], dtype=np.int64)
        except KeyError as exc:
            raise ValueError(f"unknown label {exc.args[0]!r}; known classes {self.classes}") from None
        return index[codes] if len(codes) else np.zeros(0, np.int64)

    def decode_labels(self, indices: Sequence[int] | np.ndarray) -> list[str]:
        return [self.classes[int(i)] for i in indices]

    # ------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "label_column": self.label_column,
            "feature_columns": list(self.feature_columns),
            "numeric_columns": list(self.numeric_columns),
            "means": dict(self.means),
            "stds": dict(self.stds),
            "categories": {k: list(v) for k, v in self.categories.items()},
            "classes": list(self.classes),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TableEncoder:
        known = {
            "version",
            "label_column",
            "feature_columns",
            "numeric_columns",
            "means",
            "stds",
            "categories",
            "classes",
        }
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown TableEncoder keys {unknown}")
        if data.get("version", 1) != 1:
            raise ValueError(f"unsupported TableEncoder version {data.get('version')}")
        return cls(
            label_column=data["label_column"],
            feature_columns=list(data["feature_columns"]),
            numeric_columns=list(data["numeric_columns"]),
            means={k: float(v) for k, v in data["means"].items()},
            stds={k: float(v) for k, v in data["stds"].items()},
            categories={k: list(v) for k, v in data["categories"].items()},
            classes=list(data["classes"]),
        )

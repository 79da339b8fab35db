"""Columns that look like identifiers, which must not become features.

A registered table's columns other than the row-id, label and subject columns become features; a text column is
one-hot encoded, one weight per distinct value. An identifier among them (an e-mail address, a UUID, a customer
number) would then plant one weight per person in the model — personal data in the parameters and in the exported
encoder, learnt row by row, out of reach of per-person erasure by ``subject_column`` — without anyone having asked
for it. These rules say which columns look like that; the registry refuses them at registration (app/registry) and
the worker again on the whole table before version 1 (app/jobs/tabular.py). Standard library only: the API uses
them on a bounded sample of the upload without pandas.

- text with an e-mail address or a UUID in any value;
- text with a distinct value on (nearly) every row: at least ``UNIQUE_SHARE`` of at least ``MIN_ROWS`` values
  (free text and names too: one-hot over them is a lookup table of the rows);
- whole numbers that are a row counter: at least ``MIN_ROWS`` values, all distinct, filling a consecutive range (an
  exported DataFrame index, ``Unnamed: 0``). Other numeric columns are left alone: a number is one standardised
  feature, not a weight per row, and measurements (a weight in grams, a census weight) are often all distinct.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

EMAIL = re.compile(r"^[^@\s<>]+@[^@\s<>]+\.[A-Za-z]{2,}$")
UUID = re.compile(r"^\{?[0-9a-fA-F]{8}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{12}\}?$")
MIN_ROWS = 50
UNIQUE_SHARE = 0.9


@dataclass(frozen=True)
class Finding:
    """A column that looks like an identifier, and why (``reason``: ``email``, ``uuid``, ``unique``, ``counter``)."""

    column: str
    reason: str

    @property
    def explanation(self) -> str:
        return {
            "email": "it holds e-mail addresses",
            "uuid": "it holds UUIDs",
            "unique": "it holds a distinct value on (nearly) every row",
            "counter": "it counts the rows (distinct consecutive whole numbers)",
        }[self.reason]

    def as_dict(self) -> dict[str, str]:
        return {"column": self.column, "reason": self.reason, "explanation": self.explanation}


def text_finding(column: str, distinct: Iterable[str], n_values: int) -> Finding | None:
    """``distinct``: the column's distinct non-missing values (stripped); ``n_values``: how many non-missing values
    it has (with repeats)."""
    count = 0
    for value in distinct:
        count += 1
        if EMAIL.match(value):
            return Finding(column, "email")
        if UUID.match(value):
            return Finding(column, "uuid")
    if n_values >= MIN_ROWS and count >= UNIQUE_SHARE * n_values:
        return Finding(column, "unique")
    return None


def integer_finding(column: str, values: list[int]) -> Finding | None:
    """``values``: the column's values when every one is a whole number (missing ones left out)."""
    if len(values) < MIN_ROWS or len(set(values)) != len(values):
        return None
    return Finding(column, "counter") if max(values) - min(values) == len(values) - 1 else None


def encoder_findings(encoder: dict, n_rows: int, allowed: Iterable[str] = ()) -> list[Finding]:
    """The whole table's verdict from a fitted encoder (``TableEncoder.to_dict``): its categorical columns'
    categories are their distinct values. Numeric columns are not judged here (the encoder keeps only their mean and
    standard deviation); the registration's sample judged them."""
    allowed = set(allowed)
    found = []
    for column in encoder["feature_columns"]:
        if column in encoder["categories"] and column not in allowed:
            finding = text_finding(column, encoder["categories"][column], n_rows)
            if finding is not None:
                found.append(finding)
    return found


def describe(findings: list[Finding]) -> str:
    """One sentence for a problem's detail or a failed registration's error."""
    named = "; ".join(f"{f.column!r}: {f.explanation}" for f in findings)
    return (
        f"column(s) that would become features look like identifiers ({named}). A feature column is one-hot "
        "encoded, one weight per value: set it as `dataset.subject_column` if it names the data subject, list it "
        "in `dataset.exclude_columns` (or drop it from the file) if it is no feature, or list it in "
        "`dataset.allow_identifier_columns` if it really is one"
    )

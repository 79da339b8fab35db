"""The registration's identifier guard: a column that would become a feature and looks like an identifier
(app/ml/identifiers.py's rules) is refused with ``422 identifier-column`` unless the caller says what it is.

Refused rather than warned about: once version 1 is trained, the identifier's one-hot weights are in the parameters
(and its values in the encoder every export carries), a warning in a 202 body is read by nobody, and the fix costs
one field (``subject_column``, ``exclude_columns`` or, when it really is a feature, ``allow_identifier_columns``).

The API reads the header only and leaves parsing to the job; for this check it reads a bounded sample: the first
``SAMPLE_ROWS`` rows within the first ``SAMPLE_BYTES`` of a CSV (the standard library's reader), the first batch of a
Parquet file's candidate columns (pyarrow). The worker checks the whole table again before it trains version 1
(app/jobs/tabular.py), so a column whose values change after the sample is caught there (the registration fails with
the same explanation).
"""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence

from app.ml.identifiers import Finding, describe, integer_finding, text_finding
from app.problems import Problem

SAMPLE_ROWS = 10_000
SAMPLE_BYTES = 8 << 20
CSV_MISSING = frozenset(
    {"", "?", "#N/A", "#N/A N/A", "#NA", "-1.#IND", "-1.#QNAN", "-NaN", "-nan", "1.#IND", "1.#QNAN", "<NA>", "N/A",
     "NA", "NULL", "NaN", "None", "n/a", "nan", "null"}
)  # fmt: skip
"""pandas' default missing-value markers and ``?`` (app/ml/data/tabular.py reads CSV with them)."""


def _csv_sample(data: bytes, wanted: Sequence[str]) -> dict[str, list[str | None]]:
    head = data[:SAMPLE_BYTES]
    if len(data) > SAMPLE_BYTES:
        head = head[: head.rfind(b"\n") + 1]  # whole lines only
    reader = csv.reader(io.StringIO(head.decode("utf-8-sig", errors="replace")), skipinitialspace=True)
    header = [h.strip() or f"Unnamed: {i}" for i, h in enumerate(next(reader, []))]  # pandas' name for a blank
    index = {c: header.index(c) for c in wanted if c in header}
    out: dict[str, list[str | None]] = {c: [] for c in index}
    rows = 0
    for row in reader:
        if not row or all(not cell.strip() for cell in row):
            continue  # blank lines are skipped (pandas' skip_blank_lines)
        for column, i in index.items():
            cell = row[i].strip() if i < len(row) else ""
            out[column].append(None if cell in CSV_MISSING else cell)
        rows += 1
        if rows >= SAMPLE_ROWS:
            break
    return out


def _csv_finding(column: str, values: list[str | None]) -> Finding | None:
    present = [v for v in values if v is not None]
    try:
        numbers = [float(v) for v in present]
    except ValueError:  # text: pandas reads the column as text, the encoder one-hot encodes it
        return text_finding(column, set(present), len(present))
    if all(n.is_integer() for n in numbers):
        return integer_finding(column, [int(n) for n in numbers])
    return None


def _parquet_findings(data: bytes, wanted: Sequence[str]) -> list[Finding]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(io.BytesIO(data))
        present = [c for c in wanted if c in parquet.schema_arrow.names]
        batch = next(parquet.iter_batches(batch_size=SAMPLE_ROWS, columns=present), None) if present else None
    except Exception:  # pyarrow raises several types for a broken file; the job reports it
        return []
    findings = []
    for column in present if batch is not None else []:
        array = batch.column(column)
        kind = array.type.value_type if pa.types.is_dictionary(array.type) else array.type
        values = [v for v in array.to_pylist() if v is not None]
        if pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_binary(kind):
            texts = {(v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)).strip() for v in values}
            finding = text_finding(column, texts, len(values))
        elif pa.types.is_integer(kind):
            finding = integer_finding(column, [int(v) for v in values])
        else:
            finding = None
        if finding is not None:
            findings.append(finding)
    return findings


def findings(data: bytes, fmt: str, columns: Sequence[str]) -> list[Finding]:
    """The columns among ``columns`` that look like identifiers in the table's sample, in table order."""
    if not columns:
        return []
    if fmt == "parquet":
        return _parquet_findings(data, columns)
    sample = _csv_sample(data, columns)
    return [f for column, values in sample.items() if (f := _csv_finding(column, values)) is not None]


def check(data: bytes, fmt: str, columns: Sequence[str], from_path: bool) -> None:
    """Refuse the registration when a would-be feature column looks like an identifier. A server-side file's columns
    are not named (nothing read from such a file is echoed): the reasons are."""
    found = findings(data, fmt, columns)
    if not found:
        return
    if from_path:
        reasons = sorted({f.explanation for f in found})
        raise Problem(
            422,
            "identifier-column",
            "A feature column looks like an identifier",
            f"{len(found)} column(s) of the file that would become features look like identifiers "
            f"({'; '.join(reasons)}). Set the one naming the data subject as `dataset.subject_column`, list the "
            "others in `dataset.exclude_columns`, or in `dataset.allow_identifier_columns` if they really are features "
            "(a server-side file's columns are not named here).",
        )
    raise Problem(
        422,
        "identifier-column",
        "A feature column looks like an identifier",
        describe(found)[0].upper() + describe(found)[1:] + ".",
        columns=[f.as_dict() for f in found],
    )

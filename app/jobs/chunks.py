"""A stored table as chunks (issue 21, item 2): an erasure rewrites only the chunks that held an erased row, as a
lakehouse delete rewrites only the files it touches (Delta Lake), instead of the whole table per request.

A registered table is stored as uploaded (one blob). Its first erasure splits it into chunks of consecutive
registration positions (``CHUNK_ROWS`` positions each); every later erasure rewrites the chunks whose position range
holds an erased row and keeps the others' blobs. The table's digest is then that of a small JSON manifest listing
its chunks (content-addressed like every blob: a table's identity still names its exact content); the data set's row
in the database lists them too (``Dataset.chunks``), and that, never a blob's content, says a table is chunked.

Each chunk is an uncompressed Parquet file with a position column, so a chunk alone says which registration rows it
holds. Parquet, whatever the upload's format: every column keeps the type read from the whole table (a CSV chunk
would be re-typed from its own rows: ``01`` read as 1 in a chunk without a text value); uncompressed, so a byte
scan of the store for an erased id or value (the erasure tests, bench/stream.py) cannot miss one hidden by
compression; and each data set's chunks carry its id in their metadata, so two data sets registered from one file
never share a chunk blob (one's erasure shreds what the other was about to list).

Why by hand: Delta Lake and Iceberg need their own catalogue and log; here the registry already is the log (the data
set's digest and chunk list change in the publishing transaction) and the artifact store already content-addresses
files, so a manifest of digests is all that is missing.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

KIND = "lethe.table-chunks/1"
FORMAT = "parquet"
CHUNK_ROWS = 8_192
"""Registration positions per chunk: a one-row erasure rewrites (and a worker that missed it re-encodes) 8,192 rows
(Adult: 1 of 4 chunks; 1M rows: 1 of 123), while a chunk stays large enough for Parquet's per-file overhead not to
matter."""


@dataclass(frozen=True)
class Chunk:
    digest: str
    first: int  # the chunk's registration positions: first ≤ p < stop (erased ones are simply absent)
    stop: int
    rows: int


@dataclass(frozen=True)
class Manifest:
    format: str  # each chunk's file format: parquet
    position_column: str
    chunks: tuple[Chunk, ...]

    def to_bytes(self) -> bytes:
        body = {
            "kind": KIND,
            "format": self.format,
            "position_column": self.position_column,
            "chunks": [[c.digest, c.first, c.stop, c.rows] for c in self.chunks],
        }
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()

    @property
    def digests(self) -> list[str]:
        return [c.digest for c in self.chunks]

    def touched(self, erased: np.ndarray) -> list[int]:
        """Indices of the chunks whose position range holds one of ``erased`` (sorted positions)."""
        erased = np.asarray(erased, dtype=np.int64)
        out = []
        for i, c in enumerate(self.chunks):
            lo, hi = np.searchsorted(erased, [c.first, c.stop])
            if hi > lo:
                out.append(i)
        return out


def read_manifest(blob: bytes) -> Manifest:
    """The manifest a chunked table's digest names (the data set's row says it is one)."""
    body = json.loads(blob)
    if body.get("kind") != KIND:
        raise ValueError("the stored table's manifest is not a chunk manifest")
    chunks = tuple(Chunk(d, int(a), int(b), int(n)) for d, a, b, n in body["chunks"])
    return Manifest(body["format"], body["position_column"], chunks)


def write_frame(frame: pd.DataFrame, dataset_id: str) -> bytes:
    """One chunk's bytes: uncompressed Parquet, the data set's id in the file's metadata (module docstring)."""
    table = pa.Table.from_pandas(frame, preserve_index=False)
    table = table.replace_schema_metadata({**(table.schema.metadata or {}), b"lethe.dataset": dataset_id.encode()})
    buffer = io.BytesIO()
    pq.write_table(table, buffer, compression="none")
    return buffer.getvalue()


def split(
    frame: pd.DataFrame, positions: np.ndarray, erased: np.ndarray, position_column: str, n_positions: int
) -> list[tuple[int, int, pd.DataFrame]]:
    """A whole table (``frame``, its rows' registration ``positions``) as chunks without the ``erased`` positions:
    (first, stop, rows) for every chunk range that keeps a row."""
    keep = ~np.isin(positions, erased)
    frame, positions = frame.loc[keep].copy(), positions[keep]
    frame[position_column] = positions
    order = np.argsort(positions, kind="stable")
    frame, positions = frame.iloc[order], positions[order]
    out = []
    for first in range(0, max(int(n_positions), 1), CHUNK_ROWS):
        lo, hi = np.searchsorted(positions, [first, first + CHUNK_ROWS])
        if hi > lo:
            out.append((first, first + CHUNK_ROWS, frame.iloc[lo:hi].reset_index(drop=True)))
    return out


def rewrite(
    manifest: Manifest, erased: np.ndarray, read_chunk: Callable[[str], pd.DataFrame]
) -> tuple[list[tuple[int, int, pd.DataFrame]], list[Chunk], list[Chunk]]:
    """The chunks an erasure rewrites: (first, stop, remaining rows) for each touched chunk that keeps a row, the
    chunks kept as they are, and the chunks replaced (their blobs hold erased rows: shredded with the erasure)."""
    erased = np.asarray(erased, dtype=np.int64)
    touched = set(manifest.touched(erased))
    rewritten, replaced = [], []
    for i in sorted(touched):
        chunk = manifest.chunks[i]
        frame = read_chunk(chunk.digest)
        positions = frame[manifest.position_column].to_numpy(dtype=np.int64)
        kept = frame.loc[~np.isin(positions, erased)].reset_index(drop=True)
        if len(kept):
            rewritten.append((chunk.first, chunk.stop, kept))
        replaced.append(chunk)
    untouched = [c for i, c in enumerate(manifest.chunks) if i not in touched]
    return rewritten, untouched, replaced

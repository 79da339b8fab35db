"""Byte-level erasure checks shared by the SQLite and PostgreSQL erasure tests (issue 22, item 1): the needles an
erased row leaves (its id, its category, its numeric value as decimal text and as little-endian float32/float64
bytes), where to look for them, and which stored blobs a model held before a deletion and no longer holds after it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
from sqlalchemy import select

from app.db import session_scope
from app.registry.tables import Dataset, Model, ModelVersion
from app.storage import get_store

NUMERIC_COLUMN = "x5"  # the label does not depend on it (tests/helpers.write_table): unique values cost nothing
VALUES = (1.2345678901, -2.3456789012, 3.4567890123, -0.4567890123, 2.5678901234, -1.6789012345, 0.7890123456)
"""Each erased row's numeric value: no other row holds it (the others are random normals with 16+ digits)."""


@dataclass(frozen=True)
class Row:
    """An erased row's identifying content: what no stored byte may hold once it is erased."""

    row_id: str
    category: str
    value: float

    def needles(self) -> dict[str, bytes]:
        return {
            "id": self.row_id.encode(),
            "category": self.category.encode(),
            "decimal text": repr(self.value).encode(),
            "float64 LE": struct.pack("<d", self.value),
            "float32 LE": struct.pack("<f", self.value),
        }


def plant_rows(frame: pd.DataFrame, marker: str, count: int, first: int = 10) -> list[Row]:
    """Give ``count`` rows of ``frame`` an id, a category (a column value of its own) and a numeric value that no
    other row holds; returns them in order."""
    rows = []
    for k in range(count):
        row = Row(f"subj-{marker}-{k:02d}", f"violet-{marker}-{k:02d}", VALUES[k])
        i = first + 7 * k
        frame.loc[i, ["row_id", "colour", NUMERIC_COLUMN]] = [row.row_id, row.category, row.value]
        rows.append(row)
    return rows


def write(frame: pd.DataFrame, path: Path) -> None:
    if path.suffix == ".parquet":
        frame.to_parquet(path, index=False)
    else:
        frame.to_csv(path, index=False)


def files_holding(home: Path, rows: list[Row]) -> list[str]:
    """Every (file, row, needle) where a stored file (artifact store, SQLite file and WAL, logs) holds a needle."""
    files = [(p, p.read_bytes()) for p in sorted(home.rglob("*")) if p.is_file()]
    return [
        f"{p.relative_to(home)}: {row.row_id} {kind}"
        for p, data in files
        for row in rows
        for kind, needle in row.needles().items()
        if needle in data
    ]


def held_digests(model_id: str) -> set[str]:
    """Every blob the model points at now: its versions' weights (retired ones too: their rows stay listed), its
    data set's table and chunks, every method's state and its verification shadows."""
    with session_scope() as session:
        model = session.get(Model, model_id)
        dataset = session.get(Dataset, model.dataset_id)
        held = set(session.execute(select(ModelVersion.digest).where(ModelVersion.model_id == model_id)).scalars())
        held |= {dataset.digest, *(dataset.chunks or [])}
        for entry in (model.state or {}).get("methods", {}).values():
            held |= set(entry.get("artifacts", {}).values())
        if shadows := (model.state or {}).get("verification", {}).get("shadows"):
            held.add(shadows)
        return held


def live_digests(model_id: str) -> set[str]:
    """``held_digests`` less the retired versions' weights (trained on erased rows: they must go)."""
    with session_scope() as session:
        retired = set(
            session.execute(
                select(ModelVersion.digest).where(
                    ModelVersion.model_id == model_id, ModelVersion.retired_at.is_not(None)
                )
            ).scalars()
        )
    return held_digests(model_id) - retired


def manifest_befores(manifest: dict) -> dict[str, str]:
    """Every blob an erasure manifest names as replaced (label → digest): the table, each method's superseded
    state, the shadow set, the retired versions' weights."""
    out: dict[str, str] = {}
    if "dataset" in manifest:
        out["dataset"] = manifest["dataset"]["before"]
    for name, entry in manifest.get("method_state", {}).items():
        after = set((entry.get("after") or {}).values())
        for artifact, digest in (entry.get("before") or {}).items():
            if digest not in after:
                out[f"method {name}/{artifact}"] = digest
    if "verification_shadows" in manifest:
        out["verification shadows"] = manifest["verification_shadows"]["before"]
    for version in manifest.get("versions_retired", []):
        out[f"version {version['number']} weights"] = version["digest"]
    return out


def stored(digests) -> list[str]:
    """The digests still in the artifact store."""
    store = get_store()
    return sorted(d for d in digests if store.exists(d))


def tables_holding(pg_url: str, rows: list[Row]) -> list[str]:
    """Every (table, row, needle) where a PostgreSQL table's rows, read back as text (bytea as hex), hold a needle."""
    import psycopg

    url = pg_url.replace("postgresql+psycopg://", "postgresql://", 1)
    hits = []
    with psycopg.connect(url) as conn:
        tables = conn.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = 'public'"
        ).fetchall()
        for (table,) in tables:
            for row in rows:
                for kind, needle in row.needles().items():
                    text = needle.decode() if kind in ("id", "category", "decimal text") else needle.hex()
                    query = f'SELECT count(*) FROM "{table}" t WHERE lower(t::text) LIKE %s'
                    if conn.execute(query, (f"%{text.lower()}%",)).fetchone()[0]:
                        hits.append(f"{table}: {row.row_id} {kind}")
    return hits


def pages_holding(pg_url: str, rows: list[Row], skip: tuple[str, ...] = ()) -> list[str]:
    """Every (relation, page, needle) where a PostgreSQL page of a public table, its TOAST table or one of their
    indexes holds a needle in its raw 8 KB — live tuples, dead ones (an updated row's old versions) and the free
    space VACUUM leaves unzeroed alike (``pageinspect``'s ``get_raw_page``; the test's role is a superuser).
    ``skip``: tables that hold the rows by design until their erasure (the data set's row index)."""
    import psycopg

    url = pg_url.replace("postgresql+psycopg://", "postgresql://", 1)
    hits = []
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS pageinspect")
        relations = conn.execute(
            """
            SELECT t.relname, r.oid::regclass::text
            FROM pg_class t
            JOIN pg_class r ON r.oid = t.oid OR r.oid = t.reltoastrelid
                OR r.oid IN (SELECT indexrelid FROM pg_index WHERE indrelid IN (t.oid, t.reltoastrelid))
            WHERE t.relnamespace = 'public'::regnamespace AND t.relkind = 'r'
            """
        ).fetchall()
        for table, relation in relations:
            if table in skip:
                continue
            blocks = conn.execute("SELECT pg_relation_size(%s::regclass) / 8192", (relation,)).fetchone()[0]
            for block in range(int(blocks)):
                page = bytes(conn.execute("SELECT get_raw_page(%s, %s)", (relation, block)).fetchone()[0])
                for row in rows:
                    for kind, needle in row.needles().items():
                        if needle in page:
                            hits.append(f"{table} ({relation}) page {block}: {row.row_id} {kind}")
    return hits

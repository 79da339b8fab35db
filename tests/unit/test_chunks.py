"""A stored table as chunks (issue 21, item 2): an erasure rewrites only the chunks that held the erased rows, a
worker that missed a version reads only those, and the chunks a rewrite replaced are shredded while every chunk a
data set still lists stays."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from app.db import session_scope
from app.jobs import chunks
from app.jobs import tabular as wing
from app.registry import versions as registry
from app.registry.tables import Dataset
from app.storage import get_store
from tests.helpers import configure, write_table

N = 200


@pytest.fixture
def table(tmp_path, monkeypatch):
    """A 200-row CSV in the store (chunks of 50 positions) and the model state a registration leaves."""
    configure(tmp_path / "home")
    monkeypatch.setattr(chunks, "CHUNK_ROWS", 50)
    for cache in (wing.ENCODED, wing.FRAMES, wing.ENCODED_CHUNKS, wing.MANIFESTS):
        cache.clear()
    write_table(tmp_path / "t.csv", n=N, seed=1)
    digest = get_store().put_bytes((tmp_path / "t.csv").read_bytes())
    dataset = SimpleNamespace(
        id="d1", digest=digest, label_column="label", row_id_column="row_id", n_positions=N, format="csv", chunks=None
    )
    data = wing.load_tabular(dataset, SimpleNamespace(state={}))
    return dataset, data, data.encoder.to_dict()


def _erase(dataset, data, encoder, erased):
    erased = np.asarray(erased)
    rewrite = wing.rewrite_table(dataset, erased, ("row_id",))
    wing.remember_erased(dataset, data, erased, rewrite, encoder)
    after = SimpleNamespace(**{**vars(dataset), "digest": rewrite.digest, "chunks": rewrite.chunks})
    return rewrite, after, wing.load_tabular(after, SimpleNamespace(state={"encoder": encoder}))


def _cold(dataset, encoder):
    for cache in (wing.ENCODED, wing.FRAMES, wing.ENCODED_CHUNKS, wing.MANIFESTS):
        cache.clear()
    return wing.load_tabular(dataset, SimpleNamespace(state={"encoder": encoder}))


def _same(a, b):
    for name in ("X", "y", "row_ids", "present"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name


def test_an_erasure_rewrites_only_the_chunks_that_held_the_rows(table):
    dataset, data, encoder = table
    first, after1, warm1 = _erase(dataset, data, encoder, [3, 7])  # as uploaded: split into chunks once
    assert len(first.chunks) == 4 and len(first.written) == 4 and first.replaced == []
    second, after2, warm2 = _erase(after1, warm1, encoder, [120, 121])
    assert len(second.written) == 1 and second.written[0].first == 100  # the one chunk that held 120 and 121
    assert second.replaced == [first.chunks[2]]
    assert [d for i, d in enumerate(second.chunks) if i != 2] == [d for i, d in enumerate(first.chunks) if i != 2]
    frame = wing.stored_frame(second.digest, ("row_id",), chunked=True)
    assert len(frame) == N - 4 and not {"r3", "r7", "r120", "r121"} & set(frame["row_id"])
    assert not warm2.present[[3, 7, 120, 121]].any() and warm2.present.sum() == N - 4
    _same(warm2, _cold(after2, encoder))  # what the erasing worker keeps is what a reload gives


def test_a_worker_that_missed_a_version_reads_only_the_chunks_it_rewrote(table, monkeypatch):
    dataset, data, encoder = table
    _, after1, warm1 = _erase(dataset, data, encoder, [3])
    _, after2, warm2 = _erase(after1, warm1, encoder, [180])
    _cold(after1, encoder)  # another worker: it served version 1's table and missed the erasure of row 180
    wing.ENCODED.clear()
    read = []
    real = wing._read_chunk
    monkeypatch.setattr(wing, "_read_chunk", lambda d, cols: read.append(d) or real(d, cols))
    _same(wing.load_tabular(after2, SimpleNamespace(state={"encoder": encoder})), warm2)
    assert len(read) == 1  # the one chunk the second erasure wrote


def _dataset(session, digest, listed):
    row = Dataset(name="d", format="csv", digest=digest, row_id_column="row_id", label_column="label", columns=[])
    row.chunks, row.n_rows = listed, N
    session.add(row)
    session.flush()
    return row.id


def test_replaced_chunks_are_shredded_and_listed_ones_kept(table):
    store = get_store()
    a, b, c, shared, manifest, new_manifest = (store.put_bytes(f"blob {i}".encode()) for i in range(6))
    with session_scope() as session:
        ours = _dataset(session, manifest, [a, b, shared])
        _dataset(session, store.put_bytes(b"other manifest"), [shared])  # another data set lists the same chunk
    with session_scope() as session:
        shared_manifest, _ = registry.erase_rows(
            session, ours, {}, new_digest=new_manifest, new_chunks=[a, c], superseded=[b, shared]
        )
    assert shared_manifest["dataset"]["chunks"] == 2 and shared_manifest["dataset"]["chunks_rewritten"] == 1
    with session_scope() as session:
        counts = registry.shred_due(session)
        assert session.get(Dataset, ours).chunks == [a, c]
    assert counts == {"shredded": 2, "kept": 1}  # b and the old manifest; the chunk another data set lists stays
    assert not store.exists(b) and not store.exists(manifest)
    assert store.exists(a) and store.exists(c) and store.exists(shared)


def test_chunks_keep_the_whole_tables_column_types_and_are_never_shared(tmp_path, monkeypatch):
    """A CSV column read as text over the whole table (``01``, ``02`` and one ``x``) stays text in every chunk: a
    chunk without the ``x`` re-read as CSV would give 1 and 2, categories the encoder never saw (all-zero one-hot
    rows). And two data sets registered from one file never share a chunk blob (one's erasure would shred what the
    other lists)."""
    configure(tmp_path / "home")
    monkeypatch.setattr(chunks, "CHUNK_ROWS", 50)
    for cache in (wing.ENCODED, wing.FRAMES, wing.ENCODED_CHUNKS, wing.MANIFESTS):
        cache.clear()
    frame = write_table(tmp_path / "t.csv", n=N, seed=2)
    frame["code"] = ["01" if i % 2 else "02" for i in range(N)]
    frame.loc[170, "code"] = "x"
    frame.to_csv(tmp_path / "t.csv", index=False)
    digest = get_store().put_bytes((tmp_path / "t.csv").read_bytes())
    fields = dict(digest=digest, label_column="label", row_id_column="row_id", n_positions=N, format="csv", chunks=None)
    first = SimpleNamespace(id="d1", **fields)
    data = wing.load_tabular(first, SimpleNamespace(state={}))
    encoder = data.encoder.to_dict()
    assert encoder["categories"]["code"] == ["01", "02", "x"]
    rewrite, after, warm = _erase(first, data, encoder, [3])
    _same(warm, _cold(after, encoder))
    twin = _erase(SimpleNamespace(id="d2", **fields), data, encoder, [3])[0]
    assert not set(rewrite.chunks) & set(twin.chunks)

"""The registry's worker-side writes: versions, row index and tombstones, model state, method state, weights.

The worker (app/jobs/) never writes a registry row itself; it calls these functions inside its transaction. A model
version is built in exactly one place (:func:`add_version`), which also holds the "model moved to a newer version"
guard: a version is a child of the version the job started from, or nothing.

Weights are stored as safetensors (one float32 tensor ``theta``), content-addressed by sha256. They are written with
``safetensors.numpy`` — the same file format as ``safetensors.torch`` — so that the registry, which the API imports,
never loads torch; the worker turns the array into a tensor with ``torch.from_numpy``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import numpy as np
from safetensors.numpy import load as load_arrays
from safetensors.numpy import save as save_arrays
from sqlalchemy import delete, func, insert, select, text, update
from sqlalchemy.orm import Session

from app.audit.service import append_event, hash_subject
from app.config import get_settings
from app.db import new_id, utcnow
from app.registry.tables import Dataset, DatasetRow, ErasedRow, Model, ModelVersion, ShredItem
from app.storage import get_store

WEIGHTS_KEY = "theta"
ROW_INSERT_CHUNK = 5000
"""Rows per multi-row INSERT when indexing a data set (bounded statement size on both databases)."""
ID_QUERY_CHUNK = 5000
"""Ids per ``IN (...)`` list (SQLite's bound-parameter limit is 32,766)."""


class ModelMovedError(RuntimeError):
    """Another job published a newer version while this one ran: retry on the new current version (transient)."""


# ------------------------------------------------------------------------------------------------------ weights
def weights_to_bytes(theta: Any) -> bytes:
    """A float32 parameter vector (torch tensor or array) as safetensors bytes."""
    if hasattr(theta, "detach"):  # a torch tensor: to a CPU float32 array without importing torch here
        theta = theta.detach().to("cpu").float().numpy()
    return save_arrays({WEIGHTS_KEY: np.ascontiguousarray(theta, dtype=np.float32)})


def weights_from_bytes(data: bytes) -> np.ndarray:
    return load_arrays(data)[WEIGHTS_KEY]


def put_weights(theta: Any) -> str:
    """Store a parameter vector; returns its digest (idempotent: the same weights give the same blob)."""
    return get_store().put_bytes(weights_to_bytes(theta))


def load_weights(digest: str) -> np.ndarray:
    return weights_from_bytes(get_store().get_bytes(digest))


# ------------------------------------------------------------------------------------------------------ versions
@dataclass
class VersionDraft:
    """A version the worker has computed and stored the weights of, not yet written (publish writes it)."""

    model_id: str
    number: int
    digest: str
    method: str
    job_id: str
    parent_id: str | None = None
    request_id: str | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    id: str = field(default_factory=new_id)


def version_for_job(session: Session, job_id: str) -> ModelVersion | None:
    """The version a job already wrote (a job writes at most one, whatever its retries)."""
    return session.execute(select(ModelVersion).where(ModelVersion.job_id == job_id)).scalar_one_or_none()


def add_version(
    session: Session,
    draft: VersionDraft,
    *,
    state_update: Mapping[str, Any] | None = None,
) -> ModelVersion:
    """Write ``draft`` as the model's new current version, with the model-state changes it carries.

    Idempotent per job: if the job already wrote its version, that version is returned unchanged. Raises
    :class:`ModelMovedError` if the model's current version is no longer the draft's parent.
    """
    existing = version_for_job(session, draft.job_id)
    if existing is not None:
        return existing
    model = session.get(Model, draft.model_id)
    if model.current_version_id != draft.parent_id:
        raise ModelMovedError("the model moved to a newer version while this job ran; retrying on it")
    version = ModelVersion(
        id=draft.id,
        model_id=draft.model_id,
        number=draft.number,
        parent_id=draft.parent_id,
        digest=draft.digest,
        method=draft.method,
        job_id=draft.job_id,
        request_id=draft.request_id,
        metrics=draft.metrics,
    )
    session.add(version)
    session.flush()
    model.current_version_id = version.id
    if state_update:
        model.state = {**model.state, **state_update}
    return version


def child_draft(parent: ModelVersion, **fields: Any) -> VersionDraft:
    """A draft numbered after ``parent`` and linked to it."""
    return VersionDraft(model_id=parent.model_id, number=parent.number + 1, parent_id=parent.id, **fields)


# ------------------------------------------------------------------------------------------------------ models
def load_model(session: Session, model_id: str) -> tuple[Model, Dataset | None, ModelVersion | None]:
    """The model, its data set and its current version, detached (safe to read after the session closes)."""
    model = session.get(Model, model_id)
    dataset = session.get(Dataset, model.dataset_id) if model.dataset_id else None
    current = session.get(ModelVersion, model.current_version_id) if model.current_version_id else None
    session.expunge_all()
    return model, dataset, current


def model_kind(session: Session, model_id: str) -> str:
    return session.execute(select(Model.kind).where(Model.id == model_id)).scalar_one()


def set_state(session: Session, model_id: str, update_: Mapping[str, Any]) -> None:
    """Merge keys into the model's state (e.g. its verification shadows)."""
    model = session.get(Model, model_id)
    model.state = {**model.state, **update_}


def mark_ready(session: Session, model_id: str, *, dataset_id: str | None = None) -> None:
    model = session.get(Model, model_id)
    model.status = "ready"
    if dataset_id is not None:
        model.dataset_id = dataset_id


def mark_failed(session: Session, model_id: str, job_id: str, error: str) -> None:
    """A registration whose training job failed for good."""
    model = session.get(Model, model_id)
    model.status, model.error = "failed", error[:4000]
    append_event(
        session,
        actor="worker",
        action="model.failed",
        entity_type="model",
        entity_id=model_id,
        payload={"job_id": job_id, "error": error.split("\n", 1)[0][:500]},
    )


# ------------------------------------------------------------------------------------------------------ method state
def method_artifacts(model: Model, method: str) -> dict[str, bytes]:
    """The prepared state of ``method`` on ``model`` (e.g. L2UL's unlearner), as the method stored it."""
    digests = model.state.get("methods", {}).get(method, {}).get("artifacts", {})
    store = get_store()
    return {name: store.get_bytes(digest) for name, digest in digests.items()}


def prepared_methods(model: Model) -> dict[str, dict[str, Any]]:
    """The methods ready to serve on ``model``, each with its preparation facts (``info``: what ``auto`` reads,
    e.g. the measured validation). Iterating it gives the names."""
    return {
        name: entry.get("info", {}) or {}
        for name, entry in model.state.get("methods", {}).items()
        if entry.get("status") == "ready"
    }


def refuse_method(session: Session, model_id: str, method: str, reason: str, info: dict) -> None:
    """Record that ``method`` will not serve this model (e.g. retraining its recipe is chaotic, or its validated
    quality is no better than doing nothing): the API answers a request naming it with the reason, ``auto`` skips
    it. Any state it had is queued for shredding."""
    model = session.get(Model, model_id)
    methods = dict(model.state.get("methods", {}))
    enqueue_shred(
        session, list(methods.get(method, {}).get("artifacts", {}).values()), "method refused", grace_seconds=0
    )
    methods[method] = {"status": "refused", "reason": reason, "info": info}
    model.state = {**model.state, "methods": methods}


def store_method_state(
    session: Session, model_id: str, method: str, artifacts: Mapping[str, bytes], info: dict
) -> None:
    """Record a method's one-off preparation (its artifacts and facts) on the model."""
    model = session.get(Model, model_id)
    model.state = _with_method_state(model.state, method, artifacts, info=info)


def _with_method_state(
    state: dict[str, Any], method: str, artifacts: Mapping[str, bytes], info: dict | None
) -> dict[str, Any]:
    store = get_store()
    methods = dict(state.get("methods", {}))
    entry = dict(methods.get(method, {}))
    entry["artifacts"] = {**entry.get("artifacts", {}), **{k: store.put_bytes(v) for k, v in artifacts.items()}}
    entry["status"] = "ready"
    entry["info"] = info if info is not None else entry.get("info", {})
    methods[method] = entry
    return {**state, "methods": methods}


# ------------------------------------------------------------------------------------------------------ rows
def create_dataset(session: Session, **fields: Any) -> Dataset:
    dataset = Dataset(**fields)
    session.add(dataset)
    session.flush()
    return dataset


def index_rows(session: Session, dataset_id: str, row_ids: Iterable[str], labels: Iterable[str]) -> None:
    """Index every row id (position and label) so the API validates sample ids without touching the data.

    Once per data set: a retried job finds the index there and leaves it."""
    exists = session.execute(select(DatasetRow.id).where(DatasetRow.dataset_id == dataset_id).limit(1)).first()
    if exists:
        return
    rows = [
        {"dataset_id": dataset_id, "row_id": rid, "position": i, "label": label}
        for i, (rid, label) in enumerate(zip(row_ids, labels, strict=True))
    ]
    for start in range(0, len(rows), ROW_INSERT_CHUNK):
        session.execute(insert(DatasetRow), rows[start : start + ROW_INSERT_CHUNK])
    session.execute(update(Dataset).where(Dataset.id == dataset_id).values(n_rows=len(rows), n_positions=len(rows)))
    if session.get_bind().dialect.name == "postgresql":
        # the planner's statistics must know the new rows before the first request names them: with statistics
        # from before the load, PostgreSQL takes the new data set for a few rows and the intake's look-up
        # (data set, row ids) scans every row of the data set through the (data set, position) index instead of
        # probing the unique (data set, row id) one: 4-7 ms per batch at 40,000 rows, growing with the table.
        # Autovacuum analyses only after its next nap; ANALYZE samples a bounded number of rows (ms, once).
        session.execute(text("ANALYZE dataset_rows"))


def positions_of(session: Session, dataset_id: str, scope: Mapping[str, Any]) -> list[int]:
    """Row positions a ``samples`` or ``class`` scope names (sorted), those the index still holds (a row erased by
    another request meanwhile is not). Raises ValueError for another scope kind."""
    if scope["kind"] == "samples":
        return positions_by_request(session, dataset_id, {"": scope})[""]
    if scope["kind"] == "class":
        query = select(DatasetRow.position).where(DatasetRow.dataset_id == dataset_id)
        return sorted(session.execute(query.where(DatasetRow.label == str(scope["label"]))).scalars().all())
    raise ValueError(f"scope {scope['kind']!r} names no rows of a table")


def positions_by_request(
    session: Session, dataset_id: str, scopes: Mapping[str, Mapping[str, Any]]
) -> dict[str, list[int]]:
    """``positions_of`` for a batch's ``samples`` scopes (request id → scope) in one query per ID_QUERY_CHUNK rows
    instead of one per request; a row two requests name counts for both. A scope names its rows by ``positions``
    (written at intake beside the ids' keyed hashes: the request row never holds the ids, issue 22) or, written by
    an older release, by ``sample_ids``."""
    by_position: dict[int, list[str]] = {}
    by_id: dict[str, list[str]] = {}
    for request_id, scope in scopes.items():
        if "positions" in scope:
            for position in scope["positions"]:
                by_position.setdefault(int(position), []).append(request_id)
        else:
            for sample_id in scope["sample_ids"]:
                by_id.setdefault(str(sample_id), []).append(request_id)
    out: dict[str, list[int]] = {request_id: [] for request_id in scopes}
    query = select(DatasetRow.position).where(DatasetRow.dataset_id == dataset_id)
    wanted = list(by_position)
    for start in range(0, len(wanted), ID_QUERY_CHUNK):
        chunk = wanted[start : start + ID_QUERY_CHUNK]
        for position in session.execute(query.where(DatasetRow.position.in_(chunk))).scalars():
            for request_id in by_position[position]:
                out[request_id].append(position)
    ids = list(by_id)
    query = select(DatasetRow.row_id, DatasetRow.position).where(DatasetRow.dataset_id == dataset_id)
    for start in range(0, len(ids), ID_QUERY_CHUNK):
        chunk = ids[start : start + ID_QUERY_CHUNK]
        for row_id, position in session.execute(query.where(DatasetRow.row_id.in_(chunk))):
            for request_id in by_id[row_id]:
                out[request_id].append(position)
    return {request_id: sorted(positions) for request_id, positions in out.items()}


def tombstones(session: Session, dataset_id: str, except_request: str | None = None) -> list[tuple[int, str]]:
    """(position, row id) of every row deleted by an earlier request (never trained on again)."""
    query = select(DatasetRow.position, DatasetRow.row_id).where(
        DatasetRow.dataset_id == dataset_id, DatasetRow.deleted_by.is_not(None)
    )
    if except_request is not None:
        query = query.where(DatasetRow.deleted_by != except_request)
    return [(int(p), str(r)) for p, r in session.execute(query).all()]


def tombstone(session: Session, dataset_id: str, positions: Iterable[int], request_id: str) -> None:
    session.execute(
        update(DatasetRow)
        .where(
            DatasetRow.dataset_id == dataset_id,
            DatasetRow.position.in_([int(p) for p in positions]),
            DatasetRow.deleted_by.is_(None),
        )
        .values(deleted_by=request_id, deleted_at=utcnow())
    )


# ------------------------------------------------------------------------------------------------------ erasure
# GDPR Art. 17: a completed deletion leaves no stored copy of the erased rows. The worker computes what replaces each
# copy (a rewritten table, purged method state, rewritten rounds); these functions swap them in inside the publishing
# transaction and queue every superseded blob for shredding.


def hash_row_id(row_id: str) -> str:
    """The keyed hash an erased row's id is kept as: HMAC under its own ``row-id-hash`` key, not the subject key, so a
    subject reference equal to some row id never hashes to that row's stored hash (issue 22)."""
    return hash_subject(get_settings().derived_key("row-id-hash"), str(row_id))


def rows_with_hashes(session: Session, dataset_id: str, hashes: set[str]) -> dict[str, int]:
    """Keyed hash → position for the data set's live rows whose id's hash is in ``hashes`` (hashes every row id
    once: for a request written before intake kept positions, a rare operator action)."""
    query = select(DatasetRow.row_id, DatasetRow.position).where(
        DatasetRow.dataset_id == dataset_id, DatasetRow.deleted_by.is_(None)
    )
    found: dict[str, int] = {}
    key = get_settings().derived_key("row-id-hash")  # hash_row_id's key, derived once for the pass
    for row_id, position in session.execute(query.execution_options(yield_per=10_000)).all():
        digest = hash_subject(key, str(row_id))
        if digest in hashes:
            found[digest] = int(position)
    return found


def hash_row_ids(row_ids: Iterable[str]) -> list[str]:
    """``hash_row_id`` of each, the key derived once."""
    key = get_settings().derived_key("row-id-hash")
    return [hash_subject(key, str(r)) for r in row_ids]


def present_row_ids(session: Session, dataset_id: str) -> set[str]:
    return set(session.execute(select(DatasetRow.row_id).where(DatasetRow.dataset_id == dataset_id)).scalars())


def erased_hashes(session: Session, dataset_id: str, hashes: Iterable[str]) -> set[str]:
    """Which of ``hashes`` name rows of this data set that were erased."""
    wanted = list(hashes)
    found: set[str] = set()
    for start in range(0, len(wanted), ID_QUERY_CHUNK):
        chunk = wanted[start : start + ID_QUERY_CHUNK]
        found |= set(
            session.execute(
                select(ErasedRow.id_hash).where(ErasedRow.dataset_id == dataset_id, ErasedRow.id_hash.in_(chunk))
            ).scalars()
        )
    return found


def erase_rows(
    session: Session,
    dataset_id: str,
    rows_of: Mapping[str, Iterable[int]],
    *,
    new_digest: str | None = None,
    state_update: Mapping[str, Any] | None = None,
    model_id: str | None = None,
    new_chunks: Sequence[str] | None = None,
    superseded: Sequence[str] = (),
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """Drop the rows' index entries (keeping keyed hashes of their ids, each under the request that erased it:
    ``rows_of`` maps request id → positions), point the data set at its rewritten blob (``new_digest``; a chunked
    table's: ``new_chunks`` lists its chunks; the old blob and the ``superseded`` chunks are shredded at once), and
    return the manifest: the entries shared by every request of the version, and each request's own (its rows'
    counts)."""
    dataset = session.get(Dataset, dataset_id)
    owner = {int(p): request_id for request_id, positions in rows_of.items() for p in positions}
    wanted = sorted(owner)
    rows: list[tuple[int, int, str]] = []
    for start in range(0, len(wanted), ID_QUERY_CHUNK):
        chunk = wanted[start : start + ID_QUERY_CHUNK]
        rows += session.execute(
            select(DatasetRow.id, DatasetRow.position, DatasetRow.row_id).where(
                DatasetRow.dataset_id == dataset_id, DatasetRow.position.in_(chunk)
            )
        ).all()
    now = utcnow()
    if rows:
        session.execute(
            insert(ErasedRow),
            [
                {"dataset_id": dataset_id, "id_hash": hash_row_id(r), "request_id": owner[int(p)], "erased_at": now}
                for _, p, r in rows
            ],
        )
        for start in range(0, len(rows), ID_QUERY_CHUNK):
            chunk = [i for i, _, _ in rows[start : start + ID_QUERY_CHUNK]]
            session.execute(
                delete(DatasetRow).where(DatasetRow.id.in_(chunk)).execution_options(synchronize_session=False)
            )
    rows_before = dataset.n_rows
    if dataset.n_positions is None:
        dataset.n_positions = rows_before
    dataset.n_rows = (rows_before or 0) - len(rows)
    deleted = {request_id: 0 for request_id in rows_of}
    for _, p, _ in rows:
        deleted[owner[int(p)]] += 1
    own = {
        request_id: {
            "index": {"rows_deleted": k, "rows_before": rows_before, "rows_after": dataset.n_rows},
            "identifiers": {"erased_row_ids": k, "kept_as": "keyed hashes (HMAC-SHA256)"},
        }
        for request_id, k in deleted.items()
    }
    manifest: dict[str, Any] = {}
    if new_digest is not None and new_digest != dataset.digest:
        manifest["dataset"] = {"before": dataset.digest, "after": new_digest}
        if new_chunks is not None:  # only the chunks that held the rows were rewritten
            rewritten = len(set(new_chunks) - set(dataset.chunks or []))
            manifest["dataset"] |= {"chunks": len(new_chunks), "chunks_rewritten": rewritten}
        enqueue_shred(session, [dataset.digest, *superseded], "dataset rewritten without erased rows", grace_seconds=0)
        dataset.digest = new_digest
        dataset.chunks = list(new_chunks) if new_chunks is not None else None
    if state_update and model_id:
        model = session.get(Model, model_id)
        # verification shadows that trained on the erased rows are copies of them: the replaced set is shredded
        old_shadows = (model.state.get("verification") or {}).get("shadows")
        new_shadows = (state_update.get("verification") or {}).get("shadows", old_shadows)
        if old_shadows and new_shadows != old_shadows:
            manifest["verification_shadows"] = {"before": old_shadows, "after": new_shadows}
            enqueue_shred(session, [old_shadows], "shadow models replaced after erasure", grace_seconds=0)
        # stored round files rewritten without a departed client: the originals hold its updates
        old_rounds = [d for d in model.state.get("rounds", []) if d not in set(state_update.get("rounds", []))]
        if "rounds" in state_update and old_rounds:
            manifest["round_files_shredded"] = len(old_rounds)
            enqueue_shred(session, old_rounds, "round files rewritten without a departed client", grace_seconds=0)
        model.state = {**model.state, **state_update}
    return manifest, own


def adopt_chunks(session: Session, dataset_id: str, digest: str, chunks: Sequence[str]) -> None:
    """The registered table re-stored as chunks (app/jobs/chunks.py) at its first version: the data set points at
    the manifest and the file as uploaded is shredded (the same rows, now in the chunks). Once per data set."""
    dataset = session.get(Dataset, dataset_id)
    if dataset.chunks is not None or dataset.digest == digest:
        return
    enqueue_shred(session, [dataset.digest], "table re-stored in chunks", grace_seconds=0)
    dataset.digest, dataset.chunks = digest, list(chunks)


def swap_verification(session: Session, model_id: str, expected: str, entry: Mapping[str, Any]) -> bool:
    """Point the model at a refilled shadow set, if its current set is still ``expected`` (compare-and-set under
    the model row's lock); the superseded blob is shredded. False when another writer changed it meanwhile."""
    model = session.execute(select(Model).where(Model.id == model_id).with_for_update()).scalar_one()
    current = (model.state.get("verification") or {}).get("shadows")
    if current != expected:
        return False
    model.state = {**model.state, "verification": dict(entry)}
    if entry.get("shadows") != current:
        enqueue_shred(session, [current], "shadow set superseded by its refill", grace_seconds=0)
    return True


def update_method_state(
    session: Session, model_id: str, purged: Mapping[str, Mapping[str, bytes]], invalidated: Mapping[str, str]
) -> dict[str, Any]:
    """Swap in each purged method's new state; drop the state of methods that cannot purge (they must be prepared
    again before they serve); queue every superseded artifact for shredding. Returns the manifest entries."""
    model = session.get(Model, model_id)
    state = dict(model.state)
    methods = dict(state.get("methods", {}))
    manifest: dict[str, Any] = {}
    superseded: list[str] = []
    for name, artifacts in purged.items():
        before = dict(methods.get(name, {}).get("artifacts", {}))
        state = _with_method_state({**state, "methods": methods}, name, artifacts, info=None)
        methods = dict(state["methods"])
        after = methods[name]["artifacts"]
        superseded += [d for d in before.values() if d not in after.values()]
        manifest[name] = {"action": "purged", "before": before, "after": after}
    for name, reason in invalidated.items():
        entry = methods.get(name, {})
        superseded += list(entry.get("artifacts", {}).values())
        methods[name] = {"status": "invalidated", "reason": reason, "info": entry.get("info", {})}
        manifest[name] = {"action": "state deleted; prepare again to use", "reason": reason}
    model.state = {**state, "methods": methods}
    enqueue_shred(session, superseded, "superseded method state", grace_seconds=0)
    return manifest


def retire_versions(
    session: Session, model_id: str, keep_version_id: str, request_id: str, grace_seconds: float
) -> list[dict[str, Any]]:
    """Retire every earlier live version (each was trained with the erased rows): weights answer 410 Gone, blobs are
    shredded after the grace period; lineage metadata stays for the audit trail."""
    versions = (
        session.execute(
            select(ModelVersion).where(
                ModelVersion.model_id == model_id,
                ModelVersion.id != keep_version_id,
                ModelVersion.retired_at.is_(None),
            )
        )
        .scalars()
        .all()
    )
    now = utcnow()
    for version in versions:
        version.retired_at, version.retired_by = now, request_id
    enqueue_shred(session, [v.digest for v in versions], "retired version", grace_seconds=grace_seconds)
    return [{"number": v.number, "digest": v.digest} for v in versions]


def enqueue_shred(session: Session, digests: Iterable[str], reason: str, grace_seconds: float) -> None:
    not_before = utcnow() + timedelta(seconds=grace_seconds)
    rows = [{"digest": d, "reason": reason, "not_before": not_before, "created_at": utcnow()} for d in set(digests)]
    if rows:
        session.execute(insert(ShredItem), rows)


def queued_since(session: Session, after_id: int | None, settle_seconds: float = 60.0) -> tuple[list[str], int]:
    """Digests queued for shredding with an id above ``after_id`` (a worker drops its in-memory copies of them), and
    the id to ask after next time: the highest among those queued more than ``settle_seconds`` ago, so an id taken
    by a transaction that committed late is asked for again (dropping twice costs nothing). ``after_id`` None (a
    process's first look): the last ``FIRST_LOOK_ROWS`` only, not the whole history."""
    if after_id is None:
        after_id = max(int(session.execute(select(func.max(ShredItem.id))).scalar() or 0) - FIRST_LOOK_ROWS, 0)
    rows = session.execute(
        select(ShredItem.id, ShredItem.digest, ShredItem.created_at).where(ShredItem.id > after_id)
    ).all()
    settled = utcnow() - timedelta(seconds=settle_seconds)
    next_id = max((int(i) for i, _, created in rows if created < settled), default=after_id)
    return [d for _, d, _ in rows], next_id


FIRST_LOOK_ROWS = 10_000


def _live_digests(session: Session) -> set[str]:
    """Every blob something live points at: unretired versions, data sets, models' method state, locks, rounds."""
    live = set(session.execute(select(ModelVersion.digest).where(ModelVersion.retired_at.is_(None))).scalars())
    live |= set(session.execute(select(Dataset.digest)).scalars())
    for chunks in session.execute(select(Dataset.chunks).where(Dataset.chunks.is_not(None))).scalars():
        live |= set(chunks or [])
    for (state,) in session.execute(select(Model.state)).all():
        state = state or {}
        for entry in state.get("methods", {}).values():
            live |= set(entry.get("artifacts", {}).values())
        live |= set(state.get("rounds", []))
        for key in ("theta_init",):
            if state.get(key):
                live.add(state[key])
        if state.get("forget_lock"):
            live.add(state["forget_lock"]["digest"])
        if state.get("verification", {}).get("shadows"):
            live.add(state["verification"]["shadows"])
    return live


def referenced_digests(session: Session) -> set[str]:
    """What the registry keeps: every live blob and every blob queued for shredding (its grace period is the queue's
    to keep, a retired version's say). The sweep of unreferenced blobs (app/jobs/blobs.py) leaves these alone."""
    queued = select(ShredItem.digest).where(ShredItem.done_at.is_(None))
    return _live_digests(session) | set(session.execute(queued).scalars())


def shred_due(session: Session) -> dict[str, int]:
    """Delete every queued blob whose grace period has passed and that nothing live references."""
    due = (
        session.execute(
            select(ShredItem).where(ShredItem.done_at.is_(None), ShredItem.not_before <= utcnow()).with_for_update()
        )
        .scalars()
        .all()
    )
    if not due:
        return {"shredded": 0, "kept": 0}
    live, store, counts = _live_digests(session), get_store(), {"shredded": 0, "kept": 0}
    for item in due:
        if item.digest in live:
            item.outcome = "still referenced"
            counts["kept"] += 1
        else:
            store.delete(item.digest)
            item.outcome = "deleted"
            counts["shredded"] += 1
        item.done_at = utcnow()
    return counts

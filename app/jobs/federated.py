"""Worker steps for federated CLIP + LoRA models (``clip_federated``): version 1, round aggregation, EASE deletions.

Thin glue between the registry and app.ml: the LoRA initialisation is version 1; each uploaded round is FedAvg'd
into a new version (projected off the forget-exclusive directions once EASE has published a forget lock); a deletion
builds a :class:`FederatedProblem` from the stored round history and the clients' data, runs the method, publishes the
new version, the tombstones and the forget lock, and records forget/retain/test R@1 before and after.
"""

from __future__ import annotations

import json
import time
from functools import lru_cache
from typing import Any

import numpy as np
import torch
from safetensors.torch import load as load_tensors
from sqlalchemy import insert, select

from app.audit.service import append_event
from app.db import session_scope
from app.jobs import service as jobs
from app.jobs.tables import Job
from app.ml.clip import TINY_ARCH, ClipLoRA, ClipSpec, LoraSettings, pretrain_tiny_clip
from app.ml.data.captions import CaptionDataset, make_synthetic_federation
from app.ml.federation import FederatedProblem, FedSettings, apply_round
from app.ml.unlearning.base import get_method
from app.ml.unlearning.ease.lock import ForgetLock
from app.ml.verification.retrieval import evaluate_retrieval
from app.registry.tables import Dataset, DatasetRow, Model, ModelVersion
from app.requests.tables import DeletionRequest
from app.storage import get_store

EVAL_RETAIN_PAIRS = 500


class FederatedJobError(jobs.PermanentJobError):
    """A federated request that cannot be done (the pipeline turns it into a rejected request)."""


def _theta_bytes(theta: torch.Tensor) -> bytes:
    from safetensors.torch import save

    return save({"theta": theta.detach().to("cpu", torch.float32).contiguous()})


def _load_theta(digest: str) -> torch.Tensor:
    return load_tensors(get_store().get_bytes(digest))["theta"]


@lru_cache(maxsize=2)
def _clip(spec_json: str) -> ClipLoRA:
    return ClipLoRA(ClipSpec.from_dict(json.loads(spec_json)))


@lru_cache(maxsize=2)
def _federation_data(data_json: str):
    data = {k: v for k, v in json.loads(data_json).items() if k != "kind"}
    return make_synthetic_federation(**data)


def clip_for(model: Model) -> ClipLoRA:
    return _clip(json.dumps(model.state["spec"], sort_keys=True))


def data_for(model: Model):
    return _federation_data(json.dumps(model.spec["data"], sort_keys=True))


def run_train_clip(job: Job, ctx) -> None:
    """Version 1 of a federated model: the LoRA initialisation θ₀ every client starts from."""
    with session_scope() as session:
        model = session.get(Model, job.model_id)
        session.expunge(model)
        existing = session.execute(select(ModelVersion).where(ModelVersion.job_id == job.id)).scalar_one_or_none()
    clip_in = model.spec["clip"]
    checkpoint = clip_in.get("checkpoint_path")
    if checkpoint is None:
        if clip_in["arch"] != TINY_ARCH:
            raise FederatedJobError(f"architecture {clip_in['arch']!r} needs a checkpoint_path (no downloads here)")
        ctx.progress(0.05, "pretraining the tiny CLIP backbone (cached after the first time)")
        # the shared cache (LETHE_CACHE_DIR, default ~/.cache/lethe): keyed by config and settings, built once
        checkpoint = str(pretrain_tiny_clip(progress=lambda f, m: ctx.progress(0.05 + 0.6 * f, m)))
    spec = ClipSpec(arch=clip_in["arch"], checkpoint=checkpoint, lora=LoraSettings(**clip_in.get("lora", {})))
    ctx.progress(0.7, "building the LoRA model")
    clip = _clip(json.dumps(spec.to_dict(), sort_keys=True))
    data = data_for(model)
    vocabulary = sorted({w for client in data.clients for c in client.captions for w in c.split()})
    state = {
        "spec": spec.to_dict(),
        "clients": [f"c{k}" for k in range(len(data.clients))],
        "client_sizes": [len(c) for c in data.clients],
        "n_params": clip.num_params,
        "rounds": [],
        "removed": [],
        "vocabulary": vocabulary,
    }
    digest = get_store().put_bytes(_theta_bytes(clip.theta_init))
    with session_scope() as session:
        jobs.assert_lease(session, job.id, ctx.owner)
        row = session.get(Model, model.id)
        version = existing or ModelVersion(
            model_id=model.id,
            number=1,
            digest=digest,
            method="lora-init",
            job_id=job.id,
            metrics={"n_params": clip.num_params},
        )
        if existing is None:
            session.add(version)
        dataset = Dataset(
            name=f"{row.name} clients",
            format="synthetic",
            digest=get_store().put_json(model.spec["data"]),
            row_id_column="pair_id",
            label_column="client",
            columns=["pair_id", "client", "caption"],
            n_rows=sum(state["client_sizes"]),
        )
        session.add(dataset)
        session.flush()
        rows = [
            {"dataset_id": dataset.id, "row_id": pid, "position": i, "label": f"c{k}"}
            for i, (k, pid) in enumerate((k, pid) for k, c in enumerate(data.clients) for pid in c.ids)
        ]
        for start in range(0, len(rows), 5000):
            session.execute(insert(DatasetRow), rows[start : start + 5000])
        row.dataset_id, row.current_version_id, row.status = dataset.id, version.id, "ready"
        row.state = {**row.state, **state, "theta_init": digest}
        append_event(
            session,
            actor="worker",
            action="model_version.created",
            entity_type="model",
            entity_id=model.id,
            payload={"version": 1, "digest": digest, "method": "lora-init"},
        )
        jobs.finish(session, session.get(Job, job.id), {"version_id": version.id, "n_params": clip.num_params})


def run_aggregate_round(job: Job, ctx) -> None:
    """θ ← θ + P(FedAvg(Δ)) for one uploaded round; P projects off U_μ while a forget lock is active (EASE, PFL)."""
    with session_scope() as session:
        model = session.get(Model, job.model_id)
        parent = session.get(ModelVersion, model.current_version_id)
        existing = session.execute(select(ModelVersion).where(ModelVersion.job_id == job.id)).scalar_one_or_none()
        session.expunge_all()
    digest_in = job.payload["updates_digest"]
    if existing is None:
        tensors = load_tensors(get_store().get_bytes(digest_in))
        updates = tensors["updates"]
        weights = tensors.get("weights", torch.tensor(model.state["client_sizes"], dtype=torch.float32)).clone()
        removed = [model.state["clients"].index(c) for c in model.state.get("removed", [])]
        for k in removed:
            if float(updates[k].abs().max()) > 0:
                raise FederatedJobError(
                    f"client {model.state['clients'][k]} was forgotten and may not take part "
                    "in later rounds; its update row must be zero"
                )
            weights[k] = 0.0
        if not torch.isfinite(updates).all():
            raise FederatedJobError("the round holds NaN or infinite updates")
        lock_entry = model.state.get("forget_lock")
        lock = ForgetLock.from_bytes(get_store().get_bytes(lock_entry["digest"])) if lock_entry else None
        theta = _load_theta(parent.digest)
        theta_new = apply_round(theta, updates, weights, projection=lock.project if lock else None)
        metrics: dict[str, Any] = {
            "round": len(model.state.get("rounds", [])) + 1,
            "projected": lock is not None,
            "update_norm": float(torch.linalg.norm(theta_new - theta)),
        }
        if lock is not None:
            metrics["lock_drift"] = lock.drift(theta_new)
        digest = get_store().put_bytes(_theta_bytes(theta_new))
        method = "fedavg+forget-lock" if lock else "fedavg"
    with session_scope() as session:
        jobs.assert_lease(session, job.id, ctx.owner)
        row = session.get(Model, model.id)
        if existing is None:
            if row.current_version_id != parent.id:
                raise RuntimeError("the model moved to a newer version while this round was aggregated; retrying")
            version = ModelVersion(
                model_id=model.id,
                number=parent.number + 1,
                parent_id=parent.id,
                digest=digest,
                method=method,
                job_id=job.id,
                metrics=metrics,
            )
            session.add(version)
            session.flush()
            row.current_version_id = version.id
            row.state = {**row.state, "rounds": [*row.state.get("rounds", []), digest_in]}
            append_event(
                session,
                actor="worker",
                action="round.aggregated",
                entity_type="model",
                entity_id=model.id,
                payload={
                    "version": version.number,
                    "digest": digest,
                    "updates": digest_in,
                    "projected": lock is not None,
                },
            )
        else:
            version = existing
        jobs.finish(session, session.get(Job, job.id), {"version_id": version.id})


def _forget_masks(model: Model, request: DeletionRequest, data, tombstoned: set[str]) -> tuple[list, int | None]:
    scope = request.scope
    forget_client = None
    masks = []
    for k, client in enumerate(data.clients):
        if scope["kind"] == "client":
            forget_client = model.state["clients"].index(scope["client_id"])
            mask = np.full(len(client), k == forget_client)
        elif scope["kind"] == "class":
            mask = client.has_word(scope["label"])
        else:
            wanted = set(scope["sample_ids"])
            mask = np.array([pid in wanted for pid in client.ids], dtype=bool)
        masks.append(mask & ~np.array([pid in tombstoned for pid in client.ids], dtype=bool))
    return masks, forget_client


def _retrieval(clip: ClipLoRA, theta: torch.Tensor, sets: dict[str, CaptionDataset], distractors) -> dict:
    clip.set_theta(theta)
    out = {}
    for name, subset in sets.items():
        if len(subset):
            scores = evaluate_retrieval(clip, subset, distractors if name == "forget" else None)
            out[f"{name}_r1"] = round(scores.mean_r1, 3)
    return out


def run_federated_deletion(
    job: Job, ctx, request: DeletionRequest, model: Model, parent: ModelVersion, method_name: str, publish
) -> None:
    with session_scope() as session:
        tombstoned = set(
            session.execute(
                select(DatasetRow.row_id).where(
                    DatasetRow.dataset_id == model.dataset_id,
                    DatasetRow.deleted_by.is_not(None),
                    DatasetRow.deleted_by != request.id,
                )
            ).scalars()
        )
        existing = session.execute(select(ModelVersion).where(ModelVersion.job_id == job.id)).scalar_one_or_none()
    data = data_for(model)
    masks, forget_client = _forget_masks(model, request, data, tombstoned)
    if not any(m.any() for m in masks):
        raise FederatedJobError("no remaining pair matches the scope")
    positions = [
        i
        for i, pid in enumerate(pid for c in data.clients for pid in c.ids)
        if pid
        in {p for c, m in zip(data.clients, masks, strict=True) for p, keep in zip(c.ids, m, strict=True) if keep}
    ]
    if existing is not None:
        publish(existing, positions, {})
        return
    spec = get_method(method_name)
    if model.kind not in spec.model_kinds or request.scope["kind"] not in spec.scopes:
        raise FederatedJobError(f"method {method_name!r} cannot take a {request.scope['kind']!r} scope here")
    method = spec.build({**model.spec.get("method_settings", {}).get(method_name, {}), **request.method_settings})
    clip = clip_for(model)
    rounds = model.state.get("rounds", [])
    if not rounds:
        raise FederatedJobError("the model has no federated rounds yet: there is nothing to unlearn")
    history = torch.stack([load_tensors(get_store().get_bytes(d))["updates"] for d in rounds])
    clients = [c.subset(np.flatnonzero(~np.array([p in tombstoned for p in c.ids], dtype=bool))) for c in data.clients]
    masks = [
        m[~np.array([p in tombstoned for p in c.ids], dtype=bool)] for c, m in zip(data.clients, masks, strict=True)
    ]
    theta = _load_theta(parent.digest)
    problem = FederatedProblem(
        spec=clip.spec,
        theta=theta,
        theta_init=_load_theta(model.state["theta_init"]),
        history=history,
        clients=clients,
        forget_masks=masks,
        scope=request.scope["kind"],
        forget_client=forget_client,
        fed_settings=FedSettings(**model.spec.get("fed_settings", {})),
        weights=torch.tensor(model.state["client_sizes"], dtype=torch.float32),
        model=clip,
        progress=lambda f, m: ctx.progress(0.1 + 0.7 * f, f"{method_name}: {m}"),
    )
    ctx.progress(0.1, f"unlearning {sum(int(m.sum()) for m in masks)} pairs with {method_name}")
    started = time.perf_counter()
    result = method.unlearn(problem)
    seconds = time.perf_counter() - started
    ctx.progress(0.85, "measuring retrieval before and after")
    forget = problem.forget_data()
    retain = CaptionDataset.concat([problem.retain_data(k) for k in problem.retained_clients()])
    retain = retain.subset(np.random.default_rng(0).permutation(len(retain))[:EVAL_RETAIN_PAIRS])
    sets = {"forget": forget, "retain": retain, "test": data.test}
    metrics = {
        "method": method_name,
        "unlearn_seconds": round(seconds, 3),
        "before": _retrieval(clip, theta, sets, data.test),
        "after": _retrieval(clip, result.theta, sets, data.test),
        "method_info": result.info,
    }
    version_digest = get_store().put_bytes(_theta_bytes(result.theta))
    state_update: dict[str, Any] = {}
    if "forget_lock" in result.artifacts:
        lock_bytes = result.artifacts["forget_lock"]
        lock = ForgetLock.from_bytes(lock_bytes)
        state_update["forget_lock"] = {
            "digest": get_store().put_bytes(lock_bytes),
            "alpha": lock.alpha,
            "rank": lock.rank,
            "n_params": lock.p,
            "request_id": request.id,
        }
    if forget_client is not None:
        state_update["removed"] = [*model.state.get("removed", []), model.state["clients"][forget_client]]
    version = ModelVersion(
        model_id=model.id,
        number=parent.number + 1,
        parent_id=parent.id,
        digest=version_digest,
        method=method_name,
        job_id=job.id,
        request_id=request.id,
        metrics=metrics,
    )
    publish(version, positions, state_update)

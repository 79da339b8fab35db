"""SISA (Bourtoule et al., "Machine Unlearning", S&P 2021) and the do-nothing floor, for tabular models.

SISA: the training rows are split at random into ``shards`` disjoint shards, each shard into ``slices`` slices. A
constituent model per shard is trained incrementally: on slice 1, then (warm-started from that checkpoint) on
slices 1..2, ..., keeping the checkpoint after every slice. Deleting rows retrains only the shards that held them,
from the checkpoint saved before the first slice holding a deleted row. Prediction aggregates the constituents by
averaging their predicted class probabilities.

What the service's theta is for SISA (a choice, kept consistent): the concatenation of the ``shards`` constituent
vectors. ``app.ml.tabular.predict_proba``/``accuracy`` recognise a vector k times the single-model size as a k-model
ensemble and average its members, so a SISA version is stored, served and verified like any other theta.
``prepare`` follows the method contract and returns the original theta unchanged (the registered model is a single
model trained on all rows); the first SISA ``unlearn`` returns the ensemble. ||theta' - theta_r|| is not defined for
SISA (different parameter spaces); compare it by accuracy.

For logistic regression (strictly convex) a slice checkpoint only saves solver iterations: each constituent ends
at the unique optimum of its shard. For the MLP the warm-started slice sequence is the real SISA training path.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from app.ml import tabular
from app.ml.unlearning.base import TabularProblem, UnlearningResult

ARTIFACT_SISA = "sisa.safetensors"
ARTIFACT_SISA_STATE = "sisa_state.json"


@dataclass
class SISAConfig:
    shards: int = 5
    slices: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        if self.shards < 1 or self.slices < 1:
            raise ValueError("shards and slices must be >= 1")


class SISA:
    def __init__(self, config: SISAConfig | None = None):
        self.config = config or SISAConfig()

    def _train_shard(
        self,
        problem: TabularProblem,
        rows_by_slice: list[np.ndarray],
        first_slice: int,
        init: torch.Tensor | None,
        checkpoints: torch.Tensor,
        shard: int,
    ) -> int:
        """(Re)train slices first_slice.. of one shard, each warm-started from the previous checkpoint."""
        used = 0
        for r in range(first_slice, len(rows_by_slice)):
            rows = np.concatenate(rows_by_slice[: r + 1])
            if len(rows) == 0:
                theta = (
                    init
                    if init is not None
                    else torch.from_numpy(
                        tabular._init_theta(problem.recipe, problem.X.shape[1], problem.n_classes)
                    ).float()
                )
            else:
                theta = tabular.train(problem.recipe, problem.X[rows], problem.y[rows], problem.n_classes, init=init)
            checkpoints[shard, r] = theta
            init = theta
            used = len(rows)
        return used

    def prepare(self, problem: TabularProblem) -> UnlearningResult:
        cfg = self.config
        rows = np.nonzero(np.asarray(problem.retain_mask, dtype=bool))[0]
        rng = np.random.default_rng(cfg.seed)
        perm = rng.permutation(rows)
        shard_of = np.full(problem.X.shape[0], -1, dtype=np.int32)
        slice_of = np.full(problem.X.shape[0], -1, dtype=np.int32)
        P = tabular.param_count(problem.recipe, problem.X.shape[1], problem.n_classes)
        checkpoints = torch.zeros(cfg.shards, cfg.slices, P)
        start = time.perf_counter()
        for k, shard_rows in enumerate(np.array_split(perm, cfg.shards)):
            shard_of[shard_rows] = k
            for r, slice_rows in enumerate(np.array_split(shard_rows, cfg.slices)):
                slice_of[slice_rows] = r
            by_slice = [np.sort(s) for s in np.array_split(shard_rows, cfg.slices)]
            self._train_shard(problem, by_slice, 0, None, checkpoints, k)
            problem.progress((k + 1) / cfg.shards, f"SISA: trained shard {k + 1}/{cfg.shards}")
        wall = time.perf_counter() - start
        artifacts = self._save(shard_of, slice_of, checkpoints, {"config": asdict(cfg), "requests": 0})
        info = {"method": "sisa", "stage": "prepare", "rows": int(len(rows)), "wall_time_s": wall, "n_params": P}
        return UnlearningResult(
            theta=torch.as_tensor(problem.theta).detach().float().cpu(), info=info, artifacts=artifacts
        )

    def unlearn(self, problem: TabularProblem) -> UnlearningResult:
        if ARTIFACT_SISA not in problem.artifacts:
            raise ValueError("SISA is not prepared for this model (missing sisa.safetensors); run prepare first")
        t = st_load(problem.artifacts[ARTIFACT_SISA])
        shard_of, slice_of, checkpoints = t["shard_of"].numpy(), t["slice_of"].numpy(), t["checkpoints"].clone()
        state = json.loads(problem.artifacts.get(ARTIFACT_SISA_STATE, b"{}") or b"{}")
        retain = np.asarray(problem.retain_mask, dtype=bool)
        # rows deleted now, and rows deleted earlier by another method that a shard still holds: a constituent
        # trained on an erased row must never be served again
        gone = np.asarray(problem.forget_mask, dtype=bool) | np.asarray(problem.tombstone_mask, dtype=bool)
        forget = np.nonzero(gone & (shard_of >= 0))[0]
        S, R = checkpoints.shape[:2]
        start = time.perf_counter()
        affected = sorted({int(shard_of[i]) for i in forget if shard_of[i] >= 0})
        retrained_rows, restarts = 0, {}
        for k in affected:
            in_shard = forget[shard_of[forget] == k]
            first = int(slice_of[in_shard].min())
            by_slice = [np.nonzero((shard_of == k) & (slice_of == r) & retain)[0] for r in range(R)]
            init = checkpoints[k, first - 1].clone() if first > 0 else None
            retrained_rows += self._train_shard(problem, by_slice, first, init, checkpoints, k)
            restarts[k] = first
        wall = time.perf_counter() - start
        shard_of[forget] = -1  # the deleted rows no longer belong to any shard
        slice_of[forget] = -1
        state["requests"] = int(state.get("requests", 0)) + 1
        theta = checkpoints[:, -1].reshape(-1).contiguous()
        info = {
            "method": "sisa",
            "rows_forgotten": int(len(forget)),
            "shards_retrained": len(affected),
            "restart_slice_by_shard": {str(k): v for k, v in restarts.items()},
            "rows_in_retrained_shards": retrained_rows,
            "wall_time_s": wall,
            "theta_is_ensemble_of": S,
        }
        return UnlearningResult(theta=theta, info=info, artifacts=self._save(shard_of, slice_of, checkpoints, state))

    def purge(self, problem: TabularProblem) -> UnlearningResult:
        """Erase rows another method deleted: retrain the shards that hold them (the same step as ``unlearn``); the
        returned θ is not served, only the artifacts are kept."""
        return self.unlearn(problem)

    @staticmethod
    def evidence_parts(before: dict[str, bytes], after: dict[str, bytes]) -> list[dict]:
        """The single models a SISA version is made of that this deletion retrained, each with the rows it must now
        be trained on exactly (its shard's remaining rows): {"part", "theta_before" (the constituent that held the
        erased rows), "theta_after", "rows" (bool mask)}. The verify step checks each against its shard's objective
        (verification/evidence.py): the ensemble as a whole is no one model's optimum."""
        b, a = st_load(before[ARTIFACT_SISA]), st_load(after[ARTIFACT_SISA])
        was, now = b["shard_of"].numpy(), a["shard_of"].numpy()
        affected = sorted({int(k) for k in was[(was >= 0) & (now < 0)]})
        return [
            {
                "part": k,
                "theta_before": b["checkpoints"][k, -1],
                "theta_after": a["checkpoints"][k, -1],
                "rows": now == k,
            }
            for k in affected
        ]

    @staticmethod
    def _save(shard_of: np.ndarray, slice_of: np.ndarray, checkpoints: torch.Tensor, state: dict) -> dict[str, bytes]:
        tensors = {
            "shard_of": torch.from_numpy(np.ascontiguousarray(shard_of, dtype=np.int32)),
            "slice_of": torch.from_numpy(np.ascontiguousarray(slice_of, dtype=np.int32)),
            "checkpoints": checkpoints.contiguous(),
        }
        return {ARTIFACT_SISA: st_save(tensors), ARTIFACT_SISA_STATE: json.dumps(state, sort_keys=True).encode()}


@dataclass
class DoNothingConfig:
    """No settings."""


class DoNothing:
    """Returns theta unchanged: the floor every method must beat (its ||theta - theta_r|| is the param_ratio's
    denominator). Not registered with the service — a deletion that changes nothing must never be certified."""

    def __init__(self, config: DoNothingConfig | None = None):
        self.config = config or DoNothingConfig()

    def unlearn(self, problem: TabularProblem) -> UnlearningResult:
        theta = torch.as_tensor(problem.theta).detach().float().cpu().clone()
        return UnlearningResult(theta=theta, info={"method": "do_nothing", "wall_time_s": 0.0})

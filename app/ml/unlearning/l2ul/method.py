"""L2UL as a registered method: ``prepare`` = Algorithm 1 + N_U fit, ``unlearn`` = Algorithm 2 + a privacy purge.

Algorithm 2 (notes §1.4): mu_f from the stored Phi rows, x = concat(mu_D, mu_f, theta), theta' = N_U(x) — one
forward pass. Here theta' = theta + rho * N_U(x) (scaled residual, see unlearner.py).

The purge the paper does not do (its §8.2 only notes that U "must" be unlearned too): after answering,
1. mu_D drops the deleted rows exactly (integer cell counts);
2. every meta-task whose subset held a deleted row is dropped, its shadow models with it, and (``replenish_tasks``)
   as many fresh tasks are trained on retained rows, so the meta-set keeps m tasks. A task of s rows holds one of
   |f| random deletions with probability 1 - (1 - s/n)^|f|: for |f| = 100 on Adult (n = 26,000, s = 1,000) that is
   98 % of the tasks, so a large deletion costs about a full meta-training — the price of not keeping deleted rows
   inside N_U's training set, reported as purge time;
3. every Isolation Kernel seed that is a deleted row is re-drawn from the retained rows and its partitioning's
   Phi column recomputed (kernel.py), and the stored Phi of deleted rows is scrubbed (zeroed);
4. if anything changed, N_U is refit on the remaining tasks (linear path re-solved exactly, hidden layers
   warm-started; ``purge_refit="cold"`` refits from scratch instead).
Output calibration ([INFERENCE], ``calibration_tasks``): N_U learns from s-row subsets but answers for the full
D. The 1/rho scaling removes the n/s size effect, but not everything: in a 1,000-row subset a rare one-hot
category may have a single row, whose deletion moves that weight far more than it would with the ~10 rows it has in
D. So ``prepare`` also retrains the model on D minus a few real forget sets (sizes 1, 10, 100, 1000, twice) and fits
one scalar c in [0, 1] (least squares on relative errors): theta' = theta + c * rho * N_U(x). c = 0 would mean N_U
is no better than doing nothing at full scale. Those retrained models are not stored (they hold every row but their
forget set, so they would leak later deletions); only c is, and a purge refit keeps it.

The forward time and the purge time are reported separately: only the former is the latency a requester waits on
in the paper's accounting; the latter is the cost of not leaving the deleted rows inside the method's own state.

Sequential requests: ``problem.tombstone_mask`` rows are gone from mu_D already. Rows tombstoned by another
method since the last L2UL call (still counted in mu_D) are removed first, and purged like this request's rows.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from app.ml import tabular
from app.ml.unlearning.base import TabularProblem, UnlearningResult
from app.ml.unlearning.l2ul.kernel import IsolationKernel, KernelState
from app.ml.unlearning.l2ul.meta import MetaSet, generate_meta_set
from app.ml.unlearning.l2ul.unlearner import Unlearner, UnlearnerConfig, _safetensors_metadata

ARTIFACT_KERNEL = "l2ul_kernel.safetensors"
ARTIFACT_META = "l2ul_meta.safetensors"
ARTIFACT_UNLEARNER = "l2ul_unlearner.safetensors"
ARTIFACT_STATE = "l2ul_state.json"
ARTIFACT_NAMES = (ARTIFACT_KERNEL, ARTIFACT_META, ARTIFACT_UNLEARNER, ARTIFACT_STATE)


SEED_REDRAW_STREAM = 7919
"""Random stream of the Isolation-Kernel seed re-draws in a purge (kept apart from meta-training's stream)."""


@dataclass
class L2ULConfig:
    """Paper defaults (§5.4, notes §1.5): psi=4, t=100, m=1000, s=1000 (LR) / 3000 (MLP).

    Settings marked [INFERENCE] are choices the paper leaves open (notes §1.13); each is documented where used:
    ``max_forget_fraction`` (meta.py), ``label_aware`` (kernel.py), ``scale_by_forget_fraction`` and the N_U
    architecture (unlearner.py), the ``purge_*`` steps (method.py).
    """

    psi: int = 4
    t: int = 100
    m: int = 1000
    subset_size: int | None = None  # None -> 1000 for LR, 3000 for the MLP
    min_forget: int = 1
    max_forget_fraction: float = 0.05  # [INFERENCE]
    label_aware: bool = True  # [INFERENCE]
    scale_by_forget_fraction: bool = True  # [INFERENCE]
    hidden: tuple[int, int] = (64, 64)  # [INFERENCE] paper: two hidden layers, widths unknown
    activation: str = "gelu"  # [INFERENCE]
    linear_skip: bool = True  # [INFERENCE]
    epochs: int = 400
    refit_epochs: int = 50
    lr: float = 1e-3
    weight_decay: float = 1e-4
    validation_fraction: float = 0.1
    purge_meta_tasks: bool = True
    purge_seeds: bool = True
    purge_refit: str = "warm"  # "warm" | "cold"
    replenish_tasks: bool = True
    calibration_tasks: int = 8  # [INFERENCE] full-data retrains that fit the output scale c; 0 -> c = 1
    workers: int = 0  # 0 -> one per CPU core
    seed: int = 0

    def __post_init__(self) -> None:
        self.hidden = tuple(int(h) for h in self.hidden)
        if self.psi < 2 or self.t < 1 or self.m < 2 or self.min_forget < 1:
            raise ValueError("need psi >= 2, t >= 1, m >= 2, min_forget >= 1")
        if not 0 < self.max_forget_fraction < 1:
            raise ValueError("max_forget_fraction must be in (0, 1)")
        if self.purge_refit not in ("warm", "cold"):
            raise ValueError("purge_refit must be 'warm' or 'cold'")
        self.unlearner_config()  # validates hidden / activation

    def unlearner_config(self) -> UnlearnerConfig:
        return UnlearnerConfig(
            hidden=self.hidden,
            activation=self.activation,
            linear_skip=self.linear_skip,
            epochs=self.epochs,
            refit_epochs=self.refit_epochs,
            lr=self.lr,
            weight_decay=self.weight_decay,
            validation_fraction=self.validation_fraction,
            seed=self.seed,
        )

    def subset_size_for(self, recipe: tabular.TabularRecipe) -> int:
        if self.subset_size is not None:
            return int(self.subset_size)
        return 3000 if recipe.family == "mlp" else 1000


# ---------------------------------------------------------------------------------------------- state (de)serialisation
def _kernel_to_bytes(ks: KernelState, redraws: int) -> bytes:
    tensors = {
        "seeds": torch.from_numpy(np.ascontiguousarray(ks.kernel.seeds, dtype=np.int64)),
        "cells": torch.from_numpy(np.ascontiguousarray(ks.cells)),
        "counted": torch.from_numpy(ks.counted.astype(np.uint8)),
        "counts": torch.from_numpy(np.ascontiguousarray(ks.counts, dtype=np.int64)),
    }
    meta = {"n_classes": str(ks.n_classes or 0), "redraws": str(redraws)}
    return st_save(tensors, metadata=meta)


def _kernel_from_bytes(data: bytes) -> tuple[KernelState, int]:
    t = {k: v.numpy() for k, v in st_load(data).items()}
    meta = _safetensors_metadata(data)
    n_classes = int(meta.get("n_classes", "0")) or None
    ks = KernelState(
        IsolationKernel(t["seeds"].copy()), t["cells"].copy(), t["counted"].astype(bool), t["counts"], n_classes
    )
    return ks, int(meta.get("redraws", "0"))


class L2UL:
    """Learning-to-UnLearn (Zhang et al. 2026) for tabular LR / MLP models."""

    def __init__(self, config: L2ULConfig | None = None):
        self.config = config or L2ULConfig()

    # ------------------------------------------------------------------ helpers
    def _task_inputs(
        self, ks: KernelState, meta: MetaSet, y: np.ndarray, n_classes: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """N_U training pairs for every task: x = concat(mu_S, mu_f, theta), target = (theta_r - theta) / rho."""
        labels = y if ks.n_classes else None
        mu_s = ks.kernel.embed_many(ks.cells, list(meta.task_rows), labels, ks.n_classes)
        mu_f = ks.kernel.embed_many(ks.cells, [meta.forget(j) for j in range(meta.m)], labels, ks.n_classes)
        inputs = np.concatenate([mu_s, mu_f, meta.theta], axis=1)
        k = meta.forget_sizes().astype(np.float64)
        rho = k / (meta.s - k) if self.config.scale_by_forget_fraction else np.ones_like(k)
        targets = (meta.theta_r.astype(np.float64) - meta.theta) / rho[:, None]
        return inputs, targets.astype(np.float32)

    def _artifacts(self, ks: KernelState, redraws: int, meta: MetaSet, nu: Unlearner, state: dict) -> dict[str, bytes]:
        return {
            ARTIFACT_KERNEL: _kernel_to_bytes(ks, redraws),
            ARTIFACT_META: meta.to_bytes(),
            ARTIFACT_UNLEARNER: nu.to_bytes(),
            ARTIFACT_STATE: json.dumps(state, sort_keys=True).encode(),
        }

    def _calibrate(self, recipe, X, y, C, rows, theta, ks: KernelState, nu: Unlearner) -> tuple[float, dict]:
        """Fit c = argmin_c sum_j ||c A_j - D_j||^2 / ||D_j||^2 over full-data tasks, clipped to [0, 1];
        A_j = rho_j N_U(x_j), D_j = theta_r_j - theta (see the module docstring)."""
        cfg = self.config
        if cfg.calibration_tasks <= 0:
            return 1.0, {"tasks": 0, "scale": 1.0}
        rng = np.random.default_rng([cfg.seed, 31337])
        n = len(rows)
        sizes = [min(k, max(1, int(cfg.max_forget_fraction * n))) for k in (1, 10, 100, 1000)]
        num = den = 0.0
        raw, details = [], []
        theta_np = theta.numpy().astype(np.float64)
        mu_D = ks.mu_D()
        for j in range(cfg.calibration_tasks):
            k = sizes[j % len(sizes)]
            f = rng.choice(rows, k, replace=False)
            keep = np.setdiff1d(rows, f, assume_unique=True)
            delta = tabular.train(recipe, X[keep], y[keep], C).numpy().astype(np.float64) - theta_np
            x = np.concatenate([mu_D, ks.mu(f, y), theta.numpy()]).astype(np.float32)
            rho = k / (n - k) if cfg.scale_by_forget_fraction else 1.0
            a = rho * nu.predict(x)[0].astype(np.float64)
            d2 = float(delta @ delta)
            if d2 <= 0:
                continue
            num += float(a @ delta) / d2
            den += float(a @ a) / d2
            raw.append((a, delta))
            details.append({"forget": k, "ratio_uncalibrated": float(np.linalg.norm(a - delta) / np.sqrt(d2))})
        scale = float(np.clip(num / den, 0.0, 1.0)) if den > 0 else 1.0
        for (a, delta), det in zip(raw, details, strict=True):
            det["ratio_calibrated"] = float(np.linalg.norm(scale * a - delta) / np.linalg.norm(delta))
        return scale, {"tasks": len(details), "scale": scale, "per_task": details}

    # ------------------------------------------------------------------ Algorithm 1
    def prepare(self, problem: TabularProblem) -> UnlearningResult:
        cfg, recipe = self.config, problem.recipe
        X, y, C = problem.X, np.asarray(problem.y), problem.n_classes
        rows = np.nonzero(np.asarray(problem.retain_mask, dtype=bool))[0]
        theta = torch.as_tensor(problem.theta).detach().to(torch.float32).cpu()
        P = tabular.param_count(recipe, X.shape[1], C)
        if theta.numel() != P:
            raise ValueError(f"L2UL needs a single {recipe.family} theta of {P} parameters, got {theta.numel()}")
        rng = np.random.default_rng(cfg.seed)
        timings: dict[str, float] = {}

        problem.progress(0.0, "Isolation Kernel: drawing seeds, mapping rows")
        t0 = time.perf_counter()
        ks = KernelState.build(X, y, rows, cfg.psi, cfg.t, rng, C if cfg.label_aware else None)
        ks.cells[~ks.counted] = 0  # rows outside the training set (earlier tombstones) keep no Phi
        timings["kernel_s"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        meta, meta_info = generate_meta_set(
            recipe,
            X,
            y,
            C,
            rows,
            m=cfg.m,
            s=cfg.subset_size_for(recipe),
            min_forget=cfg.min_forget,
            max_forget_fraction=cfg.max_forget_fraction,
            seed=cfg.seed + 1,
            workers=cfg.workers,
            progress=lambda f, msg: problem.progress(0.02 + 0.9 * f, msg),
        )
        timings["meta_training_s"] = time.perf_counter() - t0

        problem.progress(0.93, "fitting N_U")
        t0 = time.perf_counter()
        inputs, targets = self._task_inputs(ks, meta, y, C)
        nu = Unlearner(cfg.unlearner_config(), inputs.shape[1], P)
        fit_info = nu.fit(inputs, targets)
        timings["unlearner_fit_s"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        problem.progress(0.96, "calibrating N_U's output scale on full-data retrains")
        scale, calib_info = self._calibrate(recipe, X, y, C, rows, theta, ks, nu)
        timings["calibration_s"] = time.perf_counter() - t0
        timings["total_s"] = sum(timings.values())
        problem.progress(1.0, "L2UL prepared")

        state = {
            "config": {**asdict(cfg), "hidden": list(cfg.hidden)},
            "recipe": recipe.to_dict(),
            "n_features": int(X.shape[1]),
            "n_classes": int(C),
            "n_params": P,
            "output_scale": scale,
            "requests": 0,
            "next_task_id": cfg.m,
            "tasks_dropped_total": 0,
            "seeds_redrawn_total": 0,
        }
        info = {
            "method": "l2ul",
            "stage": "prepare",
            "rows": int(len(rows)),
            "timings": timings,
            "meta": meta_info,
            "unlearner": fit_info,
            "calibration": calib_info,
            "input_dim": int(inputs.shape[1]),
            "artifact_bytes": {},
        }
        artifacts = self._artifacts(ks, 0, meta, nu, state)
        info["artifact_bytes"] = {k: len(v) for k, v in artifacts.items()}
        return UnlearningResult(theta=theta, info=info, artifacts=artifacts)

    # ------------------------------------------------------------------ Algorithm 2 + purge
    def unlearn(self, problem: TabularProblem) -> UnlearningResult:
        cfg, recipe = self.config, problem.recipe
        X, y, C = problem.X, np.asarray(problem.y), problem.n_classes
        missing = [a for a in ARTIFACT_NAMES if a not in problem.artifacts]
        if missing:
            raise ValueError(f"L2UL is not prepared for this model (missing artifacts {missing}); run prepare first")

        t0 = time.perf_counter()
        ks, redraws = _kernel_from_bytes(problem.artifacts[ARTIFACT_KERNEL])
        meta = MetaSet.from_bytes(problem.artifacts[ARTIFACT_META])
        nu = Unlearner.from_bytes(problem.artifacts[ARTIFACT_UNLEARNER])
        state = json.loads(problem.artifacts[ARTIFACT_STATE])
        load_s = time.perf_counter() - t0
        if state.get("needs_prepare"):
            raise ValueError("L2UL's meta-set was exhausted by earlier purges (replenish_tasks off); run prepare again")
        if ks.cells.shape[0] != X.shape[0]:
            raise ValueError(f"L2UL was prepared for {ks.cells.shape[0]} rows, the data set has {X.shape[0]}")

        forget = np.asarray(problem.forget_mask, dtype=bool)
        f_rows = np.nonzero(forget & ks.counted)[0]
        present = np.asarray(problem.retain_mask, dtype=bool) | forget
        stale = np.nonzero(ks.counted & ~present)[0]  # deleted since the last L2UL call by another method
        ks.remove(stale, y)
        theta = torch.as_tensor(problem.theta).detach().to(torch.float32).cpu()
        if theta.numel() != state["n_params"]:
            raise ValueError(f"theta has {theta.numel()} parameters, L2UL was prepared for {state['n_params']}")
        if len(f_rows) == 0:
            raise ValueError("nothing to forget: no forget row is in the current training set")

        # --- Algorithm 2: one forward pass (timed on its own; numpy end to end, see Unlearner.predict) ---
        theta_np = theta.numpy()
        t0 = time.perf_counter()
        n_before = ks.n
        mu_D = ks.mu_D()
        mu_f = ks.mu(f_rows, y)
        x = np.concatenate([mu_D, mu_f, theta_np]).astype(np.float32)
        k = len(f_rows)
        rho = k / (n_before - k) if cfg.scale_by_forget_fraction else 1.0
        scale = rho * state.get("output_scale", 1.0)
        theta_new_np = theta_np + (scale * nu.predict(x)[0]).astype(np.float32)
        forward_s = time.perf_counter() - t0
        theta_new = torch.from_numpy(theta_new_np)

        # --- purge (timed separately) ---
        t0 = time.perf_counter()
        gone = np.union1d(f_rows, stale)
        ks.remove(f_rows, y)
        dropped = 0
        if cfg.purge_meta_tasks:
            hit = meta.tasks_containing(gone)
            dropped = int(hit.sum())
            if dropped:
                meta = meta.keep(~hit)
        replenished = 0
        if dropped and cfg.replenish_tasks:
            fresh, _ = generate_meta_set(
                recipe,
                X,
                y,
                C,
                np.nonzero(ks.counted)[0],
                m=dropped,
                s=meta.s if meta.m else cfg.subset_size_for(recipe),
                min_forget=cfg.min_forget,
                max_forget_fraction=cfg.max_forget_fraction,
                seed=cfg.seed + 1_000_003 * (state["requests"] + 1),
                workers=cfg.workers,
                progress=lambda f, msg: problem.progress(f, f"L2UL purge: re-training dropped tasks ({msg})"),
            )
            next_id = int(state.get("next_task_id", cfg.m))
            fresh.task_ids = np.arange(next_id, next_id + fresh.m, dtype=np.int32)
            state["next_task_id"] = next_id + fresh.m
            meta = meta.concat(fresh) if meta.m else fresh
            replenished = fresh.m
        seeds = 0
        if cfg.purge_seeds:
            rng = np.random.default_rng([cfg.seed, SEED_REDRAW_STREAM, redraws])
            seeds = ks.purge_seeds(gone, X, y, rng)
            redraws += 1 if seeds else 0
        ks.cells[gone] = 0  # scrub the stored Phi of deleted rows
        refit_info: dict[str, Any] | None = None
        if (dropped or seeds) and meta.m >= 2:
            inputs, targets = self._task_inputs(ks, meta, y, C)
            if cfg.purge_refit == "cold":
                nu = Unlearner(cfg.unlearner_config(), inputs.shape[1], state["n_params"])
            refit_info = nu.fit(inputs, targets, warm_start=cfg.purge_refit == "warm")
        elif dropped or seeds:
            # Too few tasks left to refit N_U without the deleted rows (replenish_tasks off): this request is
            # answered, but the current N_U was trained on deleted rows, so it must not answer another one.
            state["needs_prepare"] = True
        purge_s = time.perf_counter() - t0

        state["requests"] += 1
        state["tasks_dropped_total"] += dropped
        state["seeds_redrawn_total"] += seeds
        t0 = time.perf_counter()
        artifacts = self._artifacts(ks, redraws, meta, nu, state)
        save_s = time.perf_counter() - t0
        info = {
            "method": "l2ul",
            "rows_forgotten": k,
            "rows_before": n_before,
            "stale_rows_removed": int(len(stale)),
            "rho": rho,
            "forward_time_s": forward_s,
            "purge_time_s": purge_s,
            "load_time_s": load_s,
            "save_time_s": save_s,
            "tasks_dropped": dropped,
            "tasks_replenished": replenished,
            "tasks_remaining": meta.m,
            "unlearner_refit": refit_info is not None,
            "unlearner_refit_info": refit_info,
            "needs_prepare": bool(state.get("needs_prepare", False)),
            "seeds_redrawn": seeds,
            "update_norm": float(np.linalg.norm(theta_new_np - theta_np)),
        }
        return UnlearningResult(theta=theta_new.to(torch.float32), info=info, artifacts=artifacts)

"""L2UL as a registered method: ``prepare`` = Algorithm 1 + N_U fit, ``unlearn`` = Algorithm 2 + a privacy purge,
``purge`` = the same purge for rows another method erased.

Algorithm 2 (notes §1.4): mu_f from the stored Phi rows, x = concat(mu_D, mu_f, theta), theta' = N_U(x) — one
forward pass. Here theta' = theta + c * rho * N_U(x) (scaled residual, see unlearner.py; c below).

Units (issue 10, item 3a) [INFERENCE: the paper keeps one N_U and does not purge it, §8.2 only says U "must" be
unlearned]. N_U is trained on shadow models of data rows, so a deleted row must leave it too. With one N_U over
random s-row subsets a row sits in ~s/n of the tasks: on Adult that is 33 of 1,000 tasks for one row and all of
them for 100, so the old purge re-trained those tasks and refit N_U, 15 to 90 s a request against a 0.2 s retrain
(measured-findings.md, "Costs the headline left out"). Here the training rows are split into ``units`` disjoint
blocks; each unit has its own Isolation-Kernel partitionings (seeds drawn from its block only), its own meta-tasks
(subsets of its block) and its own N_U over its own partitionings' embeddings; the answer averages the units. A
row belongs to one unit, so everything that depends on it is that unit: the purge drops the units holding erased
rows — kernel columns, tasks and N_U together — and refits nothing. No stored parameter of a remaining unit was
computed from an erased row (the regression test trains twice on data that differ only in the erased row and finds
identical state after the purge). The price: a dropped unit is not rebuilt in the request path (that would cost
part of a meta-training), so L2UL thins with every deletion; a deletion that hits every unit (any ~``units`` * 3
random rows) leaves none, and L2UL reports ``needs_prepare``: the worker marks it invalidated until prepared
again. The answer itself is computed before the purge, with every live unit (the paper's order).

Stored Phi of rows outside the training set — held out, or erased by any request — is zeroed after every purge
(the old seed re-draw wrote earlier-erased rows' cells back: measured-findings.md, "Purge bugs" 2).

Output calibration ([INFERENCE], ``calibration_tasks``): N_U learns from s-row subsets but answers for the full
D. The 1/rho scaling removes the n/s size effect, but not everything (a rare one-hot category with one row in a
subset and ten in D). So ``prepare`` also retrains the model on D minus a few real forget sets and fits one scalar c
in [0, 1] (least squares on relative errors). c = 0 means N_U is no better than doing nothing at full scale: then
L2UL IS doing nothing, and preparation says so (``info["refused"]``: the worker refuses the method for the model,
``auto`` never offers it; issue 10, item 3b). The retrained models are not stored; c, one number fitted before any
deletion, is kept by a purge (an aggregate, like the encoder's means and standard deviations).

The forward time (``method_seconds``) and the purge time (``purge_seconds``) are reported separately, both measured.
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
from app.ml.unlearning.warm import WarmStates

ARTIFACT_KERNEL = "l2ul_kernel.safetensors"
ARTIFACT_UNLEARNER = "l2ul_unlearner.safetensors"
ARTIFACT_STATE = "l2ul_state.json"
ARTIFACT_NAMES = (ARTIFACT_KERNEL, ARTIFACT_UNLEARNER, ARTIFACT_STATE)
STATE_FORMAT = 2
"""2: units (this module's docstring). Format 1 (one N_U, re-trained tasks) is refused: prepare again."""
NO_UNIT = -1
WARM = WarmStates()
"""Parsed states of this worker (warm.py), keyed by the unlearner artifact's bytes."""


@dataclass
class L2ULConfig:
    """Paper defaults (§5.4, notes §1.5): psi=4, t=100, m=1000, s=1000 (LR) / 3000 (MLP).

    Settings marked [INFERENCE] are choices the paper leaves open (notes §1.13); each is documented where used:
    ``max_forget_fraction`` (meta.py), ``label_aware`` (kernel.py), ``scale_by_forget_fraction`` and the N_U
    architecture (unlearner.py), ``units`` and ``calibration_tasks`` (this module).
    """

    psi: int = 4
    t: int = 100  # partitionings in all, split among the units
    m: int = 1000  # meta-tasks in all, split among the units
    units: int = 8  # [INFERENCE] disjoint blocks of training rows (module docstring)
    subset_size: int | None = None  # None -> 1000 for LR, 3000 for the MLP (capped at a unit's block)
    min_forget: int = 1
    max_forget_fraction: float = 0.05  # [INFERENCE]
    label_aware: bool = True  # [INFERENCE]
    scale_by_forget_fraction: bool = True  # [INFERENCE]
    hidden: tuple[int, int] = (64, 64)  # [INFERENCE] paper: two hidden layers, widths unknown
    activation: str = "gelu"  # [INFERENCE]
    linear_skip: bool = True  # [INFERENCE]
    epochs: int = 400
    lr: float = 1e-3
    weight_decay: float = 1e-4
    validation_fraction: float = 0.1
    calibration_tasks: int = 8  # [INFERENCE] full-data retrains that fit the output scale c; 0 -> c = 1
    workers: int = 0  # 0 -> one per CPU core
    seed: int = 0

    def __post_init__(self) -> None:
        self.hidden = tuple(int(h) for h in self.hidden)
        if self.psi < 2 or self.t < 1 or self.m < 2 or self.min_forget < 1 or self.units < 1:
            raise ValueError("need psi >= 2, t >= 1, m >= 2, min_forget >= 1, units >= 1")
        if self.t < self.units or self.m < 2 * self.units:
            raise ValueError("each unit needs at least one partitioning (t >= units) and two tasks (m >= 2 units)")
        if not 0 < self.max_forget_fraction < 1:
            raise ValueError("max_forget_fraction must be in (0, 1)")
        self.unlearner_config()  # validates hidden / activation

    def unlearner_config(self) -> UnlearnerConfig:
        return UnlearnerConfig(
            hidden=self.hidden,
            activation=self.activation,
            linear_skip=self.linear_skip,
            epochs=self.epochs,
            lr=self.lr,
            weight_decay=self.weight_decay,
            validation_fraction=self.validation_fraction,
            seed=self.seed,
        )

    def subset_size_for(self, recipe: tabular.TabularRecipe) -> int:
        if self.subset_size is not None:
            return int(self.subset_size)
        return 3000 if recipe.family == "mlp" else 1000


# ---------------------------------------------------------------------------------------------- state
@dataclass
class L2ULState:
    """Everything ``unlearn`` reads: the kernel over the live units' partitionings, which unit each partitioning
    and each row belongs to, each live unit's N_U, and the facts in ``meta`` (JSON)."""

    kernel: KernelState
    unit_of_partition: np.ndarray  # int16 [t_live]
    unit_of_row: np.ndarray  # int16 [N]: the unit whose block holds the row, NO_UNIT for none
    unlearners: dict[int, Unlearner]
    meta: dict[str, Any]

    def partitions(self, unit: int) -> np.ndarray:
        return np.nonzero(self.unit_of_partition == unit)[0]

    @property
    def live_units(self) -> list[int]:
        return sorted(self.unlearners)

    def to_artifacts(self) -> dict[str, bytes]:
        ks = self.kernel
        kernel = {
            "seeds": torch.from_numpy(np.ascontiguousarray(ks.kernel.seeds, dtype=np.int64)),
            "cells": torch.from_numpy(np.ascontiguousarray(ks.cells)),
            "counted": torch.from_numpy(ks.counted.astype(np.uint8)),
            "counts": torch.from_numpy(np.ascontiguousarray(ks.counts, dtype=np.int64)),
            "unit_of_partition": torch.from_numpy(np.ascontiguousarray(self.unit_of_partition, dtype=np.int16)),
            "unit_of_row": torch.from_numpy(np.ascontiguousarray(self.unit_of_row, dtype=np.int16)),
        }
        units = {
            f"unit_{u}": torch.frombuffer(bytearray(nu.to_bytes()), dtype=torch.uint8)
            for u, nu in sorted(self.unlearners.items())
        }
        artifacts = {
            ARTIFACT_KERNEL: st_save(kernel, metadata={"n_classes": str(ks.n_classes or 0)}),
            ARTIFACT_UNLEARNER: st_save(units, metadata={"format": str(STATE_FORMAT)}) if units else b"",
            ARTIFACT_STATE: json.dumps(self.meta, sort_keys=True).encode(),
        }
        return artifacts

    @classmethod
    def from_artifacts(cls, artifacts: dict[str, bytes]) -> L2ULState:
        missing = [a for a in ARTIFACT_NAMES if a not in artifacts]
        if missing:
            raise ValueError(f"L2UL is not prepared for this model (missing artifacts {missing}); run prepare first")
        meta = json.loads(artifacts[ARTIFACT_STATE])
        if meta.get("format") != STATE_FORMAT:
            raise ValueError("L2UL's stored state predates units (format 1); prepare it again")
        t = {k: v.numpy() for k, v in st_load(artifacts[ARTIFACT_KERNEL]).items()}
        n_classes = int(_safetensors_metadata(artifacts[ARTIFACT_KERNEL]).get("n_classes", "0")) or None
        kernel = KernelState(
            IsolationKernel(t["seeds"].copy()), t["cells"].copy(), t["counted"].astype(bool), t["counts"], n_classes
        )
        units: dict[int, Unlearner] = {}
        if artifacts[ARTIFACT_UNLEARNER]:
            for name, blob in st_load(artifacts[ARTIFACT_UNLEARNER]).items():
                units[int(name.removeprefix("unit_"))] = Unlearner.from_bytes(blob.numpy().tobytes())
        return cls(kernel, t["unit_of_partition"].astype(np.int16), t["unit_of_row"].astype(np.int16), units, meta)


def load_state(artifacts: dict[str, bytes]) -> L2ULState:
    """The state of these artifacts, from this worker's memory when the same bytes were seen (read-only: callers
    build a new state for any change)."""
    if ARTIFACT_UNLEARNER not in artifacts:
        return L2ULState.from_artifacts(artifacts)  # raises the "not prepared" error
    return WARM.get(artifacts[ARTIFACT_UNLEARNER], lambda _: L2ULState.from_artifacts(artifacts))


# ---------------------------------------------------------------------------------------------- the method
class L2UL:
    """Learning-to-UnLearn (Zhang et al. 2026) for tabular LR / MLP models, purged by units."""

    approximates_retraining = True
    """A prediction of the retrained model: preparation gates it with the determinism probe and validates it."""

    def __init__(self, config: L2ULConfig | None = None):
        self.config = config or L2ULConfig()

    # ------------------------------------------------------------------ helpers
    def _task_inputs(
        self, ks: KernelState, parts: np.ndarray, meta: MetaSet, y: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """N_U training pairs of one unit: x = concat(mu_S, mu_f, theta) over its partitionings, target =
        (theta_r - theta) / rho."""
        labels = y if ks.n_classes else None
        mu_s = ks.kernel.embed_many(ks.cells, list(meta.task_rows), labels, ks.n_classes)
        mu_f = ks.kernel.embed_many(ks.cells, [meta.forget(j) for j in range(meta.m)], labels, ks.n_classes)
        inputs = np.concatenate([ks.partitions_view(mu_s, parts), ks.partitions_view(mu_f, parts), meta.theta], 1)
        k = meta.forget_sizes().astype(np.float64)
        rho = k / (meta.s - k) if self.config.scale_by_forget_fraction else np.ones_like(k)
        targets = (meta.theta_r.astype(np.float64) - meta.theta) / rho[:, None]
        return inputs, targets.astype(np.float32)

    @staticmethod
    def _predict(state: L2ULState, f_rows: np.ndarray, y: np.ndarray, theta_np: np.ndarray) -> np.ndarray:
        """Mean over live units of N_U_u(mu_D^u, mu_f^u, theta): the scaled residual (one forward pass each)."""
        ks = state.kernel
        mu_D, mu_f = ks.mu_D(), ks.mu(f_rows, y)
        out = np.zeros(theta_np.shape[0], np.float64)
        for u, nu in state.unlearners.items():
            parts = state.partitions(u)
            x = np.concatenate([ks.partitions_view(mu_D, parts), ks.partitions_view(mu_f, parts), theta_np])
            out += nu.predict(x.astype(np.float32))[0]
        return out / max(1, len(state.unlearners))

    def _calibrate(self, recipe, X, y, C, rows, theta, state: L2ULState) -> tuple[float, dict]:
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
        for j in range(cfg.calibration_tasks):
            k = sizes[j % len(sizes)]
            f = rng.choice(rows, k, replace=False)
            keep = np.setdiff1d(rows, f, assume_unique=True)
            delta = tabular.train(recipe, X[keep], y[keep], C).numpy().astype(np.float64) - theta_np
            rho = k / (n - k) if cfg.scale_by_forget_fraction else 1.0
            a = rho * self._predict(state, f, y, theta.numpy())
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
        U = cfg.units
        if len(rows) < U * max(cfg.psi, 4):
            raise ValueError(f"L2UL with {U} units needs at least {U * max(cfg.psi, 4)} training rows")
        rng = np.random.default_rng(cfg.seed)
        timings: dict[str, float] = {}

        problem.progress(0.0, f"Isolation Kernel: {U} units, seeds from each unit's own rows")
        t0 = time.perf_counter()
        blocks = [np.sort(b) for b in np.array_split(rng.permutation(rows), U)]
        unit_of_row = np.full(len(y), NO_UNIT, np.int16)
        for u, block in enumerate(blocks):
            unit_of_row[block] = u
        unit_of_partition = np.sort(np.arange(cfg.t) % U).astype(np.int16)
        seeds = np.concatenate(
            [IsolationKernel.fit(blocks[u], cfg.psi, int((unit_of_partition == u).sum()), rng).seeds for u in range(U)]
        )
        ks = KernelState.from_kernel(IsolationKernel(seeds), X, y, rows, C if cfg.label_aware else None)
        timings["kernel_s"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        s = min(cfg.subset_size_for(recipe), min(len(b) for b in blocks) - 1)
        meta, meta_info = generate_meta_set(
            recipe,
            X,
            y,
            C,
            rows,
            m=cfg.m,
            s=s,
            min_forget=cfg.min_forget,
            max_forget_fraction=cfg.max_forget_fraction,
            seed=cfg.seed + 1,
            workers=cfg.workers,
            progress=lambda f, msg: problem.progress(0.02 + 0.85 * f, msg),
            blocks=blocks,
        )
        timings["meta_training_s"] = time.perf_counter() - t0

        problem.progress(0.88, f"fitting N_U for {U} units")
        t0 = time.perf_counter()
        unit_of_task = np.arange(meta.m) % U
        unlearners, fit_info = {}, {}
        for u in range(U):
            mine = meta.keep(unit_of_task == u)
            inputs, targets = self._task_inputs(ks, np.nonzero(unit_of_partition == u)[0], mine, y)
            nu = Unlearner(cfg.unlearner_config(), inputs.shape[1], P)
            fit_info[str(u)] = nu.fit(inputs, targets)
            unlearners[u] = nu
        timings["unlearner_fit_s"] = time.perf_counter() - t0
        state = L2ULState(ks, unit_of_partition, unit_of_row, unlearners, {})

        t0 = time.perf_counter()
        problem.progress(0.95, "calibrating N_U's output scale on full-data retrains")
        scale, calib_info = self._calibrate(recipe, X, y, C, rows, theta, state)
        timings["calibration_s"] = time.perf_counter() - t0
        timings["total_s"] = sum(timings.values())
        problem.progress(1.0, "L2UL prepared")
        held_out = [i.get("val_param_ratio_median") for i in fit_info.values() if "val_param_ratio_median" in i]
        state.meta = {
            "format": STATE_FORMAT,
            "config": {**asdict(cfg), "hidden": list(cfg.hidden)},
            "recipe": recipe.to_dict(),
            "n_features": int(X.shape[1]),
            "n_classes": int(C),
            "n_params": P,
            "output_scale": scale,
            "requests": 0,
            "purges": 0,
            "units_prepared": U,
            "units_dropped": [],
        }
        info: dict[str, Any] = {
            "method": "l2ul",
            "stage": "prepare",
            "rows": int(len(rows)),
            "units": U,
            "rows_per_unit": [int(len(b)) for b in blocks],
            "timings": timings,
            "meta": meta_info,
            "unlearner": fit_info,
            "held_out_task_param_ratio_median": float(np.median(held_out)) if held_out else None,
            "calibration": calib_info,
            "output_scale": scale,
        }
        if scale == 0.0:
            info["refused"] = (
                "calibrated output scale 0: on full-data retrains N_U's predicted change did no better than no "
                "change at all, so L2UL would return the original model (doing nothing)"
            )
        artifacts = state.to_artifacts()
        WARM.put(artifacts[ARTIFACT_UNLEARNER], state)
        info["artifact_bytes"] = {k: len(v) for k, v in artifacts.items()}
        return UnlearningResult(theta=theta, info=info, artifacts=artifacts)

    # ------------------------------------------------------------------ the purge
    def _purged(self, state: L2ULState, gone: np.ndarray, y: np.ndarray) -> tuple[L2ULState, dict[str, Any]]:
        """A new state without the units that hold any of ``gone`` (rows erased now or since the last call), the
        rows out of mu_D, and zero Phi for every row outside the training set."""
        gone = np.asarray(gone, dtype=np.int64)
        hit = sorted({int(u) for u in state.unit_of_row[gone] if u != NO_UNIT} & set(state.unlearners))
        keep_parts = np.nonzero(~np.isin(state.unit_of_partition, hit))[0]
        unlearners = {u: nu for u, nu in state.unlearners.items() if u not in hit}
        if unlearners:
            ks = state.kernel.keep_partitions(keep_parts)
            ks.remove(gone, y)
        else:  # nothing left to embed for: the kernel leaves with the last unit
            ks = KernelState(
                IsolationKernel(np.zeros((0, state.kernel.kernel.psi), np.int64)),
                np.zeros((len(y), 0), state.kernel.cells.dtype),
                state.kernel.counted & ~np.isin(np.arange(len(y)), gone),
                np.zeros(0, np.int64),
                state.kernel.n_classes,
            )
        ks.cells[~ks.counted] = 0  # every row outside the training set, not only this request's
        unit_of_row = state.unit_of_row.copy()
        unit_of_row[gone] = NO_UNIT
        unit_of_row[np.isin(unit_of_row, hit)] = NO_UNIT  # a dropped unit's rows belong to no unit
        meta = {
            **state.meta,
            "purges": int(state.meta.get("purges", 0)) + 1,
            "units_dropped": [*state.meta.get("units_dropped", []), *hit],
        }
        new = L2ULState(ks, state.unit_of_partition[keep_parts], unit_of_row, unlearners, meta)
        info: dict[str, Any] = {
            "rows_erased": int(len(gone)),
            "units_dropped": hit,
            "units_remaining": len(unlearners),
        }
        if not unlearners:
            info["needs_prepare"] = (
                "every L2UL unit held an erased row and was dropped with it (no N_U parameter may depend on an "
                "erased row); prepare L2UL again"
            )
        return new, info

    def purge(self, problem: TabularProblem) -> UnlearningResult:
        """Erase rows another method deleted (the worker's erase step calls this on every prepared method)."""
        y = np.asarray(problem.y)
        t0 = time.perf_counter()
        state = load_state(problem.artifacts)
        present = np.asarray(problem.retain_mask, dtype=bool)
        gone = np.nonzero(np.asarray(problem.forget_mask, dtype=bool) | (state.kernel.counted & ~present))[0]
        new, info = self._purged(state, gone, y)
        artifacts = new.to_artifacts()
        WARM.put(artifacts[ARTIFACT_UNLEARNER], new)
        info.update(method="l2ul", stage="purge", purge_seconds=time.perf_counter() - t0)
        return UnlearningResult(theta=torch.as_tensor(problem.theta), info=info, artifacts=artifacts)

    # ------------------------------------------------------------------ Algorithm 2 + purge
    def unlearn(self, problem: TabularProblem) -> UnlearningResult:
        cfg = self.config
        X, y = problem.X, np.asarray(problem.y)
        t0 = time.perf_counter()
        state = load_state(problem.artifacts)
        load_s = time.perf_counter() - t0
        if state.kernel.cells.shape[0] != X.shape[0]:
            raise ValueError(f"L2UL was prepared for {state.kernel.cells.shape[0]} rows, the data set has {len(X)}")
        theta = torch.as_tensor(problem.theta).detach().to(torch.float32).cpu()
        if theta.numel() != state.meta["n_params"]:
            raise ValueError(f"theta has {theta.numel()} parameters, L2UL was prepared for {state.meta['n_params']}")
        forget = np.asarray(problem.forget_mask, dtype=bool)
        present = np.asarray(problem.retain_mask, dtype=bool) | forget
        stale = np.nonzero(state.kernel.counted & ~present)[0]  # erased by another method without a purge here
        if len(stale):
            state, _ = self._purged(state, stale, y)
        if not state.unlearners:
            raise ValueError("no L2UL unit is left (each held an erased row); prepare L2UL again")
        f_rows = np.nonzero(forget & state.kernel.counted)[0]
        if len(f_rows) == 0:
            raise ValueError("nothing to forget: no forget row is in the current training set")

        # --- Algorithm 2: one forward pass per live unit (timed on its own; numpy end to end) ---
        theta_np = theta.numpy()
        t0 = time.perf_counter()
        n_before, k = state.kernel.n, len(f_rows)
        rho = k / (n_before - k) if cfg.scale_by_forget_fraction else 1.0
        scale = rho * state.meta.get("output_scale", 1.0)
        theta_new_np = theta_np + (scale * self._predict(state, f_rows, y, theta_np)).astype(np.float32)
        method_s = time.perf_counter() - t0
        units_answering = state.live_units

        # --- purge (timed separately, in full) ---
        t0 = time.perf_counter()
        new, purge_info = self._purged(state, f_rows, y)
        new.meta["requests"] = int(new.meta.get("requests", 0)) + 1
        artifacts = new.to_artifacts()
        WARM.put(artifacts[ARTIFACT_UNLEARNER], new)
        purge_s = time.perf_counter() - t0
        info = {
            "method": "l2ul",
            "rows_forgotten": k,
            "rows_before": n_before,
            "stale_rows_removed": int(len(stale)),
            "rho": rho,
            "output_scale": state.meta.get("output_scale", 1.0),
            "units_answering": units_answering,
            "method_seconds": method_s,
            "forward_time_s": method_s,
            "purge_seconds": purge_s,
            "purge_time_s": purge_s,
            "load_time_s": load_s,
            **purge_info,
            "update_norm": float(np.linalg.norm(theta_new_np - theta_np)),
        }
        return UnlearningResult(theta=torch.from_numpy(theta_new_np), info=info, artifacts=artifacts)

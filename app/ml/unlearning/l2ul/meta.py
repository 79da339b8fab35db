"""Meta-training set generation (paper Algorithm 1, notes §1.4) and the meta-task purge.

Each task j draws a subset S_j of s retained rows and a forget set F_j inside it, then trains the recipe's model
FROM SCRATCH on S_j (theta_j) and on S_j minus F_j (theta_r_j) — the real retrained model, never a warm start from
theta_j, because N_U must learn what retraining does, not what a shortcut does. Unknowns the paper leaves open
(notes §1.13) are settings here:

- forget sizes [INFERENCE]: log-uniform integers from ``min_forget`` to ``max_forget_fraction * s``, so one N_U
  serves every request size; with the residual scaled by |f| / (n - |f|) (unlearner.py) what matters is that the
  deployment deletion fractions are covered, and 5 % of s covers |D_f| = 1,000 on Adult (3.8 %);
- theta and theta_r share the recipe's seed (same initialisation for the MLP), as retraining in the service does.

Tasks run in a process pool (both cores; each worker pins torch to one thread so two workers do not oversubscribe
two cores). Inside a daemonic process (a Celery prefork child cannot have children) they run serially instead.

Every task keeps its rows, forget rows, theta and theta_r while N_U is fit; L2UL does not store them afterwards
(they are shadow models trained on data rows, so each would have to be purged with its rows: method.py, "units").
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from app.ml import tabular
from app.ml.unlearning.l2ul.unlearner import single_torch_thread


@dataclass
class MetaSet:
    """The m meta-tasks. Rows are indices into the registered data set's X."""

    task_ids: np.ndarray  # int32 [m]: index of the task at generation time (stable across purges)
    task_rows: np.ndarray  # int32 [m, s]: the subset S_j
    forget_ptr: np.ndarray  # int64 [m + 1]: CSR pointers into forget_rows
    forget_rows: np.ndarray  # int32 [sum |F_j|]: the forget sets F_j (subsets of S_j)
    theta: np.ndarray  # float32 [m, P]: A(S_j)
    theta_r: np.ndarray  # float32 [m, P]: A(S_j minus F_j), trained from scratch

    @property
    def m(self) -> int:
        return len(self.task_ids)

    @property
    def s(self) -> int:
        return int(self.task_rows.shape[1])

    def forget(self, j: int) -> np.ndarray:
        return self.forget_rows[self.forget_ptr[j] : self.forget_ptr[j + 1]]

    def forget_sizes(self) -> np.ndarray:
        return np.diff(self.forget_ptr)

    def tasks_containing(self, rows: np.ndarray) -> np.ndarray:
        """Bool [m]: the task's subset holds at least one of ``rows``."""
        if len(rows) == 0:
            return np.zeros(self.m, dtype=bool)
        return np.isin(self.task_rows, np.asarray(rows)).any(1)

    def keep(self, mask: np.ndarray) -> MetaSet:
        """The tasks where ``mask`` is True (the purge drops the others, their shadow models included)."""
        mask = np.asarray(mask, dtype=bool)
        sizes = self.forget_sizes()[mask]
        forget = [self.forget(j) for j in np.nonzero(mask)[0]]
        return MetaSet(
            task_ids=self.task_ids[mask],
            task_rows=self.task_rows[mask],
            forget_ptr=np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64),
            forget_rows=(np.concatenate(forget) if forget else np.zeros(0)).astype(np.int32),
            theta=self.theta[mask],
            theta_r=self.theta_r[mask],
        )

    def concat(self, other: MetaSet) -> MetaSet:
        return MetaSet(
            task_ids=np.concatenate([self.task_ids, other.task_ids]).astype(np.int32),
            task_rows=np.concatenate([self.task_rows, other.task_rows]).astype(np.int32),
            forget_ptr=np.concatenate([self.forget_ptr, self.forget_ptr[-1] + other.forget_ptr[1:]]).astype(np.int64),
            forget_rows=np.concatenate([self.forget_rows, other.forget_rows]).astype(np.int32),
            theta=np.concatenate([self.theta, other.theta]),
            theta_r=np.concatenate([self.theta_r, other.theta_r]),
        )

    def to_bytes(self, metadata: dict[str, str] | None = None) -> bytes:
        t = {
            "task_ids": torch.from_numpy(np.ascontiguousarray(self.task_ids, dtype=np.int32)),
            "task_rows": torch.from_numpy(np.ascontiguousarray(self.task_rows, dtype=np.int32)),
            "forget_ptr": torch.from_numpy(np.ascontiguousarray(self.forget_ptr, dtype=np.int64)),
            "forget_rows": torch.from_numpy(np.ascontiguousarray(self.forget_rows, dtype=np.int32)),
            "theta": torch.from_numpy(np.ascontiguousarray(self.theta, dtype=np.float32)),
            "theta_r": torch.from_numpy(np.ascontiguousarray(self.theta_r, dtype=np.float32)),
        }
        return st_save(t, metadata=metadata)

    @classmethod
    def from_bytes(cls, data: bytes) -> MetaSet:
        t = {k: v.numpy() for k, v in st_load(data).items()}
        return cls(t["task_ids"], t["task_rows"], t["forget_ptr"], t["forget_rows"], t["theta"], t["theta_r"])


# ---------------------------------------------------------------------------------------------- generation
def sample_forget_size(rng: np.random.Generator, s: int, min_forget: int, max_fraction: float) -> int:
    """Log-uniform integer in [min_forget, max(min_forget, round(max_fraction * s))], never all of s."""
    hi = min(max(min_forget, int(round(max_fraction * s))), s - 1)
    lo = min(min_forget, hi)
    k = int(math.floor(math.exp(rng.uniform(math.log(lo), math.log(hi + 1)))))
    return min(max(k, lo), hi)


def _init_worker() -> None:
    torch.set_num_threads(1)


def _run_tasks(recipe_dict: dict[str, Any], n_classes: int, batch: list[tuple]) -> list[tuple]:
    """Worker: for each (task, X_S, y_S, forget positions) train theta and theta_r from scratch."""
    recipe = tabular.TabularRecipe.from_dict(recipe_dict)
    out = []
    for j, Xs, ys, fpos in batch:
        start = time.perf_counter()
        theta = tabular.train(recipe, Xs, ys, n_classes)
        keep = np.ones(len(ys), dtype=bool)
        keep[fpos] = False
        theta_r = tabular.train(recipe, Xs[keep], ys[keep], n_classes)
        out.append((j, theta.numpy(), theta_r.numpy(), time.perf_counter() - start))
    return out


def generate_meta_set(
    recipe: tabular.TabularRecipe,
    X: np.ndarray,
    y: np.ndarray,
    n_classes: int,
    rows: np.ndarray,
    m: int,
    s: int,
    min_forget: int = 1,
    max_forget_fraction: float = 0.05,
    seed: int = 0,
    workers: int = 0,
    progress: Callable[[float, str], None] | None = None,
    blocks: Sequence[np.ndarray] | None = None,
) -> tuple[MetaSet, dict[str, Any]]:
    """Algorithm 1, lines 2-6: m tasks over ``rows`` (the retained rows). ``workers=0`` means one per CPU core.

    ``blocks`` (disjoint sets of rows): task j draws its subset from ``blocks[j % len(blocks)]`` only, so a deleted
    row invalidates the tasks of one block, not ~s/n of all of them (method.py, "units")."""
    rows = np.asarray(rows, dtype=np.int64)
    pools = [np.asarray(b, dtype=np.int64) for b in blocks] if blocks is not None else [rows]
    s = min(int(s), min(len(p) for p in pools))
    if s < 2 or m < 1:
        raise ValueError(f"need s >= 2 rows and m >= 1 tasks (s={s}, m={m})")
    rng = np.random.default_rng(seed)
    task_rows = np.empty((m, s), dtype=np.int32)
    forget_pos: list[np.ndarray] = []
    for j in range(m):
        task_rows[j] = rng.choice(pools[j % len(pools)], s, replace=False)
        k = sample_forget_size(rng, s, min_forget, max_forget_fraction)
        forget_pos.append(np.sort(rng.choice(s, k, replace=False)))
    forget_rows = [task_rows[j, forget_pos[j]] for j in range(m)]
    P = tabular.param_count(recipe, X.shape[1], n_classes)
    theta = np.empty((m, P), dtype=np.float32)
    theta_r = np.empty((m, P), dtype=np.float32)
    task_seconds = np.empty(m)

    workers = workers or os.cpu_count() or 1
    workers = min(workers, m)
    if mp.current_process().daemon:
        workers = 1
    per_batch = max(1, min(25, m // (workers * 8) or 1))
    batches = [list(range(i, min(i + per_batch, m))) for i in range(0, m, per_batch)]
    recipe_dict = {**recipe.to_dict(), "device": "cpu"}  # s-row tasks are too small for a GPU to pay off

    def payload(idx: list[int]) -> list[tuple]:
        return [(j, X[task_rows[j]], y[task_rows[j]], forget_pos[j]) for j in idx]

    done = 0
    start = time.perf_counter()

    def collect(results: list[tuple]) -> None:
        nonlocal done
        for j, th, thr, sec in results:
            theta[j], theta_r[j], task_seconds[j] = th, thr, sec
        done += len(results)
        if progress:
            progress(done / m, f"meta-training: {done}/{m} tasks")

    if workers > 1:
        ctx = mp.get_context("spawn")  # fork after torch/OpenMP initialisation can deadlock
        with ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_init_worker) as pool:
            futures = [pool.submit(_run_tasks, recipe_dict, n_classes, payload(b)) for b in batches]
            for fut in as_completed(futures):
                collect(fut.result())
    else:
        with single_torch_thread():
            for b in batches:
                collect(_run_tasks(recipe_dict, n_classes, payload(b)))
    wall = time.perf_counter() - start
    forget_sizes = np.array([len(f) for f in forget_rows])
    meta = MetaSet(
        task_ids=np.arange(m, dtype=np.int32),
        task_rows=task_rows,
        forget_ptr=np.concatenate([[0], np.cumsum(forget_sizes)]).astype(np.int64),
        forget_rows=np.concatenate(forget_rows).astype(np.int32),
        theta=theta,
        theta_r=theta_r,
    )
    info = {
        "m": m,
        "s": s,
        "workers": workers,
        "wall_time_s": wall,
        "task_cpu_s_mean": float(task_seconds.mean()),
        "forget_size_min": int(forget_sizes.min()),
        "forget_size_median": float(np.median(forget_sizes)),
        "forget_size_max": int(forget_sizes.max()),
    }
    return meta, info

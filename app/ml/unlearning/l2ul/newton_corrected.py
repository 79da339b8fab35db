"""L2UL-N (issue 10, item 3c) [INFERENCE: not in the paper]: N_U takes the Newton step as its input and learns a
gated correction to it, so that its worst case is the Newton step.

Why: on Adult LR the IK embeddings carry almost nothing of theta_r - theta (held-out meta-tasks 1.06), while the
exact Newton step alone lands at 0.034 (measured-findings.md, "What an N_U input can carry"). So instead of
predicting the change from mu_D and mu_f, L2UL-N starts from the Newton step Delta_N (the ``newton`` method's,
from its own prepared state) and learns only what Newton misses:

    theta' = theta + Delta_N + g * rho * N_U(Delta_N / rho, theta)

- meta-tasks (Algorithm 1, meta.py): s-row subsets S_j, forget sets F_j, theta_j = A(S_j), theta_r_j =
  A(S_j minus F_j) from scratch; on each the exact Newton step over S_j minus F_j at theta_j is computed, and N_U is
  trained on input (Delta_N_j / rho_j, theta_j) to the target (theta_r_j - theta_j - Delta_N_j) / rho_j (rho =
  |F| / (|S| - |F|), the same size scaling as unlearner.py);
- the gate g in [0, 1] is fitted after training on a few real deletions of the full model (exact retrains, as
  L2UL's calibration): least squares of the correction against what the Newton step missed. g = 0 means the
  correction does not help at full scale and L2UL-N *is* the Newton step (said so in ``info``); never worse than
  Newton on those deletions by construction of the fit (a least-squares g > 0 lowers their summed relative error);
- units and purge: as L2UL (method.py, "units"): the training rows are split into disjoint blocks, each unit's tasks
  draw their subsets from its block only, a deletion drops the units whose block held an erased row (their N_U and
  tasks with them) and the Newton state is purged by the Newton method itself. When no unit is left, the answer is
  the Newton step alone (said so in ``info["note"]``): the method keeps serving at its worst case.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from app.ml import tabular
from app.ml.unlearning.base import TabularProblem, UnlearningResult
from app.ml.unlearning.l2ul.meta import generate_meta_set
from app.ml.unlearning.l2ul.unlearner import Unlearner, UnlearnerConfig
from app.ml.unlearning.newton.method import (
    ARTIFACT_STATE as NEWTON_ARTIFACT,
)
from app.ml.unlearning.newton.method import (
    NewtonConfig,
    NewtonUnlearning,
    _shift_free,
    factor,
    objective_hessian,
)
from app.ml.unlearning.warm import WarmStates

ARTIFACT_UNITS = "l2uln_units.safetensors"
ARTIFACT_NEWTON = "l2uln_newton.safetensors"
ARTIFACT_STATE = "l2uln_state.json"
ARTIFACT_NAMES = (ARTIFACT_UNITS, ARTIFACT_NEWTON, ARTIFACT_STATE)
NO_UNIT = -1
WARM = WarmStates()


@dataclass
class L2ULNConfig:
    m: int = 400  # meta-tasks in all, split among the units
    units: int = 8
    subset_size: int | None = None  # None -> 1000 for LR, 3000 for the MLP (capped at a unit's block)
    min_forget: int = 1
    max_forget_fraction: float = 0.05
    hidden: tuple[int, int] = (64, 64)
    epochs: int = 200
    lr: float = 1e-3
    weight_decay: float = 1e-4
    calibration_tasks: int = 6  # full-data retrains that fit the gate g; 0 -> g = 0 (the Newton step)
    newton: dict[str, Any] = field(default_factory=dict)  # NewtonConfig settings of the step it corrects
    workers: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        self.hidden = tuple(int(h) for h in self.hidden)
        if self.units < 1 or self.m < 2 * self.units:
            raise ValueError("need units >= 1 and at least two meta-tasks per unit (m >= 2 units)")
        if not 0 < self.max_forget_fraction < 1 or self.min_forget < 1:
            raise ValueError("need min_forget >= 1 and max_forget_fraction in (0, 1)")
        if self.calibration_tasks < 0:
            raise ValueError("calibration_tasks must be >= 0")
        self.newton_config()  # validates

    def newton_config(self) -> NewtonConfig:
        """The Newton step's settings; its state (kept inside L2UL-N's own artifact) has no deferred completion, so
        its purge is ``recompute`` unless ``downdate`` is asked for, never ``deferred``."""
        config = NewtonConfig(**{"purge": "recompute", **self.newton})
        if config.purge == "deferred":
            raise ValueError("l2ul_n's newton.purge cannot be 'deferred' (nothing completes it): recompute or downdate")
        return config

    def unlearner_config(self) -> UnlearnerConfig:
        return UnlearnerConfig(
            hidden=self.hidden, epochs=self.epochs, lr=self.lr, weight_decay=self.weight_decay, seed=self.seed
        )


@dataclass
class L2ULNState:
    unit_of_row: np.ndarray  # int16 [N]
    unlearners: dict[int, Unlearner]
    meta: dict[str, Any]

    def to_bytes(self) -> bytes:
        tensors = {"unit_of_row": torch.from_numpy(np.ascontiguousarray(self.unit_of_row, dtype=np.int16))}
        for u, nu in sorted(self.unlearners.items()):
            tensors[f"nu_{u}"] = torch.frombuffer(bytearray(nu.to_bytes()), dtype=torch.uint8)
        return st_save(tensors, metadata={"meta": json.dumps(self.meta, sort_keys=True)})

    @classmethod
    def from_bytes(cls, data: bytes) -> L2ULNState:
        t = st_load(data)
        n = int.from_bytes(data[:8], "little")
        meta = json.loads(json.loads(data[8 : 8 + n])["__metadata__"]["meta"])
        units = {
            int(k.removeprefix("nu_")): Unlearner.from_bytes(v.numpy().tobytes())
            for k, v in t.items()
            if k.startswith("nu_")
        }
        return cls(t["unit_of_row"].numpy().astype(np.int16), units, meta)


def newton_step(recipe: tabular.TabularRecipe, theta: torch.Tensor, X, y, C: int, config: NewtonConfig) -> np.ndarray:
    """Delta_N = -H_R(theta)^-1 grad L_R(theta) over the retained rows (X, y) given: the exact Newton step of the
    ``newton`` method, computed directly (a meta-task's subset is small)."""
    theta64 = torch.as_tensor(theta).to(torch.float64)
    kind = config.hessian_kind(recipe, theta64.numel())
    _, grad = tabular.objective_gradient(recipe, theta64, X, y, C)
    H = objective_hessian(recipe, theta64, X, y, C, kind)
    base = NewtonUnlearning(config)._base_damping(recipe, X.shape[1], C, kind)
    L, _ = factor(H, base)
    n_out = tabular.param_shapes(recipe, X.shape[1], C)[-1][1][0]
    return (-_shift_free(torch.cholesky_solve(grad[:, None], L)[:, 0], n_out)).numpy()


class L2ULN:
    """L2UL-N: a learned, gated correction of the Newton step (module docstring)."""

    approximates_retraining = True

    def __init__(self, config: L2ULNConfig | None = None):
        self.config = config or L2ULNConfig()

    def _newton(self, validation: bool = False) -> NewtonUnlearning:
        method = NewtonUnlearning(self.config.newton_config())
        return method.for_validation() if validation else method

    def for_validation(self) -> L2ULN:
        clone = type(self)(self.config)
        clone._validation = True  # type: ignore[attr-defined]
        return clone

    @staticmethod
    def _inputs(delta_over_rho: np.ndarray, theta: np.ndarray) -> np.ndarray:
        return np.concatenate([np.atleast_2d(delta_over_rho), np.atleast_2d(theta)], 1).astype(np.float32)

    @staticmethod
    def _correct(state: L2ULNState, delta: np.ndarray, rho: float, theta: np.ndarray) -> np.ndarray:
        """rho * mean over live units of N_U(Delta_N / rho, theta): the correction before the gate."""
        if not state.unlearners:
            return np.zeros_like(delta)
        x = L2ULN._inputs(delta / rho, theta)
        return rho * np.mean([nu.predict(x)[0] for nu in state.unlearners.values()], axis=0)

    # ------------------------------------------------------------------ prepare
    def prepare(self, problem: TabularProblem) -> UnlearningResult:
        cfg, recipe = self.config, problem.recipe
        X, y, C = problem.X, np.asarray(problem.y), problem.n_classes
        rows = np.nonzero(np.asarray(problem.retain_mask, dtype=bool))[0]
        theta = torch.as_tensor(problem.theta).detach().to(torch.float32).cpu().reshape(-1)
        P = tabular.param_count(recipe, X.shape[1], C)
        if theta.numel() != P:
            raise ValueError(f"L2UL-N needs a single {recipe.family} theta of {P} parameters, got {theta.numel()}")
        U = cfg.units
        if len(rows) < 8 * U:
            raise ValueError(f"L2UL-N with {U} units needs at least {8 * U} training rows")
        timings: dict[str, float] = {}
        t0 = time.perf_counter()
        newton = self._newton().prepare(problem)
        timings["newton_prepare_s"] = time.perf_counter() - t0

        rng = np.random.default_rng(cfg.seed)
        blocks = [np.sort(b) for b in np.array_split(rng.permutation(rows), U)]
        unit_of_row = np.full(len(y), NO_UNIT, np.int16)
        for u, block in enumerate(blocks):
            unit_of_row[block] = u
        s = min(cfg.subset_size or (3000 if recipe.family == "mlp" else 1000), min(len(b) for b in blocks) - 1)
        t0 = time.perf_counter()
        meta, meta_info = generate_meta_set(
            recipe, X, y, C, rows, m=cfg.m, s=s, min_forget=cfg.min_forget,
            max_forget_fraction=cfg.max_forget_fraction, seed=cfg.seed + 1, workers=cfg.workers,
            progress=lambda f, msg: problem.progress(0.05 + 0.6 * f, msg), blocks=blocks,
        )  # fmt: skip
        timings["meta_training_s"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        problem.progress(0.7, f"Newton steps on {meta.m} meta-tasks")
        ncfg = cfg.newton_config()
        inputs = np.zeros((meta.m, 2 * P), np.float32)
        targets = np.zeros((meta.m, P), np.float32)
        newton_ratio = []
        for j in range(meta.m):
            keep = np.setdiff1d(meta.task_rows[j], meta.forget(j))
            k = len(meta.task_rows[j]) - len(keep)
            rho = k / len(keep)
            delta = newton_step(recipe, torch.from_numpy(meta.theta[j]), X[keep], y[keep], C, ncfg)
            full = meta.theta_r[j].astype(np.float64) - meta.theta[j]
            inputs[j] = self._inputs(delta / rho, meta.theta[j])[0]
            targets[j] = (full - delta) / rho
            newton_ratio.append(float(np.linalg.norm(full - delta) / max(np.linalg.norm(full), 1e-30)))
        timings["task_newton_s"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        problem.progress(0.8, f"fitting N_U for {U} units")
        unit_of_task = np.arange(meta.m) % U
        unlearners, fit_info = {}, {}
        for u in range(U):
            mine = unit_of_task == u
            nu = Unlearner(cfg.unlearner_config(), 2 * P, P)
            fit_info[str(u)] = nu.fit(inputs[mine], targets[mine])
            unlearners[u] = nu
        timings["unlearner_fit_s"] = time.perf_counter() - t0
        state = L2ULNState(unit_of_row, unlearners, {})

        t0 = time.perf_counter()
        problem.progress(0.9, "fitting the gate on full-data retrains")
        gate, calib = self._calibrate(problem, rows, theta, state, newton.artifacts)
        timings["calibration_s"] = time.perf_counter() - t0
        held_out = [i["val_param_ratio_median"] for i in fit_info.values() if "val_param_ratio_median" in i]
        state.meta = {"config": {**asdict(cfg), "hidden": list(cfg.hidden)}, "gate": gate, "n_params": P,
                      "units_prepared": U, "units_dropped": [], "requests": 0}  # fmt: skip
        artifacts = {
            ARTIFACT_UNITS: state.to_bytes(),
            ARTIFACT_NEWTON: newton.artifacts[NEWTON_ARTIFACT],
            ARTIFACT_STATE: json.dumps({"gate": gate}).encode(),
        }
        WARM.put(artifacts[ARTIFACT_UNITS], state)
        info: dict[str, Any] = {
            "method": "l2ul_n",
            "stage": "prepare",
            "units": U,
            "timings": timings,
            "meta": meta_info,
            "task_newton_param_ratio_median": float(np.median(newton_ratio)),
            # held-out tasks: ||correction - target|| / ||target||, i.e. how much of Newton's miss N_U leaves
            "held_out_task_correction_ratio_median": float(np.median(held_out)) if held_out else None,
            "calibration": calib,
            "gate": gate,
            "artifact_bytes": {k: len(v) for k, v in artifacts.items()},
        }
        if gate == 0.0:
            info["note"] = "gate 0: on full-data retrains the correction did not help; L2UL-N is the Newton step"
        return UnlearningResult(theta=theta, info=info, artifacts=artifacts)

    def _calibrate(self, problem, rows, theta, state, newton_artifacts) -> tuple[float, dict[str, Any]]:
        """g = argmin sum_j ||Delta_N_j + g a_j - D_j||^2 / ||D_j||^2 over full-data deletions, clipped to [0, 1];
        a_j = the ungated correction, D_j = theta_r_j - theta."""
        cfg, recipe = self.config, problem.recipe
        X, y, C = problem.X, np.asarray(problem.y), problem.n_classes
        if cfg.calibration_tasks == 0:
            return 0.0, {"tasks": 0}
        rng = np.random.default_rng([cfg.seed, 7331])
        n = len(rows)
        sizes = [min(k, max(1, int(cfg.max_forget_fraction * n))) for k in (1, 10, 100, 1000)]
        theta_np = theta.numpy().astype(np.float64)
        newton = self._newton(validation=True)
        num = den = 0.0
        per_task, pairs = [], []
        for j in range(cfg.calibration_tasks):
            k = sizes[j % len(sizes)]
            f = rng.choice(rows, k, replace=False)
            forget = np.zeros(len(y), bool)
            forget[f] = True
            retain = np.asarray(problem.retain_mask, dtype=bool) & ~forget
            case = replace(
                problem,
                retain_mask=retain,
                forget_mask=forget,
                artifacts={NEWTON_ARTIFACT: newton_artifacts[NEWTON_ARTIFACT]},
            )
            delta = newton.unlearn(case).theta.numpy().astype(np.float64) - theta_np
            D = tabular.train(recipe, X[retain], y[retain], C).numpy().astype(np.float64) - theta_np
            a = self._correct(state, delta, k / (n - k), theta_np)
            d2 = float(D @ D)
            if d2 <= 0:
                continue
            e = D - delta
            num += float(a @ e) / d2
            den += float(a @ a) / d2
            pairs.append((a, e, d2))
            per_task.append({"forget": int(k), "newton_ratio": float(np.sqrt(e @ e / d2))})
        gate = float(np.clip(num / den, 0.0, 1.0)) if den > 0 else 0.0
        for (a, e, d2), rec in zip(pairs, per_task, strict=True):
            rec["ratio_gated"] = float(np.linalg.norm(e - gate * a) / np.sqrt(d2))
            rec["ratio_ungated"] = float(np.linalg.norm(e - a) / np.sqrt(d2))
        return gate, {"tasks": len(per_task), "gate": gate, "per_task": per_task}

    # ------------------------------------------------------------------ purge
    @staticmethod
    def _drop(state: L2ULNState, gone: np.ndarray) -> tuple[L2ULNState, list[int]]:
        hit = sorted({int(u) for u in state.unit_of_row[gone] if u != NO_UNIT} & set(state.unlearners))
        unit_of_row = state.unit_of_row.copy()
        unit_of_row[gone] = NO_UNIT
        unit_of_row[np.isin(unit_of_row, hit)] = NO_UNIT
        meta = {**state.meta, "units_dropped": [*state.meta.get("units_dropped", []), *hit]}
        return L2ULNState(unit_of_row, {u: v for u, v in state.unlearners.items() if u not in hit}, meta), hit

    @staticmethod
    def _load(artifacts: dict[str, bytes]) -> L2ULNState:
        missing = [a for a in ARTIFACT_NAMES if a not in artifacts]
        if missing:
            raise ValueError(f"L2UL-N is not prepared for this model (missing {missing}); run prepare first")
        return WARM.get(artifacts[ARTIFACT_UNITS], L2ULNState.from_bytes)

    def purge(self, problem: TabularProblem) -> UnlearningResult:
        """Rows another method erased: the Newton state purged by Newton, the units that held them dropped."""
        t0 = time.perf_counter()
        state = self._load(problem.artifacts)
        present = np.asarray(problem.retain_mask, dtype=bool)
        gone = np.nonzero(np.asarray(problem.forget_mask, dtype=bool) | ((state.unit_of_row != NO_UNIT) & ~present))
        new, hit = self._drop(state, gone[0])
        res = self._newton().purge(replace(problem, artifacts={NEWTON_ARTIFACT: problem.artifacts[ARTIFACT_NEWTON]}))
        info: dict[str, Any] = {"method": "l2ul_n", "stage": "purge", "units_dropped": hit,
                                "units_remaining": len(new.unlearners)}  # fmt: skip
        if res.info.get("needs_prepare"):
            info["needs_prepare"] = res.info["needs_prepare"]
            return UnlearningResult(theta=torch.as_tensor(problem.theta), info=info)
        artifacts = {
            **problem.artifacts,
            ARTIFACT_UNITS: new.to_bytes(),
            ARTIFACT_NEWTON: res.artifacts[NEWTON_ARTIFACT],
        }
        WARM.put(artifacts[ARTIFACT_UNITS], new)
        info["purge_seconds"] = time.perf_counter() - t0
        return UnlearningResult(theta=torch.as_tensor(problem.theta), info=info, artifacts=artifacts)

    # ------------------------------------------------------------------ one request
    def unlearn(self, problem: TabularProblem) -> UnlearningResult:
        validation = getattr(self, "_validation", False)
        state = self._load(problem.artifacts)
        theta = torch.as_tensor(problem.theta).detach().to(torch.float32).cpu().reshape(-1)
        theta_np = theta.numpy().astype(np.float64)
        case = replace(problem, artifacts={NEWTON_ARTIFACT: problem.artifacts[ARTIFACT_NEWTON]})
        res = self._newton(validation).unlearn(case)  # the step and (served) the Newton state's upkeep
        delta = res.theta.numpy().astype(np.float64) - theta_np
        k, n = int(res.info["rows_forgotten"]), int(res.info["rows_before"])
        rho = k / (n - k)
        t0 = time.perf_counter()
        gate = float(state.meta.get("gate", 0.0))
        correction = gate * self._correct(state, delta, rho, theta_np) if gate > 0 else np.zeros_like(delta)
        theta_new = torch.from_numpy((theta_np + delta + correction).astype(np.float32))
        correct_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        forget = np.nonzero(np.asarray(problem.forget_mask, dtype=bool))[0]
        new, hit = self._drop(state, forget)
        new.meta["requests"] = int(new.meta.get("requests", 0)) + 1
        artifacts = {
            **problem.artifacts,
            ARTIFACT_UNITS: new.to_bytes(),
            ARTIFACT_NEWTON: res.artifacts[NEWTON_ARTIFACT],
        }
        WARM.put(artifacts[ARTIFACT_UNITS], new)
        purge_s = time.perf_counter() - t0
        newton_info = {k_: v for k_, v in res.info.items() if k_ not in ("config",)}
        info: dict[str, Any] = {
            "method": "l2ul_n",
            "rows_forgotten": k,
            "rows_before": n,
            "gate": gate,
            "units_answering": len(state.unlearners),
            "units_dropped": hit,
            "units_remaining": len(new.unlearners),
            "correction_norm": float(np.linalg.norm(correction)),
            "newton_step_norm": float(np.linalg.norm(delta)),
            "method_seconds": float(res.info["method_seconds"]) + correct_s,
            "correction_seconds": correct_s,
            "purge_seconds": purge_s + float(res.info.get("purge_seconds", 0.0)),
            "newton": newton_info,
        }
        if not new.unlearners:
            info["note"] = (
                "every L2UL-N unit held an erased row and was dropped with it: from now on the answer is the Newton "
                "step alone (its worst case); prepare L2UL-N again to restore the correction"
            )
        return UnlearningResult(theta=theta_new, info=info, artifacts=artifacts)

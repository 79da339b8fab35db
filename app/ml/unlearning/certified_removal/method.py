"""The ``certified_removal`` method: a perturbed model kept as method state, removals by Guo et al.'s Algorithm 2.

Preparation trains the model the guarantee speaks of: the minimiser of the PERTURBED objective L_b on the training
rows, b ~ N(0, σ²) drawn from OS entropy (certified.py, Theorem 3). That model, b and the budget spent are the
method's state (artifact store, never published: b must stay secret). Version 1 of the registration is the plain
recipe; the first ``certified_removal`` deletion publishes the perturbed model with the rows removed, so every
version this method publishes is the output of Algorithm 2.

Each deletion: one Newton step on the perturbed retained objective, charged to the residual budget ε′; when the
charge would exceed it, an exact retrain with FRESH noise (certified.remove). The version's info carries (ε, δ), the
charge, the budget spent and whether it retrained; the certificate states them.

Erasure by another method (``purge``): the state model trained on the erased rows is a copy of them, so it is
replaced by a fresh perturbed fit on the remaining rows (new noise, budget restarted): an exact removal, not a step.
"""

from __future__ import annotations

import io
import json
import time

import numpy as np
import torch

from app.ml.unlearning import certified
from app.ml.unlearning.base import TabularProblem, UnlearningResult

ARTIFACT_THETA = "perturbed_theta.npy"
ARTIFACT_NOISE = "noise.npy"
ARTIFACT_STATE = "certified_state.json"


def _npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(array), allow_pickle=False)
    return buffer.getvalue()


def _load(data: bytes) -> np.ndarray:
    return np.load(io.BytesIO(data), allow_pickle=False)


class CertifiedRemoval:
    def __init__(self, config: certified.CertifiedRemovalConfig | None = None):
        self.config = config or certified.CertifiedRemovalConfig()

    def _fresh(self, problem: TabularProblem, stage: str) -> UnlearningResult:
        """A perturbed fit on the retained rows with new noise: the state a preparation or a purge leaves."""
        retain = np.asarray(problem.retain_mask, bool)
        started = time.perf_counter()
        b = certified.draw_noise(self.config, int(torch.as_tensor(problem.theta).numel()))
        theta, info = certified.fit_perturbed(
            problem.recipe, problem.X[retain], problem.y[retain], problem.n_classes, b
        )
        state = {"spent": info["residual"], "requests": 0, "retrains": 0}
        facts = {
            "method": "certified_removal",
            "stage": stage,
            "epsilon": self.config.epsilon,
            "delta": self.config.delta,
            "residual_budget": self.config.residual_budget,
            "noise_std": certified.noise_std(self.config),
            "spent": info["residual"],
            "solver": {k: info[k] for k in ("status", "iterations", "grad_max") if k in info},
            "wall_time_s": time.perf_counter() - started,
        }
        return UnlearningResult(theta=theta, info=facts, artifacts=self._save(theta, b, state))

    def prepare(self, problem: TabularProblem) -> UnlearningResult:
        try:
            certified.check_recipe(problem.recipe, problem.n_classes)
        except ValueError as exc:
            return UnlearningResult(theta=problem.theta, info={"refused": str(exc)})
        return self._fresh(problem, "prepare")

    def purge(self, problem: TabularProblem) -> UnlearningResult:
        return self._fresh(problem, "purge")

    def unlearn(self, problem: TabularProblem) -> UnlearningResult:
        if ARTIFACT_NOISE not in problem.artifacts:
            raise ValueError("certified_removal is not prepared for this model; run prepare first")
        theta, b = _load(problem.artifacts[ARTIFACT_THETA]), _load(problem.artifacts[ARTIFACT_NOISE])
        state = json.loads(problem.artifacts[ARTIFACT_STATE])
        forget = np.asarray(problem.forget_mask, bool) & ~np.asarray(problem.tombstone_mask, bool)
        started = time.perf_counter()
        step = certified.remove(
            problem.recipe, theta, problem.X, problem.y, problem.retain_mask, forget, b, state["spent"], self.config
        )
        state = {
            "spent": step.spent_after,
            "requests": state["requests"] + 1,
            "retrains": state["retrains"] + int(step.retrained),
        }
        guarantee = {
            "epsilon": step.epsilon,
            "delta": step.delta,
            "budget": step.budget,
            "spent": step.spent_after,
            "charge": step.residual_bound,
            "exact_residual": step.exact_residual,
            "retrained": step.retrained,
            "requests_since_prepare": state["requests"],
            "retrains_since_prepare": state["retrains"],
            "mechanism": "Guo et al. 2020, Theorem 3 / Algorithm 2 (objective perturbation, Gaussian noise)",
        }
        info = {
            "method": "certified_removal",
            "rows_forgotten": int(forget.sum()),
            "certified_removal": guarantee,
            "terms": step.terms,
            "method_seconds": time.perf_counter() - started,
        }
        artifacts = self._save(step.theta, step.b, state)
        return UnlearningResult(theta=step.theta, info=info, artifacts=artifacts)

    @staticmethod
    def evidence_parts(before: dict[str, bytes], after: dict[str, bytes]) -> list[dict]:
        """The published model must sit at the optimum of the PERTURBED retained objective (noise ``linear``), not
        the plain one; doing nothing is the state model before this removal."""
        return [
            {
                "part": "perturbed",
                "theta_before": torch.from_numpy(_load(before[ARTIFACT_THETA])),
                "theta_after": torch.from_numpy(_load(after[ARTIFACT_THETA])),
                "rows": None,
                "linear": _load(after[ARTIFACT_NOISE]),
            }
        ]

    @staticmethod
    def _save(theta, b: np.ndarray, state: dict) -> dict[str, bytes]:
        return {
            ARTIFACT_THETA: _npy(torch.as_tensor(theta).detach().cpu().numpy().astype(np.float32)),
            ARTIFACT_NOISE: _npy(np.asarray(b, dtype=np.float64)),
            ARTIFACT_STATE: json.dumps(state, sort_keys=True).encode(),
        }

"""Exact unlearning: train the recipe from scratch on the retained rows only.

This is the reference every approximate method is judged against (notes §1.8 "Retrain"); it also serves class-scope
deletions, since removing every row of a class is just another retain mask.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from app.ml.unlearning.base import TabularProblem, UnlearningResult, register_method

AUTO_PRIORITY_FALLBACK = 10
"""``auto`` falls back to exact retraining when no faster method is prepared for the model."""


@dataclass
class RetrainConfig:
    """Exact retrain has no settings: the recipe stored with the model says how to train."""


class ExactRetrain:
    def __init__(self, config: RetrainConfig | None = None):
        self.config = config or RetrainConfig()

    def unlearn(self, problem: TabularProblem) -> UnlearningResult:
        from app.ml import tabular  # here, not at the top: the API reads this module's registration without torch

        retain = np.asarray(problem.retain_mask, dtype=bool)
        if not retain.any():
            raise ValueError("no rows left to retrain on")
        problem.progress(0.0, f"retraining on {int(retain.sum())} rows")
        start = time.perf_counter()
        theta, solver = tabular.fit(problem.recipe, problem.X[retain], problem.y[retain], problem.n_classes)
        wall = time.perf_counter() - start
        problem.progress(1.0, "retrained")
        info = {
            "method": "retrain",
            "rows_used": int(retain.sum()),
            "rows_forgotten": int(np.asarray(problem.forget_mask, dtype=bool).sum()),
            "wall_time_s": wall,
            "solver": solver,
        }
        return UnlearningResult(theta=theta, info=info)


register_method(
    "retrain",
    RetrainConfig,
    ExactRetrain,
    model_kinds={"tabular"},
    scopes={"samples", "class"},
    auto_priority=AUTO_PRIORITY_FALLBACK,
    exact=True,
)

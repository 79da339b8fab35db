"""Exact unlearning: train the recipe on the retained rows only.

This is the reference every approximate method is judged against (notes §1.8 "Retrain"); it also serves class-scope
deletions, since removing every row of a class is just another retain mask.

A convex recipe (logistic regression with l2 > 0: strictly convex, one optimum) starts from the served θ: the solver
reaches the same unique optimum from any start, in fewer Newton iterations from a nearby one (issue 21; the evidence
check, app/ml/verification/evidence.py, confirms every retrain landed on the retained optimum). The MLP starts from
its seeded initialisation as at registration: its optimum depends on the start.
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
        init = self.warm_start(problem)
        theta, solver = tabular.fit(problem.recipe, problem.X[retain], problem.y[retain], problem.n_classes, init)
        wall = time.perf_counter() - start
        problem.progress(1.0, "retrained")
        info = {
            "method": "retrain",
            "rows_used": int(retain.sum()),
            "rows_forgotten": int(np.asarray(problem.forget_mask, dtype=bool).sum()),
            "wall_time_s": wall,
            "solver": solver,
            "warm_start": init is not None,
        }
        return UnlearningResult(theta=theta, info=info)

    @staticmethod
    def warm_start(problem: TabularProblem):
        """The served θ when the recipe is strictly convex and θ is one model of the recipe's shape, else None."""
        from app.ml import tabular

        recipe = problem.recipe
        if recipe.family != "logistic_regression" or not recipe.l2 > 0:
            return None
        size = tabular.param_count(recipe, problem.X.shape[1], problem.n_classes)
        theta = problem.theta
        return theta if theta is not None and theta.numel() == size else None


register_method(
    "retrain",
    RetrainConfig,
    ExactRetrain,
    model_kinds={"tabular"},
    scopes={"samples", "class"},
    auto_priority=AUTO_PRIORITY_FALLBACK,
    exact=True,
)

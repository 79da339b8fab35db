"""Measured quality of a fast method on real deletions of the full model (issue 10, item 4).

A fast method (Newton, influence, L2UL) predicts what retraining would give; whether it does, on this model, is an
empirical question that a method's own training-time figures cannot answer (L2UL's held-out meta-tasks are s-row
subsets, not the registered table: measured-findings.md, "subset-to-full shift"). So preparation deletes K random
training rows sets from the full model, retrains each exactly (the reference, as the ``retrain`` method would), and
asks each prepared method for the same deletions:

    param_ratio = ||theta' - theta_r|| / ||theta - theta_r||     (0: exact, 1: no better than doing nothing)
    acc_gap_pts = 100 * (accuracy(theta_r) - accuracy(theta'))   on the evaluation rows (held out of training)

Medians over the K deletions are stored with the method and read by ``choose_method`` (``auto``). Softmax output
biases are centred first (tabular.center_output_bias): the objective is flat along their shared shift.

The references are computed once per preparation and shared by every method, and the determinism probe
(newton/probe.py) reuses their one-row deletions, so a preparation pays K trainings in all.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from app.ml import tabular
from app.ml.unlearning.base import TabularProblem, UnlearningMethod

DEFAULT_SIZES = (1, 1, 100, 1000)
"""|D_f| of the K reference deletions: two single rows (they are also the determinism probe's) and two larger
requests (capped at MAX_SIZE_FRACTION of the rows), since a step's error grows with |D_f| (Guo et al. 2020's bound
is O(k^2 / n^2)): the median then sits between a one-row and a 100-row deletion's error."""
MAX_SIZE_FRACTION = 0.01
"""A reference deletion takes at most this share of the training rows (small tables in tests and the demo)."""


@dataclass
class ReferenceDeletion:
    """One real deletion of the full model and its exact retrain."""

    rows: np.ndarray  # positions deleted (training rows)
    theta_r: torch.Tensor
    retrain_seconds: float
    solver: dict[str, Any]


def reference_deletions(
    recipe: tabular.TabularRecipe,
    X: np.ndarray,
    y: np.ndarray,
    n_classes: int,
    retain_mask: np.ndarray,
    sizes: tuple[int, ...] = DEFAULT_SIZES,
    seed: int = 0,
) -> list[ReferenceDeletion]:
    """Random forget sets of the given sizes among the training rows (capped at MAX_SIZE_FRACTION of them), each
    retrained from scratch with the model's recipe."""
    retain = np.asarray(retain_mask, dtype=bool)
    rows = np.nonzero(retain)[0]
    cap = max(1, int(MAX_SIZE_FRACTION * len(rows)))
    rng = np.random.default_rng([seed, 4049])
    out = []
    for k in sizes:
        f = np.sort(rng.choice(rows, min(int(k), cap), replace=False))
        keep = retain.copy()
        keep[f] = False
        start = time.perf_counter()
        theta_r, solver = tabular.fit(recipe, X[keep], np.asarray(y)[keep], n_classes)
        out.append(ReferenceDeletion(f, theta_r, time.perf_counter() - start, solver))
    return out


def param_ratio(
    recipe: tabular.TabularRecipe, n_features: int, n_classes: int, theta_new, theta, theta_r
) -> float | None:
    """||theta' - theta_r|| / ||theta - theta_r|| (softmax biases centred); None when the retrain did not move."""

    def c(t) -> torch.Tensor:
        return tabular.center_output_bias(recipe, torch.as_tensor(t), n_features, n_classes).to(torch.float64)

    moved = float((c(theta) - c(theta_r)).norm())
    return float((c(theta_new) - c(theta_r)).norm()) / moved if moved > 0 else None


def validate(
    method: UnlearningMethod,
    problem: TabularProblem,
    references: list[ReferenceDeletion],
    eval_mask: np.ndarray,
) -> dict[str, Any]:
    """Run ``method`` (prepared: ``problem.artifacts``) on every reference deletion of ``problem``'s model and
    compare with the retrain. Each deletion starts from the same prepared state; the method's state upkeep (its
    purge) is not part of the answer, so a method may offer ``for_validation()`` to skip it."""
    runner = method.for_validation() if hasattr(method, "for_validation") else method
    recipe, X, y, C = problem.recipe, problem.X, np.asarray(problem.y), problem.n_classes
    retain = np.asarray(problem.retain_mask, dtype=bool)
    evaluate = np.asarray(eval_mask, dtype=bool)
    theta = torch.as_tensor(problem.theta).detach().float().cpu()
    ratios, gaps, seconds, walls, unchanged = [], [], [], [], []
    for ref in references:
        forget = np.zeros(len(y), bool)
        forget[ref.rows] = True
        case = replace(problem, retain_mask=retain & ~forget, forget_mask=forget, progress=problem.progress)
        start = time.perf_counter()
        result = runner.unlearn(case)
        walls.append(time.perf_counter() - start)
        seconds.append(float(result.info.get("method_seconds", walls[-1])))
        ratios.append(param_ratio(recipe, X.shape[1], C, result.theta, theta, ref.theta_r))
        rows = evaluate & ~forget
        gaps.append(
            100.0
            * (
                tabular.accuracy(recipe, ref.theta_r, X[rows], y[rows], C)
                - tabular.accuracy(recipe, result.theta, X[rows], y[rows], C)
            )
        )
        unchanged.append(bool(torch.equal(result.theta.float(), theta)))
    measured = [r for r in ratios if r is not None]
    return {
        "deletions": len(references),
        "sizes": [int(len(ref.rows)) for ref in references],
        "param_ratios": ratios,
        "param_ratio_median": float(np.median(measured)) if measured else None,
        "acc_gap_pts": gaps,
        "acc_gap_pts_median": float(np.median(gaps)) if gaps else None,
        "method_seconds": seconds,
        "method_seconds_median": float(np.median(seconds)) if seconds else None,
        "wall_seconds_median": float(np.median(walls)) if walls else None,
        "retrain_seconds_median": float(np.median([ref.retrain_seconds for ref in references])),
        "equals_do_nothing": bool(unchanged) and all(unchanged),
        "eval_rows": int(evaluate.sum()),
    }

"""Determinism probe (issue 10, item 2): is retraining this recipe a well-posed target for a Newton step?

A Newton / influence step predicts where retraining lands by local curvature. That is only meaningful when retraining
itself is a smooth function of the data: a convex recipe, or an MLP regularised and trained to a well-separated
minimum. measured-findings.md ("MLP: retraining from scratch is chaotic under the current recipe") shows the
service's default MLP (l2 = 1e-4, 100 iterations) is not: deleting one row moves the retrain by half of ||theta||,
a different basin each time. The probe measures it directly: retrain after deleting one random row (``n_probes``
times, different rows) and compare the Newton prediction (exact Hessian, Guo et al. 2020's step with the true
gradient residual) with the retrain:
    param_ratio = ||theta' - theta_r|| / ||theta - theta_r||   (softmax biases centred, tabular.center_output_bias).
A ratio near or above 1 means the step explains nothing of the retrain's move: the recipe is reported ``chaotic``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from app.ml import tabular
from app.ml.unlearning.base import TabularProblem
from app.ml.unlearning.newton.method import NewtonConfig, NewtonUnlearning

CHAOTIC_PARAM_RATIO = 0.5
"""A recipe is chaotic when, for any probed row, the Newton prediction misses the retrain by at least half of the
retrain's own move. Well-posed recipes measure 1e-4 to a few 1e-2 (LR, an MLP at l2 = 1e-2 trained to convergence);
chaotic ones about 1 and more (the unconverged l2 = 1e-4 MLP)."""
PROBE_EXACT_HESSIAN_MAX_PARAMS = 1 << 30
"""The probe always uses the exact Hessian: a Gauss-Newton miss would be the approximation's fault, not the recipe's."""


def determinism_probe(
    recipe: tabular.TabularRecipe,
    X: np.ndarray,
    y: np.ndarray,
    n_classes: int,
    retain_mask: np.ndarray,
    n_probes: int = 2,
    seed: int = 0,
    threshold: float = CHAOTIC_PARAM_RATIO,
    theta: torch.Tensor | None = None,
    retrained: Sequence[tuple[int, torch.Tensor, dict[str, Any]]] | None = None,
) -> dict[str, Any]:
    """Train on ``retain_mask`` rows, then ``n_probes`` times delete one random row, retrain, and compare the Newton
    prediction with the retrain. Costs n_probes + 1 trainings. Returns the verdict and the figures behind it.

    A caller that already holds the model trained on ``retain_mask`` (``theta``: the service's version 1, the same
    deterministic fit) and one-row retrains (``retrained``: (row, theta_r, solver info), e.g. the validation's
    reference deletions, app/ml/unlearning/validation.py) passes them and pays no training here."""
    start = time.perf_counter()
    y = np.asarray(y)
    retain = np.asarray(retain_mask, dtype=bool)
    rows = np.nonzero(retain)[0]
    if retrained is None and (n_probes < 1 or len(rows) <= n_probes):
        raise ValueError("need n_probes >= 1 and more retained rows than probes")
    if retrained is not None and not retrained:
        raise ValueError("the probe needs at least one one-row retrain")
    d = X.shape[1]

    def centred(theta: torch.Tensor) -> torch.Tensor:
        return tabular.center_output_bias(recipe, theta, d, n_classes).to(torch.float64)

    if theta is None:
        theta, fit_info = tabular.fit(recipe, X[retain], y[retain], n_classes)
    else:
        theta = torch.as_tensor(theta).detach().to("cpu", torch.float32).reshape(-1)
        _, grad = tabular.objective_gradient(recipe, theta, X[retain], y[retain], n_classes)
        fit_info = {"status": "given", "grad_max": float(grad.abs().max())}
    method = NewtonUnlearning(
        NewtonConfig(purge="downdate", certify=False, exact_hessian_max_params=PROBE_EXACT_HESSIAN_MAX_PARAMS)
    )
    none = np.zeros(len(y), dtype=bool)
    prepared = method.prepare(TabularProblem(recipe, X, y, n_classes, theta, retain, none, ~retain))
    if retrained is None:
        picks = np.random.default_rng(seed).choice(rows, n_probes, replace=False)
        retrained = [(int(row), None, None) for row in picks]
    ratios, shifts, retrains, statuses, picks = [], [], [], [], []
    for row, theta_r, info_r in retrained:
        forget = none.copy()
        forget[row] = True
        keep = retain & ~forget
        if theta_r is None:
            theta_r, info_r = tabular.fit(recipe, X[keep], y[keep], n_classes)
        picks.append(row)
        problem = TabularProblem(recipe, X, y, n_classes, theta, keep, forget, ~retain, prepared.artifacts)
        predicted = method.unlearn(problem).theta
        moved = float((centred(theta) - centred(theta_r)).norm())
        missed = float((centred(predicted) - centred(theta_r)).norm())
        ratios.append(missed / moved if moved > 0 else (0.0 if missed == 0 else float("inf")))
        shifts.append(moved)
        retrains.append(centred(theta_r))
        statuses.append(info_r["status"])
    pairwise = [float((a - b).norm()) for i, a in enumerate(retrains) for b in retrains[i + 1 :]]
    worst = max(ratios)
    return {
        "chaotic": bool(worst >= threshold),
        "threshold": threshold,
        "param_ratios": ratios,
        "max_param_ratio": worst,
        "rows_deleted": [int(r) for r in picks],
        "retrain_shift": shifts,
        "retrain_pairwise_distance": pairwise,
        "theta_norm": float(centred(theta).norm()),
        "fit_status": fit_info["status"],
        "fit_grad_max": fit_info["grad_max"],
        "retrain_status": statuses,
        "seconds": time.perf_counter() - start,
    }

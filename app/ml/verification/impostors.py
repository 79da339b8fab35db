"""Impostor "methods": parameter vectors that are NOT an unlearning of the forget rows, for testing that the verdict
can fail (issue 20, item 2). The verifier's own adversarial self-check: tests/unit/test_impostors.py and
``python -m bench.verify`` run every impostor through the same evidence and verdict as a real deletion, and every one
must fail in every scenario.

Each impostor takes an ``ImpostorCase`` (the parent θ, the data, the retained and forget masks, the recipe, the exact
retrain when the caller has it) and a random generator, and returns θ′. ``EXACT_IMPOSTORS`` claim to be exact
retraining and are judged as such (an exact method must land on the retained optimum, evidence.py); the others are
judged as approximate methods, the lenient setting.

Strengths are fixed here, before any measurement (never tuned on the verdicts they are scored by): noise at
10⁻⁶, 10⁻⁴ and 10⁻² of ||θ||, scaling by 1 ± 10⁻⁴ and 1 ± 10⁻², half of the exact retrain's displacement (half a
perfect Newton step), and ``ASCENT_STEPS`` steps of gradient ascent on the forget rows' mean loss with step
``ASCENT_LR`` (the usual gradient-ascent unlearning baseline, notes Part 2 §2.5, stopped early).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from app.ml import tabular

ASCENT_STEPS = 3
ASCENT_LR = 0.05


@dataclass
class ImpostorCase:
    recipe: tabular.TabularRecipe
    X: np.ndarray
    y: np.ndarray
    n_classes: int
    theta: torch.Tensor
    retain: np.ndarray  # bool: the rows the new version may learn from
    forget: np.ndarray  # bool: the rows this request deletes (trained on by θ)
    theta_retrained: torch.Tensor | None = None


Impostor = Callable[[ImpostorCase, np.random.Generator], torch.Tensor]


def _f32(theta: torch.Tensor | np.ndarray) -> torch.Tensor:
    return torch.as_tensor(theta).detach().to("cpu", torch.float32).reshape(-1).clone()


def do_nothing(case: ImpostorCase, rng: np.random.Generator) -> torch.Tensor:
    return _f32(case.theta)


def one_ulp(case: ImpostorCase, rng: np.random.Generator) -> torch.Tensor:
    """One parameter moved to the next float32 value: passes "θ changed" and any utility check."""
    out = _f32(case.theta).numpy()
    j = int(rng.integers(out.size))
    out[j] = np.nextafter(out[j], np.float32(np.inf if rng.random() < 0.5 else -np.inf))
    return torch.from_numpy(out)


def noise(scale: float) -> Impostor:
    """Gaussian noise whose norm is ``scale`` · ||θ||: destroys per-example signal without removing anything."""

    def impostor(case: ImpostorCase, rng: np.random.Generator) -> torch.Tensor:
        th = _f32(case.theta).to(torch.float64)
        e = torch.from_numpy(rng.standard_normal(th.numel()))
        return (th + e * (scale * float(th.norm()) / float(e.norm()))).to(torch.float32)

    return impostor


def scaled(factor: float) -> Impostor:
    def impostor(case: ImpostorCase, rng: np.random.Generator) -> torch.Tensor:
        return (_f32(case.theta).to(torch.float64) * factor).to(torch.float32)

    return impostor


def retrained(case: ImpostorCase) -> torch.Tensor:
    """The exact retrain on the retained rows (computed once per case and kept)."""
    if case.theta_retrained is None:
        case.theta_retrained = tabular.train(case.recipe, case.X[case.retain], case.y[case.retain], case.n_classes)
    return case.theta_retrained


def half_step(case: ImpostorCase, rng: np.random.Generator) -> torch.Tensor:
    """Half of the way to the exact retrain: half a perfect Newton step."""
    th = _f32(case.theta).to(torch.float64)
    return (th + 0.5 * (retrained(case).to(torch.float64) - th)).to(torch.float32)


def gradient_ascent(case: ImpostorCase, rng: np.random.Generator) -> torch.Tensor:
    """A few steps up the forget rows' mean loss (without the penalty): the gradient-ascent baseline, stopped early."""
    th = _f32(case.theta).to(torch.float64)
    Xf, yf = case.X[case.forget], case.y[case.forget]
    mask = tabular.regularisation_mask(case.recipe, case.X.shape[1], case.n_classes)
    for _ in range(ASCENT_STEPS):
        _, g = tabular.objective_gradient(case.recipe, th, Xf, yf, case.n_classes)
        th = th + ASCENT_LR * (g - case.recipe.l2 * mask * th)
    return th.to(torch.float32)


def retrain_other_rows(case: ImpostorCase, rng: np.random.Generator) -> torch.Tensor:
    """An exact retrain that removed as many OTHER training rows (rows whose features or label differ from every
    forget row's) and kept the forget rows: a deletion of the wrong rows."""
    forget = np.flatnonzero(case.forget)
    candidates = np.flatnonzero(case.retain)
    rows = case.X[forget]
    same = np.zeros(len(candidates), bool)
    for i in forget:  # duplicates of a forget row are the same data: removing one is not "the wrong row"
        same |= (case.X[candidates] == case.X[i]).all(axis=1) & (case.y[candidates] == case.y[i])
    candidates = candidates[~same]
    wrong = rng.choice(candidates, size=len(rows), replace=False)
    keep = case.retain | case.forget
    keep[wrong] = False
    return tabular.train(case.recipe, case.X[keep], case.y[keep], case.n_classes, init=case.theta)


def retrain_kept_rows(case: ImpostorCase, rng: np.random.Generator) -> torch.Tensor:
    """An exact retrain that forgot to drop the rows (trained on retained ∪ forget again)."""
    keep = case.retain | case.forget
    return tabular.train(case.recipe, case.X[keep], case.y[keep], case.n_classes, init=case.theta)


IMPOSTORS: dict[str, Impostor] = {
    "do_nothing": do_nothing,
    "one_ulp": one_ulp,
    "noise_1e-6": noise(1e-6),
    "noise_1e-4": noise(1e-4),
    "noise_1e-2": noise(1e-2),
    "scale_1+1e-4": scaled(1 + 1e-4),
    "scale_1-1e-4": scaled(1 - 1e-4),
    "scale_1+1e-2": scaled(1 + 1e-2),
    "scale_1-1e-2": scaled(1 - 1e-2),
    "half_newton_step": half_step,
    "gradient_ascent": gradient_ascent,
    "retrain_other_rows": retrain_other_rows,
    "retrain_kept_rows": retrain_kept_rows,
}
EXACT_IMPOSTORS = frozenset({"retrain_other_rows", "retrain_kept_rows"})
"""Impostors that claim to be exact retraining: judged with ``exact=True``."""

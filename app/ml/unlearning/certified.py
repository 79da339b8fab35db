"""Certified removal for L2 logistic regression (Guo, Goldstein, Hannun, van der Maaten 2020, "Certified Data Removal
from Machine Learning Models", ICML): Theorem 3 and Algorithm 2, as pure array code.

What is certified. Training minimises the PERTURBED objective, in Guo's sum form over the current rows D (n rows)
    L_b(theta; D) = sum_i loss_i(theta) + (n l2 / 2) ||weights||^2 + b . theta,    b ~ N(0, sigma^2 I_p) secret,
i.e. n times app/ml/tabular.py's mean objective with ``linear=b`` (biases unpenalised there, so here too). Theorem 3:
if a removal mechanism's output theta^- has gradient residual ||grad L_b(theta^-; D')|| <= eps' (D' = D minus the
removed rows), it is (eps, delta)-certified removal, i.e. indistinguishable from retraining on D' with fresh noise,
when sigma = c eps' / eps with c = sqrt(2 ln(1.5 / delta)). (The proof: theta^- is the exact minimiser of
L_{b - u}(.; D') with u its residual, and N(0, sigma^2) densities at b and b - u differ by at most e^eps outside
probability delta.) Algorithm 2 charges each Newton removal's data-dependent residual bound to a budget beta and,
once beta would exceed eps', retrains from scratch with fresh noise (beta restarts at the retrain's own residual:
a float32 retrain is the exact minimiser for a noise vector shifted by that residual, so the same argument applies).

Limits, stated plainly:
- the guarantee holds for models trained with this perturbation only; the unperturbed Newton step in
  app/ml/unlearning/newton is NOT certified removal (a small residual without noise hides nothing);
- the theorem speaks of ONE release: publishing many versions of one model (one per removal) composes, and that
  composition is not covered;
- b must stay secret: it is model state, stored with the model and never published (knowing b, the residual u is
  computable from theta^- and D', which is exactly the difference the noise has to hide);
- binary logistic regression only (Guo's gamma is for the logistic loss; softmax and MLPs are not handled).

Accounting. A step's charge is Guo's Taylor bound (``residual_bound``) at the model actually published, float32,
plus ||g + H v|| there: the first-order residual its rounding leaves (0 for the exact Newton point; on large tables
it is most of the charge). The Newton step uses the exact gradient of the retained perturbed objective at the current
model, so earlier residuals are corrected, not assumed zero; each step's charge alone then bounds the new residual,
and Algorithm 2's running sum, kept here as the paper has it, is conservative: bench/certified.py measured the
exact residual at 3e-4 of the sum spent after 8 Adult removals and 4e-3 after 328 on 800,000 generated rows, where
the float32 term was ~3,000x the Taylor bound (median 6.6 against 0.002, sum form).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import scipy.linalg
import scipy.special
import torch

from app.ml import tabular

GAMMA = 0.25
"""Guo et al.'s Lipschitz constant for the logistic loss's second derivative, |l''(a) - l''(b)| <= gamma |a - b|.
The true sup of |sigmoid''| is 1/(6 sqrt 3) ~ 0.096, so 1/4 is conservative (by ~2.6x)."""
SPECTRAL_MARGIN = 1.0 + 1e-9
"""||X~||_2 from a float64 eigensolve is inflated by this to cover its rounding (relative error ~1e-13)."""
DEFAULT_RESIDUAL_BUDGET = 2.28
"""eps', sum form: sigma = 10 at (eps, delta) = (1, 1e-4). Chosen by bench/certified.py on the TRAINING split of
Adult only (an inner 80/20 split of it; the test split was not looked at): the largest sigma on a half-decade grid
whose perturbed fits lost at most half a point of inner-validation accuracy (mean of 3 draws; sigma = 30 lost 1.5),
then eps' = sigma eps / c. Larger training sets tolerate larger eps' (the noise enters the mean objective as b / n):
tune it per data set the same way."""


@dataclass
class CertifiedRemovalConfig:
    """(eps, delta) of Theorem 3 and the residual budget eps' of Algorithm 2 (sum-form gradient norm)."""

    epsilon: float = 1.0
    delta: float = 1e-4
    residual_budget: float = DEFAULT_RESIDUAL_BUDGET

    def __post_init__(self) -> None:
        for name in ("epsilon", "delta", "residual_budget"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a finite number > 0; got {value!r}")
        if self.delta >= 1:
            raise ValueError(f"delta must be < 1 (a probability of failure); got {self.delta!r}")


def noise_std(config: CertifiedRemovalConfig) -> float:
    """sigma = c eps' / eps, c = sqrt(2 ln(1.5 / delta)) (Guo et al., Theorem 3, Gaussian form)."""
    return math.sqrt(2.0 * math.log(1.5 / config.delta)) * config.residual_budget / config.epsilon


def draw_noise(config: CertifiedRemovalConfig, p: int, rng: np.random.Generator | int | None = None) -> np.ndarray:
    """b ~ N(0, sigma^2 I_p), float64. ``rng=None`` draws from OS entropy, which is what a real secret needs."""
    return np.random.default_rng(rng).normal(0.0, noise_std(config), int(p))


# ---------------------------------------------------------------------------------------------- helpers
def check_recipe(recipe: tabular.TabularRecipe, n_classes: int) -> None:
    if recipe.family != "logistic_regression" or n_classes != 2:
        raise ValueError(
            "certified removal is implemented for binary logistic regression only (Guo et al.'s gamma "
            f"is for the logistic loss); got family={recipe.family!r}, n_classes={n_classes}"
        )
    if not recipe.l2 > 0:
        raise ValueError("certified removal needs l2 > 0 (a strongly convex objective with a unique minimiser)")


def _vec(theta: Any) -> np.ndarray:
    return np.asarray(torch.as_tensor(theta).detach().cpu(), dtype=np.float64).reshape(-1)


def _xa(X: np.ndarray, v: np.ndarray) -> np.ndarray:
    """[X, 1] v without materialising the appended column (1M-row tables)."""
    return X @ v[:-1] + v[-1]


def spectral_norm(X: np.ndarray) -> float:
    """||[X, 1]||_2 (largest singular value) via the (d+1) x (d+1) Gram matrix's largest eigenvalue, float64.

    Removing rows only lowers it (the Gram matrix loses a PSD term), so a value for a superset of the rows is a valid,
    slightly looser, input to ``residual_bound``: a caller running many removals can compute it once."""
    X = np.asarray(X, dtype=np.float64)
    s = X.sum(0)
    G = np.block([[X.T @ X, s[:, None]], [s[None, :], np.array([[float(len(X))]])]])
    top = scipy.linalg.eigvalsh(G, subset_by_index=[G.shape[0] - 1, G.shape[0] - 1])[0]
    return math.sqrt(max(float(top), 0.0)) * SPECTRAL_MARGIN


def _hessian_sum(recipe: tabular.TabularRecipe, theta: np.ndarray, X: np.ndarray) -> np.ndarray:
    """Exact float64 Hessian of L_b over these rows (sum form): [X,1]^T diag(s) [X,1] + n l2 on the weights, with
    s = sigmoid(z) sigmoid(-z) (b is linear and adds nothing). tabular's own Hessian accumulates in float32, which is
    fine for a solver's direction but not inside a proof."""
    z = _xa(X, theta)
    s = np.exp(-np.logaddexp(0.0, z) - np.logaddexp(0.0, -z))
    Xs = X * s[:, None]
    col = Xs.sum(0)
    H = np.block([[Xs.T @ X, col[:, None]], [col[None, :], np.array([[s.sum()]])]])
    d = X.shape[1]
    H[np.arange(d), np.arange(d)] += len(X) * recipe.l2
    return H


def _grad_sum(
    recipe: tabular.TabularRecipe, theta: np.ndarray, X: np.ndarray, y: np.ndarray, b: np.ndarray
) -> np.ndarray:
    """grad L_b over these rows (sum form), dense float64 numpy: the Newton step's gradient. (``exact_residual`` uses
    tabular's own objective instead, so the reported residual is of the very function ``fit`` minimised; the unit
    tests check that the two agree.)"""
    r = scipy.special.expit(_xa(X, theta)) - y
    g = np.append(X.T @ r, r.sum()) + b
    g[:-1] += len(X) * recipe.l2 * theta[:-1]
    return g


# ---------------------------------------------------------------------------------------------- public API
def fit_perturbed(
    recipe: tabular.TabularRecipe,
    X: np.ndarray,
    y: np.ndarray,
    n_classes: int,
    b: np.ndarray,
    init: Any = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Algorithm A of Theorem 3: the minimiser of L_b(.; D) (tabular.fit with ``linear=b``), float32, plus the solver
    facts and ``residual``, the exact sum-form ||grad L_b|| at the published float32 model (what Algorithm 2 starts
    its budget from)."""
    check_recipe(recipe, n_classes)
    b = _vec(b)
    theta, info = tabular.fit(recipe, X, y, n_classes, init, linear=b)
    info["residual"] = exact_residual(recipe, theta, X, y, n_classes, b)
    return theta, info


def exact_residual(
    recipe: tabular.TabularRecipe, theta: Any, X: np.ndarray, y: np.ndarray, n_classes: int, b: np.ndarray
) -> float:
    """||grad L_b(theta; rows)||_2, sum form, float64 at the given (float32) theta: one pass over the rows."""
    check_recipe(recipe, n_classes)
    _, g = tabular.objective_gradient(recipe, theta, X, y, n_classes, linear=_vec(b))
    return len(X) * float(np.linalg.norm(g.numpy()))


def residual_bound(
    recipe: tabular.TabularRecipe,
    theta: Any,
    theta_new: Any,
    X_retained: np.ndarray,
    spectral: float | None = None,
) -> float:
    """Guo et al.'s data-dependent bound (Corollary 1 form) gamma ||X~||_2 ||a||_inf ||a||_2 on the part of
    ||grad L_b(theta_new; D')|| that a Newton step cannot see; v = theta_new - theta, a = X~ v, X~ = [X, 1]:
        g(theta_new) = [g + H v] + int_0^1 (H(theta + t v) - H(theta)) dt v = [g + H v] + X~^T diag(e) a,
        e_i = int_0^1 (l''(z_i + t a_i) - l''(z_i)) dt,  |e_i| <= gamma |a_i| / 2 <= gamma ||a||_inf  (l'' is
        gamma-Lipschitz; the penalty is quadratic and b . theta linear, so neither leaves a term), hence
        ||X~^T diag(e) a||_2 <= ||X~||_2 ||e||_inf ||a||_2 <= gamma ||X~||_2 ||a||_inf ||a||_2.
    (g, H: gradient and exact Hessian of L_b(.; D') at theta; Guo keeps gamma where the integral gives gamma / 2.)
    For the exact Newton point g + H v = 0. For the float32 model actually published it is not: ``remove`` passes
    that model as ``theta_new`` and adds ||g + H v|| (float32 rounding and the float64 solve), computed exactly.
    ``spectral`` may pass ||X~||_2 of a superset of the rows (``spectral_norm``); None computes it.
    """
    check_recipe(recipe, 2)
    X = np.asarray(X_retained, dtype=np.float64)
    norm = spectral_norm(X) if spectral is None else float(spectral)
    a = _xa(X, _vec(theta_new) - _vec(theta))
    return GAMMA * norm * float(np.abs(a).max()) * float(np.linalg.norm(a))


@dataclass
class RemovalResult:
    """One step of Algorithm 2. ``theta`` (float32) and ``b`` are the new model state; keep ``b`` secret."""

    theta: torch.Tensor
    b: np.ndarray
    retrained: bool
    residual_bound: float  # this Newton step's charge (Taylor bound + ||g + H v||), also when it was not used
    spent_after: float  # the budget used by the model now published
    exact_residual: float  # ||grad L_b(theta; D')||, sum form, at the published theta
    epsilon: float
    delta: float
    budget: float
    terms: dict[str, float] = field(default_factory=dict)  # the charge's parts: taylor (Guo's bound), linear
    fit_info: dict[str, Any] | None = None  # the retrain's solver facts when retrained


def remove(
    recipe: tabular.TabularRecipe,
    theta: Any,
    X: np.ndarray,
    y: np.ndarray,
    retain_mask: np.ndarray,
    forget_mask: np.ndarray,
    b: np.ndarray,
    spent: float,
    config: CertifiedRemovalConfig,
    rng: np.random.Generator | int | None = None,
    spectral: float | None = None,
) -> RemovalResult:
    """Remove the ``forget_mask`` rows from a model trained (with noise ``b``) on ``retain_mask | forget_mask``,
    given the budget ``spent`` so far (Guo et al., Algorithm 2).

    One Newton step on the perturbed retained objective (its exact gradient, b included, and exact float64
    Hessian), published as float32 and charged with ``residual_bound`` at that published model plus ||g + H v|| there
    (the first-order residual that rounding to float32 leaves; 0 for the exact Newton point). If ``spent`` + that
    charge exceeds eps', the step is discarded: the model is retrained from scratch on the retained rows with fresh
    noise (``rng``; None = OS entropy), and ``spent_after`` is the retrain's exact residual. ``spectral``: see
    ``residual_bound``.
    """
    check_recipe(recipe, 2)
    X, y = np.asarray(X), np.asarray(y)
    keep, gone = np.asarray(retain_mask, dtype=bool), np.asarray(forget_mask, dtype=bool)
    if keep.shape != (len(X),) or gone.shape != (len(X),):
        raise ValueError("retain_mask and forget_mask must be boolean vectors with one entry per row of X")
    if (keep & gone).any() or not gone.any() or not keep.any():
        raise ValueError("forget_mask must select at least one row, none of them retained, and some rows must remain")
    if not (math.isfinite(spent) and spent >= 0):
        raise ValueError(f"spent must be a finite number >= 0; got {spent!r}")
    th, b = _vec(theta), _vec(b)
    if b.shape != th.shape:
        raise ValueError(f"b has {b.size} elements, theta has {th.size}")
    Xr, yr = np.asarray(X[keep], dtype=np.float64), y[keep]
    g = _grad_sum(recipe, th, Xr, yr, b)
    H = _hessian_sum(recipe, th, Xr)
    v = -scipy.linalg.cho_solve(scipy.linalg.cho_factor(H), g)
    published = torch.from_numpy(th + v).to(torch.float32)
    v = _vec(published) - th  # the step actually taken
    terms = {"taylor": residual_bound(recipe, th, published, Xr, spectral), "linear": float(np.linalg.norm(g + H @ v))}
    charge = terms["taylor"] + terms["linear"]
    common = dict(epsilon=config.epsilon, delta=config.delta, budget=config.residual_budget, terms=terms)
    if spent + charge <= config.residual_budget:
        exact = exact_residual(recipe, published, Xr, yr, 2, b)
        return RemovalResult(published, b, False, charge, spent + charge, exact, **common)
    b_new = draw_noise(config, th.size, rng)
    theta_r, info = fit_perturbed(recipe, Xr, yr, 2, b_new)
    if info["residual"] > config.residual_budget:
        raise RuntimeError(
            f"the retrained model's own residual {info['residual']:.3g} exceeds the budget eps' = "
            f"{config.residual_budget:.3g}: raise the budget (or the solver's precision)"
        )
    return RemovalResult(theta_r, b_new, True, charge, info["residual"], info["residual"], **common, fit_info=info)

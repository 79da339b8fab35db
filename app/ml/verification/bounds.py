"""A proven distance to the retrained model from the retained objective at theta' (no retraining needed).

Guo et al. 2020 ("Certified data removal", Theorem 1 and its proof) bound the error of the Newton removal step by
the gradient residual ||grad L(theta')|| divided by the objective's strong-convexity constant, taken there as the
L2 weight lambda. That constant is NOT valid for this project's objective (app/ml/tabular.py): the biases are not
penalised, so along the bias coordinates the curvature is the data's alone, p(1 - p) averaged over rows, which tends
to 0 as predictions saturate; for softmax models adding one constant to every class bias leaves the objective
unchanged (direction e), so there is no strong convexity along e at all. mu = l2 would overstate the guarantee.

What ``gradient_norm_bound`` proves (logistic regression, exact arithmetic; float64 rounding margins are added).
L is the retained objective (mean cross-entropy over the retained rows + (l2/2)||weights||^2), g = grad L(theta'),
H' = Hessian of L at theta' (softmax: restricted to e-perp, where g lies), lambda = lambda_min(H') > 0 (curvature
the data actually give the biases, not l2), ||v||_H' = sqrt(v^T H' v), J_i = d logits_i / d theta (softmax: minus
its mean over classes, since a shift shared by all logits leaves p unchanged), rho = max_i ||J_i H'^-1/2|| and
a = 1 (sigmoid) or sqrt(2) (softmax).
1. Curvature is stable near theta'. If ||u - theta'||_H' <= R, row i's (centred) logits move by w with ||w|| <= rho R,
   so each log p_c moves by at most a rho R =: t (softmax: by |w_c| + max|w| <= sqrt(2) ||w||, as the log-sum-exp
   moves by at most max|w|); p(1 - p) has |d log / dz| <= 1, and
   diag(p) - p p^T (the covariance form Var_p(v)) scales between e^-t and e^t when every p_c does. Hence
       e^-t H'  <=  H(u)  <=  e^t H'      (Loewner order; the penalty term only helps).
2. The minimiser is near. L is convex, and e^-t-strongly convex in the H'-norm on that region; if
   2 ||g||_{H'^-1} e^t <= R, L exceeds L(theta') wherever ||u - theta'||_H' is in (2 ||g||_{H'^-1} e^t, R], so the
   minimiser theta* (softmax: the one in theta' + e-perp) lies inside the region.
3. Two bounds follow for delta = theta' - theta*, with Hbar the Hessian averaged along the segment (inside the region,
   so between e^-t H' and e^t H') and g = Hbar delta:
       ||delta|| <= ||delta||_H' / sqrt(lambda) <= e^t ||g||_{H'^-1} / sqrt(lambda)                  (convexity)
       ||delta - H'^-1 g|| <= ||H'^-1/2|| ||(I + E)^-1 - I|| ||g||_{H'^-1} <= (e^t - 1) ||g||_{H'^-1} / sqrt(lambda),
   so ||delta|| <= ||H'^-1 g|| + (e^t - 1) ||g||_{H'^-1} / sqrt(lambda): the remaining Newton step's own length,
   nearly exact when t is small. The smaller of the two is returned as ``bound``.
It bounds the distance to the exact minimiser theta*; the retrained model theta_r is the solver's float32
approximation of it, so ||theta' - theta_r|| <= bound(theta') + bound(theta_r) (the triangle inequality; theta_r's
own gradient is ~0, so its bound is its rounding).

The MLP objective is not convex: a small gradient says theta' is near *a* stationary point, not near the retrain
(which depends on the initialisation and the solver path), so no bound is returned for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import scipy.linalg
import scipy.special
import torch

from app.ml import tabular

RADIUS_FACTORS = (1.001, 1.01, 1.1, 1.5, 2.0, 4.0, 8.0, 16.0, 64.0)
"""Candidate radii R (H'-norm), as multiples of 2 ||g||_{H'^-1}: the first that certifies itself (step 2) gives the
tightest bound, since t grows with R."""
ROUNDING_MARGIN = 1e-12
"""Float64 rounding allowance: g may be off by it times the gradient's typical per-row magnitude, lambda_min shrinks
by it times lambda_max, and the H'^-1 norms grow by it times the condition number."""
SOFTMAX_LOGIT_FACTOR = math.sqrt(2.0)
"""Softmax: centred logits moving by w move each log p_c by at most sqrt(2) ||w|| (module docstring, step 1)."""


def _outputs(recipe: tabular.TabularRecipe, n_features: int, n_classes: int) -> int:
    """1 for sigmoid (binary LR), C for softmax: the length of the last bias in the layout."""
    return tabular.param_shapes(recipe, n_features, n_classes)[-1][1][0]


def _row_norms(A: np.ndarray) -> np.ndarray:
    """Each row's Euclidean norm, as one fused pass (``linalg.norm(axis=1)`` makes two n-by-p temporaries)."""
    return np.sqrt(np.einsum("ij,ij->i", A, A))


ROW_BLOCK = 65_536
"""Rows per block of the bound's float64 passes: [x, 1] of a 1M-row table at once is several 170 MB temporaries
(0.9 s of a deletion's critical path in the stream); a block of 65,536 stays within the caches' reach."""


def _blocks(X: np.ndarray, mask: np.ndarray | None = None, y: np.ndarray | None = None):
    """[x, 1] in float64, ROW_BLOCK rows at a time; ``mask``: only the rows it marks (the retained rows of the whole
    table, without first copying them out of it: a 1M-row table's copy is 80 MB); with ``y``, (block, its labels).
    Each block is written into one buffer whose ones column is set once (a block is valid until the next one)."""
    buffer = None
    for start in range(0, len(X), ROW_BLOCK):
        rows = X[start : start + ROW_BLOCK]
        labels = None if y is None else y[start : start + ROW_BLOCK]
        if mask is not None:
            keep = mask[start : start + ROW_BLOCK]
            rows = rows[keep]
            labels = None if labels is None else labels[keep]
        m = len(rows)
        if m == 0:  # every row of this block is left out
            continue
        if buffer is None:
            buffer = np.ones((min(ROW_BLOCK, len(X)), rows.shape[1] + 1))
        block = buffer[:m]
        block[:, :-1] = rows  # converted to float64 on the way in
        yield block if y is None else (block, labels)


def _hessian_block(H: np.ndarray, Xa: np.ndarray, Z: np.ndarray, k: int, n: int) -> None:
    """Add one block's share of the data Hessian (mean over ``n`` rows) to ``H`` (sigmoid: [d1, d1]; softmax:
    [k, d1, k, d1], the upper class pairs), given the block's logits ``Z`` ([rows] or [rows, k]) at the point."""
    if k == 1:  # only the upper triangle (a symmetric rank-k update: half a general product); _hessian_finish mirrors
        s = np.exp(-np.logaddexp(0.0, Z) - np.logaddexp(0.0, -Z))  # sigmoid(z) sigmoid(-z) without underflow
        A = Xa * np.sqrt(s / n)[:, None]
        H += scipy.linalg.blas.dsyrk(1.0, A.T)  # A.T is Fortran-ordered: no copy; A^T A, upper triangle
        return
    P = np.exp(Z - np.logaddexp.reduce(Z, axis=1, keepdims=True))
    for c in range(k):
        for c2 in range(c, k):
            w = P[:, c] * ((1.0 if c == c2 else 0.0) - P[:, c2]) / n
            H[c, :, c2, :] += (Xa * w[:, None]).T @ Xa


def _hessian_finish(recipe: tabular.TabularRecipe, H: np.ndarray, k: int, d: int) -> np.ndarray:
    """The summed blocks in the flat layout, the penalty added (softmax: the lower class pairs mirrored)."""
    if k == 1:
        H = np.triu(H) + np.triu(H, 1).T  # the blocks filled the upper triangle
        H[np.arange(d), np.arange(d)] += recipe.l2
        return H
    for c in range(k):
        for c2 in range(c + 1, k):
            H[c2, :, c, :] = H[c, :, c2, :].T
    d1 = d + 1
    idx = np.concatenate([np.arange(k * d1).reshape(k, d1)[:, :d].reshape(-1), np.arange(k) * d1 + d])
    H = H.reshape(k * d1, k * d1)[np.ix_(idx, idx)]
    H[np.arange(k * d), np.arange(k * d)] += recipe.l2
    return H


def _augmented(theta: np.ndarray, k: int, d: int) -> np.ndarray:
    """The flat layout as [k, d + 1] rows (weights then bias per output): logits of [x, 1] are ``Xa @ Wa.T``."""
    return np.concatenate([theta[: k * d].reshape(k, d), theta[k * d :, None]], axis=1)


def _softmax_rho(Xa: np.ndarray, T: np.ndarray, k: int, d: int) -> float:
    """max over these rows of ||J_i T||: the rows' logit Jacobians through H'^-1/2, centred over the classes."""
    JT = np.stack([Xa @ T[np.r_[c * d : (c + 1) * d, k * d + c]] for c in range(k)], axis=1)  # [n, C, .]
    JT -= JT.mean(axis=1, keepdims=True)  # a shift shared by all logits leaves p unchanged (module docstring)
    return float(np.sqrt(np.linalg.eigvalsh(JT @ JT.transpose(0, 2, 1))[:, -1].max()))


def _hessian64(
    recipe: tabular.TabularRecipe, theta: np.ndarray, X: np.ndarray, k: int, mask: np.ndarray | None = None
) -> np.ndarray:
    """The LR objective's Hessian at theta in float64 throughout (tabular's own accumulates the Gram matrix in
    float32, fine for a Newton direction, not for a proof), in the flat layout; summed over row blocks (``mask``:
    over the rows it marks)."""
    d = X.shape[1]
    n = int(mask.sum()) if mask is not None else len(X)
    Wa = _augmented(theta, k, d)
    H = np.zeros((d + 1, d + 1)) if k == 1 else np.zeros((k, d + 1, k, d + 1))
    for Xa in _blocks(X, mask):
        _hessian_block(H, Xa, Xa @ Wa[0] if k == 1 else Xa @ Wa.T, k, n)
    return _hessian_finish(recipe, H, k, d)


@dataclass
class RetainedPass:
    """What one pass over the retained rows gives the evidence (evidence.tabular_evidence): the objective's gradient
    at each point asked for, its float64 Hessian at the first, and the rows' mean ||[x, 1]|| (the rounding
    allowance's scale). The same numbers as ``tabular.objective_gradient`` and the passes of
    ``strong_convexity_bound``, up to the order of float64 summation."""

    grads: list[np.ndarray]
    hessian: np.ndarray
    typical_row_norm: float
    rows: int
    max_row_norm: float | None = None


def retained_pass(
    recipe: tabular.TabularRecipe,
    thetas: list[torch.Tensor | np.ndarray],
    X: np.ndarray,
    y: np.ndarray,
    n_classes: int,
    mask: np.ndarray | None = None,
    linear: np.ndarray | torch.Tensor | None = None,
) -> RetainedPass:
    """Logistic regression: the retained objective's gradient at every θ in ``thetas`` (mean cross-entropy +
    (l2/2)||weights||², plus ``linear · θ / n``: ``tabular.objective_gradient``'s objective), its Hessian at
    ``thetas[0]`` and the typical row norm, all in ONE float64 pass over the rows ``mask`` marks, ROW_BLOCK at a
    time: the rows are read, converted and multiplied once for every figure (three passes and two float64 copies of
    the retained rows before: most of a 1M-row deletion's verification)."""
    X, y = np.asarray(X), np.asarray(y)
    d = X.shape[1]
    k = _outputs(recipe, d, n_classes)
    n = int(mask.sum()) if mask is not None else len(X)
    if n == 0:
        raise ValueError("the objective over no rows is undefined")
    ths = [np.asarray(torch.as_tensor(t).detach().cpu(), dtype=np.float64).reshape(-1) for t in thetas]
    W = np.concatenate([_augmented(t, k, d) for t in ths])  # [m k, d + 1]: every point's logits in one product
    H = np.zeros((d + 1, d + 1)) if k == 1 else np.zeros((k, d + 1, k, d + 1))
    G = np.zeros_like(W)
    norms, largest = 0.0, 0.0
    for Xa, labels in _blocks(X, mask, y):
        Z = Xa @ W.T  # [rows, m k]
        if k == 1:
            _hessian_block(H, Xa, Z[:, 0], k, n)
            R = scipy.special.expit(Z) - labels[:, None]  # dloss/dz at each point
        else:
            _hessian_block(H, Xa, Z[:, :k], k, n)
            Zs = Z.reshape(len(Z), len(ths), k)
            R = np.exp(Zs - scipy.special.logsumexp(Zs, axis=2, keepdims=True))
            R[np.arange(len(Z)), :, labels] -= 1.0
            R = R.reshape(len(Z), -1)
        G += R.T @ Xa
        row_norms = _row_norms(Xa)
        norms, largest = norms + float(row_norms.sum()), max(largest, float(row_norms.max()))
    mask_l2 = recipe.l2 * tabular.regularisation_mask(recipe, d, n_classes).numpy()
    lin = None if linear is None else np.asarray(torch.as_tensor(linear), dtype=np.float64).reshape(-1) / n
    grads = []
    for i, th in enumerate(ths):
        g = G[i * k : (i + 1) * k] / n
        flat = np.concatenate([g[:, :d].reshape(-1), g[:, d]]) + mask_l2 * th
        grads.append(flat if lin is None else flat + lin)
    return RetainedPass(grads, _hessian_finish(recipe, H, k, d), norms / n, n, largest)


def strong_convexity_bound(
    recipe: tabular.TabularRecipe,
    theta: torch.Tensor | np.ndarray,
    X: np.ndarray,
    n_classes: int,
    grad: torch.Tensor | np.ndarray,
    others: dict[str, torch.Tensor | np.ndarray] | None = None,
    mask: np.ndarray | None = None,
    computed: RetainedPass | None = None,
) -> dict[str, Any]:
    """The bound of the module docstring for theta, given the retained rows ``X`` and the retained objective's
    gradient ``grad`` at theta (callers that already hold it, such as the Newton method, skip a pass).

    ``mask``: the retained rows are those it marks in ``X`` (no copy of them is made). ``computed``: the Hessian at
    theta and the typical row norm from ``retained_pass`` over the same rows (then only rho's pass is left here).

    ``others``: further gradients of the same objective (at other parameters, e.g. the parent version's); the result's
    ``newton_step_norms`` gives ||H'^-1 g|| for each, the length of the Newton step that the curvature at theta
    would take from there (an estimate of that point's distance to the optimum, first-order exact near theta*).

    Cost: the float64 Hessian (O(n d^2 C^2)), its eigendecomposition (O(p^3)) and rho (O(n C p^2)).
    """
    g = np.asarray(torch.as_tensor(grad).detach().cpu(), dtype=np.float64).reshape(-1)
    grad_norm = float(np.linalg.norm(g))
    if recipe.family != "logistic_regression":
        return {
            "grad_norm": grad_norm,
            "mu": None,
            "bound": None,
            "holds_for": "nothing: the MLP objective is not convex, so a small gradient does not place theta near "
            "the retrained model (retraining reaches an initialisation- and path-dependent stationary point)",
        }
    th = np.asarray(torch.as_tensor(theta).detach().cpu(), dtype=np.float64).reshape(-1)
    X = np.asarray(X)
    d = X.shape[1]
    k = _outputs(recipe, d, n_classes)
    rows = int(mask.sum()) if mask is not None else len(X)
    H = computed.hessian if computed is not None else _hessian64(recipe, th, X, k, mask)
    out: dict[str, Any] = {"grad_norm": grad_norm, "rows": rows}
    Q = np.eye(len(th))
    if k == 1:
        out["holds_for"] = "||theta - theta*||, theta* the exact (unique) minimiser of the retained objective"
    else:
        out["holds_for"] = (
            "||P (theta - theta*)||, P removing the shared class-bias shift e (which leaves the objective unchanged);"
            " equals ||theta - theta*|| when both have the same mean output bias (tabular.center_output_bias)"
        )
        out["mean_bias"] = float(th[k * d :].mean())
        e = np.zeros(len(th))
        e[k * d :] = 1.0
        Q = scipy.linalg.null_space(e[None, :])  # orthonormal basis of e-perp
    H, g = Q.T @ H @ Q, Q.T @ g  # (softmax: g is in e-perp up to rounding; Q^T drops that rounding)
    lam, V = np.linalg.eigh(H)
    lam_min = float(lam[0]) - ROUNDING_MARGIN * float(lam[-1])
    out["mu_at_theta"] = lam_min
    if lam_min <= 0:
        return {**out, "mu": None, "bound": None, "reason": "the Hessian at theta is not positive definite"}
    lam = np.maximum(lam, lam_min)
    penalised = tabular.regularisation_mask(recipe, d, n_classes).numpy()
    if computed is not None:
        typical = computed.typical_row_norm
    else:
        typical = sum(float(_row_norms(Xa).sum()) for Xa in _blocks(X, mask)) / max(rows, 1)
    typical += recipe.l2 * float(np.linalg.norm(penalised * th))
    extra = ROUNDING_MARGIN * typical  # rounding allowance on g (per-row gradient magnitude), carried into the norms
    slack = 1.0 + ROUNDING_MARGIN * float(lam[-1]) / lam_min
    coords = V.T @ g
    step_norm = float(np.linalg.norm(coords / lam)) * slack + extra / lam_min  # ||H'^-1 g||
    g_dual = math.sqrt(float(np.sum(coords**2 / lam))) * slack + extra / math.sqrt(lam_min)  # ||g||_{H'^-1}
    a = 1.0 if k == 1 else SOFTMAX_LOGIT_FACTOR
    out["newton_step_norm"] = step_norm
    if others:
        out["newton_step_norms"] = {
            name: float(
                np.linalg.norm((V.T @ (Q.T @ np.asarray(torch.as_tensor(o), dtype=np.float64).reshape(-1))) / lam)
            )
            for name, o in others.items()
        }

    def certified(rho_h: float, by: str, factors=RADIUS_FACTORS) -> dict[str, Any] | None:
        """The first radius that certifies itself (step 2) with this rho, and the bounds it gives (step 3)."""
        for factor in factors:
            radius = factor * 2.0 * g_dual  # in the H'-norm
            t = a * radius * rho_h
            if t <= math.log(factor):  # 2 ||g||_{H'^-1} e^t <= R, in logs (e^t overflows for a hopeless start)
                by_convexity = math.exp(t) * g_dual / math.sqrt(lam_min)
                by_newton = step_norm + math.expm1(t) * g_dual / math.sqrt(lam_min)
                return {
                    "mu": math.exp(-t) * lam_min,
                    "radius_h_norm": radius,
                    "rho": {"value": rho_h, "by": by, "t": t},
                    "bound_strong_convexity": by_convexity,
                    "bound_newton_step": by_newton,
                    "bound": min(by_convexity, by_newton),
                }
        return None

    # rho_H = max_i ||J_i H'^-1/2|| (J_i: the row's logits' Jacobian): how far a logit moves per unit H'-norm step.
    # ||J_i|| = ||[x_i, 1]|| (each output's logit reads its own block; centring is a projection) and ||H'^-1/2|| <=
    # 1 / sqrt(lambda), so the rows' largest norm over sqrt(lambda) bounds rho without a second pass over the rows;
    # any rho at least the true one keeps steps 1-3 valid. It is used where it certifies at the first radius (then t
    # <= log RADIUS_FACTORS[0] and the bound exceeds the exact rho's by at most (e^t - 1) ||g||_{H'^-1} / sqrt(lambda),
    # 0.1 % of the convexity bound); otherwise the exact rho is computed (one more pass over the rows).
    if computed is not None and computed.max_row_norm is not None:
        by_norms = certified(computed.max_row_norm / math.sqrt(lam_min) * slack, "row norms", RADIUS_FACTORS[:1])
        if by_norms is not None:
            return {**out, **by_norms}
    T = Q @ (V / np.sqrt(lam))  # H'^-1/2 in the flat layout, [p, p or p - 1]
    if k == 1:
        rho_h = max(float(_row_norms(Xa @ T).max()) for Xa in _blocks(X, mask))
    else:
        rho_h = max(_softmax_rho(Xa, T, k, d) for Xa in _blocks(X, mask))
    exact = certified(rho_h * slack, "exact pass")
    if exact is not None:
        return {**out, **exact}
    return {**out, "mu": None, "bound": None, "reason": "the curvature falls too fast within the required radius"}


def gradient_norm_bound(
    recipe: tabular.TabularRecipe,
    theta: torch.Tensor | np.ndarray,
    X: np.ndarray,
    y: np.ndarray,
    n_classes: int,
    retain_mask: np.ndarray,
) -> dict[str, Any]:
    """||grad L_retained(theta)|| and, for logistic regression, the proven ||theta - theta_retrain*|| bound.

    Returns ``{"grad_norm", "mu", "bound" (None for the MLP or when nothing is certified), "holds_for", ...}``;
    see the module docstring for what is proven. One pass over the retained rows for the gradient and one for the
    float64 Hessian (O(n d^2 C^2)), then an eigendecomposition of it.
    """
    retain = np.asarray(retain_mask, dtype=bool)
    if not retain.any():
        raise ValueError("no retained rows: the retained objective is undefined")
    Xr, yr = np.asarray(X)[retain], np.asarray(y)[retain]
    _, grad = tabular.objective_gradient(recipe, theta, Xr, yr, n_classes)
    return strong_convexity_bound(recipe, theta, Xr, n_classes, grad)

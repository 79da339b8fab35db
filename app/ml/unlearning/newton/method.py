"""Newton / influence-function removal (the step of Guo et al. 2020, §3: theta^- = theta + H^-1 Delta), without their
objective perturbation: no (ε, δ) guarantee, so not "certified removal" (app/ml/unlearning/certified.py is).

The objective is the one app/ml/tabular.py minimises, over the rows a model version was trained on (set D, n rows):
    L_D(theta) = (1/n) sum_{i in D} loss_i(theta) + (l2/2) ||weights||^2      (biases unpenalised).
Deleting f (k rows) leaves R = D minus f. Guo et al.'s step assumes theta minimises L_D exactly; here it does not
(a float32 model, a solver tolerance, and after one approximate deletion theta' is *not* the minimiser of L_R), so
the gradient residual r = grad L_D(theta) is stored and used (measured-findings.md, "Sequential requests must use the
true gradient residual"). With per-row sums G_f = sum_{i in f} grad loss_i(theta) the retained gradient needs no pass
over R (the mean's denominator changes from n to n - k):
    grad L_R(theta) = (n r - G_f - k l2 M theta) / (n - k)                  (M: the weight mask)
    H_R(theta_H)    = (n (H_D - l2 M) - sum_{i in f} hess loss_i(theta_H)) / (n - k) + l2 M    (O(k p^2))
with theta_H the point the stored Hessian is at (theta itself unless ``purge="downdate"``, below):
``newton``:    theta' = theta - H_R(theta_H)^-1 grad L_R(theta)   (Cholesky of the downdated matrix, O(p^3); binary LR
               with k <= p / 2: Woodbury's identity in a generalised eigenbasis kept with the state, O(k p^2 + k^3)).
``influence``: theta' = theta - H_D(theta_H)^-1 grad L_R(theta)   (the cached factor: no downdate, O(p^2)).
``exact_steps`` more steps each take one full pass over R for the exact gradient and reuse the factor (chord steps;
they converge linearly at rate ~||I - H^-1 H_R(theta')||, i.e. to retraining's float32 floor in one or two).

Hessian: logistic regression and MLPs of at most ``exact_hessian_max_params`` parameters use the exact Hessian
(app/ml/tabular.py ``data_hessian_sum``); larger MLPs the Gauss-Newton matrix plus ``gauss_newton_damping`` I
(positive definite where the exact Hessian of a non-convex net may not be). Softmax layouts (multi-class LR, every
MLP) are exactly singular along "add one constant to every output bias", which changes nothing; a ridge of
``BIAS_SHIFT_RIDGE`` (as tabular's own Newton solver uses) keeps the Cholesky factor defined, and the step's
component along it (rounding noise divided by the ridge) is dropped. Only if the factorisation still fails (an
indefinite MLP Hessian) is the damping raised, and reported.

State and purge (GDPR: H and r are aggregates of every training row, the erased ones included). After answering,
``unlearn`` returns new state with the erased rows' contributions gone:
- the residual is recomputed at the published theta' (float32, as stored) over R: one gradient pass, which is also
  the honest ``retained_grad_norm``. It is required, not optional: the next request starts from it;
- ``purge="deferred"`` (default): the answer's purge is the downdate below (exact removal of the erased rows' terms,
  O(k p^2): nothing more on the request's path), and ``complete_purge`` — the service's upkeep right after the
  certificates, in the same job (issue 21) — recomputes H over R at theta', as ``recompute`` would have. Until then
  the stored Hessian is at the parent model, which trained on the erased rows: a derivative of them of the same kind
  as the retired parent's weights (queued for shredding by the same publish, retired_version_grace_seconds 0 by
  default). Bound: the completion is the upkeep's first step, so it lives until the end of the deletion's own job;
  a worker that dies first leaves the job to be retried, and should every retry fail, the model's next deletion
  completes it before anything else (``purge_pending``). Besides, the subtraction leaves rounding residue of the
  erased terms (float64, relative 1e-16), gone with the recompute;
- ``purge="recompute"``: H is recomputed over R at theta' (O(|R| p^2), the preparation's cost, reported as
  ``purge_seconds``). The stored state is then a function of theta' and the retained rows only;
- ``purge="downdate"``: the erased rows' terms are subtracted, evaluated at the point where they were added
  (O(k p^2), nothing more to compute for ``newton``), so the Hessian stays at the model of the last full
  computation (prepare or a refresh), stored as ``hessian_theta``; later steps use it as a chord (the true residual
  keeps them right, their accuracy decays as the model drifts from that point). Cheaper, but that stored model was
  trained with every row erased since, and the Hessian depends on the erased rows through it (together with
  theta' it reveals aggregates of their gradients). Use it only where keeping that version is acceptable.
If the model given is not the one the state was computed at, its row set changed (another method answered a
request in between) or the settings ask for another Hessian kind or damping, the state is first recomputed at the
given model (``state_refreshed`` in info, with the reason).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, replace
from functools import partial
from typing import Any

import numpy as np
import scipy.linalg
import scipy.linalg.lapack
import scipy.special
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from app.ml import tabular
from app.ml.unlearning.base import TabularProblem, UnlearningResult
from app.ml.unlearning.warm import WarmStates

ARTIFACT_STATE = "newton_state.safetensors"
WARM = WarmStates()
"""Parsed states of this worker (warm.py): a request on a state this process stored or read pays no parse."""
PURGE_MODES = ("deferred", "recompute", "downdate")
BIAS_SHIFT_RIDGE = 1e-10
"""Added to the diagonal for softmax layouts, whose Hessian is singular along the shared output-bias shift."""
INDEFINITE_DAMPING_START = 1e-8
"""First damping tried (times the mean |diagonal|) when the Cholesky factorisation fails; then x DAMPING_GROWTH."""
DAMPING_GROWTH = 100.0
DAMPING_TRIES = 8
STATE_FORMAT = "1"
GAUSS_NEWTON_DAMPING = 1e-2
"""Levenberg-Marquardt damping added to the Gauss-Newton matrix. GN has no curvature floor along the unpenalised
biases: on a 5-unit MLP at l2 = 1e-2 (its units had converged onto one function, so GN was singular along four
hidden-bias combinations) one deletion measured param_ratio 1.7 at damping 1e-4, 0.9 at 1e-3 and 0.31 at 1e-2,
against 0.0085 with the exact Hessian. Prefer raising ``exact_hessian_max_params`` to relying on GN."""


@dataclass
class NewtonConfig:
    """Settings shared by ``newton`` and ``influence`` (see the module docstring)."""

    exact_steps: int = 0
    purge: str = "deferred"
    exact_hessian_max_params: int = 2048
    gauss_newton_damping: float = GAUSS_NEWTON_DAMPING
    certify: bool = False
    """Logistic regression: also compute the proven ||theta' - theta_retrain|| bound here (verification/bounds.py).
    Off by default: the service's verify step computes it at the published parameters (evidence.py); computing it
    here too doubled that cost per request (issue 21). Benchmarks and tests that read info["bound"] ask for it."""

    def __post_init__(self) -> None:
        if int(self.exact_steps) < 0:
            raise ValueError("exact_steps must be >= 0")
        if self.purge not in PURGE_MODES:
            raise ValueError(f"purge must be one of {PURGE_MODES}")
        if self.exact_hessian_max_params < 0 or self.gauss_newton_damping < 0:
            raise ValueError("exact_hessian_max_params and gauss_newton_damping must be >= 0")

    def hessian_kind(self, recipe: tabular.TabularRecipe, n_params: int) -> str:
        if recipe.family == "logistic_regression" or n_params <= self.exact_hessian_max_params:
            return "exact"
        return "gauss_newton"


@dataclass
class NewtonState:
    """What ``prepare`` stores and ``unlearn`` replaces: everything at ``theta`` over the rows in ``rows``."""

    theta: torch.Tensor  # float32 [p]: the model the residual is at
    hessian_theta: torch.Tensor  # float32 [p]: the model the Hessian is at (== theta unless purge="downdate")
    hessian: torch.Tensor  # float64 [p, p]: Hessian of L_rows at hessian_theta, undamped
    cholesky: torch.Tensor  # float64 [p, p]: lower factor of hessian + damping * I
    damping: float
    residual: torch.Tensor  # float64 [p]: grad L_rows(theta)
    rows: np.ndarray  # bool [N]: the rows aggregated
    hessian_kind: str
    base_damping: float  # the damping the settings asked for (``damping`` is larger only if that failed)
    requests: int = 0

    @property
    def n(self) -> int:
        return int(self.rows.sum())

    def to_bytes(self) -> bytes:
        tensors = {
            "theta": self.theta.contiguous(),
            "hessian_theta": self.hessian_theta.clone(),  # often the same tensor as theta: safetensors refuses aliases
            "hessian": self.hessian.contiguous(),
            "cholesky": self.cholesky.contiguous(),
            "residual": self.residual.contiguous(),
            "rows": torch.from_numpy(self.rows.astype(np.uint8)),
        }
        meta = {
            "format": STATE_FORMAT,
            "damping": repr(float(self.damping)),
            "hessian_kind": self.hessian_kind,
            "base_damping": repr(float(self.base_damping)),
            "requests": str(self.requests),
        }
        return st_save(tensors, metadata=meta)

    @classmethod
    def from_bytes(cls, data: bytes) -> NewtonState:
        t = st_load(data)
        header_len = int.from_bytes(data[:8], "little")
        meta = json.loads(data[8 : 8 + header_len]).get("__metadata__", {})
        if meta.get("format") != STATE_FORMAT:
            raise ValueError(f"unknown Newton state format {meta.get('format')!r}; run prepare again")
        return cls(
            theta=t["theta"],
            hessian_theta=t["hessian_theta"],
            hessian=t["hessian"],
            cholesky=t["cholesky"],
            damping=float(meta["damping"]),
            residual=t["residual"],
            rows=t["rows"].numpy().astype(bool),
            hessian_kind=meta["hessian_kind"],
            base_damping=float(meta["base_damping"]),
            requests=int(meta["requests"]),
        )


# ---------------------------------------------------------------------------------------------- linear algebra
def _n_out(recipe: tabular.TabularRecipe, n_features: int, n_classes: int) -> int:
    """1 for a sigmoid output (binary LR), C for softmax: the length of the last bias in the layout."""
    return tabular.param_shapes(recipe, n_features, n_classes)[-1][1][0]


def _shift_free(step: torch.Tensor, n_out: int) -> torch.Tensor:
    """Drop a step's component along the shared output-bias shift (softmax): the objective is flat there, so that
    component is only rounding noise divided by the ridge (see tabular.center_output_bias)."""
    if n_out > 1:
        step = step.clone()
        step[-n_out:] -= step[-n_out:].mean()
    return step


def factor(H: torch.Tensor, base_damping: float) -> tuple[torch.Tensor, float]:
    """Lower Cholesky factor of H + damping I, with damping = ``base_damping`` unless that fails (then raised)."""
    eye = torch.eye(H.shape[0], dtype=H.dtype)
    damping = float(base_damping)
    scale = float(H.diagonal().abs().mean()) or 1.0
    for _ in range(DAMPING_TRIES):
        L, info = torch.linalg.cholesky_ex(H + damping * eye)
        if int(info) == 0:
            return L, damping
        damping = max(damping * DAMPING_GROWTH, INDEFINITE_DAMPING_START * scale)
    raise ValueError(
        f"the Hessian is not positive definite even with damping {damping:.3g}: theta is far from a minimum"
    )


def objective_hessian(
    recipe: tabular.TabularRecipe, theta: torch.Tensor, X: np.ndarray, y: np.ndarray, n_classes: int, kind: str
) -> torch.Tensor:
    """Hessian (or Gauss-Newton matrix) of the mean objective over these rows: sum / n + l2 M, symmetrised (a BLAS
    Gram product is symmetric only to rounding, and the Cholesky factor reads one triangle)."""
    mask = tabular.regularisation_mask(recipe, X.shape[1], n_classes)
    H = tabular.data_hessian_sum(recipe, theta, X, y, n_classes, kind)
    return (H + H.T) / (2 * len(X)) + torch.diag(recipe.l2 * mask)


def downdate(H: torch.Tensor, n: int, H_f_sum: torch.Tensor, k: int, l2_mask: torch.Tensor) -> torch.Tensor:
    """H_R from H_D (mean objective over n rows) and the k erased rows' summed loss Hessians (module docstring)."""
    reg = torch.diag(l2_mask)
    return (n * (H - reg) - (H_f_sum + H_f_sum.T) / 2) / (n - k) + reg


def retained_gradient(
    residual: torch.Tensor, n: int, G_f_sum: torch.Tensor, k: int, l2_mask: torch.Tensor, theta: torch.Tensor
) -> torch.Tensor:
    """grad L_R(theta) from the stored grad L_D(theta) and the erased rows' summed loss gradients."""
    return (n * residual - G_f_sum - k * l2_mask * theta) / (n - k)


WOODBURY_MAX_ROWS_PER_PARAM = 0.5
"""Binary LR, newton: up to k <= this x p erased rows the step is solved by Woodbury's identity on a generalised
eigenbasis kept with the state (O(k p^2 + k^3), exact); above it H_R is formed and factorised (O(k p^2 + p^3))."""
ONE_ROW_PATH = True
"""One erased row of binary LR takes _one_row_step (the tests switch it off to compare with _woodbury_step)."""


def _lr_sums(
    recipe: tabular.TabularRecipe, theta: np.ndarray, X: np.ndarray, y: np.ndarray, C: int, at: np.ndarray | None
) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray] | np.ndarray | None]:
    """Logistic regression: sum_i grad loss_i(theta) and (``at`` given) sum_i Hessian loss_i(at) over the rows, in
    the flat layout, in plain float64 numpy (tabular.data_gradient_sum / data_hessian_sum compute the same sums
    through torch, whose per-call overhead is most of the cost for a handful of rows). Binary: the Hessian sum is
    returned factored, (A, s) with sum = A^T diag(s) A; softmax: dense."""
    k, d = X.shape
    Xa = np.empty((k, d + 1))
    Xa[:, :d], Xa[:, d] = X, 1.0
    if _n_out(recipe, d, C) == 1:
        G = Xa.T @ (scipy.special.expit(Xa @ theta) - y)
        if at is None:
            return G, None
        p = scipy.special.expit(Xa @ at)
        return G, (Xa, p * (1.0 - p))

    def probabilities(t: np.ndarray) -> np.ndarray:
        Z = Xa @ np.concatenate([t[: C * d].reshape(C, d), t[C * d :, None]], axis=1).T
        return scipy.special.softmax(Z, axis=1)

    E = probabilities(theta)
    E[np.arange(k), y] -= 1.0
    gWa = E.T @ Xa  # [C, d + 1]
    G = np.concatenate([gWa[:, :d].reshape(-1), gWa[:, d]])
    if at is None:
        return G, None
    P = probabilities(at)
    S = np.einsum("ic,cd->icd", P, np.eye(C)) - P[:, :, None] * P[:, None, :]  # diag(p) - p p^T per row
    Hb = np.einsum("icd,ij,il->cjdl", S, Xa, Xa).reshape(C * (d + 1), C * (d + 1))
    idx = np.concatenate([np.arange(C * (d + 1)).reshape(C, d + 1)[:, :d].reshape(-1), np.arange(C) * (d + 1) + d])
    return G, Hb[np.ix_(idx, idx)]


@dataclass
class _LRFast:
    """Per-state numpy views and precomputed terms for the logistic-regression step (kept with the warm state, so a
    request does only the O(k p^2) work, not the conversions)."""

    theta: np.ndarray  # float64 [p]
    at: np.ndarray  # float64 [p]: where the stored Hessian is
    mask: np.ndarray  # l2 * M (weights penalised, biases not)
    n_residual: np.ndarray  # n * grad L_D(theta)
    n_data_hessian: np.ndarray  # n * (H_D - l2 M): the summed loss Hessians
    cholesky: np.ndarray  # lower factor of H_D + damping I (Fortran order, for LAPACK)
    n: int
    eigvecs: np.ndarray | None = None  # V with V^T (H_D + b I) V = I and V^T (l2 M + b I) V = diag(gamma)
    gamma: np.ndarray | None = None
    v_residual: np.ndarray | None = None  # V^T n grad L_D(theta)
    v_penalty: np.ndarray | None = None  # V^T l2 M theta
    points: np.ndarray | None = None  # [theta, at] as columns: both logits of a row in one product
    one_row_w: np.ndarray | None = None  # [M1; theta; at; a1] on the feature columns (_one_row_terms)
    one_row_b: np.ndarray | None = None  # the same rows' bias column
    one_row_base: np.ndarray | None = None  # theta - a1

    @classmethod
    def of(cls, state: NewtonState, recipe: tabular.TabularRecipe, d: int, C: int) -> _LRFast:
        fast = getattr(state, "_lr_fast", None)
        if fast is None:
            n = state.n
            mask = recipe.l2 * tabular.regularisation_mask(recipe, d, C).numpy()
            H = n * state.hessian.numpy()
            H[np.diag_indices_from(H)] -= n * mask
            fast = cls(
                state.theta.to(torch.float64).numpy(),
                state.hessian_theta.to(torch.float64).numpy(),
                mask,
                n * state.residual.numpy(),
                H,
                np.asfortranarray(state.cholesky.numpy()),
                n,
            )
            if _n_out(recipe, d, C) == 1 and state.damping == state.base_damping:
                fast.eigvecs, fast.gamma = fast._pencil(state.hessian.numpy(), state.base_damping)
                if fast.eigvecs is not None:
                    fast.v_residual = fast.n_residual @ fast.eigvecs
                    fast.v_penalty = (fast.mask * fast.theta) @ fast.eigvecs
                    fast.points = np.ascontiguousarray(np.stack([fast.theta, fast.at], axis=1))
                    fast._one_row_terms(d)
            state._lr_fast = fast  # type: ignore[attr-defined]  # the state is immutable once built
        return fast

    def _one_row_terms(self, d: int) -> None:
        """Everything of the one-row step that does not depend on the row, O(p^3) once per state: one-row requests
        are the common erasure (one person, one row), and inside a request each numpy call pays cold caches (measured
        ~20-50 us per call right after an O(N) pass over the table), so the step is cut to six calls. With m = n - 1,
        M1 = V D_1 V^T = (H_R + b I + w w^T)^-1 (D_1 as in _woodbury_step at k = 1) and a1 = M1 (n r - l2 M theta) / m,
        Sherman-Morrison gives, for the row x (bias appended), e = sigma(x theta) - y and s = sigma'(x at):
            theta' = (theta - a1) + q (e / m - s (h - e g / m) / (m - s g)),   q = M1 x, g = x^T q, h = x^T a1.
        q, x theta, x at and h are one product with the stacked rows [M1; theta; at; a1]."""
        m = self.n - 1
        if m < 1:  # a one-row table: no row can be erased (unlearn refuses k >= n)
            return
        c = self.n / m
        dinv = 1.0 / (c - (c - 1.0) * self.gamma)
        M1 = (self.eigvecs * dinv) @ self.eigvecs.T
        a1 = self.eigvecs @ (dinv * (self.v_residual - self.v_penalty) / m)
        K = np.concatenate([M1, self.theta[None, :], self.at[None, :], a1[None, :]])
        self.one_row_w = np.ascontiguousarray(K[:, :d])
        self.one_row_b = np.ascontiguousarray(K[:, d])
        self.one_row_base = self.theta - a1

    def _pencil(self, H_D: np.ndarray, base: float) -> tuple[np.ndarray | None, np.ndarray | None]:
        """The generalised eigenbasis of (l2 M + b I, H_D + b I), O(p^3) once per state. Deleting k rows scales the
        data part of H by n / (n - k) but not the penalty, so H_R is not a low-rank change of H_D; in this basis both
        are diagonal, and H_R + b I = V^-T diag(c - (c - 1) gamma) V^-1 - W W^T with c = n / (n - k) and W the erased
        rows' scaled features: Woodbury's identity then costs O(k p^2 + k^3). gamma lies in [0, 1] (the data
        Hessian is positive semi-definite), so the diagonal is >= 1: no cancellation."""
        penalty = np.diag(self.mask + base)
        try:
            gamma, V = scipy.linalg.eigh(penalty, (H_D + H_D.T) / 2 + base * np.eye(len(H_D)), check_finite=False)
        except np.linalg.LinAlgError:  # H_D + b I not positive definite: the factor-and-solve path handles it
            return None, None
        return np.ascontiguousarray(V), np.clip(gamma, 0.0, 1.0)


def _sigmoid(z: float) -> float:
    """Logistic function of one float without overflow (math on a scalar: no numpy call)."""
    if z >= 0:
        return 1.0 / (1.0 + math.exp(-z))
    t = math.exp(z)
    return t / (1.0 + t)


def _one_row_step(f: _LRFast, x: np.ndarray, y: float) -> np.ndarray:
    """theta' for one erased row of binary LR from the terms kept with the state (_LRFast._one_row_terms): the same
    answer as _woodbury_step at k = 1, in O(p d) and six numpy calls."""
    p, m = len(f.theta), f.n - 1
    v = f.one_row_w @ x
    v += f.one_row_b
    q_bias, z_theta, z_at, h = v[p - 1 :].tolist()  # M1's bias row, x theta, x at, x^T a1
    g = float(v[: p - 1] @ x) + q_bias
    e = _sigmoid(z_theta) - y
    sig = _sigmoid(z_at)
    s = sig * (1.0 - sig)
    coef = e / m - s * (h - e * g / m) / (m - s * g)
    return f.one_row_base + coef * v[:p]


def _woodbury_step(f: _LRFast, Xf: np.ndarray, yf: np.ndarray) -> np.ndarray:
    """theta' for binary LR by Woodbury's identity in the pencil basis (_LRFast._pencil), all of it in that basis:
    with U = X_f V (the erased rows, bias column appended), e_i = sigma(x_i theta) - y_i, s_i = sigma'(x_i at),
    D = diag(1 / (c - (c-1) gamma)) and B = U * sqrt(s / (n - k)),
        w = V^T grad L_R(theta) = (V^T n r - U^T e - k V^T l2 M theta) / (n - k)
        theta' = theta - V (D w + D B^T (I - B D B^T)^-1 B D w).
    Two products with V and O(k^2 p + k^3) besides; the retained gradient itself is never formed (only its norm is
    reported, computed after the step)."""
    k, d = Xf.shape
    n = f.n
    Xa = np.empty((k, d + 1))
    Xa[:, :d], Xa[:, d] = Xf, 1.0
    P = scipy.special.expit(Xa @ f.points)  # [k, 2]: sigma at theta and at the Hessian's point
    e = P[:, 0] - yf
    U = Xa @ f.eigvecs
    c = n / (n - k)
    Dinv = 1.0 / (c - (c - 1.0) * f.gamma)
    z = Dinv * ((f.v_residual - e @ U - k * f.v_penalty) / (n - k))
    B = U * np.sqrt(P[:, 1] * (1.0 - P[:, 1]) / (n - k))[:, None]
    BD = B * Dinv
    if k == 1:  # Sherman-Morrison
        b, bd = B[0], BD[0]
        z += bd * (float(b @ z) / (1.0 - float(b @ bd)))
    else:
        z += BD.T @ np.linalg.solve(np.eye(k) - BD @ B.T, B @ z)
    return f.theta - f.eigvecs @ z


def _lr_step(
    mode: str,
    recipe: tabular.TabularRecipe,
    state: NewtonState,
    X: np.ndarray,
    y: np.ndarray,
    f_idx: np.ndarray,
    C: int,
    base: float,
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None, float, np.ndarray]:
    """The Newton (or influence) step for logistic regression, in plain float64 numpy and LAPACK on views kept with
    the state: the same algebra as the general path (module docstring). Returns theta', H_R (newton when it was
    formed; None when Woodbury's identity solved without it), H_R's factor (lower triangle meaningful; None
    likewise), the damping and the retained gradient at theta (None from Woodbury's path: the caller forms it after
    the step, for the report). Only the rows ``f_idx`` of X and y are read."""
    d, k = X.shape[1], len(f_idx)
    f = _LRFast.of(state, recipe, d, C)
    n = f.n
    if mode == "newton" and f.eigvecs is not None and k <= WOODBURY_MAX_ROWS_PER_PARAM * (d + 1):
        if k == 1 and ONE_ROW_PATH and f.one_row_w is not None:
            i = int(f_idx[0])  # a plain index: a view of the row, no fancy-indexing copy
            return _one_row_step(f, np.asarray(X[i], np.float64), float(y[i])), None, None, base, None
        return _woodbury_step(f, X[f_idx], y[f_idx]), None, None, base, None
    Xf, yf = np.asarray(X[f_idx], np.float64), y[f_idx]
    G, H_f = _lr_sums(recipe, f.theta, Xf, np.asarray(yf), C, f.at if mode == "newton" else None)
    grad = (f.n_residual - G - k * f.mask * f.theta) / (n - k)
    shift = _n_out(recipe, d, C) > 1

    def finish(step: np.ndarray) -> np.ndarray:
        if shift:
            step[-C:] -= step[-C:].mean()  # the shared output-bias shift: see _shift_free
        return f.theta - step

    if H_f is None:
        step, _ = scipy.linalg.lapack.dpotrs(f.cholesky, grad, lower=1)
        return finish(step), None, None, state.damping, grad
    if isinstance(H_f, tuple):
        A, s_f = H_f
        H_f = (A * s_f[:, None]).T @ A
    H_R = (f.n_data_hessian - H_f) / (n - k)
    H_R[np.diag_indices_from(H_R)] += f.mask
    L, info = scipy.linalg.lapack.dpotrf(H_R + base * np.eye(len(grad)) if base else H_R, lower=1, clean=0)
    damping = base
    if info != 0:  # not positive definite at the requested damping: the general factor raises it
        Lt, damping = factor(torch.from_numpy((H_R + H_R.T) / 2), base)
        L = np.asfortranarray(Lt.numpy())
    step, _ = scipy.linalg.lapack.dpotrs(L, grad, lower=1)
    return finish(step), H_R, L, damping, grad


def warm_views(state: NewtonState, recipe: tabular.TabularRecipe, d: int, C: int) -> NewtonState:
    """Build the step's precomputed views now (upkeep, not the next request's latency)."""
    if recipe.family == "logistic_regression":
        _LRFast.of(state, recipe, d, C)
    return state


def _computed_at(state: Any, *, theta: torch.Tensor, rows: np.ndarray, kind: str, base: float) -> bool:
    """Whether ``state`` is the full state at ``theta`` over ``rows`` (the Hessian at theta itself, not downdated)
    with these settings."""
    return (
        isinstance(state, NewtonState)
        and (state.hessian_kind, state.base_damping) == (kind, base)
        and torch.equal(state.theta, theta)
        and torch.equal(state.hessian_theta, theta)
        and np.array_equal(state.rows, rows)
    )


def _residual_kept(theta: torch.Tensor, rows: np.ndarray, kind: str, base: float) -> torch.Tensor | None:
    """The retained gradient at ``theta`` over ``rows`` that a state kept in memory already holds (the method that
    answered the deletion computed it a moment ago at the same θ′ over the same rows: ``unlearn``'s residual), or
    None. The same function of the same numbers, so a purge need not make another pass over the table for it."""
    kept = WARM.find(
        lambda s: (
            isinstance(s, NewtonState)
            and (s.hessian_kind, s.base_damping) == (kind, base)
            and torch.equal(s.theta, theta)
            and np.array_equal(s.rows, rows)
        )
    )
    return None if kept is None else kept.residual


# ---------------------------------------------------------------------------------------------- the methods
class NewtonUnlearning:
    """Newton removal: the Hessian downdated by the erased rows (more exact, O(k p^2 + p^3) per request)."""

    mode = "newton"
    approximates_retraining = True
    """A prediction of the retrained model: preparation gates it with the determinism probe and validates it."""

    def __init__(self, config: NewtonConfig | None = None):
        self.config = config or NewtonConfig()

    def for_validation(self) -> NewtonUnlearning:
        """The same step without the state upkeep a served request pays (the Hessian recomputed over the retained
        rows, the proven bound): validation measures the answer, which they do not change."""
        return type(self)(replace(self.config, purge="downdate", certify=False))

    # ------------------------------------------------------------------ state
    def _state(self, problem: TabularProblem, theta: torch.Tensor, rows: np.ndarray) -> tuple[NewtonState, dict]:
        """H, its factor and the residual at theta over ``rows``: two passes over the rows."""
        recipe, C = problem.recipe, problem.n_classes
        X, y = problem.X[rows], np.asarray(problem.y)[rows]
        kind = self.config.hessian_kind(recipe, theta.numel())
        t0 = time.perf_counter()  # the residual as unlearn computes it (a shared state is the very same number)
        residual = tabular.masked_objective_gradient(recipe, theta, problem.X, problem.y, C, rows)
        t1 = time.perf_counter()
        H = objective_hessian(recipe, theta, X, y, C, kind)
        t2 = time.perf_counter()
        base = self._base_damping(recipe, X.shape[1], C, kind)
        L, damping = factor(H, base)
        t3 = time.perf_counter()
        state = warm_views(
            NewtonState(theta.clone(), theta.clone(), H, L, damping, residual, rows.copy(), kind, base),
            recipe,
            X.shape[1],
            C,
        )
        timings = {
            "gradient_s": t1 - t0,
            "hessian_s": t2 - t1,
            "cholesky_s": t3 - t2,
            "views_s": time.perf_counter() - t3,
        }
        return state, timings

    def _base_damping(self, recipe: tabular.TabularRecipe, d: int, C: int, kind: str) -> float:
        base = BIAS_SHIFT_RIDGE if _n_out(recipe, d, C) > 1 else 0.0
        return base + (self.config.gauss_newton_damping if kind == "gauss_newton" else 0.0)

    @staticmethod
    def _theta(problem: TabularProblem) -> torch.Tensor:
        theta = torch.as_tensor(problem.theta).detach().to("cpu", torch.float32).reshape(-1).contiguous()
        P = tabular.param_count(problem.recipe, problem.X.shape[1], problem.n_classes)
        if theta.numel() != P:
            family = problem.recipe.family
            raise ValueError(f"Newton removal needs a single {family} of {P} parameters, got {theta.numel()}")
        return theta

    def prepare(self, problem: TabularProblem) -> UnlearningResult:
        rows = np.asarray(problem.retain_mask, dtype=bool)
        if not rows.any():
            raise ValueError("no training rows to prepare on")
        theta = self._theta(problem)
        problem.progress(0.0, f"Hessian over {int(rows.sum())} rows")
        state, timings = self._state(problem, theta, rows)
        t0 = time.perf_counter()
        artifacts = {ARTIFACT_STATE: state.to_bytes()}
        WARM.put(artifacts[ARTIFACT_STATE], state)
        timings["save_s"] = time.perf_counter() - t0
        problem.progress(1.0, f"{self.mode} prepared")
        info = {
            "method": self.mode,
            "stage": "prepare",
            "rows": state.n,
            "n_params": int(theta.numel()),
            "hessian": state.hessian_kind,
            "hessian_damping": state.damping,
            "residual_norm": float(state.residual.norm()),
            "timings": timings,
            "artifact_bytes": {k: len(v) for k, v in artifacts.items()},
        }
        return UnlearningResult(theta=theta, info=info, artifacts=artifacts)

    # ------------------------------------------------------------------ one request
    def _load(self, problem: TabularProblem, theta: torch.Tensor) -> tuple[NewtonState, str | None, dict]:
        if ARTIFACT_STATE not in problem.artifacts:
            raise ValueError(f"{self.mode} is not prepared for this model (no {ARTIFACT_STATE}); run prepare first")
        t0 = time.perf_counter()
        state = WARM.get(problem.artifacts[ARTIFACT_STATE], NewtonState.from_bytes)
        timings = {"load_seconds": time.perf_counter() - t0}
        if state.rows.shape != (len(problem.y),) or state.theta.numel() != theta.numel():
            raise ValueError("the stored Newton state belongs to another data set or model; run prepare again")
        # rows the model in hand was trained on: the retained ones and this request's (not tombstoned earlier)
        forget = np.asarray(problem.forget_mask, dtype=bool) & ~np.asarray(problem.tombstone_mask, dtype=bool)
        present = np.asarray(problem.retain_mask, dtype=bool) | forget
        reason = None
        if not torch.equal(state.theta, theta):
            reason = "the model is not the one the state was computed at"
        elif not np.array_equal(state.rows, present):
            reason = "the training rows changed since the state was computed"
        else:
            kind = self.config.hessian_kind(problem.recipe, theta.numel())
            base = self._base_damping(problem.recipe, problem.X.shape[1], problem.n_classes, kind)
            if (kind, base) != (state.hessian_kind, state.base_damping):
                reason = f"the settings ask for another Hessian or damping than the stored {state.hessian_kind!r}"
        if reason is not None:
            state, refresh = self._state(problem, theta, present)
            timings["refresh_seconds"] = sum(refresh.values())
        t0 = time.perf_counter()
        warm_views(state, problem.recipe, problem.X.shape[1], problem.n_classes)  # a cold state: built once, here
        timings["views_seconds"] = time.perf_counter() - t0
        return state, reason, timings

    def unlearn(self, problem: TabularProblem) -> UnlearningResult:
        cfg, recipe, C = self.config, problem.recipe, problem.n_classes
        X, y = problem.X, np.asarray(problem.y)
        theta = self._theta(problem)
        state, refreshed, timings = self._load(problem, theta)
        t_select = time.perf_counter()
        forget = np.asarray(problem.forget_mask, dtype=bool) & state.rows
        k, n = int(forget.sum()), state.n
        if k == 0:
            raise ValueError("nothing to forget: no forget row is in the current training set")
        if k >= n:
            raise ValueError("every training row would be forgotten: there is no retained objective")
        retained = state.rows & ~forget
        d = X.shape[1]
        l2_mask = recipe.l2 * tabular.regularisation_mask(recipe, d, C)
        base = self._base_damping(recipe, d, C, state.hessian_kind)
        theta64 = theta.to(torch.float64)
        at64 = state.hessian_theta.to(torch.float64)  # the erased rows' Hessian terms leave at the point they entered

        n_out = _n_out(recipe, d, C)
        f_idx = np.flatnonzero(forget)  # the request's rows (an O(N) scan of the mask: outside the step's timing)
        timings["select_seconds"] = time.perf_counter() - t_select

        def downdated() -> torch.Tensor:
            H_f = tabular.data_hessian_sum(recipe, at64, X[f_idx], y[f_idx], C, state.hessian_kind)
            return downdate(state.hessian, n, H_f, k, l2_mask)

        # --- the step itself: only the k erased rows are read (timed on its own: the requester's latency) ---
        t0 = time.perf_counter()
        if recipe.family == "logistic_regression":  # _load made the state describe theta
            new_np, H_np, L_np, damping, grad_np = _lr_step(self.mode, recipe, state, X, y, f_idx, C, base)
        else:
            G_f = tabular.data_gradient_sum(recipe, theta64, X[f_idx], y[f_idx], C)
            grad = retained_gradient(state.residual, n, G_f, k, l2_mask, theta64)
            H_R = downdated() if self.mode == "newton" else None
            L, damping = factor(H_R, base) if H_R is not None else (state.cholesky, state.damping)
            new64 = theta64 - _shift_free(torch.cholesky_solve(grad[:, None], L)[:, 0], n_out)
        timings["method_seconds"] = time.perf_counter() - t0
        if recipe.family == "logistic_regression":  # _load made the state describe theta
            if grad_np is None:  # Woodbury's path never forms it: the report's retained gradient, after the step
                G_f = tabular.data_gradient_sum(recipe, theta64, X[f_idx], y[f_idx], C)
                grad_np = retained_gradient(state.residual, n, G_f, k, l2_mask, theta64).numpy()
            new64, grad = torch.from_numpy(new_np), torch.from_numpy(grad_np)
            H_R = torch.from_numpy(np.tril(H_np) + np.tril(H_np, -1).T) if H_np is not None else None
            L = torch.from_numpy(np.tril(L_np)) if L_np is not None else None
            if self.mode == "influence":
                L = state.cholesky
        if L is None and cfg.exact_steps:  # newton solved without forming H_R: the chord steps need its factor
            H_R = downdated()
            L, damping = factor(H_R, base)

        # --- optional chord steps with the exact retained gradient (one full pass each) ---
        t0 = time.perf_counter()
        for _ in range(int(cfg.exact_steps)):
            current = new64.to(torch.float32).to(torch.float64)  # step from the model as it will be published
            g_full = tabular.masked_objective_gradient(recipe, current, X, y, C, retained)
            new64 = current - _shift_free(torch.cholesky_solve(g_full[:, None], L)[:, 0], n_out)
        timings["exact_steps_seconds"] = time.perf_counter() - t0
        theta_new = new64.to(torch.float32).contiguous()

        # --- purge: the new residual (also the honest retained gradient norm) and the Hessian without f ---
        t0 = time.perf_counter()
        residual = tabular.masked_objective_gradient(recipe, theta_new, X, y, C, retained)
        timings["residual_seconds"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        if cfg.purge == "recompute":
            H_new = objective_hessian(recipe, theta_new, X[retained], y[retained], C, state.hessian_kind)
            L_new, damping_new = factor(H_new, base)
            H_at = theta_new
        elif H_R is not None:  # newton: the downdated matrix and its factor are already at hand
            H_new, L_new, damping_new, H_at = H_R, L, damping, state.hessian_theta
        else:
            H_new = downdated()
            L_new, damping_new = factor(H_new, base)
            H_at = state.hessian_theta
        new_state = NewtonState(
            theta_new, H_at, H_new, L_new, damping_new, residual, retained, state.hessian_kind, base, state.requests + 1
        )
        if cfg.purge != "deferred":  # deferred: the upkeep replaces this state by the completed one, with its views
            warm_views(new_state, recipe, d, C)  # the next request's precomputed views: timed with the purge
        timings["purge_seconds"] = time.perf_counter() - t0

        bound = None
        if cfg.certify and recipe.family == "logistic_regression":
            from app.ml.verification.bounds import strong_convexity_bound

            t0 = time.perf_counter()
            bound = strong_convexity_bound(recipe, theta_new, X, C, residual, mask=retained)
            timings["bound_seconds"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        artifacts = {ARTIFACT_STATE: new_state.to_bytes()}
        WARM.put(artifacts[ARTIFACT_STATE], new_state)
        timings["save_seconds"] = time.perf_counter() - t0
        missing = np.flatnonzero(np.bincount(y, weights=retained, minlength=C)[:C] == 0).tolist()
        info: dict[str, Any] = {
            "method": self.mode,
            "k": k,
            "rows_forgotten": k,
            "rows_before": n,
            "rows_after": n - k,
            "hessian": state.hessian_kind,
            "hessian_damping": damping,
            "exact_steps": int(cfg.exact_steps),
            "retained_grad_norm_before": float(grad.norm()),
            "retained_grad_norm": float(residual.norm()),
            "update_norm": float((theta_new.to(torch.float64) - theta64).norm()),
            "purge": cfg.purge,
            "stored_hessian_at": "theta_new" if H_at is theta_new else "earlier_theta",
            "state_refreshed": refreshed,
            "requests": new_state.requests,
            "bound": bound,
            "config": asdict(cfg),
            **timings,
        }
        if missing:
            info["warning"] = (
                f"no retained rows of classes {missing}: their unpenalised output bias has no finite optimum, so "
                "neither this step nor a retrain has a well-defined target"
            )
        problem.progress(1.0, f"{self.mode}: {k} rows removed")
        return UnlearningResult(theta=theta_new, info=info, artifacts=artifacts)

    def purge(self, problem: TabularProblem) -> UnlearningResult:
        """Erase rows another method deleted (the worker's erase step): the state is made to describe
        ``problem.theta`` (the new version) over ``problem.retain_mask`` rows only. ``purge="recompute"``: the
        Hessian, its factor and the residual computed afresh there (one preparation's cost); ``"downdate"``: the
        erased rows' Hessian terms subtracted at the point they entered (O(k p^2)) and the residual recomputed (one
        gradient pass). Either way no stored number is a sum that still includes an erased row."""
        recipe, C = problem.recipe, problem.n_classes
        X, y = problem.X, np.asarray(problem.y)
        try:
            theta = self._theta(problem)
        except ValueError as exc:  # the new version is not one model of this recipe (a SISA ensemble)
            reason = f"{self.mode}'s state cannot describe the served model: {exc}; prepare again"
            return UnlearningResult(theta=torch.as_tensor(problem.theta), info={"needs_prepare": reason})
        if ARTIFACT_STATE not in problem.artifacts:
            raise ValueError(f"{self.mode} is not prepared for this model (no {ARTIFACT_STATE}); run prepare first")
        state = WARM.get(problem.artifacts[ARTIFACT_STATE], NewtonState.from_bytes)
        rows = np.asarray(problem.retain_mask, dtype=bool)
        t0 = time.perf_counter()
        kind = self.config.hessian_kind(recipe, theta.numel())
        base = self._base_damping(recipe, X.shape[1], C, kind)
        erased = state.rows & ~rows
        downdating = self.config.purge in ("downdate", "deferred")
        if downdating and not (rows & ~state.rows).any() and kind == state.hessian_kind:
            d = X.shape[1]
            l2_mask = recipe.l2 * tabular.regularisation_mask(recipe, d, C)
            H_f = tabular.data_hessian_sum(recipe, state.hessian_theta, X[erased], y[erased], C, kind)
            H = downdate(state.hessian, state.n, H_f, int(erased.sum()), l2_mask)
            L, damping = factor(H, state.base_damping)
            residual = _residual_kept(theta, rows, kind, state.base_damping)
            if residual is None:
                residual = tabular.masked_objective_gradient(recipe, theta, X, y, C, rows)
            new_state = NewtonState(
                theta.clone(), state.hessian_theta, H, L, damping, residual, rows.copy(), kind, state.base_damping,
                state.requests,
            )  # fmt: skip
            if self.config.purge != "deferred":  # deferred: the upkeep's complete_purge builds the views it serves
                warm_views(new_state, recipe, X.shape[1], C)
        else:
            new_state = self._full_state(problem, theta, rows, kind, base, state.requests)
        artifacts = {ARTIFACT_STATE: new_state.to_bytes()}
        WARM.put(artifacts[ARTIFACT_STATE], new_state)
        info = {
            "method": self.mode,
            "stage": "purge",
            "rows_erased": int(erased.sum()),
            "purge": self.config.purge,
            "purge_seconds": time.perf_counter() - t0,
        }
        return UnlearningResult(theta=theta, info=info, artifacts=artifacts)

    def _full_state(self, problem: TabularProblem, theta, rows, kind: str, base: float, requests: int) -> NewtonState:
        """The full state at ``theta`` over ``rows``: the one the method that answered computed a moment ago (newton
        and influence keep the same one: the Hessian, its factor and the residual), else computed here."""
        fresh = WARM.find(partial(_computed_at, theta=theta, rows=rows, kind=kind, base=base))
        if fresh is not None:
            state = replace(fresh, requests=requests)
            if (views := getattr(fresh, "_lr_fast", None)) is not None:  # views of the same numbers: shared too
                state._lr_fast = views  # type: ignore[attr-defined]
            return state
        state, _ = self._state(problem, theta, rows)
        state.requests = requests
        return state

    def purge_pending(self, artifacts: dict[str, bytes]) -> bool:
        """Whether the stored state still waits for ``complete_purge`` (its Hessian is not at its own model)."""
        if self.config.purge != "deferred" or ARTIFACT_STATE not in artifacts:
            return False
        state = WARM.get(artifacts[ARTIFACT_STATE], NewtonState.from_bytes)
        return not torch.equal(state.hessian_theta, state.theta)

    def complete_purge(self, problem: TabularProblem) -> UnlearningResult | None:
        """The deferred part of ``purge="deferred"`` (module docstring), for the upkeep after the certificates: the
        state recomputed at ``problem.theta`` (the served model) over ``problem.retain_mask``, so that no stored
        number depends on an erased row any more; shared by newton and influence (one computation for both). None
        when the stored state is already that (nothing deferred, or another purge mode)."""
        if self.config.purge != "deferred" or ARTIFACT_STATE not in problem.artifacts:
            return None
        theta = self._theta(problem)
        state = WARM.get(problem.artifacts[ARTIFACT_STATE], NewtonState.from_bytes)
        rows = np.asarray(problem.retain_mask, dtype=bool)
        kind = self.config.hessian_kind(problem.recipe, theta.numel())
        base = self._base_damping(problem.recipe, problem.X.shape[1], problem.n_classes, kind)
        at = partial(_computed_at, theta=theta, rows=rows, kind=kind, base=base)
        if at(state):
            return None
        t0 = time.perf_counter()
        new_state = self._full_state(problem, theta, rows, kind, base, state.requests)
        artifacts = {ARTIFACT_STATE: new_state.to_bytes()}
        WARM.put(artifacts[ARTIFACT_STATE], new_state)
        info = {"method": self.mode, "stage": "complete_purge", "seconds": time.perf_counter() - t0}
        return UnlearningResult(theta=theta, info=info, artifacts=artifacts)


class InfluenceUnlearning(NewtonUnlearning):
    """Influence-function removal: the Hessian factor cached for the previous version, no downdate (cheaper, less
    exact: the step ignores the erased rows' own curvature, an O(k/n) relative error)."""

    mode = "influence"

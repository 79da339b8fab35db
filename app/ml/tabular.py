"""Tabular models as flat parameter vectors: logistic regression and the L2UL paper's one-hidden-layer MLP.

Every model is one float32 CPU vector ``theta`` because that is what L2UL's N_U consumes and emits (notes §1.1: the
input is concat(mu_D, mu_f, theta)), what the service stores per version (safetensors) and what the verification code
compares (||theta' - theta_r||).

Objective (both families): mean cross-entropy over the training rows + (l2 / 2) * ||weights||^2 (biases are not
penalised). The penalty is per row-averaged loss, so it does not change with n; scikit-learn's ``C`` equals
``1 / (l2 * n)`` (``sklearn_C``).

Solvers, chosen for exactness because unlearning is judged against a retrained model:
- logistic regression: Newton's method with a Cholesky solve and Armijo backtracking ("newton"; the default for up to
  ``newton_max_params`` parameters). The problem is strictly convex, so Newton reaches the unique optimum to ~1e-12
  in about ten iterations. That matters: the change a single deleted row makes is O(1/n), smaller than the error a
  loosely converged first-order solver leaves in the weakly regularised directions (one-hot blocks are collinear with
  the bias, curvature only l2). "lbfgs" (full-batch torch L-BFGS with a strong-Wolfe line search on the float64
  objective, see ``_lbfgs``) is used above that size.
- MLP (notes §1.6: one hidden layer of 10 sigmoid units, softmax output, cross-entropy): the same full-batch torch
  L-BFGS from a seeded Glorot initialisation, so the same seed and data always give the same theta.

Objective, gradients and Hessians are hand-written torch float64 (no autograd: fewer kernel launches per iteration,
which dominates on the 1,000-row meta-training tasks). Large problems run on CUDA when it is available.

Parameter layout (``param_shapes``): LR binary ``weight [1, d], bias [1]`` (sigmoid); LR multi-class
``weight [C, d], bias [C]`` (softmax); MLP ``hidden.weight [h, d], hidden.bias [h], output.weight [C, h],
output.bias [C]``. A vector whose length is k > 1 times the single-model size is an ensemble of k models (SISA's
constituents, concatenated); ``predict_proba`` averages their probabilities.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import scipy.sparse
import scipy.special
import torch

FAMILIES = ("logistic_regression", "mlp")
SOLVERS = ("auto", "newton", "lbfgs")
DEVICES = ("auto", "cpu", "cuda")
SPARSE_DENSITY = 0.3
CUDA_MIN_ELEMENTS = 4_000_000
"""``device="auto"`` moves a fit to CUDA only when n * d reaches this: below it, launch latency outweighs the flops."""


MLP_CHUNK_ELEMENTS = 1 << 19
"""The MLP objective runs over row chunks of about this many elements per [rows, max(d, h)] array (4 MB float64)."""


DEFAULT_L2 = {"logistic_regression": 1e-4, "mlp": 1e-2}
"""The L2 weight when a recipe gives none. The MLP's is 100x the LR's on purpose (issue 10, item 2): at 1e-4 (or 1e-3
on a few thousand rows) retraining an MLP is chaotic, deleting one row lands it in another basin as far from the
last retrain as from the original (measured-findings.md, "MLP: retraining from scratch is chaotic"), so no fast
method can predict it; at 1e-2 trained to convergence it is a smooth function of the data (one-row retrains move
by ~1e-3) for ~1.2 points of Adult test accuracy (0.837 against 0.849 for LR)."""
STALLED_CONVERGED_GRAD = 1e-6
"""L-BFGS "stalled" (its line search can make no more progress in float64) at a max |gradient| this small is a
converged fit: the Adult MLP at l2 = 1e-2 stalls at ~3e-9 after ~160 iterations."""


@dataclass
class TabularRecipe:
    """How a tabular model is trained; stored with every model version so retrains are reproducible.

    ``l2=None`` means the family's default (``DEFAULT_L2``); the resolved value is what is stored."""

    family: str = "logistic_regression"
    hidden_units: int = 10
    l2: float | None = None
    max_iter: int = 500
    tol: float = 1e-9
    seed: int = 0
    solver: str = "auto"
    device: str = "auto"
    newton_max_params: int = 2048

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"unknown model family {self.family!r}; expected one of {FAMILIES}")
        if self.l2 is None:
            self.l2 = DEFAULT_L2[self.family]
        if self.solver not in SOLVERS:
            raise ValueError(f"unknown solver {self.solver!r}; expected one of {SOLVERS}")
        if self.device not in DEVICES:
            raise ValueError(f"unknown device {self.device!r}; expected one of {DEVICES}")
        if self.family == "mlp" and self.solver == "newton":
            raise ValueError("the newton solver is for logistic regression only (the MLP is non-convex)")
        if int(self.hidden_units) < 1 or int(self.max_iter) < 1:
            raise ValueError("hidden_units and max_iter must be positive")
        if not (self.l2 >= 0 and self.tol > 0):
            raise ValueError("l2 must be >= 0 and tol > 0")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> TabularRecipe:
        data = dict(data or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown recipe keys {unknown}; known: {sorted(known)}")
        try:
            return cls(**data)
        except TypeError as exc:
            raise ValueError(str(exc)) from exc


# ---------------------------------------------------------------------------------------------- parameter layout
def _n_out(recipe: TabularRecipe, n_classes: int) -> int:
    if n_classes < 2:
        raise ValueError("n_classes must be at least 2")
    return 1 if (recipe.family == "logistic_regression" and n_classes == 2) else n_classes


def param_shapes(recipe: TabularRecipe, n_features: int, n_classes: int) -> list[tuple[str, tuple[int, ...]]]:
    k, d, h = _n_out(recipe, n_classes), int(n_features), int(recipe.hidden_units)
    if recipe.family == "logistic_regression":
        return [("weight", (k, d)), ("bias", (k,))]
    return [("hidden.weight", (h, d)), ("hidden.bias", (h,)), ("output.weight", (k, h)), ("output.bias", (k,))]


def param_count(recipe: TabularRecipe, n_features: int, n_classes: int) -> int:
    return sum(math.prod(s) for _, s in param_shapes(recipe, n_features, n_classes))


def infer_n_features(recipe: TabularRecipe, n_params: int, n_classes: int) -> int:
    """Inverse of ``param_count`` for a single model."""
    k, h = _n_out(recipe, n_classes), recipe.hidden_units
    if recipe.family == "logistic_regression":
        d, rem = divmod(n_params, k)
        d -= 1
    else:
        d, rem = divmod(n_params - h - k * h - k, h)
    if rem or d < 1:
        raise ValueError(f"{n_params} parameters do not fit a {recipe.family} with {n_classes} classes")
    return d


def unflatten(recipe: TabularRecipe, theta: torch.Tensor, n_features: int, n_classes: int) -> dict[str, torch.Tensor]:
    """Flat vector -> named tensors (views of ``theta``), in ``param_shapes`` order."""
    shapes = param_shapes(recipe, n_features, n_classes)
    total = sum(math.prod(s) for _, s in shapes)
    if theta.numel() != total:
        raise ValueError(f"theta has {theta.numel()} elements, the model needs {total}")
    out, i = {}, 0
    for name, shape in shapes:
        size = math.prod(shape)
        out[name] = theta[i : i + size].view(shape)
        i += size
    return out


def flatten(params: dict[str, torch.Tensor]) -> torch.Tensor:
    """Named tensors (in layout order) -> one flat float32 CPU vector."""
    return torch.cat([p.detach().reshape(-1).to("cpu", torch.float32) for p in params.values()])


def sklearn_C(recipe: TabularRecipe, n_rows: int) -> float:
    """scikit-learn's ``C`` for the same L2 objective: C * sum(loss) + ||w||^2 / 2  ==  n C * (mean + l2/2 ||w||^2)."""
    return 1.0 / (recipe.l2 * n_rows) if recipe.l2 > 0 else float("inf")


def ensemble_size(recipe: TabularRecipe, theta: torch.Tensor, n_features: int, n_classes: int) -> int:
    p = param_count(recipe, n_features, n_classes)
    k, rem = divmod(theta.numel(), p)
    if rem or k < 1:
        raise ValueError(f"theta has {theta.numel()} elements, not a multiple of the model size {p}")
    return k


# ---------------------------------------------------------------------------------------------- objective
def _pick_device(recipe: TabularRecipe, n: int, d: int) -> torch.device:
    if recipe.device == "cuda" or (
        recipe.device == "auto" and torch.cuda.is_available() and n * d >= CUDA_MIN_ELEMENTS
    ):
        if not torch.cuda.is_available():
            raise RuntimeError("recipe.device='cuda' but CUDA is not available")
        return torch.device("cuda")
    return torch.device("cpu")


def sparse_design(X: np.ndarray) -> Any:
    """[X, 1] as the CSR matrix the LR objective runs on for a one-hot (mostly zero) table, or None when the table
    is dense enough to run as is. Slicing its rows gives a subset's ``design`` for ``fit``."""
    Xn = np.asarray(X)
    if Xn.ndim != 2 or Xn.shape[1] < 8 or np.count_nonzero(Xn) >= SPARSE_DENSITY * Xn.size:
        return None
    ones = np.ones((len(Xn), 1))
    return scipy.sparse.hstack([scipy.sparse.csr_matrix(Xn, dtype=np.float64), ones]).tocsr()


class _Objective:
    """Mean cross-entropy + (l2/2)||weights||^2 with analytic gradient (and Hessian for LR), float64.

    ``linear`` (a vector b of the parameter vector's length) adds b . theta / n: Guo et al.'s (2020) objective
    perturbation, written per row like the rest (app/ml/unlearning/certified.py). It adds b / n to the gradient and
    nothing to the Hessian."""

    def __init__(
        self,
        recipe: TabularRecipe,
        X: np.ndarray,
        y: np.ndarray,
        n_classes: int,
        device: torch.device,
        linear: np.ndarray | torch.Tensor | None = None,
        design: Any = None,
        sparse: bool = True,
    ):
        self.recipe, self.C, self.device = recipe, n_classes, device
        self.X = torch.as_tensor(np.asarray(X), dtype=torch.float64, device=device)
        self.n, self.d = self.X.shape
        self._X_np = X
        self._Xa: torch.Tensor | None = None
        self._Xa_sparse: Any = None
        yt = torch.as_tensor(np.asarray(y), dtype=torch.int64, device=device)
        self.yt = yt
        self._buffers: tuple[torch.Tensor, ...] | None = None  # the MLP's per-chunk work arrays (_mlp_value_grad)
        self.k = _n_out(recipe, n_classes)
        if self.k == 1:
            self.yf = yt.to(torch.float64)
        else:
            self.Y = torch.nn.functional.one_hot(yt, n_classes).to(torch.float64)
        self.shapes = param_shapes(recipe, self.d, n_classes)
        self.size = sum(math.prod(s) for _, s in self.shapes)
        mask = []
        for name, shape in self.shapes:
            mask.append(torch.full((math.prod(shape),), 1.0 if name.endswith("weight") else 0.0, dtype=torch.float64))
        self.reg_mask = torch.cat(mask).to(device)
        self.linear: torch.Tensor | None = None
        if linear is not None:
            lin = torch.as_tensor(linear).detach().to(device, torch.float64).reshape(-1)
            if lin.numel() != self.size:
                raise ValueError(f"linear has {lin.numel()} elements, the model has {self.size} parameters")
            self.linear = lin
        # One-hot encoded tables are mostly zeros (Adult: 14 of 105 entries per row). For LR on CPU the objective
        # and gradient then run on a CSR copy of [X, 1]: n * nnz_row work per evaluation instead of n * d.
        if recipe.family == "logistic_regression" and device.type == "cpu" and design is not None:
            self._Xa_sparse, self._y_np, self._mask_np = design, np.asarray(y), self.reg_mask.numpy()
        elif recipe.family == "logistic_regression" and device.type == "cpu" and self.d >= 8 and sparse:
            Xn = np.asarray(X)
            if np.count_nonzero(Xn) < SPARSE_DENSITY * Xn.size:
                ones = np.ones((self.n, 1))
                self._Xa_sparse = scipy.sparse.hstack([scipy.sparse.csr_matrix(Xn, dtype=np.float64), ones]).tocsr()
                self._y_np = np.asarray(y)
                self._mask_np = self.reg_mask.numpy()

    def _sparse_value_grad(self, theta: torch.Tensor, need_grad: bool) -> tuple[float, torch.Tensor | None]:
        A, n, k, d = self._Xa_sparse, self.n, self.k, self.d
        th = theta.detach().cpu().numpy()
        reg_g = self.recipe.l2 * self._mask_np * th
        reg_v = 0.5 * float(reg_g @ th)
        if k == 1:
            z = A @ th
            loss = float(np.mean(np.logaddexp(0.0, z) - self._y_np * z))
            if not need_grad:
                return loss + reg_v, None
            g = A.T @ ((scipy.special.expit(z) - self._y_np) / n)
        else:
            Wa = np.concatenate([th[: k * d].reshape(k, d), th[k * d :, None]], axis=1)
            Z = A @ Wa.T
            lse = scipy.special.logsumexp(Z, axis=1)
            loss = float(np.mean(lse - Z[np.arange(n), self._y_np]))
            if not need_grad:
                return loss + reg_v, None
            G = np.exp(Z - lse[:, None])
            G[np.arange(n), self._y_np] -= 1.0
            gWa = (A.T @ (G / n)).T  # [k, d+1]
            g = np.concatenate([gWa[:, :d].reshape(-1), gWa[:, d]])
        return loss + reg_v, torch.from_numpy(np.asarray(g) + reg_g)

    def _split(self, theta: torch.Tensor) -> list[torch.Tensor]:
        out, i = [], 0
        for _, shape in self.shapes:
            size = math.prod(shape)
            out.append(theta[i : i + size].view(shape))
            i += size
        return out

    def _reg(self, theta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        l2 = self.recipe.l2
        wt = theta * self.reg_mask
        return 0.5 * l2 * (wt * theta).sum(), l2 * wt

    def value_grad(self, theta: torch.Tensor, need_grad: bool = True) -> tuple[float, torch.Tensor | None]:
        if self.linear is None:
            return self._value_grad(theta, need_grad)
        value, grad = self._value_grad(theta, need_grad)
        lin = self.linear.to(theta.device)
        value += float(lin @ theta.to(torch.float64)) / self.n
        return value, (None if grad is None else grad + lin.to(grad.device) / self.n)

    def _value_grad(self, theta: torch.Tensor, need_grad: bool) -> tuple[float, torch.Tensor | None]:
        if self._Xa_sparse is not None:
            return self._sparse_value_grad(theta, need_grad)
        n = self.n
        if self.recipe.family == "logistic_regression":
            W, b = self._split(theta)
            if self.k == 1:
                z = self.X @ W[0] + b[0]
                loss = (torch.nn.functional.softplus(z) - self.yf * z).mean()
                gz = (torch.sigmoid(z) - self.yf) / n if need_grad else None
                grads = (gz @ self.X, gz.sum().reshape(1)) if need_grad else None
            else:
                Z = self.X @ W.T + b
                lse = torch.logsumexp(Z, dim=1)
                loss = (lse - (Z * self.Y).sum(1)).mean()
                if need_grad:
                    G = (torch.exp(Z - lse[:, None]) - self.Y) / n
                    grads = (G.T @ self.X, G.sum(0))
        else:
            loss, grads = self._mlp_value_grad(theta, need_grad)
        reg_v, reg_g = self._reg(theta)
        value = float(loss + reg_v)
        if not need_grad:
            return value, None
        return value, torch.cat([g.reshape(-1) for g in grads]) + reg_g

    def _mlp_value_grad(self, theta: torch.Tensor, need_grad: bool) -> tuple[torch.Tensor, tuple | None]:
        """The MLP's mean loss and gradient over row chunks, every intermediate written into buffers kept with the
        objective: on 800,000 rows the whole-table version spent most of its 0.64 s per evaluation allocating and
        first touching fresh [n, h] arrays (page faults), not computing; chunked with reused buffers the same
        evaluation took 0.15 s (measured on this 2-core machine; the sums differ from it only by rounding, ~1e-15)."""
        W1, b1, W2, b2 = self._split(theta)
        n = self.n
        rows = min(n, max(256, MLP_CHUNK_ELEMENTS // max(self.d, int(self.recipe.hidden_units), self.k)))
        if self._buffers is None or self._buffers[0].shape[0] != rows:
            h, f64 = int(self.recipe.hidden_units), dict(dtype=torch.float64, device=self.device)
            self._buffers = (
                torch.empty(rows, h, **f64),  # hidden activations A
                torch.empty(rows, h, **f64),  # back-propagated hidden gradient
                torch.empty(rows, h, **f64),  # sigmoid'(u) = A (1 - A)
                torch.empty(rows, self.k, **f64),  # logits Z
                torch.empty(rows, self.k, **f64),  # softmax(Z) - Y
                torch.empty(rows, **f64),  # logsumexp(Z)
            )
        bA, bG, bS, bZ, bE, bL = self._buffers
        loss = torch.zeros((), dtype=torch.float64, device=self.device)
        if need_grad:
            gW1, gb1, gW2, gb2 = (torch.zeros_like(t) for t in (W1, b1, W2, b2))
        for s in range(0, n, rows):
            e = min(s + rows, n)
            m, x = e - s, self.X[s:e]
            A, Z, lse = bA[:m], bZ[:m], bL[:m]
            torch.addmm(b1, x, W1.T, out=A)
            A.sigmoid_()
            torch.addmm(b2, A, W2.T, out=Z)
            torch.logsumexp(Z, 1, out=lse)
            loss += lse.sum() - Z.gather(1, self.yt[s:e, None]).sum()
            if not need_grad:
                continue
            E, G, S = bE[:m], bG[:m], bS[:m]
            torch.sub(Z, lse[:, None], out=E)
            E.exp_().sub_(self.Y[s:e])
            torch.mm(E, W2, out=G)
            torch.mul(A, A, out=S)
            torch.sub(A, S, out=S)
            G.mul_(S)
            gW1.addmm_(G.T, x)
            gb1.add_(G.sum(0))
            gW2.addmm_(E.T, A)
            gb2.add_(E.sum(0))
        if not need_grad:
            return loss / n, None
        return loss / n, (gW1 / n, gb1 / n, gW2 / n, gb2 / n)

    def _weighted_gram(self, w: torch.Tensor) -> torch.Tensor:
        """[X, 1]^T diag(w) [X, 1], accumulated in float32: the Hessian only sets the Newton direction (the float64
        gradient decides where Newton converges), and a dense float32 product was measured ~2x faster than both the
        float64 and the sparse one on one-hot data."""
        if self._Xa is None:
            ones = torch.ones(self.n, 1, dtype=torch.float32, device=self.device)
            self._Xa = torch.cat([torch.as_tensor(self._X_np, dtype=torch.float32, device=self.device), ones], dim=1)
        w32 = w.to(torch.float32)
        return ((self._Xa * w32[:, None]).T @ self._Xa).to(torch.float64)

    def hessian(self, theta: torch.Tensor) -> torch.Tensor:
        """Exact Hessian of the LR objective in the flat layout (weights of all outputs first, then biases)."""
        n, d, k = self.n, self.d, self.k
        W, b = self._split(theta)
        if k == 1:
            p = torch.sigmoid(self.X @ W[0] + b[0])
            Ha = self._weighted_gram(p * (1 - p) / n)  # [(d+1), (d+1)] in (w..., b) order == flat layout
        else:
            P = torch.softmax(self.X @ W.T + b, dim=1)
            Ha = torch.empty(k, d + 1, k, d + 1, dtype=torch.float64, device=self.device)
            for c in range(k):
                for c2 in range(c, k):
                    block = self._weighted_gram(P[:, c] * ((1.0 if c == c2 else 0.0) - P[:, c2]) / n)
                    Ha[c, :, c2, :] = block
                    if c2 != c:
                        Ha[c2, :, c, :] = block.T
            # reorder (c, j) with j = d for the bias  ->  flat layout [W (k*d) ..., b (k)]
            idx = torch.cat(
                [torch.arange(k * (d + 1)).view(k, d + 1)[:, :d].reshape(-1), torch.arange(k) * (d + 1) + d]
            )
            idx = idx.to(self.device)
            Ha = Ha.reshape(k * (d + 1), k * (d + 1))[idx][:, idx]
        return Ha + torch.diag(self.recipe.l2 * self.reg_mask)


# ---------------------------------------------------------------------------------------------- per-row sums
HESSIAN_KINDS = ("exact", "gauss_newton")
HESSIAN_CHUNK_ELEMENTS = 1 << 23
"""The MLP Hessian is built over row chunks so that each chunk's Jacobian (rows * C * p float64 values) stays near
this many elements (64 MB)."""


def regularisation_mask(recipe: TabularRecipe, n_features: int, n_classes: int) -> torch.Tensor:
    """1.0 on penalised coordinates (weights), 0.0 on biases, float64 in the flat layout."""
    parts = [
        torch.full((math.prod(shape),), 1.0 if name.endswith("weight") else 0.0, dtype=torch.float64)
        for name, shape in param_shapes(recipe, n_features, n_classes)
    ]
    return torch.cat(parts)


def _as_theta64(theta: torch.Tensor | np.ndarray) -> torch.Tensor:
    return torch.as_tensor(theta).detach().to("cpu", torch.float64).reshape(-1)


def objective_gradient(
    recipe: TabularRecipe,
    theta: torch.Tensor,
    X: np.ndarray,
    y: np.ndarray,
    n_classes: int,
    linear: np.ndarray | torch.Tensor | None = None,
) -> tuple[float, torch.Tensor]:
    """Value and gradient of the training objective (mean cross-entropy over these rows + (l2/2)||weights||^2, plus
    ``linear . theta / n`` when given) at ``theta``: the very function ``fit`` minimises, float64 on the CPU. One pass
    over the rows."""
    X = np.asarray(X)
    if len(X) == 0:
        raise ValueError("the objective over no rows is undefined")
    # one evaluation: the dense rows as they are (building the CSR copy that pays off over a fit's many
    # evaluations cost more than the pass itself: 0.1 s per gradient on Adult, several per deletion)
    obj = _Objective(recipe, X, np.asarray(y), n_classes, _pick_device(recipe, *X.shape), linear, sparse=False)
    value, grad = obj.value_grad(_as_theta64(theta).to(obj.device))
    return value, grad.to("cpu", torch.float64)


GRADIENT_BLOCK = 65_536
"""Rows per block of ``masked_objective_gradient``'s float64 pass (the block's copy stays within the caches' reach)."""


def masked_objective_gradient(
    recipe: TabularRecipe, theta: torch.Tensor, X: np.ndarray, y: np.ndarray, n_classes: int, mask: np.ndarray
) -> torch.Tensor:
    """``objective_gradient``'s gradient over the rows ``mask`` marks, without copying them out of the table:
    logistic regression in float64 blocks of GRADIENT_BLOCK rows (the retained rows of a 1M-row table copied, then
    converted to float64 whole, cost a Newton deletion ~0.1 s for its residual); the MLP on the copied rows. The same
    sums up to the order of float64 summation."""
    X, y, mask = np.asarray(X), np.asarray(y), np.asarray(mask, bool)
    if recipe.family != "logistic_regression":
        return objective_gradient(recipe, theta, X[mask], y[mask], n_classes)[1]
    n = int(np.count_nonzero(mask))
    if n == 0:
        raise ValueError("the objective over no rows is undefined")
    th = _as_theta64(theta)
    d, k = X.shape[1], _n_out(recipe, n_classes)
    p = unflatten(recipe, th, d, n_classes)
    W, b = p["weight"].numpy(), p["bias"].numpy()  # [k, d], [k]
    gW, gb = np.zeros_like(W), np.zeros_like(b)
    for start in range(0, len(X), GRADIENT_BLOCK):
        keep = mask[start : start + GRADIENT_BLOCK]
        rows = np.asarray(X[start : start + GRADIENT_BLOCK][keep], np.float64)
        labels = y[start : start + GRADIENT_BLOCK][keep]
        Z = rows @ W.T + b
        if k == 1:  # d loss / dz = sigmoid(z) - y
            R = scipy.special.expit(Z) - labels[:, None]
        else:  # softmax(z) - onehot(y)
            R = np.exp(Z - scipy.special.logsumexp(Z, axis=1, keepdims=True))
            R[np.arange(len(R)), labels] -= 1.0
        gW += R.T @ rows
        gb += R.sum(axis=0)
    grad = torch.from_numpy(np.concatenate([gW.reshape(-1), gb]) / n)
    return grad + recipe.l2 * regularisation_mask(recipe, d, n_classes) * th


def data_gradient_sum(
    recipe: TabularRecipe, theta: torch.Tensor, X: np.ndarray, y: np.ndarray, n_classes: int
) -> torch.Tensor:
    """sum_i grad loss_i(theta) over the rows (no penalty, no 1/n): per-row contributions add and subtract exactly,
    which is what a Newton downdate needs. Zeros for no rows."""
    th = _as_theta64(theta)
    n = len(X)
    if n == 0:
        return torch.zeros_like(th)
    _, grad = objective_gradient(recipe, th, X, y, n_classes)
    reg = recipe.l2 * regularisation_mask(recipe, np.asarray(X).shape[1], n_classes) * th
    return n * (grad - reg)


def center_output_bias(recipe: TabularRecipe, theta: torch.Tensor, n_features: int, n_classes: int) -> torch.Tensor:
    """A copy of a single model's theta whose output biases average 0 (softmax layouts; sigmoid ones are unchanged).

    Softmax is unchanged by adding one constant to every output bias and the penalty skips biases, so the objective
    is flat along that direction and the solvers leave it wherever rounding puts it (the LR Newton solver divides
    rounding noise by its 1e-10 ridge there: two fits of the same data can differ by ~1 in every bias). Parameter
    distances between models (unlearned vs retrained) are only meaningful after this.
    """
    out = torch.as_tensor(theta).detach().clone()
    k = param_shapes(recipe, n_features, n_classes)[-1][1][0]
    if k > 1:
        out[-k:] -= out[-k:].mean()
    return out


def _mlp_hessian_sum(
    recipe: TabularRecipe, theta: torch.Tensor, X: np.ndarray, y: np.ndarray, n_classes: int, kind: str
) -> torch.Tensor:
    """Hand-written MLP Hessian summed over rows, in the flat layout (float64).

    With u = W1 x + b1, a = sigmoid(u), z = W2 a + b2, p = softmax(z), e = p - y and J_i = d z_i / d theta:
    Gauss-Newton part sum_i J_i^T (diag(p_i) - p_i p_i^T) J_i, plus (``kind="exact"``) the network's own curvature
    sum_c e_c d^2 z_c: on unit j's (w_j, b_j) block sum_i (e_i W2)_j sigmoid''(u_ij) [x_i, 1][x_i, 1]^T, and between
    (w_j, b_j) and W2[c, j] the cross term sum_i e_ic sigmoid'(u_ij) [x_i, 1]. Written out rather than taken with
    autodiff, as ``_Objective`` is: 1.0 s against 5.9 s for torch.func's forward-over-reverse Hessian (3,000 rows,
    105 features, 1,082 parameters, one thread); Gauss-Newton alone 0.4 s.
    """
    p, h, C = theta.numel(), int(recipe.hidden_units), int(n_classes)
    n_all, d = np.asarray(X).shape
    params = unflatten(recipe, theta, d, C)
    W1, b1, W2, b2 = (params[k] for k in ("hidden.weight", "hidden.bias", "output.weight", "output.bias"))
    rows = max(1, HESSIAN_CHUNK_ELEMENTS // (C * p))
    yt = torch.as_tensor(np.asarray(y), dtype=torch.int64)
    out = torch.zeros(p, p, dtype=torch.float64)
    o_b1, o_w2, o_b2 = h * d, h * d + h, h * d + h + C * h
    # index of unit j's [w_j, b_j] coordinates in the flat layout, [h, d + 1]
    hidden_idx = torch.cat([torch.arange(h * d).view(h, d), torch.arange(o_b1, o_w2).view(h, 1)], dim=1)
    for start in range(0, n_all, rows):
        Xc = torch.as_tensor(np.asarray(X[start : start + rows]), dtype=torch.float64)
        n = len(Xc)
        Xa = torch.cat([Xc, torch.ones(n, 1, dtype=torch.float64)], dim=1)
        A = torch.sigmoid(Xc @ W1.T + b1)
        S1 = A * (1 - A)
        Z = A @ W2.T + b2
        P = torch.softmax(Z, dim=1)
        J = torch.zeros(n, C, p, dtype=torch.float64)
        G = W2[None, :, :] * S1[:, None, :]  # dz_c / du_j, [n, C, h]
        J[:, :, :o_b1] = (G[..., None] * Xc[:, None, None, :]).reshape(n, C, h * d)
        J[:, :, o_b1:o_w2] = G
        eye = torch.eye(C, dtype=torch.float64)
        J[:, :, o_w2:o_b2] = (eye[None, :, :, None] * A[:, None, None, :]).reshape(n, C, C * h)
        J[:, :, o_b2:] = eye
        PJ = torch.einsum("ic,icp->ip", P, J)
        AJ = P[:, :, None] * (J - PJ[:, None, :])
        out += J.reshape(-1, p).T @ AJ.reshape(-1, p)
        if kind != "exact":
            continue
        E = P.clone()
        E[torch.arange(n), yt[start : start + rows]] -= 1.0
        D = (E @ W2) * S1 * (1 - 2 * A)  # (e W2)_j sigmoid''(u_j), [n, h]
        for j in range(h):
            idx = hidden_idx[j]
            out[idx[:, None], idx[None, :]] += (Xa * D[:, j : j + 1]).T @ Xa
        K = torch.einsum("ic,ij,if->cjf", E, S1, Xa)  # [C, h, d + 1]
        for c in range(C):
            for j in range(h):
                col = o_w2 + c * h + j
                out[hidden_idx[j], col] += K[c, j]
                out[col, hidden_idx[j]] += K[c, j]
    return out


def data_hessian_sum(
    recipe: TabularRecipe,
    theta: torch.Tensor,
    X: np.ndarray,
    y: np.ndarray,
    n_classes: int,
    kind: str = "exact",
) -> torch.Tensor:
    """sum_i Hessian of loss_i at ``theta`` over the rows (no penalty, no 1/n), float64 [p, p] on the CPU.

    Logistic regression: ``_Objective.hessian`` (its Gauss-Newton matrix is the Hessian, so ``kind`` does not
    matter). MLP: ``kind="exact"`` (indefinite away from a minimum) or ``"gauss_newton"`` (positive semi-definite,
    drops the second derivative of the network). Zeros for no rows.
    """
    if kind not in HESSIAN_KINDS:
        raise ValueError(f"unknown Hessian kind {kind!r}; expected one of {HESSIAN_KINDS}")
    X = np.asarray(X)
    th = _as_theta64(theta)
    n = len(X)
    if n == 0:
        return torch.zeros(th.numel(), th.numel(), dtype=torch.float64)
    if recipe.family == "mlp":
        return _mlp_hessian_sum(recipe, th, X, np.asarray(y), n_classes, kind)
    obj = _Objective(recipe, X, np.asarray(y), n_classes, _pick_device(recipe, *X.shape))
    H = obj.hessian(th.to(obj.device)).to("cpu", torch.float64)
    return n * (H - torch.diag(recipe.l2 * regularisation_mask(recipe, X.shape[1], n_classes)))


# ---------------------------------------------------------------------------------------------- solvers
def _init_theta(recipe: TabularRecipe, d: int, n_classes: int) -> np.ndarray:
    """Deterministic start: zeros for LR (convex, the start only changes the iteration count), seeded Glorot for MLP."""
    size = param_count(recipe, d, n_classes)
    if recipe.family == "logistic_regression":
        return np.zeros(size)
    rng = np.random.default_rng(recipe.seed)
    h, k = recipe.hidden_units, n_classes
    a1, a2 = math.sqrt(6.0 / (d + h)), math.sqrt(6.0 / (h + k))
    return np.concatenate([rng.uniform(-a1, a1, h * d), np.zeros(h), rng.uniform(-a2, a2, k * h), np.zeros(k)]).astype(
        np.float64
    )


def _newton(obj: _Objective, theta: torch.Tensor, recipe: TabularRecipe) -> tuple[torch.Tensor, dict[str, Any]]:
    f, g = obj.value_grad(theta)
    steps, status = 0, "max_iter"
    eye = torch.eye(obj.size, dtype=torch.float64, device=obj.device)
    while steps < min(recipe.max_iter, 200):
        if float(g.abs().max()) <= recipe.tol:
            status = "converged"
            break
        H = obj.hessian(theta)
        # Softmax LR is invariant to adding a constant to all biases: a tiny ridge keeps Cholesky defined there
        # (the gradient has no component along that direction, so the step is unaffected).
        L, info = torch.linalg.cholesky_ex(H + 1e-10 * eye)
        if int(info) != 0:
            L, _ = torch.linalg.cholesky_ex(H + 1e-6 * eye)
        step = torch.cholesky_solve(g[:, None], L)[:, 0]
        decrement = float(g @ step)
        if decrement <= 1e-26:
            status = "converged"
            break
        alpha = 1.0
        while True:
            cand = theta - alpha * step
            fc, gc = obj.value_grad(cand, need_grad=alpha == 1.0)  # the full step is nearly always taken
            if fc <= f - 1e-4 * alpha * decrement or alpha < 1e-10:
                break
            alpha *= 0.5
        if alpha < 1e-10:  # no decrease is measurable any more in float64: we are at the optimum to rounding
            status = "converged"
            break
        theta = cand
        steps += 1
        f, g = (fc, gc) if gc is not None else obj.value_grad(theta)
    return theta, {
        "solver": "newton",
        "iterations": steps,
        "status": status,
        "loss": f,
        "grad_max": float(g.abs().max()),
    }


def _lbfgs(obj: _Objective, x0: np.ndarray, recipe: TabularRecipe) -> tuple[torch.Tensor, dict[str, Any]]:
    """Full-batch torch L-BFGS with a strong-Wolfe line search on the float64 objective.

    torch's implementation rather than scipy's L-BFGS-B: on these ~1,000-parameter problems scipy spent more time in
    its own bookkeeping per iteration than in the objective (measured ~3x slower end to end on 3,000-row MLP fits).
    """
    param = torch.nn.Parameter(torch.from_numpy(np.array(x0, dtype=np.float64)).to(obj.device))
    opt = torch.optim.LBFGS(
        [param],
        lr=1.0,
        max_iter=int(recipe.max_iter),
        max_eval=int(recipe.max_iter * 5 // 4) + 10,
        tolerance_grad=float(recipe.tol),
        tolerance_change=1e-15,
        history_size=20,
        line_search_fn="strong_wolfe",
    )

    def closure() -> torch.Tensor:
        value, grad = obj.value_grad(param.data)
        param.grad = grad
        return torch.tensor(value, dtype=torch.float64)

    opt.step(closure)
    state = opt.state[param]
    iterations = int(state.get("n_iter", 0))
    value, grad = obj.value_grad(param.data)
    gmax = float(grad.abs().max())
    status = "converged" if gmax <= recipe.tol else ("max_iter" if iterations >= recipe.max_iter else "stalled")
    info = {"solver": "lbfgs", "iterations": iterations, "status": status, "loss": value, "grad_max": gmax}
    if status == "stalled" and gmax <= STALLED_CONVERGED_GRAD:
        info.update(status="converged", stopped_by="line search stalled at float64 precision")
    return param.data.detach(), info


def fit(
    recipe: TabularRecipe,
    X: np.ndarray,
    y: np.ndarray,
    n_classes: int,
    init: torch.Tensor | np.ndarray | None = None,
    linear: np.ndarray | torch.Tensor | None = None,
    design: Any = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """``train`` plus solver facts (iterations, status, final loss and max |gradient|). ``design``: these rows as
    ``sparse_design`` gives them, when the caller fits many subsets of one table (the CSR is built once)."""
    X = np.asarray(X)
    y = np.asarray(y)
    if X.ndim != 2 or len(X) != len(y) or len(X) == 0:
        raise ValueError(f"X must be [n, d] with n = len(y) > 0; got {X.shape} and {y.shape}")
    n, d = X.shape
    device = _pick_device(recipe, n, d)
    obj = _Objective(recipe, X, y, n_classes, device, linear, design if device.type == "cpu" else None)
    x0 = _init_theta(recipe, d, n_classes) if init is None else np.asarray(torch.as_tensor(init), dtype=np.float64)
    if x0.shape != (obj.size,):
        raise ValueError(f"init has shape {x0.shape}, the model needs ({obj.size},)")
    solver = recipe.solver
    if solver == "auto":
        lr_small = recipe.family == "logistic_regression" and obj.size <= recipe.newton_max_params
        solver = "newton" if lr_small else "lbfgs"
    if solver == "newton":
        theta, info = _newton(obj, torch.from_numpy(x0).to(device), recipe)
    else:
        theta, info = _lbfgs(obj, x0, recipe)
    info["device"] = device.type
    return theta.to("cpu", torch.float32).contiguous(), info


def train(
    recipe: TabularRecipe,
    X: np.ndarray,
    y: np.ndarray,
    n_classes: int,
    init: torch.Tensor | np.ndarray | None = None,
    linear: np.ndarray | torch.Tensor | None = None,
) -> torch.Tensor:
    """Fit the recipe's model on (X, y) and return its flat float32 CPU parameter vector (deterministic per seed).

    ``init`` warm-starts the solver (SISA continues a constituent from its previous slice checkpoint with it).
    ``linear`` (b) adds b . theta / n to the objective (Guo et al.'s objective perturbation; n = len(X)).
    """
    return fit(recipe, X, y, n_classes, init, linear)[0]


# ---------------------------------------------------------------------------------------------- prediction
def _single_logits(recipe: TabularRecipe, theta: torch.Tensor, X: torch.Tensor, n_classes: int) -> torch.Tensor:
    p = unflatten(recipe, theta.to(torch.float64), X.shape[1], n_classes)
    if recipe.family == "logistic_regression":
        Z = X @ p["weight"].T + p["bias"]
        if Z.shape[1] == 1:  # binary: class 0 has logit 0, class 1 has z
            Z = torch.cat([torch.zeros_like(Z), Z], dim=1)
        return Z
    A = torch.sigmoid(X @ p["hidden.weight"].T + p["hidden.bias"])
    return A @ p["output.weight"].T + p["output.bias"]


def predict_logits(recipe: TabularRecipe, theta: torch.Tensor, X: np.ndarray, n_classes: int) -> np.ndarray:
    """Per-class logits [n, C] of a single model (float64); softmax of them is ``predict_proba``."""
    Xt = torch.as_tensor(np.asarray(X), dtype=torch.float64)
    theta = torch.as_tensor(theta).detach().cpu()
    if ensemble_size(recipe, theta, Xt.shape[1], n_classes) != 1:
        raise ValueError("an ensemble theta has no single set of logits; use predict_proba")
    return _single_logits(recipe, theta, Xt, n_classes).numpy()


def predict_logits_many(recipe: TabularRecipe, thetas: torch.Tensor, X: np.ndarray, n_classes: int):
    """``predict_logits`` of each single model in ``thetas`` ([N, P]) on the same rows, the rows converted once (a
    LiRA audit scores 64 shadows on the same rows: converting them per shadow was most of its time)."""
    Xt = torch.as_tensor(np.asarray(X), dtype=torch.float64)
    for theta in torch.as_tensor(thetas).detach().cpu():
        yield _single_logits(recipe, theta, Xt, n_classes).numpy()


def predict_logits_stacked(recipe: TabularRecipe, thetas: torch.Tensor, X: np.ndarray, n_classes: int) -> np.ndarray:
    """``predict_logits`` of each single model in ``thetas`` ([N, P]) on the same rows, as one array [N, n, C]: for
    logistic regression every model's logits come from ONE product of the rows with the stacked weights (a LiRA
    audit's 64 shadows scored one product at a time, with their φ computed per shadow, cost a 1M-row deletion
    0.15 s); the MLP goes model by model (``predict_logits_many``)."""
    thetas = torch.as_tensor(thetas).detach().cpu()
    Xt = torch.as_tensor(np.asarray(X), dtype=torch.float64)
    N, d = thetas.shape[0], Xt.shape[1]
    if recipe.family != "logistic_regression" or N == 0:
        out = list(predict_logits_many(recipe, thetas, X, n_classes))
        return np.stack(out) if out else np.zeros((0, len(Xt), n_classes))
    shapes = dict(param_shapes(recipe, d, n_classes))
    k = shapes["weight"][0]
    if thetas.shape[1] != k * d + k:
        raise ValueError(f"each theta must have {k * d + k} elements, got {thetas.shape[1]}")
    th = thetas.to(torch.float64)
    W, b = th[:, : k * d].reshape(N * k, d), th[:, k * d :].reshape(N * k)
    Z = (Xt @ W.T + b).reshape(len(Xt), N, k).permute(1, 0, 2)  # [N, n, k]
    if k == 1:  # binary: class 0 has logit 0, class 1 has z
        Z = torch.cat([torch.zeros_like(Z), Z], dim=2)
    return Z.numpy()


def predict_proba(recipe: TabularRecipe, theta: torch.Tensor, X: np.ndarray, n_classes: int) -> np.ndarray:
    """Class probabilities [n, C] (float64). An ensemble theta (k concatenated models) averages its members."""
    Xt = torch.as_tensor(np.asarray(X), dtype=torch.float64)
    theta = torch.as_tensor(theta).detach().cpu()
    k = ensemble_size(recipe, theta, Xt.shape[1], n_classes)
    members = theta.view(k, -1)
    probs = torch.zeros(Xt.shape[0], n_classes, dtype=torch.float64)
    for member in members:
        probs += torch.softmax(_single_logits(recipe, member, Xt, n_classes), dim=1)
    return (probs / k).numpy()


def predict(recipe: TabularRecipe, theta: torch.Tensor, X: np.ndarray, n_classes: int) -> np.ndarray:
    """The arg-max class; a single model's from its logits (the same arg-max as the softmax's, without it)."""
    theta = torch.as_tensor(theta).detach().cpu()
    if ensemble_size(recipe, theta, np.asarray(X).shape[1], n_classes) == 1:
        return predict_logits(recipe, theta, X, n_classes).argmax(1)
    return predict_proba(recipe, theta, X, n_classes).argmax(1)


PREDICT_BLOCK = 65_536
"""Rows per block of ``predict_many``: its float64 copy of a block stays small (a 1M-row table at once is 160 MB)."""


def predict_many(recipe: TabularRecipe, thetas: list, X: np.ndarray, n_classes: int) -> list[np.ndarray]:
    """``predict`` of each model in ``thetas`` on the same rows. Single logistic-regression models: one pass over
    the rows, PREDICT_BLOCK at a time in float64, every model's logits from one product (a deletion's before/after
    accuracies cost a 1M-row table two float64 copies and two products); anything else model by model."""
    X = np.asarray(X)
    ths = [torch.as_tensor(t).detach().cpu() for t in thetas]
    d = X.shape[1]
    if recipe.family != "logistic_regression" or any(ensemble_size(recipe, t, d, n_classes) != 1 for t in ths):
        return [predict(recipe, t, X, n_classes) for t in ths]
    k = dict(param_shapes(recipe, d, n_classes))["weight"][0]
    stacked = torch.stack([t.to(torch.float64) for t in ths]).numpy()  # [m, k d + k]
    W, b = stacked[:, : k * d].reshape(-1, d), stacked[:, k * d :].reshape(-1)
    out = [np.empty(len(X), np.int64) for _ in ths]
    for start in range(0, len(X), PREDICT_BLOCK):
        Z = np.asarray(X[start : start + PREDICT_BLOCK], np.float64) @ W.T + b  # [rows, m k]
        for i, pred in enumerate(out):
            if k == 1:  # binary: class 0 has logit 0; the arg-max of [0, z] (as predict takes it) is z > 0 (NaN: 1)
                z = Z[:, i]
                pred[start : start + len(Z)] = (z > 0) | np.isnan(z)
            else:
                pred[start : start + len(Z)] = Z[:, i * k : (i + 1) * k].argmax(1)
    return out


def accuracy(recipe: TabularRecipe, theta: torch.Tensor, X: np.ndarray, y: np.ndarray, n_classes: int) -> float:
    """Fraction of rows whose arg-max class equals ``y`` (NaN for no rows)."""
    if len(y) == 0:
        return float("nan")
    return float((predict(recipe, theta, X, n_classes) == np.asarray(y)).mean())

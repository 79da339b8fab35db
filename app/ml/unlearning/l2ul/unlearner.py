"""N_U: the learned unlearning function theta' = N_U(mu_D, mu_f, theta) (notes §1.1, §1.3; paper Eq. 2).

The paper fixes only "two hidden layers", the input concat(mu_D, mu_f, theta), output theta' and an MSE loss to
theta_r; widths, activation, optimiser and scaling are unknown (notes §1.13). The choices here, and why:

- **Residual target** ``(theta_r - theta) / rho`` instead of theta_r [INFERENCE]. theta' ~ theta for small D_f, so
  predicting theta itself would spend the network's capacity copying its input and bury the O(|f|/n) change in the
  copying error. ``rho = |f| / (n - |f|)`` (config ``scale_by_forget_fraction``) is the first-order size of that
  change: at theta (the optimum on D) the retained-set gradient is -rho (grad R(theta) + mean_f grad l), so one
  Newton step gives theta_r - theta ~ rho * H^-1 (grad R + mean_f grad l), an *intensive* quantity. Dividing by rho
  makes targets from meta-tasks on s = 1,000 rows valid for a deletion from n = 26,000 or 800,000 rows; without it
  the network, trained only on subsets, would over-shoot every real deletion by n / s (the distribution shift the
  notes' reviewers point at, §1.12 item 4). The loss is the MSE of this scaled residual (Eq. 2 up to the scaling).
- **Standardised inputs and targets** (per column, from the meta-set): mu blocks, theta and the residual live on very
  different scales.
- **Two hidden layers** (paper) of ``hidden`` units with GELU, plus a **linear path** (config ``linear_skip``,
  [INFERENCE]) fitted in closed form by ridge regression (scikit-learn RidgeCV, alpha by generalised
  cross-validation). To first order the scaled residual is linear in mu_f (a mean of per-row influences), so the
  ridge map already is a good N_U; the hidden layers learn the theta- and mu_D-dependent corrections on top of it.
  Their output layer starts at zero, so training starts exactly at the ridge solution, and early stopping on a
  held-out tenth of the tasks keeps the best of the two. The linear path is not trained by gradient: it is exact and
  cheap, and on a purge it is re-solved on the remaining tasks, so the dropped tasks leave no trace in it.
- **Full-batch AdamW** on the hidden layers (meta-sets have ~1,000 rows); widths 64 keep a fit to seconds on two
  cores (the linear path carries most of the signal). A fit always starts from the seeded initialisation; nothing
  refits N_U after a purge any more (method.py drops whole units instead).
"""

from __future__ import annotations

import copy
import json
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import scipy.special
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import nn

ACTIVATIONS = {"gelu": nn.GELU, "relu": nn.ReLU, "tanh": nn.Tanh, "silu": nn.SiLU}
_NUMPY_ACTIVATIONS = {
    "gelu": lambda z: 0.5 * z * (1.0 + scipy.special.erf(z / np.sqrt(2.0))),
    "relu": lambda z: np.maximum(z, 0.0),
    "tanh": np.tanh,
    "silu": lambda z: z * scipy.special.expit(z),
}


@dataclass
class UnlearnerConfig:
    hidden: tuple[int, int] = (64, 64)
    activation: str = "gelu"
    linear_skip: bool = True
    epochs: int = 400
    lr: float = 1e-3
    weight_decay: float = 1e-4
    validation_fraction: float = 0.1
    ridge_alphas: tuple[float, ...] = field(default=(1e-3, 1e-2, 0.1, 1.0, 10.0, 100.0, 1e3, 1e4, 1e5, 1e6, 1e7))
    seed: int = 0

    def __post_init__(self) -> None:
        self.hidden = tuple(int(h) for h in self.hidden)
        self.ridge_alphas = tuple(float(a) for a in self.ridge_alphas)
        if len(self.hidden) != 2 or min(self.hidden) < 1:
            raise ValueError("N_U has exactly two hidden layers (paper §4.1): give two positive widths")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {self.activation!r}; expected one of {sorted(ACTIVATIONS)}")


class UnlearnerNet(nn.Module):
    def __init__(self, n_in: int, n_out: int, hidden: tuple[int, int], activation: str, linear_skip: bool):
        super().__init__()
        act = ACTIVATIONS[activation]
        self.mlp = nn.Sequential(
            nn.Linear(n_in, hidden[0]), act(), nn.Linear(hidden[0], hidden[1]), act(), nn.Linear(hidden[1], n_out)
        )
        self.skip = nn.Linear(n_in, n_out) if linear_skip else None
        if self.skip is not None:
            self.skip.requires_grad_(False)  # solved in closed form (ridge), see the module docstring

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.mlp(x)
        return out + self.skip(x) if self.skip is not None else out


@contextmanager
def single_torch_thread():
    """Small models and s-row fits gain nothing from intra-op threads, and on a shared machine the thread pool's
    hand-offs cost more than the arithmetic (measured 16x slower with 2 threads on 2 busy cores)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _stats(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    mean = a.mean(0)
    std = a.std(0)
    return mean.astype(np.float32), np.where(std > 1e-8, std, 1.0).astype(np.float32)


class Unlearner:
    """N_U with its normalisation; ``fit`` on a meta-set, ``predict`` the residual (scaled units)."""

    def __init__(self, config: UnlearnerConfig, n_in: int, n_out: int):
        self.config, self.n_in, self.n_out = config, n_in, n_out
        torch.manual_seed(config.seed)
        self.net = UnlearnerNet(n_in, n_out, config.hidden, config.activation, config.linear_skip)
        self.x_mean = np.zeros(n_in, np.float32)
        self.x_std = np.ones(n_in, np.float32)
        self.y_mean = np.zeros(n_out, np.float32)
        self.y_std = np.ones(n_out, np.float32)
        self.history: dict[str, Any] = {}
        self._cache: tuple[Any, ...] | None = None

    # ------------------------------------------------------------------ training
    def _ridge_init(self, Xs: np.ndarray, Ys: np.ndarray, reset_mlp: bool) -> float:
        from sklearn.linear_model import RidgeCV

        # one alpha per output coordinate: some parameters' changes are predictable from mu_f, others (e.g. the
        # weight of a category with two rows in a 1,000-row subset) are not and are better shrunk to "no change".
        ridge = RidgeCV(alphas=self.config.ridge_alphas, fit_intercept=True, alpha_per_target=True).fit(Xs, Ys)
        with torch.no_grad():
            self.net.skip.weight.copy_(torch.as_tensor(np.atleast_2d(ridge.coef_), dtype=torch.float32))
            self.net.skip.bias.copy_(torch.as_tensor(np.atleast_1d(ridge.intercept_), dtype=torch.float32))
            if reset_mlp:
                self.net.mlp[-1].weight.zero_()
                self.net.mlp[-1].bias.zero_()
        return float(np.median(ridge.alpha_))

    def fit(self, inputs: np.ndarray, targets: np.ndarray) -> dict[str, Any]:
        """Fit on (inputs [m, n_in], targets [m, n_out]), from the seeded initialisation: no weight of an earlier
        fit survives (a warm refit kept hidden weights trained on tasks the purge had dropped: measured-findings.md,
        "Purge bugs" 1)."""
        with single_torch_thread():
            return self._fit(inputs, targets)

    def _fit(self, inputs: np.ndarray, targets: np.ndarray) -> dict[str, Any]:
        cfg = self.config
        inputs = np.asarray(inputs, np.float32)
        targets = np.asarray(targets, np.float32)
        m = len(inputs)
        if m < 2:
            raise ValueError("N_U needs at least two meta-tasks")
        self.x_mean, self.x_std = _stats(inputs)
        self.y_mean, self.y_std = _stats(targets)
        self._cache = None
        Xs = (inputs - self.x_mean) / self.x_std
        Ys = (targets - self.y_mean) / self.y_std
        rng = np.random.default_rng(cfg.seed)
        order = rng.permutation(m)
        n_val = int(round(cfg.validation_fraction * m)) if m >= 10 else 0
        val, tr = order[:n_val], order[n_val:]
        info: dict[str, Any] = {"tasks": m, "validation_tasks": n_val}
        torch.manual_seed(cfg.seed)  # the initialisation depends on the seed alone
        self.net = UnlearnerNet(self.n_in, self.n_out, cfg.hidden, cfg.activation, cfg.linear_skip)
        if self.net.skip is not None:
            info["ridge_alpha_median"] = self._ridge_init(Xs[tr], Ys[tr], reset_mlp=True)
        Xt, Yt = torch.from_numpy(Xs[tr]), torch.from_numpy(Ys[tr])
        Xv, Yv = torch.from_numpy(Xs[val]), torch.from_numpy(Ys[val])
        epochs = cfg.epochs
        opt = torch.optim.AdamW(self.net.mlp.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        torch.manual_seed(cfg.seed)

        def val_loss() -> float:
            if n_val == 0:
                return float("nan")
            with torch.no_grad():
                return float(nn.functional.mse_loss(self.net(Xv), Yv))

        best, best_state, best_epoch = val_loss(), copy.deepcopy(self.net.state_dict()), 0
        info["val_mse_start"] = best
        if n_val:
            info["val_param_ratio_median_start"] = float(np.median(self._param_ratio(inputs[val], targets[val])))
        self.net.train()
        for epoch in range(1, epochs + 1):
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(self.net(Xt), Yt)
            loss.backward()
            opt.step()
            if n_val and (epoch % 10 == 0 or epoch == epochs):
                v = val_loss()
                if v < best:
                    best, best_state, best_epoch = v, copy.deepcopy(self.net.state_dict()), epoch
        if n_val:
            self.net.load_state_dict(best_state)
        else:
            best_epoch = epochs
        self.net.eval()
        self._cache = None
        with torch.no_grad():
            info["train_mse"] = float(nn.functional.mse_loss(self.net(Xt), Yt))
        info.update(val_mse=best, best_epoch=best_epoch, epochs=epochs)
        if n_val:
            # Held-out tasks, in parameter space: ||theta' - theta_r|| / ||theta - theta_r|| per task (the rho
            # scaling cancels), i.e. how much of do-nothing's error N_U leaves. < 1 means better than do-nothing.
            err = self._param_ratio(inputs[val], targets[val])
            info["val_param_ratio_median"] = float(np.median(err))
            info["val_param_ratio_mean"] = float(err.mean())
        self.history = info
        return info

    def _param_ratio(self, inputs: np.ndarray, targets: np.ndarray) -> np.ndarray:
        pred = self.predict(inputs)
        return np.linalg.norm(pred - targets, axis=1) / np.maximum(np.linalg.norm(targets, axis=1), 1e-30)

    # ------------------------------------------------------------------ inference
    def _build_cache(self) -> tuple[Any, ...]:
        sd = {k: v.detach().cpu().numpy().astype(np.float32) for k, v in self.net.state_dict().items()}
        self._cache = (sd, self.x_mean, self.x_std, self.y_mean, self.y_std)
        return self._cache

    def predict(self, inputs: np.ndarray) -> np.ndarray:
        """Scaled residual(s) for inputs [k, n_in] (or [n_in]).

        Plain numpy on cached float32 weights: one request is a handful of small mat-vecs, where torch's per-op
        dispatch and its intra-op thread pool (badly so on a busy machine) would cost more than the arithmetic.
        """
        sd, xm, xs, ym, ys = self._cache if self._cache is not None else self._build_cache()
        x = (np.atleast_2d(np.asarray(inputs, dtype=np.float32)) - xm) / xs
        act = _NUMPY_ACTIVATIONS[self.config.activation]
        h = act(x @ sd["mlp.0.weight"].T + sd["mlp.0.bias"])
        h = act(h @ sd["mlp.2.weight"].T + sd["mlp.2.bias"])
        out = h @ sd["mlp.4.weight"].T + sd["mlp.4.bias"]
        if self.net.skip is not None:
            out = out + x @ sd["skip.weight"].T + sd["skip.bias"]
        return out * ys + ym

    # ------------------------------------------------------------------ serialisation
    def to_bytes(self) -> bytes:
        tensors = {f"net.{k}": v.detach().contiguous() for k, v in self.net.state_dict().items()}
        for name in ("x_mean", "x_std", "y_mean", "y_std"):
            tensors[name] = torch.from_numpy(np.ascontiguousarray(getattr(self, name)))
        meta = {
            "config": json.dumps(
                {
                    **self.config.__dict__,
                    "hidden": list(self.config.hidden),
                    "ridge_alphas": list(self.config.ridge_alphas),
                }
            ),
            "n_in": str(self.n_in),
            "n_out": str(self.n_out),
            "history": json.dumps(self.history),
        }
        return st_save(tensors, metadata=meta)

    @classmethod
    def from_bytes(cls, data: bytes, config: UnlearnerConfig | None = None) -> Unlearner:
        tensors = st_load(data)
        meta = _safetensors_metadata(data)
        cfg = config or UnlearnerConfig(**json.loads(meta["config"]))
        obj = cls(cfg, int(meta["n_in"]), int(meta["n_out"]))
        obj.net.load_state_dict({k[4:]: v for k, v in tensors.items() if k.startswith("net.")})
        obj.net.eval()
        for name in ("x_mean", "x_std", "y_mean", "y_std"):
            setattr(obj, name, tensors[name].numpy().copy())
        obj.history = json.loads(meta.get("history", "{}"))
        obj._build_cache()  # loading is not part of the per-request forward pass
        return obj


def _safetensors_metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors blob (8-byte little-endian header length, then a JSON header)."""
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + n].decode()).get("__metadata__", {}) or {}

"""PFL — Projection with Forget Lock (ease-notes §4).

The paper's third anchor is *temporal re-anchoring*: later FedAvg rounds partly rewrite the removed directions; it
answers with "a direction-selective Forget Lock that bounds residual drift across rounds" [PAPER], i.e. server-side
projection of later updates onto the complement of the unique subspace plus a client-side penalty on drift along it
[SECONDARY: arxivlens, knowledge-base]. The formulas are the notes' reconstruction [INFERENCE]:

* server: ``Δ ← (I − U_μU_μᵀ)Δ`` for every aggregated update (:meth:`ForgetLock.project`);
* client: ``L = L_CLIP + (α/2)‖U_μᵀ(θ − θ_unl)‖²`` (:meth:`ForgetLock.penalty`), whose gradient is
  ``α U_μU_μᵀ(θ − θ_unl)``; a quadratic lock of strength α bounds the stationary drift along U_μ by ≈ ‖U_μᵀ∇L‖/α.

It lives with the federation, not with EASE: once published it is a mechanic of every later round (the server
projects, the clients add the penalty), whichever method produced it.

Successive deletions **merge** their locks (:func:`merge_locks`): the basis becomes an orthonormal basis of the union
of the spans, so directions locked by an earlier deletion stay locked (issue 11 item 5); the anchor is the newest
unlearned model, whose displacement along every earlier locked direction is what the earlier projections left.

The lock is published by the service (``GET /v1/models/{id}/forget-lock``) so that every client can apply it; it
serialises to safetensors bytes (:meth:`to_bytes` / :meth:`from_bytes`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

FORMAT = "lethe-forget-lock/1"


@dataclass
class ForgetLock:
    """``U_μ`` ``[p × k]`` (orthonormal), strength ``alpha`` and the unlearned anchor ``θ_unl`` ``[p]``."""

    basis: torch.Tensor
    alpha: float
    theta_unl: torch.Tensor

    def __post_init__(self) -> None:
        if self.basis.ndim != 2 or self.basis.shape[0] != self.theta_unl.numel():
            raise ValueError("basis must be [p × k] with p = len(theta_unl)")

    @property
    def rank(self) -> int:
        return int(self.basis.shape[1])

    @property
    def p(self) -> int:
        return int(self.basis.shape[0])

    def project(self, delta: torch.Tensor) -> torch.Tensor:
        """Server side: remove an aggregated update's component along U_μ."""
        if self.rank == 0:
            return delta
        u = self.basis.to(device=delta.device, dtype=delta.dtype)
        return delta - u @ (u.T @ delta)

    def penalty(self, theta: torch.Tensor) -> torch.Tensor:
        """Client side: ``(α/2)‖U_μᵀ(θ − θ_unl)‖²`` on the differentiable flat LoRA vector θ."""
        if self.rank == 0 or self.alpha == 0:
            return theta.sum() * 0.0
        u = self.basis.to(device=theta.device, dtype=theta.dtype)
        drift = u.T @ (theta - self.theta_unl.to(device=theta.device, dtype=theta.dtype))
        return 0.5 * self.alpha * (drift @ drift)

    def gradient(self, theta: torch.Tensor) -> torch.Tensor:
        """Analytic gradient of :meth:`penalty`: ``α U_μU_μᵀ(θ − θ_unl)``."""
        u = self.basis.to(dtype=theta.dtype)
        return self.alpha * (u @ (u.T @ (theta - self.theta_unl.to(theta.dtype))))

    def drift(self, theta: torch.Tensor) -> float:
        """‖U_μᵀ(θ − θ_unl)‖: how far θ has moved back along the locked directions."""
        if self.rank == 0:
            return 0.0
        u = self.basis.to(torch.float64)
        return float(torch.linalg.norm(u.T @ (theta.to(torch.float64) - self.theta_unl.to(torch.float64))))

    def nbytes(self) -> int:
        return (self.basis.numel() + self.theta_unl.numel()) * 4

    def to_bytes(self) -> bytes:
        from safetensors.torch import save

        tensors = {
            "basis": self.basis.detach().to(torch.float32).cpu().contiguous(),
            "theta_unl": self.theta_unl.detach().to(torch.float32).cpu().contiguous(),
        }
        meta = {"format": FORMAT, "alpha": json.dumps(float(self.alpha)), "rank": str(self.rank), "p": str(self.p)}
        return save(tensors, metadata=meta)

    @classmethod
    def from_bytes(cls, data: bytes) -> ForgetLock:
        from safetensors.torch import load

        tensors = load(data)
        meta = _metadata(data)
        if meta.get("format") != FORMAT:
            raise ValueError(f"not a forget lock (format {meta.get('format')!r})")
        return cls(basis=tensors["basis"], alpha=float(json.loads(meta["alpha"])), theta_unl=tensors["theta_unl"])


def merge_locks(previous: ForgetLock | None, new: ForgetLock, tol: float = 1e-6) -> ForgetLock:
    """The lock of ``previous`` and ``new`` together: an orthonormal basis of span(U_prev) ∪ span(U_new) (float64
    SVD of the concatenation, directions with singular value below ``tol`` dropped), the new anchor
    θ_unl, and the stronger α. ``previous`` None or of another size (a different parameter layout) gives ``new``."""
    if previous is None or previous.rank == 0 or previous.p != new.p:
        return new
    both = torch.cat([previous.basis.to(torch.float64), new.basis.to(torch.float64)], dim=1)
    u, s, _ = torch.linalg.svd(both, full_matrices=False)
    basis = u[:, s > tol].to(new.basis.dtype if new.rank else previous.basis.dtype).contiguous()
    return ForgetLock(basis, max(previous.alpha, new.alpha), new.theta_unl.clone())


def _metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors buffer (8-byte little-endian header length, then JSON)."""
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    return header.get("__metadata__", {}) or {}

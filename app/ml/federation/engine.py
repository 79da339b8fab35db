"""FedAvg over the LoRA vector, with the per-client update history that EASE's GSD reuses.

Why record every client's update: GSD "reuses the client updates FedAvg already transmits" to build per-client
subspaces (ease-notes §3 [SECONDARY: knowledge-base]); FedEraser replays the same stored updates (§7). The history
is ``[rounds × clients × p]`` (zeros where a client did not take part), returned as a tensor the worker stores as an
artifact.

Two hooks serve PFL (ease-notes §4): ``projection(Δ) -> Δ`` runs at the server on each aggregated update, and
``penalty(θ) -> loss`` is added to every client's local objective (θ is the differentiable flat LoRA vector).

Clients are simulated in-process, one after another, on one model instance: a round is exactly what a deployment
with real clients computes (each client starts from the broadcast θ and returns θ_local − θ). Each client's CPU
seconds are recorded apart, so that a round's *critical path* (clients in parallel: the slowest client plus the
server's aggregation) can be reported next to its total compute (issue 11 item 2), with the pair-gradient
evaluations (pairs × steps) it took.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from app.ml.clip import ClipLoRA, caption_labels, clip_loss
from app.ml.data.captions import CaptionDataset
from app.ml.unlearning.base import ProgressFn, no_progress

Projection = Callable[[torch.Tensor], torch.Tensor]
Penalty = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class FedSettings:
    """The federated schedule. The paper's values are [UNKNOWN] (ease-notes §1); these fit the tiny demo model."""

    rounds: int = 20
    local_epochs: float = 1.0
    batch_size: int = 50
    lr: float = 3e-3
    weight_decay: float = 0.0
    seed: int = 0


def bytes_of(p: int, dtype: torch.dtype = torch.float32) -> int:
    """Bytes to send one p-vector (θ or Δ) in ``dtype``."""
    return p * torch.empty((), dtype=dtype).element_size()


def fedavg(updates: torch.Tensor, weights: torch.Tensor | Sequence[float] | None = None) -> torch.Tensor:
    """Weighted mean of client updates ``[clients × p]`` (weights: pair counts, McMahan et al.'s n_k / n)."""
    if updates.shape[0] == 0:
        return torch.zeros(updates.shape[1:], dtype=updates.dtype)
    w = torch.ones(updates.shape[0]) if weights is None else torch.as_tensor(weights, dtype=torch.float64)
    w = (w / w.sum()).to(updates.dtype).to(updates.device)
    return (w[:, None] * updates).sum(dim=0)


def apply_round(
    theta: torch.Tensor,
    client_updates: torch.Tensor | Sequence[torch.Tensor],
    weights: torch.Tensor | Sequence[float] | None = None,
    projection: Projection | None = None,
) -> torch.Tensor:
    """The server's step for one round: θ ← θ + P(FedAvg(Δ₁…Δ_K)); ``projection`` is e.g. ``ForgetLock.project``."""
    updates = torch.stack(list(client_updates)) if not isinstance(client_updates, torch.Tensor) else client_updates
    delta = fedavg(updates.float(), weights)
    if projection is not None:
        delta = projection(delta)
    return theta + delta.to(theta.dtype)


@dataclass
class RoundResult:
    theta: torch.Tensor
    updates: torch.Tensor  # [participants × p]
    clients: list[int]
    bytes_down: int
    bytes_up: int
    seconds: float
    client_seconds: list[float] = field(default_factory=list)  # CPU seconds of each participant's local training
    server_seconds: float = 0.0  # CPU seconds of the aggregation (and projection)
    pair_grads: int = 0  # pair-gradient evaluations: Σ over participants of steps × batch

    @property
    def compute_seconds(self) -> float:
        return sum(self.client_seconds) + self.server_seconds

    @property
    def critical_seconds(self) -> float:
        """Clients in parallel: the slowest one, then the server."""
        return max(self.client_seconds, default=0.0) + self.server_seconds


@dataclass
class TrainResult:
    theta: torch.Tensor
    history: torch.Tensor  # [rounds × n_clients × p], zeros where a client was absent
    participation: torch.Tensor  # [rounds × n_clients] bool
    weights: torch.Tensor  # [n_clients] FedAvg weights (pair counts)
    bytes_down: int
    bytes_up: int
    seconds: float
    rounds: list[RoundResult] = field(default_factory=list)

    @property
    def bytes_total(self) -> int:
        return self.bytes_down + self.bytes_up

    @property
    def compute_seconds(self) -> float:
        return sum(r.compute_seconds for r in self.rounds)

    @property
    def critical_seconds(self) -> float:
        return sum(r.critical_seconds for r in self.rounds)

    @property
    def pair_grads(self) -> int:
        return sum(r.pair_grads for r in self.rounds)


class Federation:
    """A server and ``len(clients)`` simulated clients training LoRA with FedAvg and the symmetric InfoNCE loss."""

    def __init__(self, model: ClipLoRA, clients: Sequence[CaptionDataset], settings: FedSettings = FedSettings()):
        self.model = model
        self.clients = list(clients)
        self.settings = settings
        self._tokens = [model.tokens(c.captions) for c in self.clients]
        self._labels = [caption_labels(c.captions) for c in self.clients]
        self.pair_grads = 0  # running count of pair-gradient evaluations (every local step adds its batch size)

    @property
    def p(self) -> int:
        return self.model.num_params

    def weights(self) -> torch.Tensor:
        return torch.tensor([float(len(c)) for c in self.clients])

    def local_steps(self, k: int, epochs: float | None = None) -> int:
        n = len(self.clients[k])
        epochs = self.settings.local_epochs if epochs is None else epochs
        return max(1, math.ceil(epochs * math.ceil(n / self.settings.batch_size))) if n else 0

    def local_update(
        self,
        theta: torch.Tensor,
        k: int,
        *,
        round_index: int = 0,
        epochs: float | None = None,
        penalty: Penalty | None = None,
        loss_sign: float = 1.0,
        drop: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Client k's local training from the broadcast θ; returns Δ_k = θ_local − θ.

        Adam, reset every round (no optimiser state leaves the client); data order seeded by (seed, round, k).
        ``loss_sign=-1`` turns it into gradient ascent (used by baselines). ``drop`` (a mask over client k's pairs):
        the counterfactual update without those pairs — the same data order and batches with the marked pairs left
        out of each (a batch left with fewer than two pairs skips its step), so that ``Δ − Δ(drop)`` is the marked
        pairs' share of the update rather than the noise of another order (EASE's replayed share).
        """
        data = self.clients[k]
        if len(data) == 0:
            return torch.zeros_like(theta)
        m = self.model
        m.set_theta(theta)
        params = m.parameters()
        opt = torch.optim.Adam(params, lr=self.settings.lr, weight_decay=self.settings.weight_decay)
        gen = torch.Generator().manual_seed(hash((self.settings.seed, round_index, k)) % (2**31))
        steps = self.local_steps(k, epochs)
        bs = min(self.settings.batch_size, len(data))
        order = torch.randperm(len(data), generator=gen)
        pos = 0
        for _ in range(steps):
            if pos + bs > len(data):
                order, pos = torch.randperm(len(data), generator=gen), 0
            idx = order[pos : pos + bs]
            pos += bs
            if drop is not None:
                idx = idx[~drop[idx]]
                if len(idx) < 2:
                    continue
            img, txt, scale = m.encode(data.images[idx], self._tokens[k][idx])
            self.pair_grads += len(idx)
            loss = loss_sign * clip_loss(img, txt, scale, self._labels[k][idx])
            if penalty is not None:
                flat = torch.cat([p.reshape(-1) for p in params])
                loss = loss + penalty(flat)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        return m.get_theta() - theta

    def run_round(
        self,
        theta: torch.Tensor,
        clients: Sequence[int] | None = None,
        *,
        round_index: int = 0,
        projection: Projection | None = None,
        penalty: Penalty | None = None,
        epochs: float | None = None,
    ) -> RoundResult:
        """One FedAvg round over ``clients`` (default: every client holding data)."""
        start = time.perf_counter()
        grads_before = self.pair_grads
        ids = [k for k in (range(len(self.clients)) if clients is None else clients) if len(self.clients[k])]
        rows, client_seconds = [], []
        for k in ids:
            cpu = time.process_time()
            rows.append(self.local_update(theta, k, round_index=round_index, epochs=epochs, penalty=penalty))
            client_seconds.append(time.process_time() - cpu)
        updates = torch.stack(rows) if ids else torch.zeros(0, theta.numel())
        cpu = time.process_time()
        new_theta = apply_round(theta, updates, self.weights()[ids], projection) if ids else theta.clone()
        server_seconds = time.process_time() - cpu
        one = bytes_of(theta.numel())
        return RoundResult(
            new_theta,
            updates,
            ids,
            one * len(ids),
            one * len(ids),
            time.perf_counter() - start,
            client_seconds,
            server_seconds,
            self.pair_grads - grads_before,
        )

    def train(
        self,
        theta0: torch.Tensor,
        rounds: int | None = None,
        clients: Sequence[int] | None = None,
        *,
        projection: Projection | None = None,
        penalty: Penalty | None = None,
        epochs: float | None = None,
        round_offset: int = 0,
        record_history: bool = True,
        progress: ProgressFn = no_progress,
        callback: Callable[[int, torch.Tensor], None] | None = None,
    ) -> TrainResult:
        """``rounds`` FedAvg rounds from θ₀, recording each client's update and the bytes sent each way."""
        rounds = self.settings.rounds if rounds is None else rounds
        n = len(self.clients)
        history = torch.zeros(rounds if record_history else 0, n, self.p)
        part = torch.zeros(rounds, n, dtype=torch.bool)
        theta = theta0.clone()
        down = up = 0
        results = []
        start = time.perf_counter()
        for r in range(rounds):
            res = self.run_round(
                theta, clients, round_index=round_offset + r, projection=projection, penalty=penalty, epochs=epochs
            )
            theta = res.theta
            for row, k in enumerate(res.clients):
                if record_history:
                    history[r, k] = res.updates[row]
                part[r, k] = True
            down += res.bytes_down
            up += res.bytes_up
            res.updates = torch.empty(0)  # the history holds them; do not keep two copies
            results.append(res)
            if callback is not None:
                callback(r, theta)
            progress((r + 1) / max(rounds, 1), f"round {r + 1}/{rounds}")
        return TrainResult(theta, history, part, self.weights(), down, up, time.perf_counter() - start, results)


def trajectory(theta_init: torch.Tensor, history: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Global models θ_0 … θ_R ``[(R+1) × p]`` rebuilt from the history (FedAvg over the clients present each round)."""
    thetas = [theta_init.clone()]
    for r in range(history.shape[0]):
        present = history[r].abs().sum(dim=1) > 0
        if present.any():
            thetas.append(thetas[-1] + fedavg(history[r][present], weights[present]))
        else:
            thetas.append(thetas[-1].clone())
    return torch.stack(thetas)


# ------------------------------------------------------------------------------------------------ the problem

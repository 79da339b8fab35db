"""EASE = GSD → BKE → PFL on a federated CLIP with LoRA (Ding, Wu, Huang 2026, arXiv 2605.00733).

The paper's body could not be read (ease-notes §0): every formula and threshold below is the notes' reconstruction
[INFERENCE] and is a named, documented setting of :class:`EaseConfig`. The flow of :meth:`Ease.unlearn`:

1. **GSD** (subspace.py, notes §3): a forget subspace ``U_f`` and a retain support ``Q_r``; principal angles split
   off the forget-exclusive ``U_μ``; the global model is projected ``θ ← θ_ref + (I − U_μU_μᵀ)(θ − θ_ref)``.
   Where the subspaces come from depends on the scope:

   * ``client`` — the leaving client's stored FedAvg updates give ``U_f``; the other clients' give ``Q_r`` (the
     history the server already holds: no client work);
   * ``class`` / ``samples`` — the forget pairs are mixed into their holders' updates, so no stored update isolates
     them. Each holding client *replays* its data along the stored training trajectory: at ``replay_points`` global
     models θ_t (rebuilt from θ₀ and the history) it computes the CLIP-loss gradient of its forget pairs and of its
     retained pairs and sends the energy-cut bases (``U_f`` from the forget gradients of all holders; ``Q_r`` from
     the holders' retained gradients plus the stored updates of the clients that hold no forget pairs) [INFERENCE].

2. **BKE** (excision.py, notes §2): every holder of forget pairs (the leaving client, the class holders, the
   subject's client) runs a bounded excision on both towers' LoRA from the projected model; the server averages the
   displacements (one unlearning round).

3. **PFL** (lock.py, notes §4): a :class:`ForgetLock` over U_μ and the excision direction; ``repair_rounds``
   FedAvg rounds of the retained clients run with the server projection and the client penalty active (the notes'
   "in each unlearning round, the parameter displacement is projected onto the complement of the unique subspace"),
   which repairs the retained alignment without re-entering the locked directions. The lock (U_μ, α, θ_unl) is
   returned as the ``forget_lock`` artifact; the service applies ``lock.project`` to later aggregated updates and
   clients add ``lock.penalty``.

Defaults were chosen on the synthetic benchmark (bench/ease.py, seed 0), one setting at a time: δ = 65° (45° removed
too much retained support, 70° too little forget knowledge), SGD excision with the ``"reference"`` objective (Adam
and the unbounded objectives destroyed retained R@1), margin −0.75 (0 over-forgot the class and samples scenarios,
−1 under-forgot), one repair round (none left retained R@1 several points low; two cost twice the bytes for no gain).

Communication is counted in bytes (float32): what clients download (θ, bases) and upload (θ, bases), the lock's
broadcast reported separately because it is paid at the start of the later rounds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from app.ml.clip import ClipLoRA
from app.ml.federation import FederatedProblem, bytes_of, fedavg, trajectory
from app.ml.federation.lock import ForgetLock
from app.ml.unlearning.base import UnlearningResult
from app.ml.unlearning.clip_objectives import data_gradient
from app.ml.unlearning.ease.excision import bilateral_excision
from app.ml.unlearning.ease.subspace import (
    PrincipalAngles,
    energy_basis,
    forget_exclusive,
    orthonormalize,
    principal_angles,
    project_model,
    retain_support,
)


@dataclass
class EaseConfig:
    """Every EASE threshold. The paper's values are [UNKNOWN]; defaults were chosen on the synthetic benchmark.

    GSD (notes §3, all [INFERENCE]):
      ``tau``: per-client SVD energy cut; ``tau_retain``: energy cut of the pooled retain support;
      ``delta_deg``: angle (degrees) from the retain support at or above which a forget direction is exclusive;
      ``max_rank``: cap on the per-client rank; ``history_rounds``: use only the last N rounds (None = all);
      ``replay_points``: trajectory points replayed by holders in class/samples scope, on at most
      ``replay_max_pairs`` forget and retained pairs each (a gradient estimate; None = all);
      ``gsd``: ``"exclusive"`` (U_μ, EASE), ``"whole"`` (the whole forget subspace U_f — ablation), ``"none"``;
      ``theta_ref``: reference point of the projection θ ← θ_ref + (I − U_μU_μᵀ)(θ − θ_ref):
      ``"forget_contribution"`` (client scope: θ minus the leaving client's FedAvg-weighted sum of stored updates,
      i.e. "the model before the forget client's contributions" of notes §4 — only that client's share of the
      displacement along U_μ is removed, the retained clients' share stays; other scopes fall back to ``"init"``),
      ``"init"`` (the LoRA initialisation θ₀: the whole displacement along U_μ is undone) or ``"zero"``.
    BKE (notes §2, objective [INFERENCE]):
      ``excision_steps``/``excision_lr``/``excision_batch``: local steps at each holder, with
      ``excision_optimizer`` ``"sgd"`` (momentum 0.9; steps proportional to the gradient) or ``"adam"``;
      ``excision_objective``: ``"reference"`` (no forget pair matched better than by the backbone with LoRA at
      its initialisation θ₀), ``"uce"`` or ``"hinge"`` (excision.py); ``excision_margin``: their margin;
      ``excision_towers``: ``["image", "text"]`` (bilateral, EASE) or one of them (ablation);
      ``excision_subspace``: ``"none"`` (free), ``"exclusive"`` (displacement kept inside span U_μ) or
      ``"off_retain"`` (kept orthogonal to the retain support Q_r);
      ``anchor_weight``: weight of the CLIP loss on the holder's retained pairs (class/samples scope only);
      ``retain_negatives``: the holder's retained pairs join each excision batch as negatives (class/samples).
    PFL (notes §4, [INFERENCE]):
      ``lock_alpha``: strength α of the client penalty (α/2)‖U_μᵀ(θ − θ_unl)‖²;
      ``lock_excision``: add the (normalised) excision displacement to the locked basis, so that later rounds
      cannot walk the excision back either;
      ``repair_rounds``/``repair_epochs``: FedAvg rounds of the retained clients run *as part of unlearning*, with
      the server projection and the client lock active ("in each unlearning round, the parameter displacement is
      projected onto the complement of the unique subspace", notes §4): they repair the retained alignment that
      excision disturbed without re-entering the locked directions (None epochs = the training schedule's).
    """

    tau: float = 0.95
    tau_retain: float = 0.99
    delta_deg: float = 65.0
    max_rank: int | None = None
    history_rounds: int | None = None
    replay_points: int = 4
    replay_max_pairs: int | None = 64
    gsd: str = "exclusive"
    theta_ref: str = "init"
    excision_steps: int = 20
    excision_lr: float = 2e-3
    excision_batch: int = 64
    excision_objective: str = "reference"
    excision_optimizer: str = "sgd"
    excision_margin: float = -0.75
    excision_towers: list[str] = field(default_factory=lambda: ["image", "text"])
    excision_subspace: str = "none"
    anchor_weight: float = 1.0
    retain_negatives: bool = True
    lock_alpha: float = 50.0
    repair_rounds: int = 1
    repair_epochs: float | None = None
    lock_excision: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.tau <= 1 or not 0 < self.tau_retain <= 1:
            raise ValueError("tau and tau_retain must be in (0, 1]")
        if not 0 <= self.delta_deg <= 90:
            raise ValueError("delta_deg must be in [0, 90]")
        if self.gsd not in ("exclusive", "whole", "none"):
            raise ValueError(f"gsd must be exclusive, whole or none, not {self.gsd!r}")
        if self.theta_ref not in ("forget_contribution", "init", "zero"):
            raise ValueError("theta_ref must be forget_contribution, init or zero")
        if self.excision_objective not in ("uce", "hinge", "reference"):
            raise ValueError("excision_objective must be uce, hinge or reference")
        if self.excision_optimizer not in ("sgd", "adam"):
            raise ValueError("excision_optimizer must be sgd or adam")
        if self.excision_subspace not in ("none", "exclusive", "off_retain"):
            raise ValueError("excision_subspace must be none, exclusive or off_retain")
        bad = set(self.excision_towers) - {"image", "text"}
        if bad or not self.excision_towers:
            raise ValueError("excision_towers must name image and/or text")
        if self.lock_alpha < 0:
            raise ValueError("lock_alpha must be ≥ 0")
        if self.repair_rounds < 0:
            raise ValueError("repair_rounds must be ≥ 0")


def forget_contribution(problem: FederatedProblem) -> torch.Tensor:
    """The leaving client's share of the global displacement: Σ_t (w_f / Σ_present w) Δ_f^(t) from the history."""
    f = int(problem.forget_client)  # type: ignore[arg-type]
    rounds = int(problem.n_rounds or 0)
    weights = problem.weights if problem.weights is not None else torch.ones(problem.n_clients)
    history_f = problem.client_history(f)[:rounds]
    total = torch.zeros_like(problem.theta)
    for r in range(rounds):
        if history_f[r].abs().sum() == 0:
            continue
        present = (
            [k for k in range(problem.n_clients) if problem.client_history(k)[r].abs().sum() > 0]
            if not isinstance(problem.history, torch.Tensor)
            else (problem.history[r].abs().sum(dim=1) > 0).nonzero().flatten().tolist()
        )
        total += float(weights[f] / weights[present].sum()) * history_f[r]
    return total


def reference_point(problem: FederatedProblem, choice: str) -> torch.Tensor:
    """θ_ref of the GSD projection (see :class:`EaseConfig.theta_ref`)."""
    if choice == "forget_contribution" and problem.scope == "client":
        return problem.theta - forget_contribution(problem)
    if choice == "zero":
        return torch.zeros_like(problem.theta)
    return problem.theta_init.clone()


@dataclass
class Subspaces:
    u_f: torch.Tensor
    q_r: torch.Tensor
    u_mu: torch.Tensor
    angles: PrincipalAngles
    bytes_up: int = 0
    bytes_down: int = 0
    info: dict[str, Any] = field(default_factory=dict)


def decompose(problem: FederatedProblem, config: EaseConfig, model: ClipLoRA) -> Subspaces:
    """GSD for the problem's scope (module docstring, step 1)."""
    rounds = int(problem.n_rounds or 0)
    first = max(0, rounds - config.history_rounds) if config.history_rounds else 0
    p = problem.theta.numel()
    bytes_up = bytes_down = 0
    info: dict[str, Any] = {}
    if problem.scope == "client":
        f = int(problem.forget_client)  # type: ignore[arg-type]
        u_f, s_f = energy_basis(problem.client_history(f)[first:].T, config.tau, config.max_rank)
        retain_bases = []
        for k in problem.retained_clients():
            b, _ = energy_basis(problem.client_history(k)[first:].T, config.tau, config.max_rank)
            retain_bases.append(b)
        info["source"] = "stored FedAvg updates"
    else:
        holders = problem.holders()
        weights = problem.weights if problem.weights is not None else torch.ones(problem.n_clients)
        thetas = trajectory(problem.theta_init, problem.full_history()[:rounds], weights)
        points = np.unique(np.linspace(first, rounds - 1, max(1, config.replay_points)).round().astype(int))
        forget_cols, retain_bases = [], []
        gen = torch.Generator().manual_seed(config.seed)
        for k in holders:
            fk, rk = problem.forget_data(k), problem.retain_data(k)
            if config.replay_max_pairs and len(rk) > config.replay_max_pairs:
                rk = rk.subset(torch.randperm(len(rk), generator=gen)[: config.replay_max_pairs].sort().values)
            if config.replay_max_pairs and len(fk) > config.replay_max_pairs:
                fk = fk.subset(torch.randperm(len(fk), generator=gen)[: config.replay_max_pairs].sort().values)
            g_f = torch.stack([data_gradient(model, thetas[t], fk) for t in points], dim=1)
            forget_cols.append(g_f)
            bytes_down += len(points) * bytes_of(p)  # the holder receives the replayed global models
            if len(rk) > 1:
                g_r = torch.stack([data_gradient(model, thetas[t], rk) for t in points], dim=1)
                b_r, _ = energy_basis(g_r, config.tau, config.max_rank)
                retain_bases.append(b_r)
                bytes_up += b_r.shape[1] * bytes_of(p)
        # each holder uploads the energy-cut basis of its forget gradients; the server merges them
        holder_bases = [energy_basis(g, config.tau, config.max_rank)[0] for g in forget_cols]
        bytes_up += sum(b.shape[1] for b in holder_bases) * bytes_of(p)
        u_f = orthonormalize(torch.cat(holder_bases, dim=1), 1.0) if holder_bases else torch.zeros(p, 0)
        s_f = torch.zeros(0)
        for k in range(problem.n_clients):
            if k not in holders:
                b, _ = energy_basis(problem.client_history(k)[first:].T, config.tau, config.max_rank)
                retain_bases.append(b)
        info["source"] = "gradient replay at trajectory points"
        info["replay_points"] = [int(t) for t in points]
    q_r = retain_support(retain_bases, config.tau_retain)
    pa = principal_angles(u_f, q_r)
    if config.gsd == "exclusive":
        u_mu, _ = forget_exclusive(u_f, q_r, config.delta_deg)
    elif config.gsd == "whole":
        u_mu = u_f
    else:
        u_mu = torch.zeros(p, 0, dtype=torch.float64)
    info.update(
        {
            "rank_forget": int(u_f.shape[1]),
            "rank_retain": int(q_r.shape[1]),
            "rank_exclusive": int(u_mu.shape[1]),
            "angles_deg": [round(float(a), 2) for a in pa.degrees],
            "forget_singular_values": [float(x) for x in s_f[:20]],
        }
    )
    return Subspaces(u_f, q_r, u_mu, pa, bytes_up, bytes_down, info)


class Ease:
    """The EASE unlearning method (registered as ``"ease"`` for ``clip_federated`` models)."""

    def __init__(self, config: EaseConfig | None = None):
        self.config = config or EaseConfig()

    def unlearn(self, problem: FederatedProblem) -> UnlearningResult:
        cfg = self.config
        start = time.perf_counter()
        model = problem.get_model()
        p = problem.theta.numel()
        problem.progress(0.0, "GSD: decomposing update subspaces")
        sub = decompose(problem, cfg, model)
        theta_ref = reference_point(problem, cfg.theta_ref)
        theta_p = project_model(problem.theta, theta_ref, sub.u_mu.float()).float()
        problem.progress(0.4, f"GSD: projected off {sub.u_mu.shape[1]} forget-exclusive directions")

        # BKE: one unlearning round over the holders of forget pairs
        holders = problem.holders()
        basis, mode = None, None
        if cfg.excision_subspace == "exclusive":
            basis, mode = sub.u_mu, "onto"
        elif cfg.excision_subspace == "off_retain":
            basis, mode = sub.q_r, "off"
        displacements, weights, bke_info = [], [], []
        bytes_down, bytes_up = sub.bytes_down, sub.bytes_up
        for i, k in enumerate(holders):
            retain = problem.retain_data(k) if problem.scope != "client" else None
            theta_k, info_k = bilateral_excision(
                model,
                theta_p,
                problem.forget_data(k),
                steps=cfg.excision_steps,
                lr=cfg.excision_lr,
                batch_size=cfg.excision_batch,
                objective=cfg.excision_objective,
                margin=cfg.excision_margin,
                towers=cfg.excision_towers,
                retain=retain,
                anchor_weight=cfg.anchor_weight,
                basis=basis,
                mode=mode,
                reference_theta=problem.theta_init,
                optimizer=cfg.excision_optimizer,
                retain_negatives=cfg.retain_negatives,
                seed=cfg.seed + k,
            )
            displacements.append(theta_k - theta_p)
            weights.append(float(problem.forget_masks[k].sum()))
            bke_info.append({"client": k, **info_k})
            bytes_down += bytes_of(p) + (basis.shape[1] * bytes_of(p) if basis is not None else 0)
            bytes_up += bytes_of(p)
            problem.progress(0.4 + 0.5 * (i + 1) / max(len(holders), 1), f"BKE at client {k}")
        excision = fedavg(torch.stack(displacements), weights) if displacements else torch.zeros(p)
        theta_unl = theta_p + excision

        # PFL: the lock over U_μ (and the excision direction), then the projected unlearning rounds
        lock_basis = sub.u_mu
        if cfg.lock_excision and float(torch.linalg.norm(excision)) > 0:
            lock_basis = orthonormalize(torch.cat([sub.u_mu, excision.to(torch.float64)[:, None]], dim=1), 1.0)
        lock = ForgetLock(lock_basis.float(), cfg.lock_alpha, theta_unl.clone())
        retained = problem.retained_clients()
        for r in range(cfg.repair_rounds):
            res = problem.run_round(
                theta_unl,
                retained,
                round_index=90_000 + r,
                projection=lock.project,
                penalty=lock.penalty,
                epochs=cfg.repair_epochs,
            )
            theta_unl = res.theta
            bytes_down += res.bytes_down
            bytes_up += res.bytes_up
            problem.progress(0.9 + 0.1 * (r + 1) / cfg.repair_rounds, f"projected unlearning round {r + 1}")
        lock = ForgetLock(lock.basis, cfg.lock_alpha, theta_unl.clone())
        seconds = time.perf_counter() - start
        n_retained = len(problem.retained_clients())
        info = {
            "method": "ease",
            "scope": problem.scope,
            "gsd": sub.info,
            "bke": bke_info,
            "lock_rank": lock.rank,
            "lock_alpha": cfg.lock_alpha,
            "projection_norm": float(torch.linalg.norm(theta_p - problem.theta)),
            "excision_norm": float(torch.linalg.norm(excision)),
            "seconds": seconds,
            "bytes_down": bytes_down,
            "bytes_up": bytes_up,
            "bytes_total": bytes_down + bytes_up,
            "lock_broadcast_bytes": n_retained * lock.nbytes(),
        }
        problem.progress(1.0, "EASE done")
        return UnlearningResult(
            theta=theta_unl,
            info=info,
            artifacts={"forget_lock": lock.to_bytes()},
        )


__all__ = ["Ease", "EaseConfig", "ForgetLock", "decompose"]

"""FedOSD (Pan et al., AAAI 2025): unlearning cross-entropy + orthogonal steepest descent + projected post-training.

Per ease-notes §7 (from the FedOSD paper and code):

* the holders of the forget pairs compute the gradient g_u of the bounded *unlearning cross-entropy*
  ``−log(1 − p_match/2)`` (here on both CLIP directions, ``clip_objectives.uce_loss``) —
  minimising it pushes the matched probability down without plain ascent's explosion;
* the retained clients send their CLIP-loss gradients (rows of A); the server steps along the part of g_u orthogonal
  to all of them, ``d = g_u − Aᵀ(AAᵀ)⁺A g_u``, rescaled to ‖g_u‖: ``θ ← θ − lr·d`` (``rounds`` unlearning rounds);
* post-training: ``post_rounds`` FedAvg rounds of the retained data whose aggregated update is projected off
  ``g_a = θ − θ_init`` (and rescaled to its norm), so that recovery does not revert the unlearning.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from app.ml.federation import FederatedProblem, bytes_of, fedavg
from app.ml.unlearning.base import UnlearningResult
from app.ml.unlearning.clip_objectives import batch_gradient, data_gradient, uce_loss


@dataclass
class FedOSDConfig:
    rounds: int = 5
    lr: float = 0.5
    post_rounds: int = 1
    batch_size: int = 64


class FedOSD:
    def __init__(self, config: FedOSDConfig | None = None):
        self.config = config or FedOSDConfig()

    def unlearn(self, problem: FederatedProblem) -> UnlearningResult:
        cfg = self.config
        start = time.perf_counter()
        model = problem.get_model()
        theta = problem.theta.clone()
        p = theta.numel()
        holders, retained = problem.holders(), problem.retained_clients()
        bytes_total = 0
        for _ in range(cfg.rounds):
            g_u = fedavg(
                torch.stack(
                    [batch_gradient(model, theta, problem.forget_data(k), uce_loss, cfg.batch_size) for k in holders]
                ),
                [float(problem.forget_masks[k].sum()) for k in holders],
            )
            rows = [data_gradient(model, theta, problem.retain_data(k), cfg.batch_size) for k in retained]
            a = torch.stack([r for r in rows if r.abs().sum() > 0]).double() if rows else torch.zeros(0, p)
            g = g_u.double()
            d = g - a.T @ (torch.linalg.pinv(a @ a.T) @ (a @ g)) if a.shape[0] else g
            if float(d.norm()) > 0:
                d = d * (g.norm() / d.norm())
            theta = theta - cfg.lr * d.float()
            bytes_total += (len(set(holders) | set(retained))) * 2 * bytes_of(p)
        g_a = theta - problem.theta_init
        unit = g_a / g_a.norm() if float(g_a.norm()) > 0 else g_a

        def projection(delta: torch.Tensor) -> torch.Tensor:
            out = delta - unit * (unit @ delta)
            return out * (delta.norm() / out.norm()) if float(out.norm()) > 0 else out

        for r in range(cfg.post_rounds):
            res = problem.run_round(theta, retained, round_index=70_000 + r, projection=projection)
            theta = res.theta
            bytes_total += res.bytes_down + res.bytes_up
        return UnlearningResult(
            theta=theta,
            info={
                "method": "fedosd",
                "rounds": cfg.rounds,
                "post_rounds": cfg.post_rounds,
                "client_round_trips": cfg.rounds + cfg.post_rounds,  # gradients per round, then FedAvg rounds
                "seconds": time.perf_counter() - start,
                "bytes_total": bytes_total,
            },
        )

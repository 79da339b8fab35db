"""Projected gradient ascent (Halimi et al. 2022, "Federated Unlearning: How to Efficiently Erase a Client in FL?").

The holder of the forget data *maximises* its CLIP loss on the forget pairs, but every step is projected back onto
an ℓ2 ball around a reference model, because plain ascent is unbounded and explodes (ease-notes §7):

* reference: the average of the retained clients' last-round local models, ``θ_{T−1} + mean_{c≠f} Δ_c^{(T−1)}``
  (client scope, Halimi's choice); in class/samples scope the holders' updates contain the forget pairs, so the
  reference is the current global model;
* radius: ``radius_fraction × ‖θ_ref − θ₀‖`` — Halimi uses a third of the distance between the reference and a random
  model; the LoRA initialisation θ₀ plays the random model here [INFERENCE];
* then ``post_rounds`` FedAvg rounds of the retained data repair the retained utility.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from app.ml.clip import caption_labels, clip_loss
from app.ml.federation import FederatedProblem, bytes_of, fedavg, trajectory
from app.ml.unlearning.base import UnlearningResult


@dataclass
class GradientAscentConfig:
    steps: int = 20
    lr: float = 2e-3
    batch_size: int = 64
    radius_fraction: float = 1 / 3
    post_rounds: int = 2
    seed: int = 0


class GradientAscent:
    def __init__(self, config: GradientAscentConfig | None = None):
        self.config = config or GradientAscentConfig()

    def _reference(self, problem: FederatedProblem) -> torch.Tensor:
        if problem.scope != "client":
            return problem.theta.clone()
        rounds = int(problem.n_rounds or 0)
        history = problem.full_history()[:rounds]
        thetas = trajectory(problem.theta_init, history, problem.weights)
        last = history[rounds - 1, problem.retained_clients()]
        return thetas[rounds - 1] + last.mean(dim=0)

    def unlearn(self, problem: FederatedProblem) -> UnlearningResult:
        cfg = self.config
        start = time.perf_counter()
        model = problem.get_model()
        ref = self._reference(problem)
        radius = cfg.radius_fraction * float(torch.linalg.norm(ref - problem.theta_init))
        p = ref.numel()
        displacements, weights = [], []
        bytes_total = 0
        for k in problem.holders():
            forget = problem.forget_data(k)
            model.set_theta(ref)
            params = model.parameters()
            opt = torch.optim.Adam(params, lr=cfg.lr)
            tokens, labels = model.tokens(forget.captions), caption_labels(forget.captions)
            gen = torch.Generator().manual_seed(cfg.seed + k)
            for _ in range(cfg.steps):
                idx = torch.randperm(len(forget), generator=gen)[: min(cfg.batch_size, len(forget))]
                img, txt, scale = model.encode(forget.images[idx], tokens[idx])
                loss = -clip_loss(img, txt, scale, labels[idx])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                disp = model.get_theta() - ref
                norm = float(torch.linalg.norm(disp))
                if norm > radius > 0:
                    model.set_theta(ref + disp * (radius / norm))
            displacements.append(model.get_theta() - ref)
            weights.append(float(problem.forget_masks[k].sum()))
            bytes_total += 2 * bytes_of(p)
        theta = ref + (fedavg(torch.stack(displacements), weights) if displacements else 0)
        fed = problem.federation()
        for r in range(cfg.post_rounds):
            res = fed.run_round(theta, problem.retained_clients(), round_index=10_000 + r)
            theta = res.theta
            bytes_total += res.bytes_down + res.bytes_up
        return UnlearningResult(
            theta=theta,
            info={
                "method": "fed_gradient_ascent",
                "radius": radius,
                "post_rounds": cfg.post_rounds,
                "client_round_trips": (1 if problem.holders() else 0) + cfg.post_rounds,  # the ascent, then rounds
                "seconds": time.perf_counter() - start,
                "bytes_total": bytes_total,
            },
        )

"""Federated retrain: the exact reference every federated unlearning method is judged against.

FedAvg from the same LoRA initialisation θ₀ and the same schedule, on the retained data only (the leaving client, or
the forgotten pairs, never take part) — the model that would exist had the forget data never been contributed
(ease-notes §7 "Retrain" [INFERENCE, standard]). Its new update history is returned as an artifact, since it is the
history later deletions must use.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import torch

from app.ml.federation import FederatedProblem
from app.ml.unlearning.base import UnlearningResult


@dataclass
class FedRetrainConfig:
    """``rounds``: FedAvg rounds (None = as many as the original training)."""

    rounds: int | None = None


class FedRetrain:
    def __init__(self, config: FedRetrainConfig | None = None):
        self.config = config or FedRetrainConfig()

    def unlearn(self, problem: FederatedProblem) -> UnlearningResult:
        fed = problem.federation()
        rounds = self.config.rounds or int(problem.n_rounds or problem.fed_settings.rounds)
        result = fed.train(problem.theta_init, rounds, problem.retained_clients(), progress=problem.progress)
        buf = io.BytesIO()
        torch.save({"history": result.history.half(), "weights": result.weights}, buf)
        return UnlearningResult(
            theta=result.theta,
            info={
                "method": "fed_retrain",
                "rounds": rounds,
                "client_round_trips": rounds,
                "clients": problem.retained_clients(),
                "seconds": result.seconds,
                "bytes_down": result.bytes_down,
                "bytes_up": result.bytes_up,
                "bytes_total": result.bytes_total,
                "compute_seconds": result.compute_seconds,
                "critical_seconds": result.critical_seconds,
                "pair_grads": result.pair_grads,
            },
            artifacts={"history": buf.getvalue()},
        )

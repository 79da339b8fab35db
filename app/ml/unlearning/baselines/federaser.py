"""FedEraser (Liu et al., IWQoS 2021): calibrated replay of the stored FedAvg history without the forget data.

The server keeps the clients' updates of every ``interval``-th round. Unlearning replays training from θ₀: at each
stored round the retained clients run a short *calibration* training (``calibration_ratio`` of the local epochs)
from the current unlearned model; the stored update gives the step length, the calibration update the direction,
per LoRA tensor (ease-notes §7):

    θ̃_{t+1} = θ̃_t + ‖U_old‖ · U_cal / ‖U_cal‖

with U_old the FedAvg of the retained clients' stored updates of round t (in class/samples scope: of the retained
clients, whose stored updates still contain the forget pairs — FedEraser was designed for client removal).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from app.ml.clip import lora_layout
from app.ml.federation import FederatedProblem, fedavg
from app.ml.unlearning.base import UnlearningResult


@dataclass
class FedEraserConfig:
    interval: int = 2
    calibration_ratio: float = 0.5


class FedEraser:
    def __init__(self, config: FedEraserConfig | None = None):
        self.config = config or FedEraserConfig()

    def unlearn(self, problem: FederatedProblem) -> UnlearningResult:
        cfg = self.config
        start = time.perf_counter()
        model = problem.get_model()
        slices = [(e["offset"], e["offset"] + int(torch.tensor(e["shape"]).prod())) for e in lora_layout(model.model)]
        fed = problem.federation()
        retained = problem.retained_clients()
        history = problem.full_history()
        rounds = int(problem.n_rounds or history.shape[0])
        theta = problem.theta_init.clone()
        bytes_total = 0
        calibrations = 0
        epochs = cfg.calibration_ratio * problem.fed_settings.local_epochs
        for t in range(0, rounds, max(1, cfg.interval)):
            u_old = fedavg(history[t, retained], problem.weights[retained])
            res = fed.run_round(theta, retained, round_index=t, epochs=epochs)
            u_cal = res.theta - theta
            step = torch.zeros_like(theta)
            for a, b in slices:
                n_cal = torch.linalg.norm(u_cal[a:b])
                if n_cal > 0:
                    step[a:b] = torch.linalg.norm(u_old[a:b]) * u_cal[a:b] / n_cal
            theta = theta + step
            bytes_total += res.bytes_down + res.bytes_up
            calibrations += 1
            problem.progress(min(1.0, (t + 1) / rounds), f"FedEraser calibration round {calibrations}")
        return UnlearningResult(
            theta=theta,
            info={
                "method": "federaser",
                "calibration_rounds": calibrations,
                "calibration_epochs": epochs,
                "client_round_trips": calibrations,  # one calibration round each, one after another
                "seconds": time.perf_counter() - start,
                "bytes_total": bytes_total,
            },
        )

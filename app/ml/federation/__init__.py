"""Federated learning over the LoRA vector, in three modules:

- ``engine``: FedAvg with the per-client update history EASE's GSD reuses, and the projection/penalty hooks of PFL;
- ``problem``: the ``FederatedProblem`` contract every federated unlearning method receives;
- ``demo``: a trained synthetic federation for the demo, tests and benchmarks.
"""

from app.ml.clip import lora_parameters
from app.ml.federation.demo import DemoFederation, make_demo_federation
from app.ml.federation.engine import (
    Federation,
    FedSettings,
    RoundResult,
    TrainResult,
    apply_round,
    bytes_of,
    fedavg,
    trajectory,
)
from app.ml.federation.problem import FederatedProblem

__all__ = [
    "DemoFederation",
    "FedSettings",
    "FederatedProblem",
    "Federation",
    "RoundResult",
    "TrainResult",
    "apply_round",
    "bytes_of",
    "fedavg",
    "lora_parameters",
    "make_demo_federation",
    "trajectory",
]

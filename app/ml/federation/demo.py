"""A trained synthetic federation for the demo, the tests and the benchmarks (not used by the service's worker).

Pretrains the tiny CLIP (cached), generates the planted-concept federation and runs FedAvg with LoRA, recording the
history; optionally caches the trained federation itself, keyed by every setting.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from app.ml.clip import ClipLoRA, ClipSpec, LoraSettings, PretrainSettings, default_cache_dir, pretrain_tiny_clip
from app.ml.data.captions import SyntheticFederation, make_synthetic_federation
from app.ml.federation.engine import Federation, FedSettings
from app.ml.federation.problem import FederatedProblem
from app.ml.unlearning.base import ProgressFn, no_progress


@dataclass
class DemoFederation:
    """A trained synthetic federation: what the demo registers as a ``clip_federated`` model."""

    spec: ClipSpec
    data: SyntheticFederation
    theta_init: torch.Tensor
    theta: torch.Tensor
    history: torch.Tensor
    weights: torch.Tensor
    fed_settings: FedSettings
    bytes_total: int
    seconds: float
    model: ClipLoRA

    def problem(self, scenario: str, progress: ProgressFn = no_progress, **overrides: Any) -> FederatedProblem:
        """The deletion problem of one planted scenario (``"client"``, ``"class"``, ``"samples"``, or ``"membership"``
        — a samples deletion whose matched held-out split is the problem's ``nonmembers``). The test pairs are the
        retrieval gallery's distractors."""
        masks = self.data.forget_masks(scenario)
        scope = "samples" if scenario == "membership" else scenario
        forget_client = self.data.scenarios["client"]["client"] if scope == "client" else None
        kwargs: dict[str, Any] = dict(
            spec=self.spec,
            theta=self.theta.clone(),
            theta_init=self.theta_init.clone(),
            history=self.history,
            clients=self.data.clients,
            forget_masks=masks,
            scope=scope,
            forget_client=forget_client,
            fed_settings=self.fed_settings,
            weights=self.weights,
            progress=progress,
            model=self.model,
            gallery=self.data.test,
            nonmembers=self.data.heldout if scenario == "membership" else None,
        )
        kwargs.update(overrides)
        return FederatedProblem(**kwargs)


def make_demo_federation(
    seed: int = 0,
    n_clients: int = 5,
    pairs_per_client: int = 200,
    n_test: int = 300,
    fed_settings: FedSettings | None = None,
    pretrain: Any | None = None,
    lora: LoraSettings | None = None,
    cache_dir: str | None = None,
    device: str | None = None,
    progress: ProgressFn = no_progress,
    cache_training: bool = False,
    regime: str = "concepts",
    fractions: dict[str, float] | None = None,
) -> DemoFederation:
    """Pretrain (cached) the tiny CLIP, generate the federation and run FedAvg with LoRA, recording the history.

    ``cache_training`` also caches the trained federation (θ, history) under the cache dir, keyed by every setting.
    ``regime``: the generator's ``"concepts"`` (client/class/samples scenarios) or ``"membership"`` federation.
    ``fractions``: the concepts regime's planted shares (captions.DEFAULT_FRACTIONS), e.g. a larger data subject.
    """
    checkpoint = pretrain_tiny_clip(
        pretrain or PretrainSettings(), cache_dir=cache_dir, progress=lambda f, m: progress(0.3 * f, m)
    )
    spec = ClipSpec(checkpoint=str(checkpoint), lora=lora or LoraSettings(init_seed=seed))
    model = ClipLoRA(spec, device=device)
    data = make_synthetic_federation(
        seed, n_clients=n_clients, pairs_per_client=pairs_per_client, n_test=n_test, regime=regime, fractions=fractions
    )
    settings = fed_settings or FedSettings(seed=seed)
    cached = None
    if cache_training:
        parts: list[Any] = [
            checkpoint.name,
            spec.to_dict()["lora"],
            asdict(settings),
            seed,
            n_clients,
            pairs_per_client,
        ]
        if regime != "concepts":
            parts.append(regime)
        if fractions:
            parts.append(sorted(fractions.items()))
        key = json.dumps(parts, sort_keys=True)
        cached = (
            Path(cache_dir or default_cache_dir())
            / "federations"
            / (hashlib.sha256(key.encode()).hexdigest()[:16] + ".pt")
        )
    if cached is not None and cached.exists():
        state = torch.load(cached, weights_only=True)
        theta, history, weights = state["theta"], state["history"].float(), state["weights"]
        bytes_total, seconds = int(state["bytes_total"]), float(state["seconds"])
        progress(1.0, "federation loaded from cache")
    else:
        fed = Federation(model, data.clients, settings)
        result = fed.train(model.theta_init, progress=lambda f, m: progress(0.3 + 0.7 * f, m))
        theta, history, weights = result.theta, result.history, result.weights
        bytes_total, seconds = result.bytes_total, result.seconds
        if cached is not None:
            cached.parent.mkdir(parents=True, exist_ok=True)
            tmp = cached.with_suffix(".tmp")
            torch.save(
                {
                    "theta": theta,
                    "history": history,
                    "weights": weights,
                    "bytes_total": bytes_total,
                    "seconds": seconds,
                },
                tmp,
            )
            tmp.replace(cached)
    return DemoFederation(
        spec=spec,
        data=data,
        theta_init=model.theta_init.clone(),
        theta=theta,
        history=history,
        weights=weights,
        fed_settings=settings,
        bytes_total=bytes_total,
        seconds=seconds,
        model=model,
    )

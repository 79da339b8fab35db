"""The ``FederatedProblem`` contract: everything a federated CLIP unlearning method receives.

The worker builds one from the stored round history and the clients' data; the benchmarks build one from a demo
federation. Methods read it and never touch the service.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from app.ml.clip import ClipLoRA, ClipSpec
from app.ml.data.captions import CaptionDataset
from app.ml.federation.engine import Federation, FedSettings, Penalty, Projection, RoundResult
from app.ml.federation.lock import ForgetLock
from app.ml.unlearning.base import ProgressFn, no_progress

HistoryLoader = Callable[[int], torch.Tensor]
"""client index → that client's updates ``[rounds × p]`` (for histories too large to hold at once)."""


@dataclass
class FederatedProblem:
    """Everything a federated CLIP unlearning method needs (the ``problem`` of ``Method.unlearn``).

    * ``spec``: architecture, frozen backbone checkpoint path and LoRA settings; ``theta``: the global LoRA vector
      now; ``theta_init``: the LoRA initialisation θ₀ (retrain's start; GSD's reference point).
    * ``history``: the per-client update history ``[rounds × clients × p]`` or a loader ``k -> [rounds × p]``;
      ``weights``: the FedAvg weights used in training (default: pair counts).
    * ``clients``: every client's data (tensors); ``forget_masks``: per client, which pairs to forget;
      ``scope``: ``"client"`` (``forget_client`` leaves with all its pairs), ``"class"`` or ``"samples"``.
    * ``fed_settings``: the training schedule (what retrain repeats, what further rounds use).
    * ``run_round``: run one further federated round (methods that need them); built on a :class:`Federation`.
    * ``removed``: clients that left in earlier deletions. They are neither retained nor holders, their FedAvg weight
      is zero (so a rebuilt trajectory and any later FedAvg ignore them), and their stored updates — zeroed by the
      service's erasure, or not — never enter a retain support: a departed client's directions are not protected.
    * ``forget_lock``: the lock earlier deletions published; a method that publishes a lock merges it in.
    * ``gallery``: held-out pairs that join retrieval galleries as distractors when a method measures itself (the
      same gallery the service's and the benchmark's forget R@1 use); ``nonmembers``: held-out pairs drawn like the
      forget pairs and never trained on (a membership deletion's matched split), or None where no such split exists
      (a concept's held-out pairs share the concept and are no target).
    * ``probe_masks``: per client, the forget pairs a method may *measure itself on* (EASE's strength control): a
      subset of ``forget_masks``; None = all of them. Every forget pair is still removed; an evaluation that scores
      only the other forget pairs (``heldout_forget_data``) scores pairs no control saw (issue 24 item 1).
    """

    spec: ClipSpec
    theta: torch.Tensor
    theta_init: torch.Tensor
    history: torch.Tensor | HistoryLoader
    clients: list[CaptionDataset]
    forget_masks: list[np.ndarray]
    scope: str = "client"
    forget_client: int | None = None
    fed_settings: FedSettings = field(default_factory=FedSettings)
    weights: torch.Tensor | None = None
    n_rounds: int | None = None
    artifacts: Mapping[str, bytes] = field(default_factory=dict)
    progress: ProgressFn = no_progress
    device: str | None = None
    model: ClipLoRA | None = None  # built lazily from ``spec``; pass one to share it
    removed: Sequence[int] = ()
    forget_lock: ForgetLock | None = None
    gallery: CaptionDataset | None = None
    nonmembers: CaptionDataset | None = None
    probe_masks: list[np.ndarray] | None = None

    def __post_init__(self) -> None:
        if self.scope not in ("client", "class", "samples"):
            raise ValueError(f"unknown scope {self.scope!r}")
        if len(self.forget_masks) != len(self.clients):
            raise ValueError("one forget mask per client")
        self.forget_masks = [np.asarray(m, dtype=bool) for m in self.forget_masks]
        if self.scope == "client" and self.forget_client is None:
            holders = self.holders()
            if len(holders) != 1:
                raise ValueError("client scope needs forget_client")
            self.forget_client = holders[0]
        self.removed = sorted({int(k) for k in self.removed})
        if self.scope == "client" and self.forget_client in self.removed:
            raise ValueError(f"client {self.forget_client} already left the federation")
        for k in self.removed:  # a departed client holds nothing to forget any more (its pairs are erased)
            self.forget_masks[k] = np.zeros(len(self.clients[k]), dtype=bool)
        if self.probe_masks is not None:
            if len(self.probe_masks) != len(self.clients):
                raise ValueError("one probe mask per client")
            self.probe_masks = [
                np.asarray(p, dtype=bool) & f for p, f in zip(self.probe_masks, self.forget_masks, strict=True)
            ]
        if self.weights is None:
            self.weights = torch.tensor([float(len(c)) for c in self.clients])
        self.weights = torch.as_tensor(self.weights, dtype=torch.float32).clone()
        self.weights[list(self.removed)] = 0.0
        if self.n_rounds is None:
            self.n_rounds = (
                self.history.shape[0] if isinstance(self.history, torch.Tensor) else self.fed_settings.rounds
            )

    # data views -------------------------------------------------------------------------------------------------
    @property
    def n_clients(self) -> int:
        return len(self.clients)

    def holders(self) -> list[int]:
        """Clients holding at least one pair to forget."""
        return [k for k, m in enumerate(self.forget_masks) if m.any() and k not in self.removed]

    def retained_clients(self) -> list[int]:
        """Clients that keep taking part: all but the leaving client (client scope) and those removed earlier."""
        if self.scope == "client":
            return [k for k in range(self.n_clients) if k != self.forget_client and k not in self.removed]
        return [k for k in range(self.n_clients) if (~self.forget_masks[k]).any() and k not in self.removed]

    def forget_data(self, k: int | None = None) -> CaptionDataset:
        ks = self.holders() if k is None else [k]
        return CaptionDataset.concat([self.clients[i].subset(np.flatnonzero(self.forget_masks[i])) for i in ks])

    def probe_data(self) -> CaptionDataset:
        """The forget pairs a method may measure itself on (``probe_masks``; all forget pairs where unset)."""
        if self.probe_masks is None:
            return self.forget_data()
        ks = self.holders()
        return CaptionDataset.concat([self.clients[i].subset(np.flatnonzero(self.probe_masks[i])) for i in ks])

    def heldout_forget_data(self) -> CaptionDataset:
        """The forget pairs no control measured (all forget pairs where ``probe_masks`` is unset)."""
        if self.probe_masks is None:
            return self.forget_data()
        ks = self.holders()
        masks = [self.forget_masks[i] & ~self.probe_masks[i] for i in ks]
        return CaptionDataset.concat(
            [self.clients[i].subset(np.flatnonzero(m)) for i, m in zip(ks, masks, strict=True)]
        )

    def retain_data(self, k: int) -> CaptionDataset:
        if (self.scope == "client" and k == self.forget_client) or k in self.removed:
            return self.clients[k].subset([])
        return self.clients[k].subset(np.flatnonzero(~self.forget_masks[k]))

    def retained_datasets(self) -> list[CaptionDataset]:
        """Per client, the pairs the unlearned model may learn from (empty for the leaving and departed clients)."""
        return [self.retain_data(k) for k in range(self.n_clients)]

    def client_history(self, k: int) -> torch.Tensor:
        if isinstance(self.history, torch.Tensor):
            return self.history[:, k, :]
        return self.history(k)

    def full_history(self) -> torch.Tensor:
        if isinstance(self.history, torch.Tensor):
            return self.history
        return torch.stack([self.history(k) for k in range(self.n_clients)], dim=1)

    # model and rounds -------------------------------------------------------------------------------------------
    def get_model(self) -> ClipLoRA:
        if self.model is None:
            self.model = ClipLoRA(self.spec, device=self.device)
        return self.model

    def federation(self, datasets: Sequence[CaptionDataset] | None = None) -> Federation:
        """A federation over ``datasets`` (default: the retained data of every client) with the training schedule."""
        return Federation(
            self.get_model(), datasets if datasets is not None else self.retained_datasets(), self.fed_settings
        )

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
        """One further FedAvg round of the retained data (the forget pairs never take part)."""
        fed = self.federation()
        return fed.run_round(
            theta, clients, round_index=round_index, projection=projection, penalty=penalty, epochs=epochs
        )


PROBE_FRACTION = 0.4
"""Share of a deletion's forget pairs a method may measure itself on (the service's and the benchmark's split)."""
PROBE_SEED = 24
MIN_PROBE_SPLIT = 10
"""Below this many forget pairs the service gives no probe split (a 4-pair probe is no measurement): the control
then sees every forget pair, and the verdict scores them all — stated in the report."""


def probe_split(
    forget_masks: Sequence[np.ndarray],
    fraction: float,
    seed: int = 0,
    strata: Sequence[Sequence[str]] | None = None,
) -> list[np.ndarray]:
    """A random ``fraction`` of all forget pairs as the probe split (``FederatedProblem.probe_masks``, one mask per
    client), the rest held out; with two or more forget pairs in all, both sides keep at least one (issue 24 item 1).

    ``strata``: per client, one key per pair (the caption). The split is then proportional within every key (each
    key's probe count within one pair of its share n_probe/n): systematic sampling from a random start down the pairs
    ordered by stratum (strata in a random order, pairs in a random order inside each), so the probe and the held-out
    pairs hold the captions in (nearly) the same shares; a caption with one pair lands on one side. Why: R@1 counts
    a caption twin as a hit, so a forget set clusters by caption (the benchmark's class deletion: 180 pairs, 24
    captions) and a plain random split hands the control another caption mix than the one the verdict scores.
    A single forget pair goes to the probe split (nothing is held out)."""
    if not 0.0 < fraction < 1.0:
        raise ValueError("the probe fraction must lie in (0, 1)")
    rng = np.random.default_rng(seed)
    positions = [(k, i) for k, m in enumerate(forget_masks) for i in np.flatnonzero(m)]
    n = len(positions)
    n_probe = min(max(int(round(fraction * n)), 1), n - 1) if n >= 2 else n
    if strata is None:
        chosen = rng.permutation(n)[:n_probe]
    else:
        keys = [str(strata[k][i]) for k, i in positions]
        rank = {key: r for r, key in enumerate(rng.permutation(sorted(set(keys))))}  # strata in a random order
        order = sorted(rng.permutation(n).tolist(), key=lambda j: rank[keys[j]])  # stable: random inside a stratum
        step = np.floor(np.arange(n + 1) * (n_probe / max(n, 1)) + rng.random())
        chosen = np.asarray(order, dtype=int)[np.diff(step) > 0]  # exactly n_probe picks, spread evenly
    out = [np.zeros(len(m), dtype=bool) for m in forget_masks]
    for j in chosen:
        k, i = positions[j]
        out[k][i] = True
    return out

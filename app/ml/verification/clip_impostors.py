"""Impostor "methods" for federated CLIP LoRA models (issue 20 item 2, the federated wing of impostors.py): LoRA
vectors that are NOT an unlearning of the forget pairs, run through the federated verdict (clip_evidence.py and
policy.decide) by tests/unit/test_clip_evidence.py and ``python -m bench.verify``; every one must fail.

The parameter-only impostors are impostors.py's own (do nothing, one ulp, noise, scaling: they read only ``theta``);
the others need the federation: ``ASCENT_STEPS`` Adam steps up the forget pairs' CLIP loss (the gradient-ascent
baseline stopped early, notes Part 2 §2.5), a federated retrain that removed as many OTHER pairs, and one that kept the
forget pairs. There is no Newton step for CLIP, so impostors.py's half step has no counterpart here. Strengths are
fixed before any measurement (never tuned on the verdicts they are scored by).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from app.ml.clip import ClipLoRA
from app.ml.data.captions import CaptionDataset
from app.ml.federation import Federation, FedSettings
from app.ml.verification import impostors as tabular_impostors

ASCENT_STEPS = 3
ASCENT_LR = 2e-3
"""Adam's step (the federated gradient-ascent baseline's, app/ml/unlearning/baselines/gradient_ascent.py)."""
ASCENT_NEGATIVES = 32
"""Retained pairs that join each ascent batch as negatives (a contrastive loss over one pair alone is 0)."""


@dataclass
class ClipImpostorCase:
    """One federated deletion: the clients' pairs, the forget masks per client, the served θ and the recipe."""

    model: ClipLoRA
    clients: list[CaptionDataset]
    forget: list[np.ndarray]
    theta: torch.Tensor
    theta_init: torch.Tensor
    fed: FedSettings
    rounds: int
    trained: dict[bytes, torch.Tensor] = field(default_factory=dict)
    """Retrains already run, by the pairs they kept (the recipe is deterministic: a panel shares this between trials,
    so the retrain that kept every pair runs once)."""

    def retrain(self, keep: list[np.ndarray]) -> torch.Tensor:
        """The model's recipe (FedAvg from θ₀, its schedule) on the pairs ``keep`` marks, per client."""
        key = np.concatenate(keep).tobytes()
        if key not in self.trained:
            self.trained[key] = self._train(keep)
        return self.trained[key]

    def _train(self, keep: list[np.ndarray]) -> torch.Tensor:
        data = [c.subset(np.flatnonzero(k)) for c, k in zip(self.clients, keep, strict=True)]
        live = [i for i, d in enumerate(data) if len(d)]
        return (
            Federation(self.model, data, self.fed).train(self.theta_init, self.rounds, live, record_history=False).theta
        )


def retrain_kept_rows(case: ClipImpostorCase, rng: np.random.Generator) -> torch.Tensor:
    """A federated retrain that forgot to drop the pairs (every pair again)."""
    return case.retrain([np.ones(len(c), bool) for c in case.clients])


def retrain_other_rows(case: ClipImpostorCase, rng: np.random.Generator) -> torch.Tensor:
    """A federated retrain that removed as many OTHER pairs (captions unlike every forget pair's) and kept the forget
    pairs: a deletion of the wrong pairs."""
    forget_captions = {c for d, m in zip(case.clients, case.forget, strict=True) for c in np.asarray(d.captions)[m]}
    flat = [(k, i) for k, (d, m) in enumerate(zip(case.clients, case.forget, strict=True)) for i in range(len(d))
            if not m[i] and d.captions[i] not in forget_captions]  # fmt: skip
    n = min(int(sum(int(m.sum()) for m in case.forget)), len(flat))  # as many as there are, in a small federation
    keep = [np.ones(len(c), bool) for c in case.clients]
    for j in rng.choice(len(flat), size=n, replace=False):
        k, i = flat[int(j)]
        keep[k][i] = False
    return case.retrain(keep)


def gradient_ascent(case: ClipImpostorCase, rng: np.random.Generator) -> torch.Tensor:
    """ASCENT_STEPS Adam steps up the forget pairs' InfoNCE terms (against ASCENT_NEGATIVES retained pairs)."""
    forget = CaptionDataset.concat(
        [d.subset(np.flatnonzero(m)) for d, m in zip(case.clients, case.forget, strict=True)]
    )
    retained = CaptionDataset.concat(
        [d.subset(np.flatnonzero(~m)) for d, m in zip(case.clients, case.forget, strict=True)]
    )
    negatives = retained.subset(rng.choice(len(retained), size=min(ASCENT_NEGATIVES, len(retained)), replace=False))
    batch = CaptionDataset.concat([forget, negatives])
    model = case.model
    model.set_theta(case.theta)
    optimiser = torch.optim.Adam(model.parameters(), lr=ASCENT_LR)
    tokens, k = model.tokens(batch.captions), len(forget)
    target = torch.arange(len(batch), device=model.device)
    for _ in range(ASCENT_STEPS):
        img, txt, scale = model.encode(batch.images, tokens)
        logits = scale * img @ txt.T
        per_pair = F.cross_entropy(logits, target, reduction="none") + F.cross_entropy(
            logits.T, target, reduction="none"
        )
        loss = -0.5 * per_pair[:k].mean()
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        optimiser.step()
    theta = model.get_theta().detach().clone()
    model.set_theta(case.theta)
    return theta


CLIP_IMPOSTORS = {
    **{name: tabular_impostors.IMPOSTORS[name] for name in (
        "do_nothing", "one_ulp", "noise_1e-6", "noise_1e-4", "noise_1e-2",
        "scale_1+1e-4", "scale_1-1e-4", "scale_1+1e-2", "scale_1-1e-2",
    )},
    "gradient_ascent": gradient_ascent,
    "retrain_other_rows": retrain_other_rows,
    "retrain_kept_rows": retrain_kept_rows,
}  # fmt: skip
CLIP_EXACT_IMPOSTORS = tabular_impostors.EXACT_IMPOSTORS
"""The retrain impostors claim to be exact federated retraining: judged with ``exact=True``."""

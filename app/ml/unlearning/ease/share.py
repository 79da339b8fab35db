"""The holders' replayed share: the class/samples analogue of the leaving client's stored share (issue 24 item 3).

In client scope the server knows exactly what the leaving client added to the model — its FedAvg-weighted stored
updates — and taking that share off (off U_μ, at half strength, then protected repair rounds) is what met every
aim of the client scenario. In class or samples scope no stored update isolates the forget pairs: they are mixed
into their holders' updates. Each holder can still *replay* what they added: at a stored global model θ_t (rebuilt
from θ₀ and the history, as GSD's replay does) it runs its round-t local training twice — as it ran, and with the
forget pairs left out of the same batches (``Federation.local_update(drop=…)``) — and the difference is the forget
pairs' share of its round-t update, with the batch noise of the retained pairs cancelled [INFERENCE]. (On an
untouched federation the first run reproduces the stored update bit for bit; in a service the stored round ran on data
later deletions changed, at a published θ the rebuild does not reproduce, so it is rerun, not read.) The excision is
minus the FedAvg-weighted sum over holders and rounds; at ``share_points`` < R rounds the sum is estimated from
evenly spaced rounds (each standing for R / points of them).

Cost: per holder and replayed round, two local trainings and θ_t down (none where GSD's replay already sent it),
one displacement up per holder.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from app.ml.clip import ClipLoRA
from app.ml.federation import FederatedProblem, bytes_of, trajectory
from app.ml.federation.accounting import Ledger, cpu_timer
from app.ml.federation.engine import Federation


def share_rounds(rounds: int, points: int | None) -> list[int]:
    """The rounds replayed: all of them (None), or ``points`` evenly spaced ones."""
    if points is None or points >= rounds:
        return list(range(rounds))
    return [int(t) for t in np.unique(np.linspace(0, rounds - 1, max(1, points)).round().astype(int))]


def replayed_share(
    problem: FederatedProblem, model: ClipLoRA, points: int | None, ledger: Ledger, sent: set[int] = frozenset()
) -> tuple[torch.Tensor, list[dict[str, Any]]]:
    """Σ_k Σ_t (w_k / Σ_present w) (Δ_k,t − Δ_k,t(without the forget pairs)) over the holders k and replayed rounds
    t, scaled by R / |rounds| — the forget pairs' estimated share of the global displacement (module docstring).
    ``sent``: rounds whose global model the holders already received (GSD's replay points): not counted again."""
    rounds = int(problem.n_rounds or 0)
    weights = problem.weights if problem.weights is not None else torch.ones(problem.n_clients)
    with cpu_timer() as t:
        history = problem.full_history()[:rounds]
        thetas = trajectory(problem.theta_init, history, weights)
        present = history.abs().sum(dim=2) > 0  # [rounds × clients]
    ledger.stage("replayed share: trajectory", {"server": t[0]})
    replayed = share_rounds(rounds, points)
    stretch = rounds / max(len(replayed), 1)
    fed = Federation(model, problem.clients, problem.fed_settings)  # the holders' own data, forget pairs included
    p = problem.theta.numel()
    total = torch.zeros(p, dtype=torch.float64)
    info, party = [], {}
    grads_before = fed.pair_grads
    for k in problem.holders():
        drop = torch.as_tensor(problem.forget_masks[k])
        share = torch.zeros(p, dtype=torch.float64)
        with cpu_timer() as t:
            for r in replayed:
                if not present[r, k]:
                    continue
                w = float(weights[k] / weights[present[r]].sum())
                # rerun, not read from the stored update: in a service the stored round ran on data that later
                # deletions changed, at a published θ (lock, departed clients) that the rebuild does not reproduce
                with_pairs = fed.local_update(thetas[r], k, round_index=r)
                without = fed.local_update(thetas[r], k, round_index=r, drop=drop)
                share += w * (with_pairs - without).to(torch.float64)
        party[f"client {k}"] = t[0]
        total += stretch * share
        missing = [r for r in replayed if present[r, k] and r not in sent]
        ledger.down("replayed share: global models to holders", len(missing) * bytes_of(p))
        ledger.up("replayed share: displacements from holders", bytes_of(p))
        info.append({"client": k, "source": "replayed share", "rounds": len(replayed),
                     "share_norm": float(torch.linalg.norm(stretch * share))})  # fmt: skip
    ledger.stage("replayed share", party, pair_grads=fed.pair_grads - grads_before)
    return total, info

"""Issue 24 item 1: what sets EASE's strength measures only the probe split of the forget pairs, and the verdict
scores only the other forget pairs when the method measured itself."""

import collections
import types

import numpy as np
import pytest

from app.jobs.federated import _audited_positions, _probe_masks
from app.jobs.work import Unlearned
from app.ml.federation.accounting import Ledger
from app.ml.federation.problem import PROBE_FRACTION, PROBE_SEED, probe_split
from app.ml.unlearning.ease.method import ProbeJudge

from .clip_helpers import tiny_demo


def _split_problem():
    demo = tiny_demo()
    masks = demo.data.forget_masks("client")
    return demo, demo.problem("client", probe_masks=probe_split(masks, 0.4, seed=24))


def test_probe_split_is_a_disjoint_part_of_the_forget_pairs():
    masks = [np.array([True] * 10 + [False] * 5), np.zeros(7, bool), np.array([True, True, False])]
    probe = probe_split(masks, 0.4, seed=3)
    assert sum(int(p.sum()) for p in probe) == round(0.4 * 12)
    assert all(not (p & ~m).any() for p, m in zip(probe, masks, strict=True))  # only forget pairs
    assert probe_split([np.array([True, True])], 0.01)[0].sum() == 1  # both sides keep one
    with pytest.raises(ValueError):
        probe_split(masks, 1.0)


def test_a_stratified_probe_split_gives_every_caption_its_share():
    """With captions as strata each caption's probe count is its share, rounded one way or the other: the control
    and the verdict see the same caption mix (a plain random split of these 60 pairs misses it by far)."""
    rng = np.random.default_rng(0)
    sizes = [13, 13, 11, 9, 8, 3, 2, 1]
    captions = [f"caption {j}" for j, size in enumerate(sizes) for _ in range(size)]
    order = rng.permutation(len(captions))
    clients = [[captions[i] for i in order[:25]], [captions[i] for i in order[25:]] + ["retained"] * 4]
    masks = [np.ones(25, bool), np.array([True] * (len(captions) - 25) + [False] * 4)]
    for seed in range(20):
        probe = probe_split(masks, 0.4, seed=seed, strata=clients)
        assert all(not (p & ~m).any() for p, m in zip(probe, masks, strict=True))
        picked = [c for cl, p in zip(clients, probe, strict=True) for c, hit in zip(cl, p, strict=True) if hit]
        assert len(picked) == round(0.4 * len(captions))
        share = len(picked) / len(captions)
        for j, size in enumerate(sizes):
            assert abs(picked.count(f"caption {j}") - share * size) < 1.0, (seed, j)
    unstratified = probe_split(masks, 0.4, seed=1)
    picked = [c for cl, p in zip(clients, unstratified, strict=True) for c, hit in zip(cl, p, strict=True) if hit]
    assert max(abs(picked.count(f"caption {j}") - 0.4 * size) for j, size in enumerate(sizes)) >= 1.0


def test_a_stratified_split_of_very_few_pairs_keeps_both_sides():
    for n in (0, 1, 2, 3):
        probe = probe_split([np.ones(n, bool)], 0.4, seed=n, strata=[["same"] * n])[0]
        assert int(probe.sum()) == (n if n < 2 else max(1, min(round(0.4 * n), n - 1)))


def test_the_service_stratifies_its_probe_split_by_caption():
    """The worker's split (jobs/federated.py) over the pairs an earlier deletion left: each caption its share."""
    rng = np.random.default_rng(5)
    words = [f"caption {j}" for j, size in enumerate([14, 12, 9, 9, 6, 2, 1]) for _ in range(size)]
    captions = [list(rng.permutation(words[:30])) + ["kept"] * 6, list(rng.permutation(words[30:])) + ["kept"] * 3]
    data = types.SimpleNamespace(clients=[types.SimpleNamespace(captions=c) for c in captions])
    alive = [np.ones(len(c), bool) for c in captions]
    alive[0][:4] = False  # pairs an earlier deletion took: the masks index each client's remaining pairs
    remaining = [[c for c, a in zip(cl, al, strict=True) if a] for cl, al in zip(captions, alive, strict=True)]
    masks = [np.array([c != "kept" for c in cl]) for cl in remaining]
    probe = _probe_masks(data, alive, masks)
    assert probe is not None

    def count(which):
        return collections.Counter(
            c for cl, m in zip(remaining, which, strict=True) for c, hit in zip(cl, m, strict=True) if hit
        )

    every, probed = count(masks), count(probe)
    share = sum(probed.values()) / sum(every.values())
    assert all(abs(probed[c] - share * n) < 1.0 for c, n in every.items()), (every, probed)
    # the strata are the captions of the pairs the masks index: the split is exactly the library's on those
    expected = probe_split(masks, PROBE_FRACTION, PROBE_SEED, strata=remaining)
    assert all((a == b).all() for a, b in zip(probe, expected, strict=True))
    few = [np.zeros_like(m) for m in masks]
    few[1][:3] = True
    assert _probe_masks(data, alive, few) is None  # below MIN_PROBE_SPLIT: no split


def test_the_strength_control_measures_only_the_probe_pairs():
    demo, problem = _split_problem()
    judge = ProbeJudge(problem, demo.model, Ledger())
    probe, heldout = set(problem.probe_data().ids), set(problem.heldout_forget_data().ids)
    assert set(judge.forget.ids) == probe and not probe & heldout
    assert probe | heldout == set(problem.forget_data().ids) and heldout


def test_the_verdict_scores_the_pairs_the_control_never_measured():
    demo, problem = _split_problem()
    ids = [pid for c in demo.data.clients for pid in c.ids]
    forgotten = set(problem.forget_data().ids)
    positions = [i for i, pid in enumerate(ids) if pid in forgotten]

    def unlearned(info):
        return Unlearned(theta=demo.theta, method="ease", metrics={"method_info": info}, positions=positions)

    held, why = _audited_positions(problem, demo.data, unlearned({"strength": {"probes": [{"scale": 1.0}]}}))
    assert {ids[p] for p in held} == set(problem.heldout_forget_data().ids) and "never measured" in why
    every, _ = _audited_positions(problem, demo.data, unlearned({"strength": {"mode": "fixed", "probes": []}}))
    assert every == positions

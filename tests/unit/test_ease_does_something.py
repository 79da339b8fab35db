"""Issue 24 item 5: an EASE deletion on a test federation must lower the held-out forget pairs' R@1 by more than
retraining's own run-to-run spread — for the client-scope default (the server's excision from the stored updates)
and for BKE at the leaving client — and the same bar must reject an EASE that does nothing to the leaving client's
knowledge: BKE and the server path each with neither the GSD projection nor the excision (only the protected repair
rounds). Measured when written (held-out R@1 26.4 before; retraining 9.7 and 15.3): the default 11.1, BKE 11.1; BKE
with only its excision off 20.8 and the server path with nothing removed 22.2, both within 8 points. Switching off
the excision alone is not "nothing removed": the GSD projection off the leaving client's exclusive update directions
forgets too — the server path with only its excision off passed the bar (15.3), and at stop 40, on another machine's
bits of the same pretraining, so did BKE with only its excision off (drop 18.1) — so both do-nothing variants switch
off both steps.

The federation: a CLIP pretrained a little longer than the tiny one (the memorising settings of clip_helpers) whose
LoRA learns the leaving client's novel concept, so that forgetting it is measurable; the forget R@1 is scored on the
60 % of the forget pairs EASE's strength control never measured (``probe_masks``), against the half of the test pairs
that is not the control's gallery.
"""

import dataclasses
import functools
import tempfile

import pytest
import torch

from app.ml.clip import LoraSettings
from app.ml.federation import FedSettings, make_demo_federation
from app.ml.federation.problem import probe_split
from app.ml.unlearning.base import get_method
from app.ml.verification.clip_evidence import split_reference
from app.ml.verification.retrieval import evaluate_retrieval

from .clip_helpers import MEMO_PRETRAIN

MIN_DROP = 8.0
"""Points the held-out forget R@1 must fall by at least, whatever retraining's spread (one of the 36 held-out
queries is 2.8 points: 8 points is three queries)."""


@functools.lru_cache(maxsize=1)
def world():
    """(model, problem, evaluation gallery, original θ) of the client deletion on the small federation."""
    demo = make_demo_federation(
        seed=0,
        n_clients=3,
        pairs_per_client=60,
        n_test=40,
        fed_settings=FedSettings(rounds=8, batch_size=16, lr=1e-2),
        pretrain=MEMO_PRETRAIN,
        lora=LoraSettings(rank=4),
        cache_dir=tempfile.mkdtemp(prefix="lethe-test-"),
        device="cpu",
    )
    probe_gallery, eval_gallery = split_reference(demo.data.test)
    masks = demo.data.forget_masks("client")
    problem = demo.problem("client", gallery=probe_gallery, probe_masks=probe_split(masks, 0.4, seed=24))
    return demo.model, problem, eval_gallery, demo.theta


def heldout_r1(theta: torch.Tensor) -> float:
    model, problem, gallery, _ = world()
    model.set_theta(theta)
    return evaluate_retrieval(model, problem.heldout_forget_data(), gallery).mean_r1


def test_probe_split_keeps_the_heldout_forget_pairs_out_of_the_control():
    _, problem, _, _ = world()
    probe, heldout = problem.probe_data(), problem.heldout_forget_data()
    assert len(probe) + len(heldout) == len(problem.forget_data()) and len(heldout) > len(probe) > 0
    assert not set(probe.ids) & set(heldout.ids)


@functools.lru_cache(maxsize=1)
def retraining_spread() -> float:
    _, problem, _, _ = world()
    retrained = []
    for seed in (0, 1000):  # retraining against retraining: another data order
        settings = dataclasses.replace(problem.fed_settings, seed=seed)
        run = get_method("fed_retrain").build({}).unlearn(dataclasses.replace(problem, fed_settings=settings))
        retrained.append(heldout_r1(run.theta))
    return max(retrained) - min(retrained)


def drop(settings: dict) -> float:
    _, problem, _, theta = world()
    return heldout_r1(theta) - heldout_r1(get_method("ease").build(settings).unlearn(problem).theta)


@pytest.mark.parametrize("settings", [{}, {"client_excision": "bke"}], ids=["default", "bke"])
def test_an_ease_deletion_lowers_the_heldout_forget_r1_by_more_than_retrainings_spread(settings):
    assert drop(settings) > max(retraining_spread(), MIN_DROP)


@pytest.mark.parametrize(
    "settings",
    [{"client_excision": "bke", "excision_steps": 0, "gsd": "none"}, {"gsd": "none", "offline_scale": 0.0}],
    ids=["bke-nothing-removed", "server-path-nothing-removed"],
)
def test_the_bar_rejects_an_ease_that_removes_nothing(settings):
    """The test above can fail: an EASE that removes nothing of the leaving client's knowledge stays under the bar."""
    assert drop(settings) <= max(retraining_spread(), MIN_DROP)

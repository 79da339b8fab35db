"""SISA and the do-nothing floor."""

from __future__ import annotations

import numpy as np
import torch
from safetensors.torch import load as st_load
from sklearn.datasets import make_classification

from app.ml import tabular as T
from app.ml.unlearning.base import TabularProblem, get_method
from app.ml.unlearning.baselines.sisa import ARTIFACT_SISA, SISA, DoNothing, SISAConfig


def _problem(X, y, r, theta, forget, tomb, artifacts=None):
    retain = ~forget & ~tomb
    return TabularProblem(r, X, y, 2, theta, retain, forget, tomb, artifacts=artifacts or {})


def test_sisa_retrains_only_the_affected_shard_from_its_slice():
    X, y = make_classification(n_samples=1000, n_features=6, random_state=0)
    X = X.astype(np.float32)
    r = T.TabularRecipe()
    theta = T.train(r, X, y, 2)
    none = np.zeros(1000, bool)
    sisa = get_method("sisa").build({"shards": 4, "slices": 3})
    assert isinstance(sisa, SISA) and sisa.config == SISAConfig(shards=4, slices=3)
    prep = sisa.prepare(_problem(X, y, r, theta, none, none))
    assert torch.equal(prep.theta, theta)  # contract: prepare leaves theta alone
    state = st_load(prep.artifacts[ARTIFACT_SISA])
    shard_of, slice_of, ckpt = state["shard_of"].numpy(), state["slice_of"].numpy(), state["checkpoints"]
    assert ckpt.shape == (4, 3, 7) and np.bincount(shard_of).tolist() == [250] * 4

    row = int(np.nonzero((shard_of == 2) & (slice_of == 1))[0][0])
    forget = none.copy()
    forget[row] = True
    res = sisa.unlearn(_problem(X, y, r, theta, forget, none, prep.artifacts))
    assert res.info["shards_retrained"] == 1 and res.info["restart_slice_by_shard"] == {"2": 1}
    assert res.theta.shape == (4 * 7,)
    members = res.theta.view(4, 7)
    for k in (0, 1, 3):  # untouched constituents are bit-identical
        assert torch.equal(members[k], ckpt[k, -1])
    # LR is convex: the retrained constituent is the optimum on its shard without the row
    shard_rows = np.nonzero((shard_of == 2) & ~forget)[0]
    assert (members[2] - T.train(r, X[shard_rows], y[shard_rows], 2)).abs().max() < 1e-4
    assert T.accuracy(r, res.theta, X, y, 2) > T.accuracy(r, theta, X, y, 2) - 0.03

    # sequential: a second deletion in another shard keeps the first one's effect
    row2 = int(np.nonzero(shard_of == 0)[0][0])
    forget2 = none.copy()
    forget2[row2] = True
    res2 = sisa.unlearn(_problem(X, y, r, res.theta, forget2, forget, res.artifacts))
    m2 = res2.theta.view(4, 7)
    assert torch.equal(m2[2], members[2]) and not torch.equal(m2[0], members[0])
    assert st_load(res2.artifacts[ARTIFACT_SISA])["shard_of"][[row, row2]].tolist() == [-1, -1]


def test_do_nothing_returns_theta():
    X, y = make_classification(n_samples=100, n_features=3, n_informative=2, n_redundant=0, random_state=0)
    r = T.TabularRecipe()
    theta = T.train(r, X, y, 2)
    forget = np.zeros(100, bool)
    forget[0] = True
    res = DoNothing().unlearn(_problem(X, y, r, theta, forget, np.zeros(100, bool)))
    assert torch.equal(res.theta, theta) and res.theta is not theta


def test_sisa_never_serves_a_constituent_trained_on_a_row_another_method_erased():
    """Regression (trust issue, item 3): a row erased by a retrain deletion stayed in its SISA shard, so a later SISA
    deletion elsewhere served the constituent that had learned it again."""
    X, y = make_classification(n_samples=240, n_features=5, n_informative=3, n_redundant=0, random_state=4)
    r = T.TabularRecipe()
    theta = T.train(r, X, y, 2)
    none = np.zeros(240, bool)
    sisa = SISA(SISAConfig(shards=4, slices=2))
    prep = sisa.prepare(_problem(X, y, r, theta, none, none))
    shard_of = st_load(prep.artifacts[ARTIFACT_SISA])["shard_of"].numpy()
    erased = int(np.nonzero(shard_of == 1)[0][0])  # erased earlier by another method: a tombstone for SISA
    later = int(np.nonzero(shard_of == 3)[0][0])  # what this SISA request deletes, in another shard
    tomb, forget = none.copy(), none.copy()
    tomb[erased], forget[later] = True, True
    res = sisa.unlearn(_problem(X, y, r, theta, forget, tomb, prep.artifacts))
    assert st_load(res.artifacts[ARTIFACT_SISA])["shard_of"][[erased, later]].tolist() == [-1, -1]
    member = res.theta.view(4, -1)[1]
    rows = np.nonzero((shard_of == 1) & ~tomb)[0]
    assert (member - T.train(r, X[rows], y[rows], 2)).abs().max() < 1e-4  # shard 1 retrained without the row
    # the purge hook does the same for a row erased while another method served the request
    purged = sisa.purge(_problem(X, y, r, theta, tomb, none, prep.artifacts))
    assert st_load(purged.artifacts[ARTIFACT_SISA])["shard_of"][erased].item() == -1

"""Isolation Kernel feature map, KMEs, running mu_D and the seed purge."""

from __future__ import annotations

import numpy as np
import pytest

from app.ml.unlearning.l2ul.kernel import IsolationKernel, KernelState


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(500, 4)).astype(np.float32)
    y = (X[:, 0] > 0).astype(np.int64)
    return X, y


def test_feature_map_has_t_ones_and_seeds_are_distinct(data):
    X, _ = data
    k = IsolationKernel.fit(np.arange(len(X)), psi=4, t=50, rng=np.random.default_rng(1))
    assert k.seeds.shape == (50, 4)
    assert all(len(set(row)) == 4 for row in k.seeds)  # drawn without replacement
    cells = k.cells(X)
    assert cells.shape == (500, 50) and cells.dtype == np.uint8
    phi = k.phi(cells)
    assert phi.shape == (500, 200)
    assert (phi.sum(1) == 50).all()
    assert set(np.unique(phi)) <= {0.0, 1.0}
    # a seed lies in its own cell
    for i in range(50):
        for j, row in enumerate(k.seeds[i]):
            assert cells[row, i] == j
    # nearest-seed assignment equals a brute-force argmin of Euclidean distances
    centres = X[k.seeds[3]]
    brute = np.argmin(((X[:, None, :] - centres[None]) ** 2).sum(-1), axis=1)
    assert np.array_equal(cells[:, 3], brute)


def test_kme_is_order_invariant_and_a_mean(data):
    X, y = data
    k = IsolationKernel.fit(np.arange(len(X)), psi=4, t=30, rng=np.random.default_rng(2))
    cells = k.cells(X)
    rows = np.arange(100)
    mu = k.embed(cells[rows])
    perm = np.random.default_rng(3).permutation(rows)
    assert np.array_equal(mu, k.embed(cells[perm]))
    assert np.allclose(mu, k.phi(cells[rows]).mean(0))
    assert np.allclose(mu.reshape(30, 4).sum(1), 1.0)  # t histograms over psi cells
    joint = k.embed(cells[rows], y[rows], 2)
    assert joint.shape == (2 * 120,)
    assert np.allclose(joint.reshape(2, 120).sum(0), mu)  # marginalising the label gives the feature KME
    assert np.isclose(joint[:120].reshape(30, 4).sum(1)[0], (y[rows] == 0).mean())


@pytest.mark.parametrize("n_classes", [None, 2])
def test_running_mu_D_equals_recompute(data, n_classes):
    X, y = data
    ks = KernelState.build(X, y, np.arange(450), 4, 40, np.random.default_rng(4), n_classes)
    assert ks.n == 450
    labels = y if n_classes else None
    fresh = ks.kernel.embed(ks.cells[:450], None if labels is None else labels[:450], n_classes)
    assert np.array_equal(ks.mu_D(), fresh)
    ks.remove(np.array([3, 17, 200]), y)
    ks.remove(np.array([17, 460]), y)  # already gone / never counted: ignored
    keep = np.setdiff1d(np.arange(450), [3, 17, 200])
    recomputed = ks.kernel.embed(ks.cells[keep], None if labels is None else labels[keep], n_classes)
    assert ks.n == 447
    assert np.allclose(ks.mu_D(), recomputed, rtol=0, atol=1e-15)


def test_seed_purge_redraws_only_affected_partitionings(data):
    X, y = data
    ks = KernelState.build(X, y, np.arange(500), 4, 40, np.random.default_rng(5), 2)
    seeds_before = ks.kernel.seeds.copy()
    cells_before = ks.cells.copy()
    deleted = np.unique(seeds_before[[2, 7]].reshape(-1)[:5])  # 4 seeds of partitioning 2, one of partitioning 7
    affected = np.nonzero(np.isin(seeds_before, deleted).any(1))[0]
    ks.remove(deleted, y)
    n_redrawn = ks.purge_seeds(deleted, X, y, np.random.default_rng(6))
    assert n_redrawn == int(np.isin(seeds_before, deleted).sum())
    assert not np.isin(ks.kernel.seeds, deleted).any()
    assert all(len(set(row)) == 4 for row in ks.kernel.seeds)
    assert ks.counted[ks.kernel.seeds].all()  # re-drawn from retained rows only
    unaffected = np.setdiff1d(np.arange(40), affected)
    assert np.array_equal(ks.kernel.seeds[unaffected], seeds_before[unaffected])
    assert np.array_equal(ks.cells[:, unaffected], cells_before[:, unaffected])
    assert not np.array_equal(ks.cells[:, affected], cells_before[:, affected])
    # mu_D is consistent with the new kernel
    keep = np.nonzero(ks.counted)[0]
    assert np.allclose(ks.mu_D(), ks.kernel.embed(ks.kernel.cells(X, keep), y[keep], 2))

"""L2UL: meta-set, N_U, the purge, prepare + sequential unlearns, artifacts."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from sklearn.datasets import make_classification

from app.ml import tabular as T
from app.ml.unlearning.base import InvalidMethodSettingsError, TabularProblem, get_method
from app.ml.unlearning.l2ul import ARTIFACT_NAMES, L2UL, L2ULConfig, MetaSet, Unlearner, generate_meta_set
from app.ml.unlearning.l2ul.kernel import KernelState
from app.ml.unlearning.l2ul.meta import sample_forget_size
from app.ml.unlearning.l2ul.method import ARTIFACT_KERNEL, ARTIFACT_META, ARTIFACT_UNLEARNER, _kernel_from_bytes

N = 2000


@pytest.fixture(scope="module")
def data():
    X, y = make_classification(n_samples=N, n_features=5, n_informative=4, n_redundant=1, flip_y=0.05, random_state=0)
    return X.astype(np.float32), y


@pytest.fixture(scope="module")
def meta(data):
    X, y = data
    return generate_meta_set(T.TabularRecipe(), X, y, 2, np.arange(N), m=240, s=300, workers=1, seed=1)


def test_forget_sizes_cover_the_range():
    rng = np.random.default_rng(0)
    sizes = [sample_forget_size(rng, 1000, 1, 0.05) for _ in range(2000)]
    assert min(sizes) == 1 and max(sizes) == 50
    assert 0.1 < np.mean(np.array(sizes) == 1) < 0.3  # log-uniform: small requests are common


def test_meta_set_records_tasks_and_trains_from_scratch(data, meta):
    X, y = data
    ms, info = meta
    assert ms.m == 240 and ms.s == 300 and info["forget_size_max"] <= 15
    r = T.TabularRecipe()
    for j in (0, 123):
        rows, f = ms.task_rows[j], ms.forget(j)
        assert len(set(rows)) == 300 and np.isin(f, rows).all() and len(f) >= 1
        assert np.allclose(ms.theta[j], T.train(r, X[rows], y[rows], 2).numpy())
        keep = rows[~np.isin(rows, f)]
        assert np.allclose(ms.theta_r[j], T.train(r, X[keep], y[keep], 2).numpy())
    restored = MetaSet.from_bytes(ms.to_bytes())
    for name in ("task_ids", "task_rows", "forget_ptr", "forget_rows", "theta", "theta_r"):
        assert np.array_equal(getattr(restored, name), getattr(ms, name))


def test_process_pool_gives_the_same_meta_set(data, meta):
    X, y = data
    ms2, info = generate_meta_set(T.TabularRecipe(), X, y, 2, np.arange(N), m=6, s=300, workers=2, seed=1)
    assert info["workers"] == 2
    ms1, _ = generate_meta_set(T.TabularRecipe(), X, y, 2, np.arange(N), m=6, s=300, workers=1, seed=1)
    assert np.array_equal(ms1.task_rows, ms2.task_rows) and np.array_equal(ms1.theta_r, ms2.theta_r)


def test_unlearner_beats_do_nothing_on_held_out_tasks(data, meta):
    X, y = data
    ms, _ = meta
    ks = KernelState.build(X, y, np.arange(N), 4, 100, np.random.default_rng(0), 2)
    method = L2UL(L2ULConfig(m=240, subset_size=300, epochs=100))
    inputs, targets = method._task_inputs(ks, ms, y, 2)
    assert inputs.shape == (240, 2 * 800 + 6)
    nu = Unlearner(method.config.unlearner_config(), inputs.shape[1], 6)
    info = nu.fit(inputs, targets)
    # ||theta' - theta_r|| / ||theta - theta_r|| on the 24 held-out tasks; do-nothing scores 1
    assert info["val_param_ratio_median"] < 0.8
    again = Unlearner.from_bytes(nu.to_bytes())
    assert np.allclose(again.predict(inputs[:5]), nu.predict(inputs[:5]), atol=1e-6)


def test_meta_task_purge_drops_exactly_the_tasks_holding_deleted_rows(meta):
    ms, _ = meta
    deleted = np.array([ms.task_rows[5, 0], ms.task_rows[9, 10]])
    hit = ms.tasks_containing(deleted)
    expected = np.array([np.isin(deleted, ms.task_rows[j]).any() for j in range(ms.m)])
    assert np.array_equal(hit, expected) and hit[5] and hit[9]
    kept = ms.keep(~hit)
    assert kept.m == ms.m - hit.sum()
    assert not np.isin(kept.task_rows, deleted).any()
    j = int(np.nonzero(~hit)[0][3])
    assert np.array_equal(kept.forget(3), ms.forget(j)) and np.array_equal(kept.theta[3], ms.theta[j])


def test_config_is_validated():
    spec = get_method("l2ul")
    assert spec.needs_preparation and spec.scopes == {"samples"} and spec.model_kinds == {"tabular"}
    with pytest.raises(InvalidMethodSettingsError):
        spec.build({"psy": 4})
    with pytest.raises(InvalidMethodSettingsError):
        spec.build({"hidden": [8, 8, 8]})


def test_prepare_then_two_sequential_unlearns(data):
    X, y = data
    r = T.TabularRecipe()
    theta = T.train(r, X, y, 2)
    none = np.zeros(N, bool)
    cfg = {"m": 40, "subset_size": 150, "t": 30, "epochs": 30, "refit_epochs": 10, "workers": 1}
    method = get_method("l2ul").build(cfg)
    progress = []
    prep = method.prepare(
        TabularProblem(r, X, y, 2, theta, ~none, none, none, progress=lambda f, m: progress.append(f))
    )
    assert torch.equal(prep.theta, theta) and set(prep.artifacts) == set(ARTIFACT_NAMES)
    assert progress[0] == 0.0 and progress[-1] == 1.0 and progress == sorted(progress)
    assert all(isinstance(v, bytes) for v in prep.artifacts.values())
    json.dumps(prep.info)

    meta0 = MetaSet.from_bytes(prep.artifacts[ARTIFACT_META])
    ks0, _ = _kernel_from_bytes(prep.artifacts[ARTIFACT_KERNEL])
    # request 1: one row that is an IK seed and sits in some meta-tasks, plus one more row
    seed_row = int(ks0.kernel.seeds[0, 0])
    f1 = none.copy()
    f1[[seed_row, 11]] = True
    hit1 = meta0.tasks_containing(np.nonzero(f1)[0])
    res1 = method.unlearn(TabularProblem(r, X, y, 2, theta, ~f1, f1, none, artifacts=dict(prep.artifacts)))
    i1 = res1.info
    assert i1["rows_forgotten"] == 2 and i1["rows_before"] == N
    assert i1["tasks_dropped"] == int(hit1.sum()) > 0 and i1["tasks_replenished"] == i1["tasks_dropped"]
    assert i1["tasks_remaining"] == 40 and i1["unlearner_refit"] and i1["seeds_redrawn"] >= 1
    assert i1["forward_time_s"] < i1["purge_time_s"]
    assert res1.theta.shape == theta.shape and torch.isfinite(res1.theta).all()
    assert not torch.equal(res1.theta, theta)
    json.dumps(i1)

    arts = {**prep.artifacts, **res1.artifacts}
    meta1 = MetaSet.from_bytes(arts[ARTIFACT_META])
    ks1, _ = _kernel_from_bytes(arts[ARTIFACT_KERNEL])
    assert not meta1.tasks_containing(np.nonzero(f1)[0]).any()
    assert not np.isin(ks1.kernel.seeds, np.nonzero(f1)[0]).any()
    assert ks1.n == N - 2 and not ks1.counted[f1].any()
    assert (ks1.cells[f1] == 0).all()  # scrubbed
    assert meta1.task_ids.max() >= 40  # replacement tasks got new ids

    # request 2 (sequential): earlier rows are tombstones now
    f2 = none.copy()
    f2[[20, 21, 22]] = True
    res2 = method.unlearn(TabularProblem(r, X, y, 2, res1.theta, ~(f1 | f2), f2, f1, artifacts=arts))
    assert res2.info["rows_before"] == N - 2 and res2.info["stale_rows_removed"] == 0
    ks2, _ = _kernel_from_bytes(res2.artifacts[ARTIFACT_KERNEL])
    keep = np.nonzero(~(f1 | f2))[0]
    assert np.allclose(ks2.mu_D(), ks2.kernel.embed(ks2.kernel.cells(X, keep), y[keep], 2))
    Unlearner.from_bytes(res2.artifacts[ARTIFACT_UNLEARNER])
    # the unlearned model stays a good model
    assert T.accuracy(r, res2.theta, X, y, 2) > T.accuracy(r, theta, X, y, 2) - 0.01

    # a row deleted by another method since the last L2UL call is removed from mu_D and purged too
    f3 = none.copy()
    f3[30] = True
    tomb = f1 | f2 | none
    tomb[31] = True
    res3 = method.unlearn(
        TabularProblem(r, X, y, 2, res2.theta, ~(tomb | f3), f3, tomb, artifacts={**arts, **res2.artifacts})
    )
    assert res3.info["stale_rows_removed"] == 1 and res3.info["rows_before"] == N - 6

    with pytest.raises(ValueError, match="not prepared"):
        method.unlearn(TabularProblem(r, X, y, 2, theta, ~f1, f1, none))

"""L2UL-N (issue 10, item 3c): a gated correction of the Newton step. Its worst case is the Newton step (gate 0),
its purge drops the units that held erased rows and purges the Newton state, and it is registered for ``auto``."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from sklearn.datasets import make_classification

from app.ml import tabular as T
from app.ml.unlearning.base import TabularProblem, get_method
from app.ml.unlearning.l2ul.newton_corrected import ARTIFACT_NEWTON, L2ULN, L2ULNConfig, L2ULNState, newton_step
from app.ml.unlearning.newton.method import ARTIFACT_STATE, NewtonUnlearning
from app.ml.unlearning.validation import param_ratio

N = 1200


@pytest.fixture(scope="module")
def prepared():
    X, y = make_classification(n_samples=N, n_features=5, n_informative=4, n_redundant=1, flip_y=0.05, random_state=3)
    X = X.astype(np.float32)
    recipe = T.TabularRecipe()
    theta = T.train(recipe, X, y, 2)
    none = np.zeros(N, bool)
    base = TabularProblem(recipe, X, y, 2, theta, ~none, none, none)
    method = L2ULN(L2ULNConfig(m=64, units=4, subset_size=200, epochs=40, calibration_tasks=4, workers=1))
    return method, base, method.prepare(base)


def _forget(rows):
    f = np.zeros(N, bool)
    f[rows] = True
    return f


def test_newton_step_matches_the_newton_method(prepared):
    _, base, _ = prepared
    f = _forget([5, 77])
    ours = newton_step(base.recipe, base.theta, base.X[~f], base.y[~f], 2, NewtonUnlearning().config)
    nm = NewtonUnlearning()
    art = nm.prepare(base).artifacts
    theirs = nm.unlearn(replace(base, retain_mask=~f, forget_mask=f, artifacts=art)).theta.numpy()
    assert np.allclose(base.theta.numpy() + ours, theirs, atol=1e-5)


def test_prepare_reports_gate_and_tasks(prepared):
    _, _, res = prepared
    info = res.info
    assert 0.0 <= info["gate"] <= 1.0 and info["units"] == 4
    assert info["calibration"]["tasks"] == 4
    assert info["task_newton_param_ratio_median"] < 0.5  # the Newton step is a good start on the tasks
    # by the least-squares fit, the gated answer is no worse than Newton summed over the calibration deletions
    per = info["calibration"]["per_task"]
    assert sum(p["ratio_gated"] ** 2 for p in per) <= sum(p["newton_ratio"] ** 2 for p in per) + 1e-9


def test_gate_zero_is_exactly_the_newton_step(prepared):
    method, base, res = prepared
    state = L2ULNState.from_bytes(res.artifacts["l2uln_units.safetensors"])
    state.meta["gate"] = 0.0
    arts = {**res.artifacts, "l2uln_units.safetensors": state.to_bytes()}
    f = _forget([10])
    out = method.unlearn(replace(base, retain_mask=~f, forget_mask=f, artifacts=arts))
    nm = NewtonUnlearning()
    newton = nm.unlearn(
        replace(base, retain_mask=~f, forget_mask=f, artifacts={ARTIFACT_STATE: res.artifacts[ARTIFACT_NEWTON]})
    )
    assert torch.equal(out.theta, newton.theta) and out.info["correction_norm"] == 0.0


def test_unlearn_is_close_to_retraining_and_drops_the_unit(prepared):
    method, base, res = prepared
    f = _forget([3])
    out = method.unlearn(replace(base, retain_mask=~f, forget_mask=f, artifacts=res.artifacts))
    theta_r = T.train(base.recipe, base.X[~f], base.y[~f], 2)
    ratio = param_ratio(base.recipe, base.X.shape[1], 2, out.theta, base.theta, theta_r)
    assert ratio is not None and ratio < 0.1
    assert len(out.info["units_dropped"]) == 1 and out.info["units_remaining"] == 3
    state = L2ULNState.from_bytes(out.artifacts["l2uln_units.safetensors"])
    assert state.unit_of_row[3] == -1 and len(state.unlearners) == 3


def test_purge_by_another_method_drops_units_and_purges_newton(prepared):
    method, base, res = prepared
    f = _forget([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])
    out = method.purge(replace(base, retain_mask=~f, forget_mask=f, artifacts=res.artifacts))
    state = L2ULNState.from_bytes(out.artifacts["l2uln_units.safetensors"])
    assert (state.unit_of_row[f] == -1).all()
    assert not set(out.info["units_dropped"]) & set(state.unlearners)
    newton = NewtonUnlearning()
    from app.ml.unlearning.newton.method import NewtonState

    ns = NewtonState.from_bytes(out.artifacts[ARTIFACT_NEWTON])
    assert not ns.rows[f].any() and ns.rows[~f].all()
    assert newton  # the state is Newton's own purged state


def test_registered_for_auto():
    spec = get_method("l2ul_n")
    assert spec.needs_preparation and spec.auto_priority is not None
    assert isinstance(spec.build({"m": 16, "units": 2}), L2ULN)


def test_with_every_unit_dropped_the_answer_is_the_newton_step(prepared):
    method, base, res = prepared
    state = L2ULNState.from_bytes(res.artifacts["l2uln_units.safetensors"])
    one_per_unit = [int(np.flatnonzero(state.unit_of_row == u)[0]) for u in sorted(state.unlearners)]
    f = _forget(one_per_unit)
    purged = method.purge(replace(base, retain_mask=~f, forget_mask=f, artifacts=res.artifacts))
    assert purged.info["units_remaining"] == 0 and "needs_prepare" not in purged.info
    g = _forget([500])
    case = replace(base, retain_mask=~f & ~g, forget_mask=g, tombstone_mask=f, artifacts=purged.artifacts)
    out = method.unlearn(case)
    newton = NewtonUnlearning().unlearn(replace(case, artifacts={ARTIFACT_STATE: purged.artifacts[ARTIFACT_NEWTON]}))
    assert torch.equal(out.theta, newton.theta) and "Newton step alone" in out.info["note"]

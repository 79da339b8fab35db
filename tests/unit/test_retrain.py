"""Exact retrain."""

from __future__ import annotations

import numpy as np
import torch
from sklearn.datasets import make_classification

from app.ml import tabular as T
from app.ml.unlearning.base import TabularProblem, get_method
from app.ml.unlearning.retrain import ExactRetrain, RetrainConfig


def test_retrain_equals_training_on_retained_rows():
    X, y = make_classification(n_samples=600, n_features=6, random_state=0)
    X = X.astype(np.float32)
    r = T.TabularRecipe()
    theta = T.train(r, X, y, 2)
    forget = np.zeros(600, bool)
    forget[[5, 50, 500]] = True
    tomb = np.zeros(600, bool)
    tomb[[7]] = True
    retain = ~forget & ~tomb
    problem = TabularProblem(r, X, y, 2, theta, retain, forget, tomb)
    spec = get_method("retrain")
    assert spec.method_cls is ExactRetrain and spec.model_kinds == {"tabular"}
    assert spec.scopes == {"samples", "class"} and not spec.needs_preparation
    res = spec.build({}).unlearn(problem)
    # LR is strictly convex: the retrain warm-started at the served θ lands on the cold start's optimum (to float32
    # resolution) in fewer Newton iterations
    cold, cold_info = T.fit(r, X[retain], y[retain], 2)
    assert res.info["warm_start"] is True
    assert float((res.theta - cold).abs().max()) <= 1e-5 * float(cold.abs().max())
    assert res.info["solver"]["iterations"] < cold_info["iterations"]
    assert not torch.allclose(res.theta, theta)
    assert res.info["rows_used"] == 596 and res.info["rows_forgotten"] == 3 and res.info["wall_time_s"] > 0
    assert ExactRetrain(RetrainConfig()).unlearn(problem).info["solver"]["status"] == "converged"


def test_mlp_retrain_starts_cold():
    """The MLP's optimum depends on its start: the retrain starts where registration did, never at the served θ."""
    X, y = make_classification(n_samples=200, n_features=4, random_state=0)
    X = X.astype(np.float32)
    r = T.TabularRecipe(family="mlp", hidden_units=3, max_iter=30)
    theta = T.train(r, X, y, 2)
    retain = np.ones(200, bool)
    retain[0] = False
    problem = TabularProblem(r, X, y, 2, theta, retain, ~retain, np.zeros(200, bool))
    res = ExactRetrain().unlearn(problem)
    assert res.info["warm_start"] is False
    assert torch.equal(res.theta, T.train(r, X[retain], y[retain], 2))

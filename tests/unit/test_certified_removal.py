"""Certified removal (Guo et al. 2020): tabular's ``linear`` perturbation, the perturbed fit, the residual bound and
Algorithm 2's budget (app/ml/unlearning/certified.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.linalg
import torch
from sklearn.datasets import make_classification

from app.ml import tabular as T
from app.ml.unlearning import certified as CR

RECIPE = T.TabularRecipe(l2=1e-3)


@pytest.fixture(scope="module")
def data():
    X, y = make_classification(n_samples=2000, n_features=10, n_informative=5, random_state=0)
    return X, y


@pytest.fixture(scope="module")
def onehot():
    """Mostly zeros (density < tabular.SPARSE_DENSITY, d >= 8), so tabular takes its CSR path."""
    rng = np.random.default_rng(3)
    cats = rng.integers(0, 12, size=(1500, 2))
    X = np.zeros((1500, 24))
    X[np.arange(1500), cats[:, 0]] = 1.0
    X[np.arange(1500), 12 + cats[:, 1]] = 1.0
    y = (rng.random(1500) < 0.2 + 0.05 * cats[:, 0]).astype(int)
    return X, y


def test_linear_absent_or_zero_is_unchanged(data, onehot):
    for X, y, solvers in ((*data, ("newton", "lbfgs")), (*onehot, ("newton",))):
        p = X.shape[1] + 1
        for recipe in (T.TabularRecipe(l2=1e-3, solver=solver) for solver in solvers):
            theta, info = T.fit(recipe, X, y, 2)
            theta0, info0 = T.fit(recipe, X, y, 2, linear=np.zeros(p))
            assert torch.equal(theta, theta0) and info["iterations"] == info0["iterations"]
            assert torch.equal(T.train(recipe, X, y, 2, linear=None), theta)
        v, g = T.objective_gradient(RECIPE, theta, X, y, 2)
        v0, g0 = T.objective_gradient(RECIPE, theta, X, y, 2, linear=np.zeros(p))
        assert v == v0 and torch.equal(g, g0)


def test_linear_adds_b_theta_over_n_on_dense_and_sparse_paths(data, onehot):
    for X, y in (data, onehot):
        n, p = len(X), X.shape[1] + 1
        b = np.random.default_rng(0).normal(0, 5, p)
        theta = torch.from_numpy(np.random.default_rng(1).normal(0, 0.3, p)).float()
        v, g = T.objective_gradient(RECIPE, theta, X, y, 2)
        vb, gb = T.objective_gradient(RECIPE, theta, X, y, 2, linear=torch.from_numpy(b))
        assert vb - v == pytest.approx(float(b @ theta.double().numpy()) / n, rel=1e-9)
        np.testing.assert_allclose((gb - g).numpy(), b / n, rtol=1e-9, atol=1e-15)
    with pytest.raises(ValueError, match="linear has 3 elements"):
        T.fit(RECIPE, X, y, 2, linear=np.zeros(3))


@pytest.mark.parametrize("solver", ["newton", "lbfgs"])
def test_fit_perturbed_reaches_the_perturbed_optimum(data, solver):
    X, y = data
    recipe = T.TabularRecipe(l2=1e-3, solver=solver, tol=1e-10, max_iter=1000)
    b = CR.draw_noise(CR.CertifiedRemovalConfig(residual_budget=5.0), X.shape[1] + 1, rng=0)
    theta, info = CR.fit_perturbed(recipe, X, y, 2, b)
    plain, _ = T.fit(recipe, X, y, 2)
    assert info["residual"] == CR.exact_residual(recipe, theta, X, y, 2, b) < 1e-3  # float32 rounding only
    # the unperturbed optimum is far from it: its residual is ~||b|| (the fit honoured b)
    assert CR.exact_residual(recipe, plain, X, y, 2, b) > 0.5 * np.linalg.norm(b) > 1.0
    # the numpy gradient remove() steps with is the same function as tabular's objective (what fit minimised)
    g_np = CR._grad_sum(recipe, CR._vec(plain), X, y, b)
    _, g_t = T.objective_gradient(recipe, plain, X, y, 2, linear=b)
    np.testing.assert_allclose(g_np, len(X) * g_t.numpy(), rtol=1e-9, atol=1e-9)


def test_refuses_what_the_theorem_does_not_cover(data):
    X, y = data
    b = np.zeros(X.shape[1] + 1)
    with pytest.raises(ValueError, match="binary logistic regression"):
        CR.fit_perturbed(T.TabularRecipe(family="mlp"), X, y, 2, b)
    with pytest.raises(ValueError, match="binary logistic regression"):
        CR.fit_perturbed(RECIPE, X, y % 3, 3, b)
    with pytest.raises(ValueError, match="l2 > 0"):
        CR.fit_perturbed(T.TabularRecipe(l2=0.0), X, y, 2, b)


def test_noise_std_is_theorem_3(data):
    config = CR.CertifiedRemovalConfig(epsilon=0.5, delta=1e-4, residual_budget=2.0)
    assert CR.noise_std(config) == pytest.approx(4.385390 * 2.0 / 0.5, rel=1e-6)  # sqrt(2 ln 15000) = 4.38539
    assert CR.noise_std(CR.CertifiedRemovalConfig(1.0, 1e-2, 1.0)) == pytest.approx(math.sqrt(2 * math.log(150)))
    b = CR.draw_noise(config, 200_000, rng=0)
    assert b.std() == pytest.approx(CR.noise_std(config), rel=0.01) and abs(b.mean()) < 0.1
    for bad in ({"epsilon": 0}, {"delta": 1.0}, {"delta": -1e-3}, {"residual_budget": float("inf")}):
        with pytest.raises(ValueError):
            CR.CertifiedRemovalConfig(**bad)


def _xa(X):
    return np.concatenate([X, np.ones((len(X), 1))], axis=1)


def test_residual_bound_is_gamma_spectral_inf_two(data):
    """Pins the formula against an independent computation: a bound without gamma or without ||a||_inf is still a
    valid bound (l'' lies in [0, 1/4], so gamma ||X~|| ||a||_2 always holds) and so cannot be caught by a violation;
    it is caught here."""
    X, y = data
    rng = np.random.default_rng(5)
    theta = rng.normal(0, 0.5, X.shape[1] + 1)
    new = theta + rng.normal(0, 2.0, theta.size)  # ||a||_inf far from 1, so dropping it changes the value
    Xa = _xa(X)
    a = Xa @ (new - theta)
    assert np.abs(a).max() > 5
    expected = 0.25 * np.linalg.norm(Xa, 2) * np.abs(a).max() * np.linalg.norm(a)
    assert CR.residual_bound(RECIPE, theta, new, X) == pytest.approx(expected, rel=1e-8)
    assert CR.spectral_norm(X) == pytest.approx(np.linalg.norm(Xa, 2), rel=1e-8)
    assert CR.spectral_norm(X) >= CR.spectral_norm(X[:500])  # so a superset's norm may be passed


def test_residual_bound_has_teeth():
    """A case where Guo's bound is nearly attained (exact / bound ~ 0.19 is the most any case can reach: rank-one X~
    at the logit where |l'''| peaks), so a bound 10x too small (a mean-form 1/n slip, a missing ||X~||) fails."""
    n = 400
    X = np.ones((n, 1))
    y = (np.arange(n) < int(0.74 * n)).astype(int)  # sigmoid(1.317) = 0.789: the Newton step moves logits by ~0.3
    theta = np.array([0.6585, 0.6585])
    b = np.zeros(2)
    g = CR._grad_sum(RECIPE, theta, X, y, b)
    new = theta - np.linalg.solve(CR._hessian_sum(RECIPE, theta, X), g)
    exact = CR.exact_residual(RECIPE, new, X, y, 2, b)  # float64 Newton point: no rounding term
    bound = CR.residual_bound(RECIPE, theta, new, X)
    assert 0.1 * bound < exact <= bound


def _run(data, config, steps, rng_seed=0, batch=1):
    """Algorithm 2 over ``steps`` removals of ``batch`` random rows, from a model trained with one fixed noise draw
    (sigma of eps' = 1, whatever ``config`` says, so runs with different budgets share their path until a retrain)."""
    X, y = data
    b = CR.draw_noise(CR.CertifiedRemovalConfig(residual_budget=1.0), X.shape[1] + 1, rng=0)
    theta, info = CR.fit_perturbed(RECIPE, X, y, 2, b)
    keep, spent = np.ones(len(X), dtype=bool), info["residual"]
    order = np.random.default_rng(rng_seed).permutation(len(X))
    out = []
    for i in range(steps):
        gone = np.zeros(len(X), dtype=bool)
        gone[order[i * batch : (i + 1) * batch]] = True
        keep &= ~gone
        res = CR.remove(RECIPE, theta, X, y, keep, gone, b, spent, config, rng=100 + i)
        out.append((res, keep.copy(), spent))
        theta, b, spent = res.theta, res.b, res.spent_after
    return out


def test_exact_residual_never_exceeds_the_charge(data):
    config = CR.CertifiedRemovalConfig(residual_budget=1e6)  # no retrain: every step is a Newton removal
    X, y = data
    for batch in (1, 40):
        steps = _run(data, config, 12, batch=batch)
        for res, keep, spent in steps:
            assert not res.retrained and res.theta.dtype == torch.float32
            assert res.exact_residual <= res.residual_bound  # the published float32 model, against its charge
            assert res.exact_residual == pytest.approx(CR.exact_residual(RECIPE, res.theta, X[keep], y[keep], 2, res.b))
            assert res.spent_after == pytest.approx(spent + res.residual_bound, rel=1e-12)
            assert res.residual_bound == pytest.approx(res.terms["taylor"] + res.terms["linear"], rel=1e-12)
        # the retrained (perturbed) model is what the removals track
        res, keep, _ = steps[-1]
        theta_r, _ = CR.fit_perturbed(RECIPE, X[keep], y[keep], 2, res.b)
        assert float((res.theta - theta_r).norm()) < 1e-3 * float(theta_r.norm())


def test_budget_exhaustion_retrains_with_fresh_noise(data):
    X, y = data
    probe = _run(data, CR.CertifiedRemovalConfig(residual_budget=1e6), 6)
    charges = [r.residual_bound for r, _, _ in probe]
    start = probe[0][2]
    # a budget that the first 3 charges fit in and the 4th does not (same noise draw, so the same path)
    budget = start + sum(charges[:3]) + 0.5 * charges[3]
    config = CR.CertifiedRemovalConfig(residual_budget=budget)
    steps = _run(data, config, 5)
    assert [r.retrained for r, _, _ in steps] == [False, False, False, True, False]
    res, keep, _ = steps[3]
    b_old = steps[2][0].b
    assert not np.array_equal(res.b, b_old) and res.b.shape == b_old.shape
    assert res.b.std() == pytest.approx(CR.noise_std(config), rel=0.8)
    assert res.spent_after == res.exact_residual == CR.exact_residual(RECIPE, res.theta, X[keep], y[keep], 2, res.b)
    assert res.spent_after < budget
    theta_r, _ = CR.fit_perturbed(RECIPE, X[keep], y[keep], 2, CR.draw_noise(config, X.shape[1] + 1, rng=103))
    assert torch.equal(res.theta, theta_r)  # retrained from scratch on the retained rows with the fresh draw
    after = steps[4][0]
    assert after.spent_after == pytest.approx(res.spent_after + after.residual_bound)
    with pytest.raises(RuntimeError, match="exceeds the budget"):
        _run(data, CR.CertifiedRemovalConfig(residual_budget=1e-12), 1)


def test_remove_validates_its_inputs(data):
    X, y = data
    config = CR.CertifiedRemovalConfig()
    b = np.zeros(X.shape[1] + 1)
    theta = torch.zeros(X.shape[1] + 1)
    keep = np.ones(len(X), dtype=bool)
    gone = np.zeros(len(X), dtype=bool)
    gone[0] = True
    with pytest.raises(ValueError, match="none of them retained"):
        CR.remove(RECIPE, theta, X, y, keep, gone, b, 0.0, config)
    keep[0] = False
    with pytest.raises(ValueError, match="b has"):
        CR.remove(RECIPE, theta, X, y, keep, gone, b[:-1], 0.0, config)
    with pytest.raises(ValueError, match="spent"):
        CR.remove(RECIPE, theta, X, y, keep, gone, b, float("nan"), config)
    with pytest.raises(ValueError, match="one entry per row"):
        CR.remove(RECIPE, theta, X, y, keep[1:], gone, b, 0.0, config)


def test_newton_step_matches_scipy_solve(data):
    """The step remove() takes is -H^-1 g of the PERTURBED retained objective (b included)."""
    X, y = data
    config = CR.CertifiedRemovalConfig(residual_budget=1e6)
    b = CR.draw_noise(CR.CertifiedRemovalConfig(residual_budget=1.0), X.shape[1] + 1, rng=0)
    theta, _ = CR.fit_perturbed(RECIPE, X, y, 2, b)
    keep = np.ones(len(X), dtype=bool)
    keep[:30] = False
    res = CR.remove(RECIPE, theta, X, y, keep, ~keep, b, 0.0, config)
    th = CR._vec(theta)
    H, g = CR._hessian_sum(RECIPE, th, X[keep]), CR._grad_sum(RECIPE, th, X[keep], y[keep], b)
    np.testing.assert_allclose(res.theta.numpy(), th - scipy.linalg.solve(H, g), rtol=1e-6, atol=1e-6)

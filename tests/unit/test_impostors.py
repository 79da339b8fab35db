"""The verdict can fail (issue 20): every impostor panel member fails on LR and MLP, one-row and 50-row forget sets,
while exact retraining, Newton and influence pass. Small generated tables (fast settings); the full panel with the
membership audit and the most-exposed forget sets is ``python -m bench.verify`` (bench/results/verify.json).

Expected outcomes are stated, not derived from measurements: impostors fail in every trial; the genuine methods pass
in every trial here for logistic regression (their proven-distance ratios sit 10–1000× below the threshold); on the
MLP, Newton and influence are approximate (a damped Gauss-Newton step on a non-convex objective) and may leave more
than the allowed share of the erased rows' pull — then they are rightly not certified (``auto`` retrains), so only
exact retraining is asserted there; bench/verify.py reports their pass rates."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.datasets import make_classification

from app.ml import tabular as T
from app.ml.unlearning.base import TabularProblem
from app.ml.unlearning.newton import InfluenceUnlearning, NewtonConfig, NewtonUnlearning
from app.ml.verification import evidence as E
from app.ml.verification import impostors as I
from app.ml.verification import policy as P
from app.ml.verification.audit import theta_facts

TRIALS = 3
SIZES = (1, 50)
RECIPES = {
    "lr": T.TabularRecipe(),
    "mlp": T.TabularRecipe(family="mlp", hidden_units=8),
}
N_ROWS = {"lr": 3000, "mlp": 600}


def _world(kind: str) -> dict:
    n = N_ROWS[kind]
    X, y = make_classification(n_samples=n, n_features=10, n_informative=6, flip_y=0.1, random_state=0)
    X, y = X.astype(np.float32), y.astype(np.int64)
    recipe = RECIPES[kind]
    train = np.ones(n, bool)
    train[: n // 5] = False  # held out
    theta = T.train(recipe, X[train], y[train], 2)
    none = np.zeros(n, bool)
    prepared = {}
    for name, cls in (("newton", NewtonUnlearning), ("influence", InfluenceUnlearning)):
        method = cls(NewtonConfig(certify=False))
        prepared[name] = (
            method,
            dict(method.prepare(TabularProblem(recipe, X, y, 2, theta, train, none, none)).artifacts),
        )
    return {"recipe": recipe, "X": X, "y": y, "train": train, "theta": theta, "prepared": prepared}


@pytest.fixture(scope="module", params=sorted(RECIPES))
def world(request) -> dict:
    return _world(request.param)


def _verdict(w: dict, retain: np.ndarray, theta_new, exact: bool, policy: P.VerdictPolicy | None = None) -> dict:
    """The service's decision without the membership audit (no shadows here): evidence + θ changed."""
    evidence = E.tabular_evidence(w["recipe"], w["theta"], theta_new, w["X"], w["y"], 2, retain, exact)
    report = {
        "n_forget": int((w["train"] & ~retain).sum()),
        "informative": False,
        "informative_detail": "no shadows in this test",
        "theta": theta_facts(w["theta"], theta_new, trained_on_forget=True),
    }
    policy = policy or P.VerdictPolicy(max_utility_loss_points=None)
    return P.decide(report, policy, exact=exact, evidence=evidence)


def _cases(w: dict):
    rng = np.random.default_rng(0)
    for k in SIZES:
        for _ in range(TRIALS):
            forget = np.zeros(len(w["y"]), bool)
            forget[rng.choice(np.flatnonzero(w["train"]), k, replace=False)] = True
            retain = w["train"] & ~forget
            yield k, I.ImpostorCase(w["recipe"], w["X"], w["y"], 2, w["theta"], retain, forget), rng


def test_every_impostor_fails_and_genuine_methods_pass(world):
    w = world
    failures: list[str] = []
    for k, case, rng in _cases(w):
        retrain = I.retrained(case)
        v = _verdict(w, case.retain, retrain, exact=True)
        if v["verdict"] != "pass":
            failures.append(f"retrain |D_f|={k}: {v['reasons']}")
        for name, (method, artifacts) in w["prepared"].items():
            problem = TabularProblem(w["recipe"], w["X"], w["y"], 2, w["theta"], case.retain, case.forget,
                                     np.zeros(len(w["y"]), bool), artifacts)  # fmt: skip
            v = _verdict(w, case.retain, method.unlearn(problem).theta, exact=False)
            if v["verdict"] != "pass" and w["recipe"].family == "logistic_regression":
                failures.append(f"{name} |D_f|={k}: {v['reasons']}")
        for name, impostor in I.IMPOSTORS.items():
            v = _verdict(w, case.retain, impostor(case, rng), exact=name in I.EXACT_IMPOSTORS)
            if v["verdict"] != "fail":
                failures.append(f"impostor {name} |D_f|={k} PASSED: {v['reasons']}")
    assert not failures, "\n".join(failures)


def test_one_ulp_passes_without_evidence_requirement(world):
    """The weakness issue 20 measured, kept visible: with the evidence rule off and no evidence, a one-ulp change is
    certified on "θ changed" alone. The default policy refuses it (the test above)."""
    w = world
    _, case, rng = next(_cases(w))
    theta = I.one_ulp(case, rng)
    report = {
        "n_forget": 1,
        "informative": False,
        "informative_detail": "none",
        "theta": theta_facts(w["theta"], theta, True),
    }
    lax = P.VerdictPolicy(max_utility_loss_points=None, require_informative_evidence=False)
    assert P.decide(report, lax)["verdict"] == "pass"
    strict = P.decide(report, P.VerdictPolicy(max_utility_loss_points=None))
    assert strict["verdict"] == "fail" and strict["checks"][-1]["name"] == "informative_evidence"


def test_configured_bound_that_cannot_be_certified_fails_closed():
    report = {"n_forget": 1, "informative": False, "informative_detail": "none"}
    v = P.decide(report, P.VerdictPolicy(max_proven_distance=1.0, require_informative_evidence=False))
    assert v["verdict"] == "fail"
    assert [c["name"] for c in v["checks"] if c["passed"] is False] == ["max_proven_distance"]


def test_an_unconverged_nonconvex_retrain_is_evidenced_by_an_independent_replay():
    """A recipe with a fixed iteration budget stops far from any stationary point: the retained gradient cannot place
    its retrain, the verifier's own replay of the recipe on the retained rows can — and a retrain that kept the row
    (or dropped another one) does not match it."""
    recipe = T.TabularRecipe(family="mlp", hidden_units=8, l2=1e-4, max_iter=30)
    X, y = make_classification(n_samples=300, n_features=6, flip_y=0.2, random_state=1)
    X, y = X.astype(np.float32), y.astype(np.int64)
    train = np.ones(300, bool)
    theta = T.train(recipe, X, y, 2)
    w = {"recipe": recipe, "X": X, "y": y, "train": train, "theta": theta}
    rng = np.random.default_rng(0)
    forget = np.zeros(300, bool)
    forget[[5, 17]] = True
    case = I.ImpostorCase(recipe, X, y, 2, theta, train & ~forget, forget)
    v = _verdict(w, case.retain, I.retrained(case), exact=True)
    assert v["verdict"] == "pass" and v["evidence"] == ["replay"], v["reasons"]
    for name in sorted(I.EXACT_IMPOSTORS):
        v = _verdict(w, case.retain, I.IMPOSTORS[name](case, rng), exact=True)
        assert v["verdict"] == "fail" and "replay" in {c["name"] for c in v["checks"] if c["passed"] is False}, name

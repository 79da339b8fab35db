"""Verification benchmark (issue 9): the audit's cost per request, and every tabular method judged by it.

    flock /tmp/lethe-bench.lock .venv/bin/python -m bench.verify          # full: bench/results/verify.{json,png}
    flock /tmp/lethe-bench.lock .venv/bin/python -m bench.verify --quick  # small: verify_quick.{json,png}

Settings (the same code for both):
- ``adult_lr``: Adult (bench/common.py: 80/20 split), the service's default logistic-regression recipe trained on the
  80 %; the 20 % are the held-out rows, i.e. the audit's non-members and the test set, as in the worker.
- ``overfit_mlp``: the regime of tests/unit/test_verification.py: a 400-row pool (make_classification, 10 features,
  20 % flipped labels), an MLP (64 hidden units, l2 = 1e-4, 200 L-BFGS iterations) trained on 200 of them, the other
  200 held out.

The audit is the service's (app/jobs/tabular.py ``verify_deletion``): LiRA shadows trained on random halves of the
whole pool with the model's own recipe (``train_shadows``, 64 by default, stored with ``shadows_to_bytes``), the
forget rows against the held-out rows (``run_audit``: online LiRA, TPR at 1 % FPR, the original model's figure as the
audit's power), the proven distance for a single LR (``gradient_norm_bound``) and the verdict of ``decide`` under
the default ``VerdictPolicy``.

Forget sets with power: a deletion of random rows of a well-regularised LR is invisible to LiRA even before
unlearning (shown here as the ``random_forget`` contrast, reported as uninformative). So each setting deletes the k
training rows that are most exposed to membership inference, ranked by d' = (mu_in - mu_out) / sqrt((s_in^2 +
s_out^2) / 2) of phi over a SEPARATE set of selection shadows (another seed, trained on halves of the training rows
only): selecting with the audit's own shadows picks rows whose OUT mean happens to be under-estimated, and then even
exact retraining is flagged above chance (measured while building this benchmark). No target model is looked at.

Per method (retrain, newton, influence, l2ul, sisa, do_nothing), on the original model and the same forget set:
forget-set LiRA TPR@1 %FPR of the original / unlearned / retrained model, the audit's power, the verdict, and the
U-LiRA distinguishability (Hayes et al.; ``ulira_distinguishability``): M pairs of independent random training sets
of the original's size; on one side a model trained on B_j + F and then unlearned by the method, on the other a model
trained on B'_j (never saw F); per forget example a cross-fitted Gaussian LRT between the two groups' phi, AUC 0.5 =
indistinguishable. The "never" side is the method's own learning algorithm without F: the recipe for the single-model
methods, a SISA ensemble trained on B'_j for SISA (whose published model is an ensemble: comparing it with a single
model would measure the architecture, not the forgetting). Retrain's own U-LiRA is the noise floor of the test at M.

L2UL runs with its small registration-like settings (``L2UL_SETTINGS``: for Adult the ones ``make demo`` registers;
for the 200-row MLP the integration test's, with subsets of 100 rows) and its privacy purge off: the purge changes
only L2UL's stored state for later requests, not theta' (bench/tabular.py measures it).

Audit cost (``tabular_audit_s``): what the service pays per request in its verify step, timed next to exact retraining
in the same run: load the stored shadows (``shadows_from_bytes``), LiRA on the forget rows and the held-out rows
(``run_audit``), the proven bound (one gradient pass + a float64 Hessian), ``decide``; the plots separately.
``clip_audit_s``: the federated wing's verify step (app/jobs/federated.py: the stored shadow LoRA runs, offline LiRA
``audit_clip_deletion`` on the forget pairs and the test pairs for the original and the unlearned model, ``decide``)
on the tiny CLIP demo federation (``make_demo_federation``, cached under ~/.cache/lethe); ``clip_shadow_train_s``:
training the default shadow runs, the registration's extra cost.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load as st_load

from app.ml import tabular as T
from app.ml.unlearning.base import TabularProblem
from app.ml.unlearning.baselines.sisa import ARTIFACT_SISA, SISA, DoNothing, SISAConfig
from app.ml.unlearning.l2ul import L2UL, L2ULConfig
from app.ml.unlearning.newton import InfluenceUnlearning, NewtonConfig, NewtonUnlearning
from app.ml.unlearning.retrain import ExactRetrain
from app.ml.verification import lira
from app.ml.verification.audit import run_audit
from app.ml.verification.bounds import gradient_norm_bound
from app.ml.verification.plots import audit_plots
from app.ml.verification.policy import VerdictPolicy, decide
from app.ml.verification.shadows import (
    ShadowSettings,
    model_phi,
    shadow_phi,
    shadows_from_bytes,
    shadows_to_bytes,
    train_shadows,
)
from bench.common import DATA_DIR, REPO, load_real_dataset

METHODS = ("retrain", "newton", "influence", "l2ul", "sisa", "do_nothing")
PREPARED = {"newton", "influence", "l2ul", "sisa"}
SETTINGS = ("adult_lr", "overfit_mlp")
SELECTION_SEED = 1
"""Selection shadows use another seed than the audit's (seed 0, the service's)."""
FPR_KEY = lira.fpr_key(0.01)
FLOAT_EDGE = 1e-9
MLP_RECIPE = T.TabularRecipe(family="mlp", hidden_units=64, l2=1e-4, max_iter=200, seed=0)
LR_RECIPE = T.TabularRecipe()
DEMO_L2UL = {"m": 300, "subset_size": 300, "epochs": 150}
"""app/demo.py registers L2UL with these (the Adult-sized registration-like settings)."""
SMALL_L2UL_MLP = {"m": 40, "subset_size": 100, "t": 20, "epochs": 60}
"""tests/integration/test_l2ul_service.py's registration (m 40, t 20, 60 epochs), subsets of 100 of the 200 rows."""
L2UL_FIXED = {"workers": 1, "purge_meta_tasks": False, "purge_seeds": False}


@dataclass
class Plan:
    mode: str
    adult_max_rows: int | None
    shadows: int
    selection_shadows: int
    k: dict[str, int]
    ulira_pairs: dict[str, int]
    timing_reps: int
    l2ul: dict[str, dict[str, Any]]
    clip: dict[str, int]
    sisa: dict[str, Any] = field(default_factory=lambda: asdict(SISAConfig()))


def make_plan(mode: str) -> Plan:
    if mode == "quick":
        return Plan(
            mode="quick",
            adult_max_rows=8000,
            shadows=32,
            selection_shadows=16,
            k={"adult_lr": 20, "overfit_mlp": 20},
            ulira_pairs={"adult_lr": 6, "overfit_mlp": 6},
            timing_reps=3,
            l2ul={
                "adult_lr": {"m": 60, "subset_size": 300, "epochs": 60, "calibration_tasks": 2},
                "overfit_mlp": {**SMALL_L2UL_MLP, "m": 16, "epochs": 30, "calibration_tasks": 2},
            },
            clip={"n_clients": 5, "pairs_per_client": 60, "n_test": 100, "rounds": 8},
        )
    return Plan(
        mode="full",
        adult_max_rows=None,
        shadows=64,
        selection_shadows=32,
        k={"adult_lr": 50, "overfit_mlp": 20},
        ulira_pairs={"adult_lr": 16, "overfit_mlp": 16},
        timing_reps=5,
        l2ul={"adult_lr": dict(DEMO_L2UL), "overfit_mlp": dict(SMALL_L2UL_MLP)},
        clip={"n_clients": 5, "pairs_per_client": 200, "n_test": 300, "rounds": 20},
    )


NOTES = [
    "methods.<m>.<setting>: tpr_at_1fpr = forget-set LiRA TPR at 1 % FPR on the unlearned model (the verdict's "
    "figure); tpr_original / tpr_retrained = the same attack on the original model (the audit's power) and on exact "
    "retraining without the forget rows; informative = the original's figure is above the chance margin; verdict = "
    "decide() with the default VerdictPolicy (proven LR bound passed in, exact=True for retrain only)",
    "ulira_auc = mean per-example AUC of U-LiRA (0.5 indistinguishable from never-trained; retrain's value is the "
    "noise floor at this number of pairs; ulira_auc_over_retrain_floor subtracts it)",
    "forget sets: the k training rows most exposed by d' over separate selection shadows (settings.<s>."
    "forget_selection); random_forget gives the same audit on k uniformly drawn training rows for contrast",
    "tabular_audit_s = median seconds of the worker's verify computation on Adult LR (shadows_from_bytes, run_audit, "
    "gradient_norm_bound, decide) next to tabular_retrain_s measured in the same loop; plots reported apart",
    "clip_audit_s = median seconds of verify_federated's audit (load the shadow LoRA runs, offline LiRA on the forget "
    "and test pairs for the original and unlearned LoRA, decide) on the tiny CLIP demo federation, 'samples' "
    "scenario; client/class in clip.scenarios; clip_shadow_train_s = training the default shadow runs (registration)",
    "SISA's audited model is the service's: the single model it was registered with as original, the ensemble after "
    "the deletion; its 'retrained' column is the single-model exact retrain",
    "timings share 2 CPU cores with other engineers' processes (see machine.loadavg_*); torch/BLAS single-threaded",
]


# ---------------------------------------------------------------------------------------------- worlds
@dataclass
class World:
    """A pool of rows (X, y), the rows the original model trained on, and the held-out rows (non-members, test)."""

    name: str
    recipe: T.TabularRecipe
    X: np.ndarray
    y: np.ndarray
    n_classes: int
    train: np.ndarray  # bool [n_pool]
    source: str

    @property
    def n(self) -> int:
        return len(self.y)

    @property
    def holdout(self) -> np.ndarray:
        return np.flatnonzero(~self.train)

    def mask(self, rows: np.ndarray) -> np.ndarray:
        m = np.zeros(self.n, bool)
        m[rows] = True
        return m

    def fit(self, rows_mask: np.ndarray) -> torch.Tensor:
        return T.train(self.recipe, self.X[rows_mask], self.y[rows_mask], self.n_classes)

    def phi(self, theta: torch.Tensor, rows: np.ndarray) -> np.ndarray:
        return model_phi(self.recipe, theta, self.X[rows], self.y[rows], self.n_classes)


def adult_world(plan: Plan, data_dir: Path) -> World:
    ds = load_real_dataset("adult", data_dir, plan.adult_max_rows)
    X = np.concatenate([ds["X_tr"], ds["X_te"]])
    y = np.concatenate([ds["y_tr"], ds["y_te"]])
    train = np.zeros(len(y), bool)
    train[: len(ds["y_tr"])] = True
    return World("adult_lr", LR_RECIPE, X, y, ds["n_classes"], train, ds["source"])


def overfit_world() -> World:
    """tests/unit/test_verification.py's ``_pool(0)`` with its MLP recipe (an MLP memorising 200 rows)."""
    from sklearn.datasets import make_classification

    n_pool, n_members, d, flip = 400, 200, 10, 0.2
    X, y = make_classification(n_samples=n_pool, n_features=d, n_informative=d - 1, n_redundant=0, random_state=0)
    rng = np.random.default_rng(0)
    y = np.where(rng.random(n_pool) < flip, 1 - y, y)
    perm = np.random.default_rng(100).permutation(n_pool)
    train = np.zeros(n_pool, bool)
    train[perm[:n_members]] = True
    source = (
        "sklearn make_classification(400, 10 features, 9 informative, random_state=0), 20 % labels flipped; "
        "GENERATED (tests/unit/test_verification.py's pool)"
    )
    return World("overfit_mlp", MLP_RECIPE, X.astype(np.float32), y.astype(np.int64), 2, train, source)


# ---------------------------------------------------------------------------------------------- methods
def l2ul_config(plan: Plan, setting: str) -> L2ULConfig:
    return L2ULConfig(**{**plan.l2ul[setting], **L2UL_FIXED})


def build(name: str, plan: Plan, setting: str) -> Any:
    return {
        "retrain": lambda: ExactRetrain(),
        "newton": lambda: NewtonUnlearning(NewtonConfig()),
        "influence": lambda: InfluenceUnlearning(NewtonConfig()),
        "l2ul": lambda: L2UL(l2ul_config(plan, setting)),
        "sisa": lambda: SISA(SISAConfig(**plan.sisa)),
        "do_nothing": lambda: DoNothing(),
    }[name]()


def problem(world: World, theta: torch.Tensor, trained: np.ndarray, forget: np.ndarray, artifacts=None):
    none = np.zeros(world.n, bool)
    return TabularProblem(
        world.recipe, world.X, world.y, world.n_classes, theta, trained & ~forget, forget, none, artifacts or {}
    )


def prepare(
    method: Any, world: World, theta: torch.Tensor, trained: np.ndarray
) -> tuple[dict[str, bytes], float, dict]:
    start = time.perf_counter()
    result = method.prepare(problem(world, theta, trained, np.zeros(world.n, bool)))
    return dict(result.artifacts), time.perf_counter() - start, result.info


def unlearn(method: Any, world, theta, trained, forget, artifacts) -> tuple[torch.Tensor, float, dict]:
    start = time.perf_counter()
    result = method.unlearn(problem(world, theta, trained, forget, artifacts))
    return result.theta, time.perf_counter() - start, result.info


def sisa_ensemble(artifacts: dict[str, bytes]) -> torch.Tensor:
    """The ensemble SISA serves (its constituents' last checkpoints, concatenated) from its prepared state."""
    return st_load(artifacts[ARTIFACT_SISA])["checkpoints"][:, -1].reshape(-1).contiguous()


# ---------------------------------------------------------------------------------------------- forget sets
def select_forget(world: World, plan: Plan, k: int) -> dict[str, Any]:
    """The k training rows most exposed to LiRA by d' over separate selection shadows (module docstring)."""
    rows = np.flatnonzero(world.train)
    start = time.perf_counter()
    sel = train_shadows(
        world.recipe,
        world.X[rows],
        world.y[rows],
        world.n_classes,
        ShadowSettings(n_shadows=plan.selection_shadows, seed=SELECTION_SEED),
    )
    fit = lira.fit_gaussians(shadow_phi(sel, world.X[rows], world.y[rows]), sel.in_mask, variance="per_example")
    d = (fit.mu_in - fit.mu_out) / np.sqrt((fit.std_in**2 + fit.std_out**2) / 2)
    order = np.argsort(-d, kind="stable")
    return {
        "rows": np.sort(rows[order[:k]]),
        "info": {
            "rule": f"top {k} training rows by d' over {plan.selection_shadows} selection shadows (seed "
            f"{SELECTION_SEED}, halves of the training rows, per-example variance); audit shadows are separate",
            "k": int(k),
            "dprime_selected_min_median_max": [
                float(d[order[k - 1]]),
                float(np.median(d[order[:k]])),
                float(d[order[0]]),
            ],
            "dprime_all_training_rows_median_p99": [float(np.median(d)), float(np.quantile(d, 0.99))],
            "selection_seconds": time.perf_counter() - start,
        },
    }


# ---------------------------------------------------------------------------------------------- the audit
def proven(world: World, theta: torch.Tensor, retain: np.ndarray) -> dict[str, Any] | None:
    """As the worker's ``_proven_distance``: None for an ensemble (SISA), else the gradient-norm bound."""
    if T.ensemble_size(world.recipe, theta, world.X.shape[1], world.n_classes) > 1:
        return None
    return gradient_norm_bound(world.recipe, theta, world.X, world.y, world.n_classes, retain)


def service_audit(world, shadow_blob: bytes, forget, theta, theta_new, exact: bool, plots: bool = False):
    """The verify step as the worker runs it (shadows loaded from their stored bytes; no retrained reference)."""
    shadows = shadows_from_bytes(shadow_blob)
    hold = world.holdout
    retain = world.train & ~world.mask(forget)
    report, scores = run_audit(
        shadows, world.X, world.y, forget, hold, theta, theta_new, None, world.X[hold], world.y[hold]
    )
    bound = proven(world, theta_new, retain)
    verdict = decide(report, VerdictPolicy(), proven_distance=bound.get("bound") if bound else None, exact=exact)
    if plots:
        audit_plots(scores)
    return verdict


def audit_cost(world: World, plan: Plan, shadow_blob: bytes, forget: np.ndarray, theta, theta_new, log) -> dict:
    """Median seconds of the verify step (with and without plots) next to exact retraining, interleaved."""
    retrain_s, audit_s, audit_plots_s = [], [], []
    trained = world.train
    forget_mask = world.mask(forget)
    for _ in range(plan.timing_reps):
        _, seconds, _ = unlearn(ExactRetrain(), world, theta, trained, forget_mask, None)
        retrain_s.append(seconds)
        start = time.perf_counter()
        service_audit(world, shadow_blob, forget, theta, theta_new, exact=False)
        audit_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        service_audit(world, shadow_blob, forget, theta, theta_new, exact=False, plots=True)
        audit_plots_s.append(time.perf_counter() - start)
    # the parts, once each
    parts = {}
    start = time.perf_counter()
    shadows = shadows_from_bytes(shadow_blob)
    parts["load_shadows_s"] = time.perf_counter() - start
    hold = world.holdout
    start = time.perf_counter()
    report, _ = run_audit(shadows, world.X, world.y, forget, hold, theta, theta_new, None, world.X[hold], world.y[hold])
    parts["lira_s"] = time.perf_counter() - start
    start = time.perf_counter()
    bound = proven(world, theta_new, world.train & ~forget_mask)
    parts["proven_bound_s"] = time.perf_counter() - start
    start = time.perf_counter()
    decide(report, VerdictPolicy(), proven_distance=bound.get("bound") if bound else None)
    parts["decide_s"] = time.perf_counter() - start
    out = {
        "audit_s_median": float(np.median(audit_s)),
        "audit_with_plots_s_median": float(np.median(audit_plots_s)),
        "retrain_s_median": float(np.median(retrain_s)),
        "audit_over_retrain": float(np.median(audit_s) / np.median(retrain_s)),
        "reps": plan.timing_reps,
        "audit_s_all": audit_s,
        "retrain_s_all": retrain_s,
        "parts_once": parts,
        "what": (
            "shadows_from_bytes + run_audit (LiRA on the forget rows and every held-out row, original and unlearned "
            "model, utility on the held-out rows) + gradient_norm_bound (for a single model) + decide; "
            "'with plots' adds audit_plots (ROC + histograms, PNG)"
        ),
        "rows": {"forget": int(len(forget)), "nonmembers": int(len(hold)), "retained": int((world.train).sum())},
        "shadow_blob_bytes": len(shadow_blob),
    }
    log(
        f"  audit cost: {out['audit_s_median']:.3f}s per request ({out['audit_with_plots_s_median']:.3f}s with "
        f"plots), retrain {out['retrain_s_median']:.3f}s, audit/retrain {out['audit_over_retrain']:.2f}"
    )
    return out


def summarise(report: dict, verdict: dict, bound: dict | None) -> dict[str, Any]:
    models = report["models"]

    def tpr(name: str, key: str = FPR_KEY) -> float | None:
        return models[name]["lira"]["tpr_at_fpr"][key] if name in models else None

    k = report["n_forget"]
    # a check failed by no more than float rounding at its exact threshold (e.g. a loss of exactly the threshold's
    # test rows computed as 1.0000000000000009 > 1.0 points): reported, since the verdict then rests on rounding
    edge = [
        c["name"]
        for c in verdict["checks"]
        if c["passed"] is False
        and isinstance(c.get("figure"), float)
        and isinstance(c.get("threshold"), float)
        and 0 < c["figure"] - c["threshold"] <= FLOAT_EDGE
    ]
    return {
        "tpr_at_1fpr": tpr("unlearned"),
        "tpr_original": tpr("original"),
        "tpr_retrained": tpr("retrained"),
        "tpr_at_0.1fpr": {n: tpr(n, "0.001") for n in models},
        "detected_at_1fpr": {n: f"{models[n]['lira']['detected_at_fpr'][FPR_KEY]}/{k}" for n in models},
        "chance_max_detected": f"{report['chance']['max_detected']}/{k}",
        "lira_auc": {n: models[n]["lira"]["auc"] for n in models},
        "population_mia_tpr": {n: models[n]["population_mia"]["tpr"] for n in models},
        "informative": report["informative"],
        "informative_detail": report["informative_detail"],
        "verdict": verdict["verdict"],
        "reasons": verdict["reasons"],
        "notes": verdict["notes"],
        "checks": {c["name"]: c["passed"] for c in verdict["checks"]},
        "failed_by_float_rounding_only": edge,
        "utility": report["utility"],
        "theta": report["theta"],
        "proven_bound": None if bound is None else bound.get("bound"),
        "retained_grad_norm": None if bound is None else bound.get("grad_norm"),
        "proven_bound_mu": None if bound is None else bound.get("mu"),
        "proven_bound_reason": None if bound is None else bound.get("reason"),
    }


def audit_methods(world, plan, shadows, forget, theta, theta_r, prepared, log, label) -> tuple[dict, dict]:
    """Every method on the original model and this forget set, each audited like the service does (plus the
    retrained reference side by side). Returns per-method summaries and ROC inputs for the plot."""
    hold = world.holdout
    forget_mask = world.mask(forget)
    out, rocs = {}, {}
    for name in METHODS:
        method = build(name, plan, world.name)
        theta_new, seconds, info = unlearn(method, world, theta, world.train, forget_mask, prepared.get(name))
        report, scores = run_audit(
            shadows, world.X, world.y, forget, hold, theta, theta_new, theta_r, world.X[hold], world.y[hold]
        )
        bound = proven(world, theta_new, world.train & ~forget_mask)
        verdict = decide(
            report, VerdictPolicy(), proven_distance=bound.get("bound") if bound else None, exact=name == "retrain"
        )
        out[name] = {**summarise(report, verdict, bound), "unlearn_s": seconds}
        rocs[name] = {m: (scores.forget_scores[m], scores.nonmember_scores[m]) for m in scores.forget_scores}
        s = out[name]
        log(
            f"  [{label}] {name:<10} TPR@1%: orig {s['tpr_original']:.3f} unl {s['tpr_at_1fpr']:.3f} "
            f"retr {s['tpr_retrained']:.3f} ({s['detected_at_1fpr']['unlearned']}, chance ≤ "
            f"{s['chance_max_detected']}) informative={s['informative']} → {s['verdict']}"
        )
    return out, rocs


# ---------------------------------------------------------------------------------------------- U-LiRA
def ulira(world: World, plan: Plan, forget: np.ndarray, log) -> dict[str, Any]:
    """Trained-then-unlearned vs never-trained pairs per forget example (module docstring)."""
    M = plan.ulira_pairs[world.name]
    k = len(forget)
    candidates = np.setdiff1d(np.arange(world.n), forget)
    size = int(world.train.sum()) - k
    rng = np.random.default_rng([7, SETTINGS.index(world.name)])
    phi_u = {name: np.full((M, k), np.nan) for name in METHODS}
    phi_never = {"single": np.full((M, k), np.nan), "sisa": np.full((M, k), np.nan)}
    forget_mask = world.mask(forget)
    seconds = {name: 0.0 for name in METHODS}
    start_all = time.perf_counter()
    for j in range(M):
        base = world.mask(rng.choice(candidates, size, replace=False))
        never = world.mask(rng.choice(candidates, size, replace=False))
        trained = base | forget_mask
        theta_j = world.fit(trained)
        for name in METHODS:
            start = time.perf_counter()
            method = build(name, plan, world.name)
            artifacts = prepare(method, world, theta_j, trained)[0] if name in PREPARED else None
            theta_u, _, _ = unlearn(method, world, theta_j, trained, forget_mask, artifacts)
            seconds[name] += time.perf_counter() - start
            phi_u[name][j] = world.phi(theta_u, forget)
        phi_never["single"][j] = world.phi(world.fit(never), forget)
        sisa = SISA(SISAConfig(**plan.sisa))
        phi_never["sisa"][j] = world.phi(sisa_ensemble(prepare(sisa, world, theta_j, never)[0]), forget)
        if j == 0 or (j + 1) % 4 == 0:
            log(f"  U-LiRA pair {j + 1}/{M} ({time.perf_counter() - start_all:.0f}s)")
    out: dict[str, Any] = {
        "pairs": M,
        "training_rows_per_model": size + k,
        "never_side": "the recipe trained on B'_j (SISA: a SISA ensemble prepared on B'_j)",
        "seconds_per_method_total": seconds,
        "methods": {},
    }
    for name in METHODS:
        res = lira.ulira_distinguishability(phi_u[name], phi_never["sisa" if name == "sisa" else "single"])
        auc = res["per_example_auc"]
        out["methods"][name] = {
            "ulira_auc": res["mean_auc"],
            "ulira_accuracy": res["mean_accuracy"],
            "pooled_tpr_at_1fpr": res["pooled"]["tpr_at_fpr"][FPR_KEY],
            "per_example_auc_quantiles": {q: float(np.quantile(auc, float(q))) for q in ("0.1", "0.5", "0.9")},
            "per_example_auc": [round(float(a), 4) for a in auc],
            "n_models": res["n_models"],
        }
    floor = out["methods"]["retrain"]["ulira_auc"]
    for name in METHODS:
        out["methods"][name]["ulira_auc_over_retrain_floor"] = out["methods"][name]["ulira_auc"] - floor
    log(
        "  U-LiRA AUC: "
        + ", ".join(f"{n} {out['methods'][n]['ulira_auc']:.3f}" for n in METHODS)
        + f" ({time.perf_counter() - start_all:.0f}s)"
    )
    return out


# ---------------------------------------------------------------------------------------------- one setting
def run_setting(world: World, plan: Plan, log) -> dict[str, Any]:
    C = world.n_classes
    log(f"{world.name}: pool {world.n} rows ({int(world.train.sum())} trained on, {len(world.holdout)} held out)")
    start = time.perf_counter()
    theta = world.fit(world.train)
    original_s = time.perf_counter() - start
    start = time.perf_counter()
    shadows = train_shadows(world.recipe, world.X, world.y, C, ShadowSettings(n_shadows=plan.shadows))
    shadow_s = time.perf_counter() - start
    blob = shadows_to_bytes(shadows)
    shadows = shadows_from_bytes(blob)  # the stored (float32) shadows, as the worker reads them
    log(f"  original trained in {original_s:.2f}s; {plan.shadows} shadows in {shadow_s:.1f}s")
    sel = select_forget(world, plan, plan.k[world.name])
    forget = sel["rows"]
    log(f"  forget set: {sel['info']['rule']}")
    _retrain_theta, _, _ = unlearn(ExactRetrain(), world, theta, world.train, world.mask(forget), None)
    theta_r = _retrain_theta
    prepared, prep_s, prep_info = {}, {}, {}
    for name in sorted(PREPARED):
        prepared[name], prep_s[name], prep_info[name] = prepare(
            build(name, plan, world.name), world, theta, world.train
        )
    log("  prepared once on the original: " + ", ".join(f"{n} {s:.1f}s" for n, s in prep_s.items()))
    methods, rocs = audit_methods(world, plan, shadows, forget, theta, theta_r, prepared, log, "chosen")
    # contrast: a random forget set of the same size, same methods (the uninformative case on a well-regularised LR)
    rng = np.random.default_rng([11, SETTINGS.index(world.name)])
    random_forget = np.sort(rng.choice(np.flatnonzero(world.train), len(forget), replace=False))
    theta_r_random = world.fit(world.train & ~world.mask(random_forget))
    contrast, _ = audit_methods(world, plan, shadows, random_forget, theta, theta_r_random, prepared, log, "random")
    newton_theta = unlearn(
        build("newton", plan, world.name), world, theta, world.train, world.mask(forget), prepared["newton"]
    )[0]
    cost = audit_cost(world, plan, blob, forget, theta, newton_theta, log)
    u = ulira(world, plan, forget, log)
    for name in METHODS:
        methods[name]["ulira_auc"] = u["methods"][name]["ulira_auc"]
        methods[name]["ulira_accuracy"] = u["methods"][name]["ulira_accuracy"]
        methods[name]["ulira_pooled_tpr_at_1fpr"] = u["methods"][name]["pooled_tpr_at_1fpr"]
        methods[name]["prepare_s"] = prep_s.get(name)
    methods["l2ul"]["l2ul_output_scale_c"] = prep_info["l2ul"]["calibration"]["scale"]
    return {
        "source": world.source,
        "recipe": world.recipe.to_dict(),
        "rows": {"pool": world.n, "trained": int(world.train.sum()), "held_out": len(world.holdout)},
        "original_train_s": original_s,
        "shadows": {"n": plan.shadows, "keep_fraction": 0.5, "seed_mode": "recipe", "train_s": shadow_s},
        "forget_selection": sel["info"],
        "methods": methods,
        "random_forget": {
            "rule": f"{len(forget)} training rows drawn uniformly (seed [11, {SETTINGS.index(world.name)}])",
            "methods": {
                n: {
                    key: contrast[n][key]
                    for key in ("tpr_original", "tpr_at_1fpr", "tpr_retrained", "informative", "verdict", "reasons")
                }
                for n in METHODS
            },
        },
        "audit_cost": cost,
        "ulira": u,
        "_rocs": rocs,
    }


# ---------------------------------------------------------------------------------------------- CLIP
def clip_audit(plan: Plan, log) -> dict[str, Any]:
    from app.ml.data.captions import CaptionDataset
    from app.ml.federation import FedSettings, make_demo_federation
    from app.ml.verification.clip_shadows import (
        ClipShadowSettings,
        audit_clip_deletion,
        clip_shadows_from_bytes,
        clip_shadows_to_bytes,
        train_clip_shadows,
    )
    from app.ml.verification.policy import decide

    sizes = plan.clip
    fed = FedSettings(rounds=sizes["rounds"], seed=0)
    start = time.perf_counter()
    demo = make_demo_federation(
        seed=0,
        n_clients=sizes["n_clients"],
        pairs_per_client=sizes["pairs_per_client"],
        n_test=sizes["n_test"],
        fed_settings=fed,
        cache_training=True,
    )
    log(f"clip: demo federation ready in {time.perf_counter() - start:.1f}s ({demo.model.num_params} LoRA params)")
    clip = demo.model
    test = demo.data.test
    settings = ClipShadowSettings()  # the registration default
    start = time.perf_counter()
    shadows = train_clip_shadows(clip, demo.theta_init, demo.data.clients, fed, settings)
    shadow_s = time.perf_counter() - start
    blob = clip_shadows_to_bytes(shadows)
    log(f"clip: {shadows.n_shadows} shadow LoRA runs in {shadow_s:.1f}s ({shadows.seconds} each)")
    # an "unlearned" model for the timing: the LoRA initialisation (the computation does not depend on its values)
    pool = CaptionDataset.concat(demo.data.clients)
    out: dict[str, Any] = {
        "sizes": sizes,
        "n_shadows": shadows.n_shadows,
        "shadow_train_s": shadow_s,
        "shadow_train_s_each": shadows.seconds,
        "scenarios": {},
    }
    for scope in ("samples", "client", "class"):
        masks = demo.data.forget_masks(scope)
        positions = np.flatnonzero(np.concatenate(masks))
        forget = pool.subset(positions)
        times, report = [], {}
        for _ in range(plan.timing_reps):
            start = time.perf_counter()
            loaded = clip_shadows_from_bytes(blob)
            report, _ = audit_clip_deletion(loaded, clip, forget, positions, test, demo.theta, demo.theta_init)
            verdict = decide(report)
            times.append(time.perf_counter() - start)
        orig = report["models"]["original"]["lira"]
        out["scenarios"][scope] = {
            "forget_pairs": len(forget),
            "nonmember_pairs": len(test),
            "audit_s_median": float(np.median(times)),
            "audit_s_all": times,
            "original_lira_tpr_at_1fpr": orig["tpr_at_fpr"][FPR_KEY],
            "original_lira_auc": orig["auc"],
            "original_population_auc": report["models"]["original"]["population_mia"]["auc"],
            "informative": report["informative"],
            "informative_detail": report["informative_detail"],
            "attack_check_with_theta0_as_unlearned": next(
                c["passed"] for c in verdict["checks"] if c["name"] == "forget_attack"
            ),
        }
        log(
            f"  clip {scope}: {len(forget)} forget pairs vs {len(test)} test pairs: {np.median(times):.3f}s; "
            f"{report['informative_detail']}"
        )
    out["what"] = (
        "app/jobs/federated.py verify_federated's audit: clip_shadows_from_bytes + audit_clip_deletion (offline LiRA, "
        f"{shadows.n_shadows} shadow LoRA runs of the model's FedAvg recipe on random halves of the pairs, phi over "
        "one gallery of forget + test pairs, both directions) for the original and the unlearned LoRA, plus decide. "
        "The 'unlearned' LoRA is stood in by the initialisation theta_0: the cost does not depend on the values. "
        "shadow_train_s = the registration's extra cost (and about the cost after each erasure that touches the "
        "shadows)"
    )
    out["device"] = str(clip.device)
    return out


# ---------------------------------------------------------------------------------------------- report
def print_table(results: dict, log) -> None:
    head = (
        f"{'method':<11}{'setting':<13}{'TPR orig':>9}{'TPR unl':>9}{'TPR retr':>9}{'power':>7}"
        f"{'U-LiRA':>8}{'vs floor':>9}{'verdict':>8}"
    )
    log(head)
    log("-" * len(head))
    for name in METHODS:
        for setting, row in results["methods"][name].items():
            log(
                f"{name:<11}{setting:<13}{row['tpr_original']:>9.3f}{row['tpr_at_1fpr']:>9.3f}"
                f"{row['tpr_retrained']:>9.3f}{'yes' if row['informative'] else 'NO':>7}{row['ulira_auc']:>8.3f}"
                f"{row['ulira_auc_over_retrain_floor']:>+9.3f}{row['verdict']:>8}"
                + (" (* fails only by float rounding at the threshold)" if row["failed_by_float_rounding_only"] else "")
            )


def plot(settings: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {
        "retrain": "tab:green",
        "newton": "tab:blue",
        "influence": "tab:cyan",
        "l2ul": "tab:orange",
        "sisa": "tab:purple",
        "do_nothing": "tab:red",
    }
    names = list(settings)
    fig, axes = plt.subplots(2, len(names), figsize=(6.2 * len(names), 10))
    axes = np.atleast_2d(axes).reshape(2, len(names))
    for col, setting in enumerate(names):
        res = settings[setting]
        ax = axes[0, col]
        lo = 1.0
        first = next(iter(res["_rocs"].values()))
        for label, style in (("original", dict(color="black", lw=2.2)),):
            roc = lira.roc_curve(*first[label])
            lo = min(lo, 0.5 / roc.n_nonmembers, 0.5 / roc.n_members)
            ax.plot(roc.fpr, roc.tpr, drawstyle="steps-post", label=f"original (AUC {roc.auc:.2f})", **style)
        for name in METHODS:
            roc = lira.roc_curve(*res["_rocs"][name]["unlearned"])
            ls = "--" if name == "retrain" else "-"
            ax.plot(roc.fpr, roc.tpr, drawstyle="steps-post", color=colours[name], ls=ls, label=f"{name} (unlearned)")
        ax.plot([lo, 1], [lo, 1], color="grey", lw=0.8, ls=":", label="chance")
        ax.axvline(0.01, color="grey", lw=0.5, ls=":")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlim(lo, 1)
        ax.set_ylim(lo, 1.05)
        k = res["forget_selection"]["k"]
        ax.set_title(f"{setting}: LiRA on the {k} forget rows vs {res['rows']['held_out']} held-out rows")
        ax.set_xlabel("FPR")
        ax.set_ylabel("TPR")
        ax.legend(fontsize="small", loc="lower right")
        ax = axes[1, col]
        data = [res["ulira"]["methods"][n]["per_example_auc"] for n in METHODS]
        ax.boxplot(data, showmeans=True)
        ax.set_xticks(range(1, len(METHODS) + 1), METHODS, rotation=20)
        ax.axhline(0.5, color="grey", lw=0.8, ls=":")
        ax.set_ylim(0, 1.02)
        ax.set_title(f"{setting}: U-LiRA per-example AUC ({res['ulira']['pairs']} pairs; 0.5 = indistinguishable)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--data-dir", type=Path, default=DATA_DIR)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--only", default="", help="comma list of settings (adult_lr, overfit_mlp, clip)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from threadpoolctl import threadpool_limits

    threadpool_limits(1)
    plan = make_plan("quick" if args.quick else "full")
    out = args.out or REPO / "bench" / "results" / ("verify_quick.json" if args.quick else "verify.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    only = {s for s in args.only.split(",") if s} or {*SETTINGS, "clip"}
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:7.1f}s] {msg}", flush=True)

    results: dict[str, Any] = {
        "mode": plan.mode,
        "complete": only == {*SETTINGS, "clip"},
        "plan": asdict(plan),
        "l2ul_settings": {s: asdict(l2ul_config(plan, s)) for s in SETTINGS if s in only},
        "policy": VerdictPolicy().to_dict(),
        "machine": {
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "platform": platform.platform(),
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "loadavg_start": os.getloadavg(),
        },
        "shadows": plan.shadows,
        "notes": NOTES,
        "methods": {name: {} for name in METHODS},
        "settings": {},
    }
    settings: dict[str, dict] = {}
    for setting in SETTINGS:
        if setting not in only:
            continue
        world = adult_world(plan, args.data_dir) if setting == "adult_lr" else overfit_world()
        settings[setting] = run_setting(world, plan, log)
        res = settings[setting]
        for name in METHODS:
            row = res["methods"][name]
            row["ulira_auc_over_retrain_floor"] = res["ulira"]["methods"][name]["ulira_auc_over_retrain_floor"]
            results["methods"][name][setting] = row
        results["settings"][setting] = {k: v for k, v in res.items() if k not in ("methods", "_rocs")}
        out.write_text(json.dumps(results, indent=1, default=float))
    if "adult_lr" in settings:
        cost = settings["adult_lr"]["audit_cost"]
        results["tabular_audit_s"] = cost["audit_s_median"]
        results["tabular_audit_with_plots_s"] = cost["audit_with_plots_s_median"]
        results["tabular_retrain_s"] = cost["retrain_s_median"]
        results["tabular_audit_over_retrain"] = cost["audit_over_retrain"]
        results["adult_original_tpr_at_1fpr"] = settings["adult_lr"]["methods"]["retrain"]["tpr_original"]
    if "overfit_mlp" in settings:
        results["overfit_original_tpr_at_1fpr"] = settings["overfit_mlp"]["methods"]["retrain"]["tpr_original"]
        results["overfit_audit_s"] = settings["overfit_mlp"]["audit_cost"]["audit_s_median"]
    if "clip" in only:
        results["clip"] = clip_audit(plan, log)
        results["clip_audit_s"] = results["clip"]["scenarios"]["samples"]["audit_s_median"]
        results["clip_shadow_train_s"] = results["clip"]["shadow_train_s"]
        results["clip_shadows"] = results["clip"]["n_shadows"]
    results["machine"]["loadavg_end"] = os.getloadavg()
    results["wall_time_s"] = time.perf_counter() - t_start
    out.write_text(json.dumps(results, indent=1, default=float))
    if settings:
        plot(settings, out.with_suffix(".png"))
        print_table(results, log)
    log(
        f"tabular audit {results.get('tabular_audit_s', float('nan')):.3f}s/request "
        f"(retrain {results.get('tabular_retrain_s', float('nan')):.3f}s), "
        f"clip audit {results.get('clip_audit_s', float('nan')):.3f}s; wrote {out} ({results['wall_time_s']:.0f}s)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

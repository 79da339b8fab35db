"""Tabular unlearning benchmark (issue 10): retrain / Newton / influence / L2UL / SISA / do-nothing, measured in
process and end to end through the service.

    .venv/bin/python -m bench.tabular            # full run; writes bench/results/tabular.{json,png}
    .venv/bin/python -m bench.tabular --quick    # the same code on small sizes (a few minutes)
    .venv/bin/python -m bench.tabular --scale    # a 5,000,000-row generated set (meant for a GPU machine)
    --only adult_lr,skin_mlp                     # a subset of settings; --no-service skips the end-to-end part
    --part quality|service                       # Part A or Part B only (default both)
    --merge bench/results/parts/*.json           # join part files into bench/results/tabular.{json,png}
    --table bench/results/tabular.json           # the README's Markdown table

On a shared machine run it in parts, one setting (or half) per ``flock /tmp/lethe-bench.lock`` call, each with
``--out bench/results/parts/tabular_<setting>.json``, then ``--merge``: the merged file records under ``parts`` each
part's wall time, commit and load average, since the parts ran at different moments (speed-ups are always measured
within one part).

Data: Adult (label ``Salary``) and Skin (label ``S``) from ``--data-dir`` (default ../shared/datasets), 80/20
train/test split, and a GENERATED set (sklearn ``make_classification``, 1,000,000 rows, 20 features; said so in
the JSON). Each table is encoded once with the service's own TableEncoder, so the in-process models and the
service's version 1 are the same fit of the same rows ("every method from the same original": checked and recorded).

Part A, in process (pure app/ml), per data set x model (LR, MLP) x |D_f| in {1, 100, 1000}: ``reps`` random
requests (uniform over the training rows); every method starts from the same original model and prepared state:
- retrain: the recipe on the retained rows (the reference theta_r; a convex recipe starts from the served theta, as
  the service's exact retraining does: the optimum is unique, ``retrain_warm_start`` in the JSON), and
  scikit-learn's fit of the same objective beside it (LogisticRegression / MLPClassifier, lbfgs, best of 3);
- newton / influence (Guo et al. 2020): the step alone is the method time (warm: the prepared state parsed once,
  as a warm worker holds it); the state upkeep a served request also pays (residual pass, the downdate, the
  Hessian recomputed over the retained rows by ``complete_purge``, the LR bound) is reported as ``upkeep_s``;
  ``speedup_incl_upkeep`` = median retrain time / median (method time + upkeep_s + purge_s) per request;
- l2ul: the forward pass is the method time; its purge (dropping the units that held the rows) is run in full on
  every request and reported as ``purge_s``, never estimated;
- l2ul_n (L2UL-N, app/ml/unlearning/l2ul/newton_corrected.py): the Newton step plus the gated correction is the
  method time; ``purge_s`` is its unit drop plus the Newton state's upkeep;
- sisa: its unlearn (retraining the shards that held the rows) is the method time;
- do_nothing: theta unchanged (param_ratio 1 by definition).
Figures per method: test and D_f accuracy, param_ratio = ||theta' - theta_r|| / ||theta - theta_r|| (softmax biases
centred; the median over requests, and the ratio of the mean norms), acc_gap_pts = 100 * (retrain test accuracy -
method test accuracy), medians of times, speedup = median retrain time / median method time (same run).

Part B, through the service on the embedded default (SQLite + in-process executor, FastAPI TestClient), with the
settings a user gets by default (holdout 0.2 of the table, 64 LiRA shadows: so the service's version 1 trains on 80 %
of Part A's training rows and ``same_original`` is false): the same training table is registered four times — no
fast method ("plain", for retrain), ["newton", "influence"] (for newton, influence and auto), ["l2ul"], ["sisa"] — so
each method's deletions pay only their own state upkeep. The registrations' preparation (determinism probe,
validation on real deletions) is recorded; then ``reps_e2e`` deletions per method and |D_f|, each on an idle model
(the previous job's upkeep finished) and timed POST -> certified (``e2e_s``), then its upkeep after the certificate
(``upkeep_s``: shadow refill, deferred purge) until the model is idle again; whether each audit was informative and
which evidence each verdict rests on are recorded; speedup_e2e = median retrain e2e / median method e2e. Deletions
through the service are sequential (each on the then-current version) and keep working until a method's state is
used up (L2UL's units): what ran and what was refused is recorded.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import secrets
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from app.ml import tabular as T
from app.ml.data.tabular import TableEncoder, load_table
from app.ml.unlearning.base import AUTO_MAX_PARAM_RATIO, TabularProblem
from app.ml.unlearning.baselines.sisa import SISA, DoNothing, SISAConfig
from app.ml.unlearning.l2ul import L2UL, L2ULN, L2ULConfig, L2ULNConfig
from app.ml.unlearning.newton.method import InfluenceUnlearning, NewtonUnlearning
from app.ml.unlearning.retrain import ExactRetrain
from app.ml.unlearning.validation import param_ratio

REPO = Path(__file__).resolve().parents[1]
METHODS = ("retrain", "newton", "influence", "l2ul", "l2ul_n", "sisa", "do_nothing")
E2E_METHODS = ("retrain", "newton", "influence", "auto", "l2ul", "l2ul_n", "sisa")
LEARNED = ("l2ul", "l2ul_n")  # prepared with meta-training; purged by dropping units
ROW_ID, LABEL = "row_id", "label"


@dataclass
class Plan:
    datasets: list[str]
    synthetic_rows: int
    max_rows: dict[str, int | None]
    sizes: list[int]
    reps: int
    reps_e2e: dict[str, int]  # per family
    e2e_sizes: dict[str, list[int]]  # per family
    skip: list[str] = field(default_factory=list)  # "<dataset>_<model>" not run, with the reason in notes
    skip_reason: dict[str, str] = field(default_factory=dict)
    l2ul_lr: dict[str, Any] = field(default_factory=lambda: {"m": 1000, "units": 8, "calibration_tasks": 8})
    l2ul_mlp: dict[str, Any] = field(default_factory=lambda: {"m": 80, "units": 8, "calibration_tasks": 3})
    l2uln_lr: dict[str, Any] = field(default_factory=lambda: {"m": 400, "units": 8, "calibration_tasks": 6})
    l2uln_mlp: dict[str, Any] = field(default_factory=lambda: {"m": 48, "units": 4, "calibration_tasks": 2})
    sisa_lr: dict[str, Any] = field(default_factory=lambda: {"shards": 5, "slices": 4})
    sisa_mlp: dict[str, Any] = field(default_factory=lambda: {"shards": 5, "slices": 2})
    workers: int = 0
    sklearn_repeats: int = 3
    shadows: int | None = None  # the verification's LiRA shadows per registration (None: the service's default)
    e2e_override: dict[str, dict[str, Any]] = field(default_factory=dict)  # "<dataset>_<model>" -> reps/sizes/skip
    e2e_override_reason: dict[str, str] = field(default_factory=dict)
    reps_override: dict[str, int] = field(default_factory=dict)  # "<dataset>_<model>" -> Part A requests per |D_f|
    reps_override_reason: dict[str, str] = field(default_factory=dict)
    sklearn_repeats_mlp: int | None = None

    def e2e_for(self, key: str, family: str) -> tuple[int, list[int], list[str]]:
        o = self.e2e_override.get(key, {})
        return (
            int(o.get("reps", self.reps_e2e[family])),
            list(o.get("sizes", self.e2e_sizes[family])),
            list(o.get("skip_methods", [])),
        )


def make_plan(mode: str) -> Plan:
    if mode == "quick":
        return Plan(
            datasets=["adult", "skin", "synthetic"],
            synthetic_rows=60_000,
            max_rows={"adult": 6_000, "skin": 20_000, "synthetic": None},
            sizes=[1, 100, 1000],
            reps=2,
            reps_e2e={"lr": 2, "mlp": 1},
            e2e_sizes={"lr": [1, 100], "mlp": [1]},
            l2ul_lr={"m": 64, "units": 4, "calibration_tasks": 2, "epochs": 60},
            l2ul_mlp={"m": 16, "units": 4, "calibration_tasks": 1, "epochs": 60},
            l2uln_lr={"m": 32, "units": 4, "calibration_tasks": 2, "epochs": 60},
            l2uln_mlp={"m": 16, "units": 4, "calibration_tasks": 1, "epochs": 60},
            workers=1,
            sklearn_repeats=1,
        )
    if mode == "scale":
        return Plan(
            datasets=["synthetic"],
            synthetic_rows=5_000_000,
            max_rows={"synthetic": None},
            sizes=[1, 100, 1000],
            reps=5,
            reps_e2e={"lr": 5, "mlp": 2},
            e2e_sizes={"lr": [1, 100, 1000], "mlp": [1]},
        )
    return Plan(
        datasets=["adult", "skin", "synthetic"],
        synthetic_rows=1_000_000,
        max_rows={"adult": None, "skin": None, "synthetic": None},
        sizes=[1, 100, 1000],
        reps=5,
        reps_e2e={"lr": 5, "mlp": 2},
        e2e_sizes={"lr": [1, 100, 1000], "mlp": [1, 100, 1000]},
        reps_override={"synthetic_mlp": 3},
        reps_override_reason={
            "synthetic_mlp": "3 requests per |D_f| in process instead of 5: every retrain (the reference of each "
            "request) on 800,000 rows takes ~200 s here on one thread, so 5 x 3 sizes would take about three hours",
        },
        sklearn_repeats_mlp=1,
        l2ul_mlp={"m": 48, "units": 4, "calibration_tasks": 2},
        l2uln_mlp={"m": 32, "units": 4, "calibration_tasks": 2},
        e2e_override={
            "synthetic_lr": {"reps": 3},
            "adult_mlp": {"skip_methods": ["l2ul", "l2ul_n"]},
            "skin_mlp": {"skip_methods": ["l2ul", "l2ul_n"]},
            "synthetic_mlp": {"reps": 1, "sizes": [1], "skip_methods": ["l2ul", "l2ul_n", "sisa"]},
        },
        e2e_override_reason={
            "synthetic_lr": "3 requests per |D_f| through the service instead of 5: each deletion of the 800,000-row "
            "table rewrites it and retrains, 5-15 s a request on this shared 2-core machine",
            "adult_mlp": "l2ul and l2ul_n are not registered in Part B: their meta-training (MLP fits on 3,000-row "
            "subsets) is measured in Part A and would be paid again, ~10 min each on this machine",
            "skin_mlp": "as adult_mlp: l2ul and l2ul_n are measured in Part A only",
            "synthetic_mlp": "one one-row request per method, and no l2ul / l2ul_n / sisa registration (all measured "
            "in Part A): on 800,000 rows every MLP fit takes ~200 s here, a registration pays its fit, 4 shadow fits "
            "and (with fast methods) 4 reference retrains, and each deletion its retrain or shadow replacements, so "
            "the issue's 2 x {1, 100} requests per method would take about three hours on this 2-core machine",
        },
    )


# ---------------------------------------------------------------------------------------------- data
def load_frame(name: str, data_dir: Path, plan: Plan, seed: int = 0) -> tuple[pd.DataFrame, pd.DataFrame, str]:
    """(train frame, test frame, source) with a row-id and a label column, 80/20."""
    rng = np.random.default_rng(seed)
    if name == "synthetic":
        from sklearn.datasets import make_classification

        n = plan.synthetic_rows
        X, y = make_classification(
            n_samples=n, n_features=20, n_informative=10, n_redundant=5, flip_y=0.05, random_state=seed
        )
        df = pd.DataFrame(X.astype(np.float32), columns=[f"f{i}" for i in range(20)])
        df[LABEL] = np.where(y == 1, "pos", "neg")
        source = (
            f"GENERATED: sklearn.datasets.make_classification(n_samples={n}, n_features=20, n_informative=10, "
            f"n_redundant=5, flip_y=0.05, random_state={seed})"
        )
    else:
        label = {"adult": "Salary", "skin": "S"}[name]
        path = data_dir / f"{name}.csv"
        df = load_table(path).rename(columns={label: LABEL})
        df[LABEL] = df[LABEL].astype(str)
        source = str(path)
        if plan.max_rows.get(name):
            df = df.iloc[rng.permutation(len(df))[: plan.max_rows[name]]].reset_index(drop=True)
    df.insert(0, ROW_ID, [f"{name[0]}{i}" for i in range(len(df))])
    perm = rng.permutation(len(df))
    n_tr = int(0.8 * len(df))
    return df.iloc[np.sort(perm[:n_tr])].reset_index(drop=True), df.iloc[np.sort(perm[n_tr:])], source


def encode(train: pd.DataFrame, test: pd.DataFrame) -> dict[str, Any]:
    """The service's encoding (TableEncoder fitted on the registered table)."""
    enc = TableEncoder.fit(train, LABEL, exclude=[ROW_ID])
    return {
        "X_tr": enc.transform(train),
        "y_tr": enc.encode_labels(train[LABEL]),
        "X_te": enc.transform(test),
        "y_te": enc.encode_labels(test[LABEL]),
        "n_classes": enc.n_classes,
        "row_ids": train[ROW_ID].to_numpy(),
        "raw_bytes": int(train.memory_usage(deep=True).sum()),
    }


# ---------------------------------------------------------------------------------------------- helpers
def median(xs) -> float | None:
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return float(np.median(xs)) if xs else None


def ratio(a, b) -> float | None:
    return a / b if a is not None and b not in (None, 0) else None


def recipe_for(family: str) -> T.TabularRecipe:
    """The service's defaults (issue 10, item 2: the MLP's l2 = 1e-2, trained to convergence)."""
    return T.TabularRecipe(family="mlp") if family == "mlp" else T.TabularRecipe()


def sklearn_fit(recipe: T.TabularRecipe, X, y, C: int, repeats: int) -> dict[str, Any]:
    """scikit-learn's fit of the same objective (lbfgs), best of ``repeats`` (the least disturbed run)."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.neural_network import MLPClassifier

    n = len(X)
    times, model = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        if recipe.family == "logistic_regression":
            model = LogisticRegression(C=T.sklearn_C(recipe, n), tol=1e-8, max_iter=10_000).fit(X, y)
        else:  # sklearn's alpha multiplies 0.5 ||W||^2 / n_samples: alpha = l2 * n gives the same objective
            model = MLPClassifier(
                hidden_layer_sizes=(recipe.hidden_units,),
                activation="logistic",
                solver="lbfgs",
                alpha=recipe.l2 * n,
                max_iter=recipe.max_iter,
                tol=1e-9,
                random_state=recipe.seed,
            ).fit(X, y)
        times.append(time.perf_counter() - start)
    return {"seconds": min(times), "iterations": int(np.max(model.n_iter_)), "estimator": type(model).__name__}


# ---------------------------------------------------------------------------------------------- Part A
def l2uln_settings(plan: Plan, family: str) -> dict[str, Any]:
    return dict(plan.l2uln_lr if family == "lr" else plan.l2uln_mlp)


def run_quality(key: str, family: str, ds: dict, plan: Plan, log) -> dict[str, Any]:
    X, y, C = ds["X_tr"], ds["y_tr"], ds["n_classes"]
    n, d = X.shape
    recipe = recipe_for(family)
    out: dict[str, Any] = {"n_train": n, "n_test": len(ds["y_te"]), "d": d, "recipe": recipe.to_dict()}
    none = np.zeros(n, bool)
    start = time.perf_counter()
    theta, solver = T.fit(recipe, X, y, C)
    if key in plan.reps_override_reason:
        out["reduced"] = plan.reps_override_reason[key]
    out["original"] = {"train_s": time.perf_counter() - start, "solver": solver}
    mlp = family == "mlp"
    out["sklearn_fit"] = sklearn_fit(
        recipe, X, y, C, (plan.sklearn_repeats_mlp or plan.sklearn_repeats) if mlp else plan.sklearn_repeats
    )
    log(f"  fit {out['original']['train_s']:.2f}s ({solver['status']}), sklearn {out['sklearn_fit']['seconds']:.2f}s")
    base = TabularProblem(recipe, X, y, C, theta, ~none, none, none)

    l2ul_cfg = L2ULConfig(**{**(plan.l2ul_lr if family == "lr" else plan.l2ul_mlp), "workers": plan.workers})
    sisa_cfg = SISAConfig(**(plan.sisa_lr if family == "lr" else plan.sisa_mlp))
    methods = {
        "newton": NewtonUnlearning(),
        "influence": InfluenceUnlearning(),
        "l2ul": L2UL(l2ul_cfg),
        "l2ul_n": L2ULN(L2ULNConfig(**{**l2uln_settings(plan, family), "workers": plan.workers})),
        "sisa": SISA(sisa_cfg),
    }
    prepared, prep_info = {}, {}
    for name, method in methods.items():
        start = time.perf_counter()
        res = method.prepare(base)
        prepared[name] = res.artifacts
        prep_info[name] = {"seconds": time.perf_counter() - start, **{k: v for k, v in res.info.items() if k in (
            "timings", "hessian", "n_params", "units", "output_scale", "held_out_task_param_ratio_median", "refused",
            "artifact_bytes", "wall_time_s", "gate", "task_newton_param_ratio_median",
            "held_out_task_correction_ratio_median", "calibration")}}  # fmt: skip
        log(f"  prepare {name}: {prep_info[name]['seconds']:.2f}s" + (
            f" (L2UL output scale {res.info['output_scale']:.3f}, held-out tasks "
            f"{res.info['held_out_task_param_ratio_median']})" if name == "l2ul" else
            f" (gate {res.info['gate']:.3f})" if name == "l2ul_n" else ""))  # fmt: skip
    out["prepare"] = prep_info
    # what a warm worker keeps for this model (app/jobs/tabular.py ENCODED / FRAMES / ARTIFACT_BYTES, and each
    # method's parsed state, about the size of its bytes): issue 10, item 5
    out["memory_bytes"] = {
        "encoded_table": int(X.nbytes + y.nbytes + n),  # X float32, labels, the present mask
        "row_ids": int(ds["row_ids"].nbytes + sum(len(str(r)) + 49 for r in ds["row_ids"][:1000]) * n // 1000),
        "raw_table": int(ds["raw_bytes"]),
        **{f"{m}_state": int(sum(len(v) for v in prepared[m].values())) for m in prepared},
    }

    def problem(forget, name):
        return replace(base, retain_mask=~forget, forget_mask=forget, artifacts=prepared.get(name, {}))

    rng = np.random.default_rng(12345)
    warm = none.copy()
    warm[rng.integers(n)] = True
    for name in ("newton", "influence", *LEARNED):  # warm-up: first-call costs (lazy imports, parsing) out of timing
        methods[name].unlearn(problem(warm, name))

    sizes = {}
    for k in plan.sizes:
        if k > n // 20:
            continue
        rows = []
        for rep in range(plan.reps_override.get(key, plan.reps)):
            f_rows = np.sort(rng.choice(n, k, replace=False))
            forget = none.copy()
            forget[f_rows] = True
            rec: dict[str, Any] = {"rep": rep, "time_s": {}, "upkeep_s": {}, "purge_s": {}}
            res = ExactRetrain().unlearn(problem(forget, "retrain"))
            theta_r = res.theta
            rec["time_s"]["retrain"] = res.info["wall_time_s"]
            rec["retrain_status"] = res.info["solver"]["status"]
            thetas = {"retrain": theta_r}
            rec["retrain_warm_start"] = bool(res.info.get("warm_start"))
            for name in ("newton", "influence"):
                res = methods[name].unlearn(problem(forget, name))
                thetas[name] = res.theta
                rec["time_s"][name] = res.info["method_seconds"]
                rec["upkeep_s"][name] = sum(
                    res.info.get(s, 0.0) for s in ("residual_seconds", "purge_seconds", "bound_seconds")
                )
                # the purge's deferred part (the state recomputed at θ′ over the retained rows), which the service
                # runs in the upkeep after the certificate: a cost every request still pays, off its path
                served = replace(problem(forget, name), theta=res.theta, artifacts=res.artifacts)
                start = time.perf_counter()
                methods[name].complete_purge(served)
                rec["upkeep_s"][name] += time.perf_counter() - start
                rec.setdefault("bound", {})[name] = (res.info.get("bound") or {}).get("bound")
            for name in LEARNED:
                res = methods[name].unlearn(problem(forget, name))
                thetas[name] = res.theta
                rec["time_s"][name] = res.info["method_seconds"]
                rec["purge_s"][name] = res.info["purge_seconds"]
                rec.setdefault("units_dropped", {})[name] = len(res.info["units_dropped"])
            rec["gate"] = float(methods["l2ul_n"]._load(prepared["l2ul_n"]).meta.get("gate", 0.0))
            start = time.perf_counter()
            res = methods["sisa"].unlearn(problem(forget, "sisa"))
            rec["time_s"]["sisa"] = time.perf_counter() - start
            thetas["sisa"] = res.theta
            thetas["do_nothing"] = DoNothing().unlearn(problem(forget, "do_nothing")).theta
            rec["time_s"]["do_nothing"] = 0.0
            rec["acc_test"] = {m: T.accuracy(recipe, t, ds["X_te"], ds["y_te"], C) for m, t in thetas.items()}
            rec["acc_forget"] = {m: T.accuracy(recipe, t, X[f_rows], y[f_rows], C) for m, t in thetas.items()}
            rec["param_ratio"] = {
                m: (param_ratio(recipe, d, C, t, theta, theta_r) if m != "sisa" else None) for m, t in thetas.items()
            }
            rec["dist"] = {
                m: float((T.center_output_bias(recipe, t, d, C) - T.center_output_bias(recipe, theta_r, d, C)).norm())
                for m, t in thetas.items()
                if m != "sisa"
            }
            rows.append(rec)
        sizes[str(k)] = summarise(rows)
        s = sizes[str(k)]["methods"]
        log(
            f"  |D_f|={k}: retrain {s['retrain']['time_s'] * 1e3:.1f} ms; "
            + "; ".join(
                f"{m} x{s[m]['speedup']:.0f} r={s[m]['param_ratio']:.2g}"
                for m in ("newton", "influence", *LEARNED)
                if s[m]["speedup"] and s[m]["param_ratio"] is not None
            )
            + f"; l2ul purge {s['l2ul']['purge_s'] * 1e3:.1f} ms"
        )
    out["sizes"] = sizes
    out["_theta"] = theta
    return out


def _with_upkeep(rec: dict[str, Any], m: str) -> float:
    """One request's method time plus every cost it also pays to keep the method serving: newton/influence's state
    upkeep (residual, Hessian recomputed, bound), the learned methods' purge; SISA's retrain is all in its time."""
    return rec["time_s"][m] + rec["upkeep_s"].get(m, 0.0) + rec["purge_s"].get(m, 0.0)


def _incl_upkeep(size: dict[str, Any], m: str) -> float | None:
    """The speed-up incl. upkeep of a part file written before that column existed, from its per-request records
    (their upkeep_s already held the whole state upkeep: the Hessian was then recomputed inside the purge)."""
    rows = size.get("per_request") or []
    if m == "do_nothing" or not rows or any(m not in r["time_s"] for r in rows):
        return None
    return ratio(median([r["time_s"]["retrain"] for r in rows]), median([_with_upkeep(r, m) for r in rows]))


def summarise(rows: list[dict]) -> dict[str, Any]:
    t_retrain = median([r["time_s"]["retrain"] for r in rows])
    out: dict[str, Any] = {"requests": len(rows), "methods": {}, "per_request": rows}
    out["retrain_warm_start"] = all(r.get("retrain_warm_start", False) for r in rows)
    acc_retrain = float(np.mean([r["acc_test"]["retrain"] for r in rows]))
    for m in METHODS:
        t = median([r["time_s"][m] for r in rows])
        d0 = [r["dist"]["do_nothing"] for r in rows]
        entry = {
            "time_s": t,
            "speedup": ratio(t_retrain, t) if m != "do_nothing" else None,
            "speedup_incl_upkeep": ratio(t_retrain, median([_with_upkeep(r, m) for r in rows]))
            if m != "do_nothing"
            else None,
            "param_ratio": median([r["param_ratio"][m] for r in rows]),
            "param_ratio_of_means": (ratio(float(np.mean([r["dist"][m] for r in rows])), float(np.mean(d0))))
            if m != "sisa"
            else None,
            "acc_test": float(np.mean([r["acc_test"][m] for r in rows])),
            "acc_forget": float(np.mean([r["acc_forget"][m] for r in rows])),
            "acc_gap_pts": 100 * (acc_retrain - float(np.mean([r["acc_test"][m] for r in rows]))),
        }
        if m in ("newton", "influence"):
            entry["upkeep_s"] = median([r["upkeep_s"][m] for r in rows])
            entry["bound"] = median([r.get("bound", {}).get(m) for r in rows])
        if m in LEARNED:
            entry["purge_s"] = median([r["purge_s"][m] for r in rows])
            entry["purge_s_max"] = max(r["purge_s"][m] for r in rows)
            entry["units_dropped"] = median([r["units_dropped"][m] for r in rows])
        out["methods"][m] = entry
    return out


# ---------------------------------------------------------------------------------------------- Part B
class Service:
    """The embedded default in this process: SQLite file + in-process executor, driven through FastAPI's client."""

    def __init__(self, home: Path):
        os.environ.update(
            {
                "LETHE_HOME": str(home / "lethe"),  # the data root may not contain the home (app/config.py)
                "LETHE_SECRET_KEY": secrets.token_urlsafe(48),  # >= 32 bytes (app/config.py)
                "LETHE_DATA_ROOTS": json.dumps([str(home / "data")]),
                "LETHE_POLL_SECONDS": "0.01",
                "LETHE_MAX_UPLOAD_BYTES": str(4 << 30),
            }
        )
        for var in ("LETHE_DATABASE_URL", "LETHE_BROKER_URL", "LETHE_ARTIFACT_URL"):
            os.environ.pop(var, None)
        from fastapi.testclient import TestClient

        from app.auth.service import create_key
        from app.config import get_settings
        from app.db import migrate, reset_engine_cache, session_scope
        from app.main import create_app
        from app.storage import get_store

        get_settings.cache_clear()
        get_store.cache_clear()
        reset_engine_cache()
        migrate()
        with session_scope() as session:
            _, key = create_key(session, "bench", ["admin"])
        self.home = home
        self._stack = contextlib.ExitStack()
        self.client = self._stack.enter_context(TestClient(create_app(run_background=True)))
        self.client.headers["authorization"] = f"Bearer {key}"

    def close(self) -> None:
        self._stack.close()

    def wait(self, url: str, done, timeout: float, interval: float = 0.005) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            body = self.client.get(url).json()
            if done(body):
                return body
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} did not finish in {timeout} s")
            time.sleep(interval)

    def register(self, path: Path, name: str, family: str, methods: list[str], settings: dict, shadows: int) -> dict:
        meta = {
            "name": name,
            "family": "mlp" if family == "mlp" else "logistic_regression",
            "unlearning": methods,
            "method_settings": settings,  # holdout and shadows: the service's defaults (issue 21)
            **({"verification": {"shadows": shadows}} if shadows else {}),
            "dataset": {"path": str(path), "row_id_column": ROW_ID, "label_column": LABEL},
        }
        start = time.perf_counter()
        response = self.client.post("/v1/models", json=meta)
        if response.status_code != 202:
            raise RuntimeError(f"registration refused: {response.status_code} {response.text}")
        model_id = response.json()["id"]

        def ready(body):
            return body["status"] == "failed" or (
                body["status"] == "ready"
                and all(body["unlearning"].get(m, {}).get("status") in ("ready", "refused", "failed") for m in methods)
            )

        body = self.wait(f"/v1/models/{model_id}", ready, timeout=7200, interval=0.2)
        body["registration_s"] = time.perf_counter() - start
        return body

    def idle(self, model_id: str) -> None:
        """Wait until the model's last job has ended (its upkeep after the certificate included): each request is
        timed on an idle model, as one arriving alone would be."""
        from sqlalchemy import select

        from app.db import session_scope
        from app.jobs.tables import Job

        def busy() -> bool:
            with session_scope() as session:
                active = ("pending", "dispatched", "running")
                query = select(Job.id).where(Job.model_id == model_id, Job.status.in_(active))
                return session.execute(query).first() is not None

        while busy():
            time.sleep(0.02)

    def delete(self, model_id: str, row_ids: list[str], method: str) -> dict[str, Any]:
        self.idle(model_id)
        start = time.perf_counter()
        response = self.client.post(
            "/v1/deletion-requests",
            json={
                "subject_ref": "bench",
                "model_id": model_id,
                "method": method,
                "scope": {"kind": "samples", "sample_ids": row_ids},
            },
        )
        if response.status_code != 202:
            return {"status": response.status_code, "problem": response.json().get("type", "").rsplit("/", 1)[-1]}
        url = f"/v1/deletion-requests/{response.json()['id']}"
        body = self.wait(url, lambda b: b["status"] in ("certified", "failed", "rejected"), timeout=7200)
        e2e = time.perf_counter() - start
        out: dict[str, Any] = {"status": body["status"], "e2e_s": e2e}
        self.idle(model_id)
        out["upkeep_s"] = time.perf_counter() - start - e2e  # after the certificate, before the next request
        if body["status"] == "certified":
            reports = self.client.get(body["links"]["reports"]).json()["items"]
            out["informative"] = bool(reports and reports[-1].get("informative"))
            out["evidence"] = sorted({str(e) for r in reports for e in r.get("evidence") or []})
            version = self.client.get(f"/v1/models/{model_id}/versions").json()[-1]
            out.update(
                ran=version["method"],
                unlearn_s=version["metrics"]["unlearn_seconds"],
                choice=version["metrics"].get("choice", {}).get("reason"),
            )
        else:
            error = body.get("error") or {}  # a problem object (its type and detail), or older text
            out["error"] = (error.get("detail") or error.get("type") if isinstance(error, dict) else str(error))[:300]
            out["problem"] = error.get("type", "").rsplit("/", 1)[-1] if isinstance(error, dict) else None
        return out


def run_service(key: str, family: str, train: pd.DataFrame, ds: dict, plan: Plan, theta0, log) -> dict[str, Any]:
    home = Path(tempfile.mkdtemp(prefix=f"lethe-bench-{key}-"))
    (home / "data").mkdir()
    path = home / "data" / f"{key}.parquet"
    train.to_parquet(path, index=False)
    service = Service(home)
    out: dict[str, Any] = {"table": "parquet", "rows": len(train)}
    l2ul = {**(plan.l2ul_lr if family == "lr" else plan.l2ul_mlp), "workers": plan.workers}
    sisa = plan.sisa_lr if family == "lr" else plan.sisa_mlp
    reps_e2e, e2e_sizes, skip_methods = plan.e2e_for(key, family)
    registrations = {
        "plain": ([], {}),
        "fast": (["newton", "influence"], {}),
        "l2ul": (["l2ul"], {"l2ul": l2ul}),
        "l2ul_n": (["l2ul_n"], {"l2ul_n": {**l2uln_settings(plan, family), "workers": plan.workers}}),
        "sisa": (["sisa"], {"sisa": sisa}),
    }
    registrations = {label: r for label, r in registrations.items() if label not in skip_methods}
    try:
        models = {}
        for label, (methods, settings) in registrations.items():
            body = service.register(path, f"{key}-{label}", family, methods, settings, plan.shadows)
            models[label] = body
            log(f"  service: registered {label} in {body['registration_s']:.1f}s: " + ", ".join(
                f"{m} {e['status']}" for m, e in body["unlearning"].items()) or "")  # fmt: skip
        v1 = service.client.get(f"/v1/models/{models['fast']['id']}/versions/1/weights")
        from safetensors.numpy import load as st_load

        theta_service = st_load(v1.content)["theta"]
        out["same_original"] = bool(np.array_equal(theta_service, np.asarray(theta0)))
        out["original_max_abs_diff"] = float(np.abs(theta_service - np.asarray(theta0)).max())
        out["registrations"] = {
            label: {
                "registration_s": body["registration_s"],
                "version1": service.client.get(f"/v1/models/{body['id']}/versions").json()[0]["metrics"],
                "methods": body["unlearning"],
            }
            for label, body in models.items()
        }
        model_for = {"retrain": "plain", "newton": "fast", "influence": "fast", "auto": "fast"}
        model_for.update(l2ul="l2ul", l2ul_n="l2ul_n", sisa="sisa")
        rng = np.random.default_rng(777)
        free = {label: list(rng.permutation(ds["row_ids"])) for label in models}  # rows not yet deleted
        results: dict[str, dict[str, list]] = {}
        out["reps_e2e"], out["e2e_sizes"], out["methods_not_run"] = reps_e2e, e2e_sizes, skip_methods
        if key in plan.e2e_override_reason:
            out["reduced"] = plan.e2e_override_reason[key]
        for k in e2e_sizes:
            for method in E2E_METHODS:
                if method in skip_methods:
                    continue
                runs = []
                label = model_for[method]
                for _ in range(reps_e2e):
                    rows = [str(free[label].pop()) for _ in range(k)]
                    runs.append(service.delete(models[label]["id"], rows, method))
                results.setdefault(str(k), {})[method] = runs
            r = results[str(k)]
            log(f"  service |D_f|={k}: " + "; ".join(
                f"{m} {median([x.get('e2e_s') for x in r[m]]) or float('nan'):.3f}s"
                f"{'' if all(x['status'] == 'certified' for x in r[m]) else ' (' + str(r[m][-1].get('status')) + ')'}"
                for m in E2E_METHODS if m in r))  # fmt: skip
        out["e2e"] = results
        out["after"] = {
            label: {
                m: {"status": e["status"], "reason": e.get("reason")}
                for m, e in service.client.get(f"/v1/models/{body['id']}").json()["unlearning"].items()
            }
            for label, body in models.items()
        }
    finally:
        service.close()
        import shutil

        shutil.rmtree(home, ignore_errors=True)
    return out


def e2e_summary(service: dict, k: str) -> dict[str, Any]:
    runs = service.get("e2e", {}).get(k, {})

    def done(m):
        return [r for r in runs.get(m, []) if r["status"] == "certified"]

    t_retrain = median([r["e2e_s"] for r in done("retrain")])
    out = {}
    for m in E2E_METHODS:
        ok = done(m)
        t = median([r["e2e_s"] for r in ok])
        out[m] = {
            "e2e_s": t,
            "speedup_e2e": ratio(t_retrain, t),
            "certified": len(ok),
            "asked": len(runs.get(m, [])),
            "ran": sorted({r["ran"] for r in ok}),
            "upkeep_s": median([r.get("upkeep_s") for r in ok if r.get("upkeep_s") is not None]),
            "informative_audits": sum(1 for r in ok if r.get("informative")),
            "evidence": sorted({e for r in ok for e in r.get("evidence", [])}),
            "not_completed": [
                r.get("problem") or r.get("error") or r["status"] for r in runs.get(m, []) if r["status"] != "certified"
            ],  # fmt: skip
        }
    return out


# ---------------------------------------------------------------------------------------------- report
def build_summary(settings: dict[str, dict]) -> dict[str, dict]:
    summary: dict[str, dict] = {}
    for key, res in settings.items():
        validation = {}
        fast = res.get("service", {}).get("registrations", {}).get("fast", {}).get("methods", {})
        for m in ("newton", "influence"):
            v = (fast.get(m, {}).get("info") or {}).get("validation") or {}
            validation[m] = v.get("param_ratio_median")
        regs = res.get("service", {}).get("registrations", {})
        learned_reg = {m: regs.get(m, {}).get("methods", {}).get(m, {}) for m in LEARNED}
        for m in LEARNED:
            v = (learned_reg[m].get("info") or {}).get("validation") or {}
            validation[m] = v.get("param_ratio_median") if learned_reg[m].get("status") == "ready" else None
        if "quality" not in res:
            continue
        for k, s in res["quality"]["sizes"].items():
            e2e = e2e_summary(res.get("service", {}), k) if res.get("service") else {}
            entry: dict[str, Any] = {}
            for m in METHODS:
                q = s["methods"][m]
                entry[m] = {
                    "speedup": q["speedup"],
                    "speedup_incl_upkeep": q.get("speedup_incl_upkeep", _incl_upkeep(s, m)),
                    "speedup_e2e": e2e.get(m, {}).get("speedup_e2e"),
                    "param_ratio": q["param_ratio"],
                    "acc_gap_pts": q["acc_gap_pts"],
                    "time_s": q["time_s"],
                    "e2e_s": e2e.get(m, {}).get("e2e_s"),
                    "acc_test": q["acc_test"],
                    "acc_forget": q["acc_forget"],
                }
                if m in e2e:  # why a method has no e2e figure: not asked, or refused / not completed (problem names)
                    entry[m]["e2e_upkeep_s"] = e2e[m]["upkeep_s"]
                    entry[m]["e2e_informative_audits"] = e2e[m]["informative_audits"]
                    entry[m]["e2e_evidence"] = e2e[m]["evidence"]
                    entry[m]["e2e_asked"] = e2e[m]["asked"]
                    entry[m]["e2e_not_completed"] = e2e[m]["not_completed"]
                if m in ("newton", "influence"):
                    entry[m]["upkeep_s"] = q["upkeep_s"]
                    entry[m]["validated_param_ratio"] = validation.get(m)
                if m in LEARNED:
                    entry[m]["purge_s"] = q["purge_s"]
                    entry[m]["status_in_service"] = learned_reg[m].get("status")
                    entry[m]["refused_because"] = learned_reg[m].get("reason")
                    entry[m]["validated_param_ratio"] = validation.get(m)
                    entry[m]["e2e_completed"] = e2e.get(m, {}).get("certified")
            if e2e:
                entry["auto"] = {
                    "ran": e2e["auto"]["ran"],
                    "speedup_e2e": e2e["auto"]["speedup_e2e"],
                    "e2e_s": e2e["auto"]["e2e_s"],
                    "e2e_asked": e2e["auto"]["asked"],
                }
            entry["retrain"]["time_s_sklearn"] = res["quality"]["sklearn_fit"]["seconds"]
            summary[f"{key}_{k}"] = entry
    return summary


def check_aims(summary: dict[str, dict], settings: dict) -> dict[str, Any]:
    aims: dict[str, Any] = {}
    s = summary.get("adult_lr_1")
    if s:
        aims["adult_lr_1_newton_param_ratio_le_0.01"] = {
            "value": s["newton"]["param_ratio"],
            "met": s["newton"]["param_ratio"] is not None and s["newton"]["param_ratio"] <= 0.01,
        }
        aims["adult_lr_1_newton_speedup_ge_1000"] = {
            "value": s["newton"]["speedup"],
            "met": (s["newton"]["speedup"] or 0) >= 1000,
        }
    s = summary.get("synthetic_lr_1")
    if s:
        aims["synthetic_lr_1_newton_speedup_ge_10000"] = {
            "value": s["newton"]["speedup"],
            "met": (s["newton"]["speedup"] or 0) >= 10_000,
        }
    offered = []
    for key, entry in summary.items():
        for m in ("newton", "influence", *LEARNED):
            validated = entry[m].get("validated_param_ratio")
            if validated is not None and validated <= AUTO_MAX_PARAM_RATIO:
                offered.append({"setting": key, "method": m, "validated": validated,
                                 "measured": entry[m]["param_ratio"]})  # fmt: skip
    aims["every_method_auto_may_choose_le_0.1"] = {
        "offered": offered,
        "met": all(o["measured"] is not None and o["measured"] <= AUTO_MAX_PARAM_RATIO for o in offered),
    }
    return aims


def print_table(summary: dict[str, dict], log) -> None:
    head = (
        f"{'setting':<20}{'method':<11}{'speedup':>10}{'speedup_e2e':>12}{'param_ratio':>12}{'acc_gap':>9}"
        f"{'purge_s':>9}"
    )
    log(head)
    log("-" * len(head))
    for key, entry in summary.items():
        for m in METHODS:
            e = entry[m]

            def f(v, spec):
                return format(v, spec) if v is not None else "—".rjust(len(format(1.0, spec)))

            log(
                f"{key:<20}{m:<11}{f(e['speedup'], '10.0f')}{f(e['speedup_e2e'], '12.2f')}"
                f"{f(e['param_ratio'], '12.4f')}{f(e['acc_gap_pts'], '+9.2f')}{f(e.get('purge_s'), '9.4f')}"
            )


def plot(summary: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(summary)
    fig, axes = plt.subplots(1, 2, figsize=(max(12, 0.8 * len(keys) + 6), 4.8))
    xs = np.arange(len(keys))
    width = 0.16
    for i, m in enumerate(("newton", "influence", *LEARNED, "sisa")):
        axes[0].bar(xs + i * width, [summary[k][m]["speedup"] or np.nan for k in keys], width, label=m)
        if m != "sisa":
            axes[1].bar(xs + i * width, [summary[k][m]["param_ratio"] or np.nan for k in keys], width, label=m)
    axes[0].set_yscale("log")
    axes[0].set_title("method time: speed-up over exact retrain (same run)")
    axes[1].set_yscale("log")
    axes[1].axhline(1.0, ls="--", c="k", lw=0.8)
    axes[1].axhline(AUTO_MAX_PARAM_RATIO, ls=":", c="r", lw=0.8)
    axes[1].set_title("||θ'-θr|| / ||θ-θr||  (1 = do nothing; red: auto's bar)")
    for ax in axes:
        ax.set_xticks(xs + width, keys, rotation=70, fontsize=7)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def git_commit() -> str | None:
    import subprocess

    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "app", "bench"], cwd=REPO, capture_output=True,
                               text=True, check=True)  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return None
    return head.stdout.strip() + ("+uncommitted" if dirty.stdout.strip() else "")


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def merge(paths: list[Path], out_path: Path) -> int:
    """One results file from part files run at different moments (one --only setting, Part A and/or B each): the
    settings' results side by side, and under ``parts`` each part's wall time, commit and machine load, so a reader
    knows which figures were measured together (speed-ups are always within one part: the same run)."""
    merged: dict[str, Any] = {"mode": None, "parts": [], "datasets": {}, "settings": {}, "skipped": {}, "notes": None}
    for path in paths:
        part = json.loads(path.read_text())
        if part.get("mode") == "quick" or merged["mode"] not in (None, part.get("mode")):
            raise SystemExit(f"{path}: mode {part.get('mode')!r} cannot be merged into a {merged['mode']!r} file")
        merged["mode"] = part["mode"]
        merged["plan"] = part["plan"]
        merged["notes"] = part["notes"]
        merged["skipped"].update(part.get("skipped", {}))
        merged["datasets"].update(part.get("datasets", {}))
        merged["parts"].append(
            {
                "file": path.name,
                "settings": sorted(part["settings"]),
                "part": part.get("part", "both"),
                "git_commit": part.get("git_commit"),
                "started_utc": part.get("started_utc"),
                "finished_utc": part.get("finished_utc"),
                "wall_time_s": part.get("wall_time_s"),
                "loadavg_start": part["machine"].get("loadavg_start"),
                "loadavg_end": part["machine"].get("loadavg_end"),
            }
        )
        merged["machine"] = {k: v for k, v in part["machine"].items() if not k.startswith("loadavg")}
        for key, res in part["settings"].items():
            target = merged["settings"].setdefault(key, {})
            clash = set(target) & set(res)
            if clash:
                raise SystemExit(f"{path}: {key} {sorted(clash)} is in two part files")
            target.update(res)
    # an older part's plan may have skipped a setting that a newer part ran; say which halves are missing instead
    merged["skipped"] = {k: v for k, v in merged["skipped"].items() if k not in merged["settings"]}
    merged["halves_not_run"] = {
        key: missing
        for key, res in merged["settings"].items()
        if (missing := [h for h in ("quality", "service") if h not in res])
    }
    merged["parts"].sort(key=lambda p: p["started_utc"] or "")
    merged["wall_time_s_sum"] = sum(p["wall_time_s"] or 0 for p in merged["parts"])
    merged["summary"] = build_summary(merged["settings"])
    merged["aims"] = check_aims(merged["summary"], merged["settings"])
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(merged, indent=1, default=float))
    plot(merged["summary"], out_path.with_suffix(".png"))
    print_table(merged["summary"], print)
    print(json.dumps(merged["aims"], indent=1, default=float))
    print(f"wrote {out_path} from {len(paths)} parts")
    return 0


def markdown_table(results: dict[str, Any]) -> str:
    """The README's table: a row per setting and method, a column per |D_f|, each cell "param_ratio · speed-up
    (method time) · speed-up end to end · accuracy gap", and the learned methods' purge time."""

    def f(v, spec, suffix=""):
        return format(v, spec) + suffix if v is not None else "—"

    def e2e_cell(e):
        """The e2e speed-up, else why there is none: the problems of the requests that did not complete."""
        if e.get("speedup_e2e") is not None or not e.get("e2e_not_completed"):
            return f(e.get("speedup_e2e"), ".2f", "×")
        return "/".join(sorted({str(x) for x in e["e2e_not_completed"]}))

    summary = results["summary"]
    settings: dict[str, dict[str, dict]] = {}
    for key, entry in summary.items():
        setting, k = key.rsplit("_", 1)
        settings.setdefault(setting, {})[k] = entry
    sizes = sorted({k for per in settings.values() for k in per}, key=int)
    head = " | ".join(f"\\|D_f\\| = {k}: ratio · speed-up (incl. upkeep) · e2e · gap" for k in sizes)
    lines = [f"| setting | method | {head} | purge_s |", "|---|---|" + "---|" * len(sizes) + "---:|"]
    not_run = results.get("halves_not_run", {})
    for setting, per in settings.items():
        for m in (*METHODS[:-1], "auto"):
            cells, purge = [], []
            for k in sizes:
                e = per.get(k, {}).get(m)
                if m == "auto" and "service" in not_run.get(setting, []):
                    cells.append("service half not run")
                    continue
                if e is None:
                    cells.append("")
                    continue
                if m == "auto" and e.get("e2e_asked") == 0:
                    cells.append("not run through the service")
                    continue
                if m == "auto":
                    ran = "/".join(e["ran"]) or "—"
                    cells.append(f"→ {ran} · e2e {f(e['speedup_e2e'], '.2f', '×')}")
                    continue
                ratio = "0 (reference)" if m == "retrain" else f(e["param_ratio"], ".2g")
                spec = ",.0f" if (e["speedup"] or 0) >= 10 else ".2g"
                speed = f(e["time_s"], ".3g", " s") if m == "retrain" else f(e["speedup"], spec, "×")
                if m != "retrain" and e.get("speedup_incl_upkeep") is not None:
                    up = e["speedup_incl_upkeep"]
                    speed += f" ({f(up, ',.0f' if up >= 10 else '.2g', '×')} incl. upkeep)"
                cells.append(f"{ratio} · {speed} · {e2e_cell(e)} · {f(e['acc_gap_pts'], '+.2f')}")
                if m in LEARNED:
                    purge.append(f(e.get("purge_s"), ".3f"))
            lines.append(f"| {setting} | {m} | " + " | ".join(cells) + f" | {' / '.join(purge)} |")
    if results.get("parts"):
        lines += ["", "| part | settings | half | started (UTC) | wall time | load avg (1 min) start → end | commit |",
                  "|---|---|---|---|---:|---|---|"]  # fmt: skip
        for p in results["parts"]:
            half = {"both": "A + B", "quality": "A (in process)", "service": "B (service)"}[p["part"]]
            lines.append(
                f"| {p['file']} | {', '.join(p['settings'])} | {half} | {p['started_utc']} | "
                f"{p['wall_time_s']:.0f} s | {p['loadavg_start'][0]:.1f} → {p['loadavg_end'][0]:.1f} | "
                f"{str(p['git_commit'])[:10]} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true")
    mode.add_argument("--scale", action="store_true")
    ap.add_argument("--data-dir", type=Path, default=REPO.parent / "shared" / "datasets")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--only", default="", help="comma list of <dataset>_<model> settings, e.g. adult_lr,skin_mlp")
    ap.add_argument("--no-service", action="store_true", help="skip the end-to-end part (Part B)")
    ap.add_argument(
        "--part", choices=("both", "quality", "service"), default="both", help="Part A, Part B or both (default)"
    )
    ap.add_argument(
        "--merge",
        nargs="+",
        type=Path,
        metavar="PART_JSON",
        help="combine part files (each from one --only/--part run) into --out (default bench/results/tabular.json) "
        "and its plot, with the summary and the aims over all of them; runs nothing",
    )
    ap.add_argument("--table", type=Path, metavar="JSON", help="print a results file's summary as Markdown")
    args = ap.parse_args(argv)
    if args.table:
        print(markdown_table(json.loads(args.table.read_text())))
        return 0
    if args.merge:
        return merge(args.merge, args.out or REPO / "bench" / "results" / "tabular.json")
    if args.no_service:
        args.part = "quality"
    # One thread for torch and BLAS (ours and scikit-learn alike): the 2 cores are shared with other jobs, and on a
    # busy machine torch's 2-thread pool made small ops ~16x slower. L2UL's meta-training uses both (2 processes).
    torch.set_num_threads(1)
    from threadpoolctl import threadpool_limits

    threadpool_limits(1)
    mode_name = "quick" if args.quick else "scale" if args.scale else "full"
    plan = make_plan(mode_name)
    out_path = args.out or REPO / "bench" / "results" / (
        "tabular.json" if mode_name == "full" else f"tabular_{mode_name}.json"
    )
    only = {s for s in args.only.split(",") if s}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:7.1f}s] {msg}", flush=True)

    results: dict[str, Any] = {
        "mode": mode_name,
        "part": args.part,
        "only": sorted(only),
        "git_commit": git_commit(),
        "started_utc": utc_now(),
        "plan": asdict(plan),
        "machine": {
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "cuda": torch.cuda.is_available(),
            "platform": platform.platform(),
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "loadavg_start": os.getloadavg(),
        },
        "notes": [
            "speedup = median exact-retrain wall time / median method time over the same requests (same run); the "
            "method time is the step alone, warm (newton/influence: the Guo et al. step from the prepared factor; "
            "l2ul: the forward pass; sisa: its shard retrains)",
            "speedup_e2e = median POST -> completed time of retrain / of the method, through the service on the "
            "embedded default (SQLite + in-process executor); each method on its own registration of the same table",
            "param_ratio = median over requests of ||theta' - theta_r|| / ||theta - theta_r|| (do-nothing = 1; "
            "softmax biases centred); not defined for SISA (an ensemble)",
            "acc_gap_pts = 100 * (retrain test accuracy - method test accuracy), mean over requests",
            "purge_s (l2ul) = its purge run in full on every request: dropping the units that held the rows",
            "upkeep_s (newton/influence) = what a served request also pays to keep the state purged: the residual "
            "pass, the Hessian recomputed over the retained rows, and for LR the proven bound",
            "the generated data set is marked GENERATED in datasets; timings share 2 CPU cores with other "
            "processes (see loadavg); torch and BLAS run single-threaded",
        ],
        "datasets": {},
        "settings": {},
        "skipped": {k: plan.skip_reason.get(k, "") for k in plan.skip},
    }
    settings: dict[str, dict] = {}
    for dname in plan.datasets:
        families = [
            f for f in ("lr", "mlp") if f"{dname}_{f}" not in plan.skip and (not only or f"{dname}_{f}" in only)
        ]
        if not families:
            continue
        log(f"loading {dname}")
        train, test, source = load_frame(dname, args.data_dir, plan)
        ds = encode(train, test)
        results["datasets"][dname] = {
            "source": source,
            "n_train": len(train),
            "n_test": len(test),
            "d": int(ds["X_tr"].shape[1]),
            "n_classes": ds["n_classes"],
            "generated": dname == "synthetic",
        }
        for family in families:
            key = f"{dname}_{family}"
            log(f"{key}: n={len(train)}, d={ds['X_tr'].shape[1]}")
            res: dict[str, Any] = {}
            if args.part in ("both", "quality"):
                res["quality"] = run_quality(key, family, ds, plan, log)
                theta0 = res["quality"].pop("_theta")
            else:  # the same deterministic fit Part A starts from (checked against the service's version 1)
                theta0, _ = T.fit(recipe_for(family), ds["X_tr"], ds["y_tr"], ds["n_classes"])
            if args.part in ("both", "service"):
                res["service"] = run_service(key, family, train, ds, plan, theta0, log)
            settings[key] = res
            results["settings"] = settings
            results["summary"] = build_summary(settings)
            out_path.write_text(json.dumps(results, indent=1, default=float))
    results["machine"]["loadavg_end"] = os.getloadavg()
    results["finished_utc"] = utc_now()
    results["wall_time_s"] = time.perf_counter() - t_start
    results["summary"] = build_summary(settings)
    results["aims"] = check_aims(results["summary"], settings)
    out_path.write_text(json.dumps(results, indent=1, default=float))
    if results["summary"]:
        plot(results["summary"], out_path.with_suffix(".png"))
        print_table(results["summary"], log)
        log(json.dumps(results["aims"], default=float))
    log(f"wrote {out_path} ({results['wall_time_s']:.0f}s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Tabular unlearning benchmark: original / exact retrain / SISA / L2UL / do-nothing.

    .venv/bin/python -m bench.l2ul            # full run (~15-20 min on 2 cores); writes bench/results/l2ul.{json,png}
    .venv/bin/python -m bench.l2ul --quick    # the same code on small sizes (< 2 min)
    .venv/bin/python -m bench.l2ul --scale    # bigger: 5M synthetic rows, more meta-tasks and repetitions

Data: Adult (label ``Salary``) and Skin (label ``S``) from ``--data-dir`` (default ../shared/datasets relative to the
repository root), 80/20 train/test split, plus a generated set (sklearn ``make_classification``, 1,000,000 rows,
20 features; said so in the JSON) for scale. For each data set, model (LR, MLP) and |D_f| in {1, 100, 1000}, the
same random requests (uniform over the training rows) go to every method, each starting from the original model.

Figures (per request, then averaged): test accuracy, D_f accuracy, retained-rows accuracy (on a fixed sample),
RUM's tug-of-war against retrain ToW = (1-|dAcc_f|)(1-|dAcc_r|)(1-|dAcc_test|) (notes §1.10), the parameter ratio
||theta' - theta_r|| / ||theta - theta_r|| (reported as the ratio of the request-averaged norms, plus the median of
per-request ratios, because ||theta - theta_r|| of one well-classified deleted row can be ~0 and blow up a mean of
ratios), wall times, and L2UL's speed-up = retrain time / L2UL forward time, measured on the same requests.

The L2UL privacy purge is timed on the first request of each size. Its task replenishment (re-training the dropped
meta-tasks) is run when it touches at most 20 % of the tasks and otherwise estimated as (dropped / m) x the
meta-training time, and labelled as an estimate; the other requests run the forward pass with the purge off, which
does not change theta' (the purge only affects later requests).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from app.ml import tabular as T
from app.ml.unlearning.base import TabularProblem
from app.ml.unlearning.baselines.sisa import SISA, DoNothing, SISAConfig
from app.ml.unlearning.l2ul import L2UL, L2ULConfig, Unlearner
from app.ml.unlearning.l2ul.meta import MetaSet
from app.ml.unlearning.l2ul.method import (
    ARTIFACT_KERNEL,
    ARTIFACT_META,
    ARTIFACT_STATE,
    ARTIFACT_UNLEARNER,
    _kernel_from_bytes,
)
from app.ml.unlearning.retrain import ExactRetrain
from bench.common import DATA_DIR, REPO, load_real_dataset

METHODS = ("original", "retrain", "sisa", "l2ul", "do_nothing")


@dataclass
class Plan:
    datasets: list[str]
    synthetic_rows: int
    synthetic_features: int
    max_rows: dict[str, int | None]
    sizes: list[int]
    reps: int
    m_lr: int
    m_mlp: int
    m_mlp_synthetic: int
    mlp_iter: int
    mlp_iter_synthetic: int
    retain_eval_rows: int = 20_000
    workers: int = 0
    nu_epochs: int = 400
    calibration_lr: int = 8
    calibration_mlp: int = 3
    sisa: SISAConfig = field(default_factory=SISAConfig)
    sisa_mlp: SISAConfig = field(default_factory=lambda: SISAConfig(shards=5, slices=2))


def make_plan(mode: str) -> Plan:
    if mode == "quick":
        return Plan(
            datasets=["adult", "skin", "synthetic"],
            synthetic_rows=60_000,
            synthetic_features=20,
            max_rows={"adult": 6_000, "skin": 20_000, "synthetic": None},
            sizes=[1, 100, 1000],
            reps=2,
            m_lr=40,
            m_mlp=16,
            m_mlp_synthetic=16,
            mlp_iter=40,
            mlp_iter_synthetic=30,
            retain_eval_rows=5_000,
            workers=1,
            nu_epochs=60,
        )
    if mode == "scale":
        return Plan(
            datasets=["adult", "skin", "synthetic"],
            synthetic_rows=5_000_000,
            synthetic_features=20,
            max_rows={"adult": None, "skin": None, "synthetic": None},
            sizes=[1, 100, 1000],
            reps=10,
            m_lr=1000,
            m_mlp=1000,
            m_mlp_synthetic=300,
            mlp_iter=300,
            mlp_iter_synthetic=150,
        )
    return Plan(
        datasets=["adult", "skin", "synthetic"],
        synthetic_rows=1_000_000,
        synthetic_features=20,
        max_rows={"adult": None, "skin": None, "synthetic": None},
        sizes=[1, 100, 1000],
        reps=5,
        m_lr=1000,
        m_mlp=60,
        m_mlp_synthetic=40,
        mlp_iter=100,
        mlp_iter_synthetic=40,
    )


# ---------------------------------------------------------------------------------------------- data
def load_dataset(name: str, data_dir: Path, plan: Plan, seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    if name == "synthetic":
        from sklearn.datasets import make_classification

        X, y = make_classification(
            n_samples=plan.synthetic_rows,
            n_features=plan.synthetic_features,
            n_informative=10,
            n_redundant=5,
            flip_y=0.05,
            class_sep=1.0,
            random_state=seed,
        )
        X = X.astype(np.float32)
        perm = rng.permutation(len(X))
        n_tr = int(0.8 * len(X))
        tr, te = perm[:n_tr], perm[n_tr:]
        mean, std = X[tr].mean(0), X[tr].std(0)
        X = (X - mean) / std
        source = (
            f"sklearn.datasets.make_classification(n_samples={plan.synthetic_rows}, n_features="
            f"{plan.synthetic_features}, n_informative=10, n_redundant=5, flip_y=0.05, random_state={seed}); GENERATED"
        )
        return {"X_tr": X[tr], "y_tr": y[tr], "X_te": X[te], "y_te": y[te], "n_classes": 2, "source": source}
    return load_real_dataset(name, data_dir, plan.max_rows.get(name), seed)


# ---------------------------------------------------------------------------------------------- helpers
def tow(acc: dict[str, float], ref: dict[str, float]) -> float:
    """RUM's tug-of-war (notes §1.10) on the [0, 1] scale; retrain scores 1."""
    return (
        (1 - abs(acc["forget"] - ref["forget"]))
        * (1 - abs(acc["retain"] - ref["retain"]))
        * (1 - abs(acc["test"] - ref["test"]))
    )


def accs(recipe, theta, ds, f_rows, r_eval, C) -> dict[str, float]:
    return {
        "test": T.accuracy(recipe, theta, ds["X_te"], ds["y_te"], C),
        "forget": T.accuracy(recipe, theta, ds["X_tr"][f_rows], ds["y_tr"][f_rows], C),
        "retain": T.accuracy(recipe, theta, ds["X_tr"][r_eval], ds["y_tr"][r_eval], C),
    }


def sklearn_fit_time(recipe, X, y) -> dict[str, Any]:
    from sklearn.linear_model import LogisticRegression

    out = {}
    for label, tol in (("default_tol_1e-4", 1e-4), ("tol_1e-8", 1e-8)):
        times = []
        for _ in range(3):  # best of 3: the machine is shared, the minimum is the least disturbed run
            start = time.perf_counter()
            model = LogisticRegression(C=T.sklearn_C(recipe, len(X)), tol=tol, max_iter=10_000).fit(X, y)
            times.append(time.perf_counter() - start)
        out[label] = {"seconds": min(times), "iterations": int(np.max(model.n_iter_))}
    ours = []
    for _ in range(3):
        start = time.perf_counter()
        theta = T.train(recipe, X, y, 2 if len(np.unique(y)) <= 2 else int(y.max()) + 1)
        ours.append(time.perf_counter() - start)
    out["ours_seconds"] = min(ours)
    coef = np.concatenate([model.coef_.reshape(-1), model.intercept_]) if len(model.intercept_) == 1 else None
    if coef is not None:
        out["max_abs_coef_diff_sklearn_tol_1e-8_vs_ours"] = float(np.abs(coef - theta.numpy()).max())
    return out


def mean(xs):
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return float(np.mean(xs)) if xs else None


# ---------------------------------------------------------------------------------------------- one setting
def run_setting(name: str, family: str, ds: dict, plan: Plan, log) -> dict[str, Any]:
    C = ds["n_classes"]
    X, y = ds["X_tr"], ds["y_tr"]
    n = len(X)
    synthetic = name == "synthetic"
    if family == "lr":
        recipe = T.TabularRecipe()
        m = plan.m_lr
    else:
        recipe = T.TabularRecipe(family="mlp", max_iter=plan.mlp_iter_synthetic if synthetic else plan.mlp_iter)
        m = plan.m_mlp_synthetic if synthetic else plan.m_mlp
    out: dict[str, Any] = {"dataset": name, "model": family, "n_train": n, "n_test": len(ds["y_te"]), "d": X.shape[1]}
    out["recipe"] = recipe.to_dict()
    none = np.zeros(n, bool)

    start = time.perf_counter()
    theta, solver = T.fit(recipe, X, y, C)
    out["original_train_s"] = time.perf_counter() - start
    out["original_solver"] = solver
    if family == "lr":
        out["sklearn_lbfgs_fit"] = sklearn_fit_time(recipe, X, y)
        sk = out["sklearn_lbfgs_fit"]
        log(
            f"  LR fit (best of 3) ours {sk['ours_seconds']:.3f}s, sklearn lbfgs tol 1e-4 "
            f"{sk['default_tol_1e-4']['seconds']:.3f}s, tol 1e-8 {sk['tol_1e-8']['seconds']:.3f}s"
        )

    calib = plan.calibration_lr if family == "lr" else plan.calibration_mlp
    cfg = L2ULConfig(
        m=m,
        workers=plan.workers,
        epochs=plan.nu_epochs,
        calibration_tasks=calib,
        purge_meta_tasks=False,
        purge_seeds=False,
    )
    l2ul = L2UL(cfg)
    base = TabularProblem(recipe, X, y, C, theta, ~none, none, none)
    prep = l2ul.prepare(base)
    out["l2ul_prepare"] = prep.info
    meta_time = prep.info["timings"]["total_s"]
    log(
        f"  L2UL prepare {meta_time:.1f}s (m={m}, s={prep.info['meta']['s']}); N_U held-out param ratio "
        f"{prep.info['unlearner'].get('val_param_ratio_median')}; "
        f"output scale c={prep.info['calibration']['scale']:.3f}"
    )
    artifacts = prep.artifacts

    # ablation: the paper-literal target (no 1/rho scaling), same kernel and meta-set
    abl_cfg = L2ULConfig(**{**asdict(cfg), "scale_by_forget_fraction": False})
    ks, _ = _kernel_from_bytes(artifacts[ARTIFACT_KERNEL])
    meta = MetaSet.from_bytes(artifacts[ARTIFACT_META])
    inputs, targets = L2UL(abl_cfg)._task_inputs(ks, meta, y, C)
    nu_abl = Unlearner(abl_cfg.unlearner_config(), inputs.shape[1], theta.numel())
    nu_abl.fit(inputs, targets)
    state1 = json.dumps({**json.loads(artifacts[ARTIFACT_STATE]), "output_scale": 1.0}).encode()
    abl_artifacts = {**artifacts, ARTIFACT_UNLEARNER: nu_abl.to_bytes(), ARTIFACT_STATE: state1}
    uncal_artifacts = {**artifacts, ARTIFACT_STATE: state1}
    l2ul_abl = L2UL(abl_cfg)

    sisa = SISA(plan.sisa if family == "lr" else plan.sisa_mlp)
    out["sisa_config"] = asdict(sisa.config)
    start = time.perf_counter()
    sisa_prep = sisa.prepare(base)
    out["sisa_prepare_s"] = time.perf_counter() - start
    sisa_theta0 = None

    rng = np.random.default_rng(12345)
    r_eval_all = rng.choice(n, min(plan.retain_eval_rows, n), replace=False)
    # warm-up so no method pays one-off lazy initialisation inside a timed call
    f0 = none.copy()
    f0[0] = True
    l2ul.unlearn(TabularProblem(recipe, X, y, C, theta, ~f0, f0, none, artifacts=artifacts))

    per_size = {}
    for k in plan.sizes:
        if k >= n // 10:
            continue
        rows = []
        for rep in range(plan.reps):
            f_rows = np.sort(rng.choice(n, k, replace=False))
            forget = none.copy()
            forget[f_rows] = True
            r_eval = r_eval_all[~forget[r_eval_all]]
            problem = TabularProblem(recipe, X, y, C, theta, ~forget, forget, none, artifacts=artifacts)
            rec: dict[str, Any] = {"rep": rep}
            res = ExactRetrain().unlearn(problem)
            theta_r, rec["retrain_s"] = res.theta, res.info["wall_time_s"]
            res = l2ul.unlearn(problem)
            theta_l, rec["l2ul_forward_s"], rec["l2ul_load_s"] = (
                res.theta,
                res.info["forward_time_s"],
                res.info["load_time_s"],
            )
            theta_a = l2ul_abl.unlearn(
                TabularProblem(recipe, X, y, C, theta, ~forget, forget, none, artifacts=abl_artifacts)
            ).theta
            theta_u = l2ul.unlearn(
                TabularProblem(recipe, X, y, C, theta, ~forget, forget, none, artifacts=uncal_artifacts)
            ).theta
            start = time.perf_counter()
            res = sisa.unlearn(
                TabularProblem(recipe, X, y, C, theta, ~forget, forget, none, artifacts=sisa_prep.artifacts)
            )
            rec["sisa_s"] = time.perf_counter() - start
            rec["sisa_shards_retrained"] = res.info["shards_retrained"]
            theta_s = res.theta
            if sisa_theta0 is None:
                sisa_theta0 = theta_s
            theta_d = DoNothing().unlearn(problem).theta
            thetas = {
                "original": theta,
                "retrain": theta_r,
                "sisa": theta_s,
                "l2ul": theta_l,
                "do_nothing": theta_d,
                "l2ul_unscaled": theta_a,
                "l2ul_uncalibrated": theta_u,
            }
            acc = {k_: accs(recipe, t_, ds, f_rows, r_eval, C) for k_, t_ in thetas.items()}
            rec["acc"] = acc
            rec["tow"] = {k_: tow(a_, acc["retrain"]) for k_, a_ in acc.items()}
            d0 = float((theta - theta_r).norm())
            rec["dist_do_nothing"] = d0
            rec["dist_l2ul"] = float((theta_l - theta_r).norm())
            rec["dist_l2ul_unscaled"] = float((theta_a - theta_r).norm())
            rec["dist_l2ul_uncalibrated"] = float((theta_u - theta_r).norm())
            rec["l2ul_update_norm"] = float((theta_l - theta).norm())
            if rep == 0:
                rec["purge"] = measure_purge(cfg, recipe, X, y, C, theta, forget, artifacts, meta_time, prep.info)
            rows.append(rec)
        per_size[str(k)] = summarise_size(rows, meta_time)
        s = per_size[str(k)]
        log(
            f"  |D_f|={k}: speedup {s['speedup']:.0f}x, acc gap {s['acc_gap_pts']:+.2f} pts, "
            f"param ratio {s['param_ratio']:.3f} (uncalibrated {s['param_ratio_uncalibrated']:.3f}, "
            f"unscaled {s['param_ratio_unscaled']:.3f}), "
            f"ToW l2ul {s['tow']['l2ul']:.4f} sisa {s['tow']['sisa']:.4f}"
        )
    out["sizes"] = per_size
    out["l2ul_m"] = m
    return out


def measure_purge(cfg, recipe, X, y, C, theta, forget, artifacts, meta_time, prep_info) -> dict[str, Any]:
    """Time the privacy purge of one request; replenish for real only when it re-trains <= 20 % of the tasks."""
    meta = MetaSet.from_bytes(artifacts[ARTIFACT_META])
    f_rows = np.nonzero(forget)[0]
    hit = int(meta.tasks_containing(f_rows).sum())
    replenish = hit <= 0.2 * meta.m
    pcfg = L2ULConfig(**{**asdict(cfg), "purge_meta_tasks": True, "purge_seeds": True, "replenish_tasks": replenish})
    none = np.zeros(len(X), bool)
    res = L2UL(pcfg).unlearn(TabularProblem(recipe, X, y, C, theta, ~forget, forget, none, artifacts=artifacts))
    info = res.info
    out = {
        "tasks_dropped": info["tasks_dropped"],
        "tasks_replenished": info["tasks_replenished"],
        "seeds_redrawn": info["seeds_redrawn"],
        "unlearner_refit": info["unlearner_refit"],
        "purge_time_s": info["purge_time_s"],
        "replenish_estimated": not replenish,
    }
    if not replenish:
        est = hit / meta.m * prep_info["timings"]["meta_training_s"]
        out["purge_time_s_including_estimated_replenish"] = info["purge_time_s"] + est
    else:
        out["purge_time_s_including_estimated_replenish"] = info["purge_time_s"]
    return out


def summarise_size(rows: list[dict], meta_time: float) -> dict[str, Any]:
    keys = ("original", "retrain", "sisa", "l2ul", "do_nothing", "l2ul_unscaled", "l2ul_uncalibrated")
    acc = {k: {part: mean([r["acc"][k][part] for r in rows]) for part in ("test", "forget", "retain")} for k in keys}
    # medians: on a shared machine a preempted run inflates a mean (and the longer retrain more often)
    t_retrain = float(np.median([r["retrain_s"] for r in rows]))
    t_fwd = float(np.median([r["l2ul_forward_s"] for r in rows]))
    t_sisa = float(np.median([r["sisa_s"] for r in rows]))
    d0 = mean([r["dist_do_nothing"] for r in rows])
    ratios = [r["dist_l2ul"] / r["dist_do_nothing"] for r in rows if r["dist_do_nothing"] > 0]
    out = {
        "requests": len(rows),
        "accuracy": acc,
        "tow": {k: mean([r["tow"][k] for r in rows]) for k in keys},
        "time_s": {
            "retrain": t_retrain,
            "l2ul_forward": t_fwd,
            "l2ul_load": mean([r["l2ul_load_s"] for r in rows]),
            "sisa": t_sisa,
        },
        "speedup": t_retrain / t_fwd,
        "speedup_incl_artifact_load": t_retrain / (t_fwd + float(np.median([r["l2ul_load_s"] for r in rows]))),
        "sisa_speedup_vs_retrain": t_retrain / t_sisa,
        "acc_gap_pts": 100 * (acc["retrain"]["test"] - acc["l2ul"]["test"]),
        "acc_gap_pts_do_nothing": 100 * (acc["retrain"]["test"] - acc["do_nothing"]["test"]),
        "acc_gap_pts_sisa": 100 * (acc["retrain"]["test"] - acc["sisa"]["test"]),
        "param_ratio": mean([r["dist_l2ul"] for r in rows]) / d0 if d0 else None,
        "param_ratio_median_per_request": float(np.median(ratios)) if ratios else None,
        "param_ratio_unscaled": mean([r["dist_l2ul_unscaled"] for r in rows]) / d0 if d0 else None,
        "param_ratio_uncalibrated": mean([r["dist_l2ul_uncalibrated"] for r in rows]) / d0 if d0 else None,
        "dist_theta_to_retrain": d0,
        "break_even_requests": meta_time / (t_retrain - t_fwd) if t_retrain > t_fwd else None,
        "purge": next((r["purge"] for r in rows if "purge" in r), None),
        "per_request": rows,
    }
    return out


# ---------------------------------------------------------------------------------------------- report
def print_table(summary: dict[str, dict], log) -> None:
    head = (
        f"{'setting':<22}{'speedup':>10}{'acc_gap':>9}{'p_ratio':>9}{'p_ratio~':>9}{'uncalib':>9}{'unscaled':>9}"
        f"{'ToW_l2ul':>9}{'ToW_sisa':>9}{'ToW_none':>9}{'sisa_x':>8}{'break_even':>11}{'purge_s':>9}"
    )
    log(head)
    log("-" * len(head))
    for key, s in summary.items():
        be = s["break_even_requests"]
        log(
            f"{key:<22}{s['speedup']:>10.0f}{s['acc_gap_pts']:>+9.2f}{s['param_ratio']:>9.3f}"
            f"{s['param_ratio_median']:>9.3f}{s['param_ratio_uncalibrated']:>9.3f}{s['param_ratio_unscaled']:>9.3f}"
            f"{s['tow_l2ul']:>9.4f}"
            f"{s['tow_sisa']:>9.4f}{s['tow_do_nothing']:>9.4f}{s['sisa_speedup']:>8.1f}"
            f"{(be if be is not None else float('nan')):>11.0f}{s['purge_time_s']:>9.1f}"
        )


def plot(summary: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(summary)
    fig, axes = plt.subplots(1, 3, figsize=(max(12, 0.9 * len(keys) + 6), 4.8))
    xs = np.arange(len(keys))
    axes[0].bar(xs, [summary[k]["speedup"] for k in keys], color="tab:blue")
    axes[0].set_yscale("log")
    axes[0].set_title("L2UL speed-up over retrain (forward pass)")
    axes[1].bar(xs, [summary[k]["acc_gap_pts"] for k in keys], color="tab:orange")
    axes[1].axhline(0.5, ls="--", c="k", lw=0.8)
    axes[1].axhline(-0.5, ls="--", c="k", lw=0.8)
    axes[1].set_title("test acc: retrain - L2UL (points)")
    axes[2].bar(xs, [summary[k]["param_ratio"] for k in keys], color="tab:green")
    axes[2].axhline(1.0, ls="--", c="k", lw=0.8)
    axes[2].set_yscale("log")
    axes[2].set_title("||θ'-θr|| / ||θ-θr||  (1 = do-nothing)")
    for ax in axes:
        ax.set_xticks(xs, keys, rotation=70, fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true")
    mode.add_argument("--scale", action="store_true")
    ap.add_argument("--data-dir", type=Path, default=DATA_DIR)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "l2ul.json")
    ap.add_argument("--only", default="", help="comma list of <dataset>_<model> settings to run, e.g. adult_lr")
    args = ap.parse_args(argv)
    # One thread for torch and for BLAS (numpy/scikit-learn): the 2 cores are shared with other jobs, and on a busy
    # machine torch's 2-thread pool made small ops ~16x slower. Meta-training still uses both cores (2 processes).
    torch.set_num_threads(1)
    from threadpoolctl import threadpool_limits

    threadpool_limits(1)
    mode_name = "quick" if args.quick else "scale" if args.scale else "full"
    plan = make_plan(mode_name)
    only = {s for s in args.only.split(",") if s}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:7.1f}s] {msg}", flush=True)

    results: dict[str, Any] = {
        "mode": mode_name,
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
            "speedup = median exact-retrain wall time / median L2UL forward time (mu_f + one N_U pass), same requests",
            "param_ratio = mean ||theta'-theta_r|| / mean ||theta-theta_r|| over the requests (do-nothing = 1)",
            "acc_gap_pts = 100 * (retrain test acc - L2UL test acc); positive = L2UL worse",
            "l2ul_unscaled = ablation: N_U trained on the paper-literal residual (no 1/rho scaling, no calibration)",
            "l2ul_uncalibrated = ablation: L2UL with output scale c = 1 (no full-data calibration)",
            "table columns: p_ratio = param_ratio, p_ratio~ = median of per-request ratios, sisa_x = SISA speed-up "
            "over retrain, break_even = one-off L2UL prepare time / (retrain time - L2UL forward time), purge_s = "
            "privacy purge time of one request (incl. estimated replenishment where marked)",
            "SISA theta is the concatenation of its constituents; accuracy averages their probabilities",
            "timings share 2 CPU cores with other processes; see loadavg. torch and BLAS run single-threaded "
            "(ours and scikit-learn alike); meta-training uses 2 worker processes",
        ],
        "datasets": {},
        "settings": {},
    }
    summary: dict[str, dict] = {}
    for dname in plan.datasets:
        if only and not any(s.startswith(dname + "_") for s in only):
            continue
        log(f"loading {dname}")
        ds = load_dataset(dname, args.data_dir, plan)
        results["datasets"][dname] = {
            "source": ds["source"],
            "n_train": len(ds["y_tr"]),
            "n_test": len(ds["y_te"]),
            "d": int(ds["X_tr"].shape[1]),
            "n_classes": ds["n_classes"],
            "generated": dname == "synthetic",
        }
        for family in ("lr", "mlp"):
            key = f"{dname}_{family}"
            if only and key not in only:
                continue
            log(f"{key}: n={len(ds['y_tr'])}, d={ds['X_tr'].shape[1]}")
            res = run_setting(dname, family, ds, plan, log)
            results["settings"][key] = res
            for k, s in res["sizes"].items():
                summary[f"{key}_{k}"] = {
                    "speedup": s["speedup"],
                    "speedup_incl_artifact_load": s["speedup_incl_artifact_load"],
                    "acc_gap_pts": s["acc_gap_pts"],
                    "param_ratio": s["param_ratio"],
                    "param_ratio_median": s["param_ratio_median_per_request"],
                    "param_ratio_unscaled": s["param_ratio_unscaled"],
                    "param_ratio_uncalibrated": s["param_ratio_uncalibrated"],
                    "l2ul_output_scale": res["l2ul_prepare"]["calibration"]["scale"],
                    "acc_gap_pts_do_nothing": s["acc_gap_pts_do_nothing"],
                    "acc_gap_pts_sisa": s["acc_gap_pts_sisa"],
                    "tow_l2ul": s["tow"]["l2ul"],
                    "tow_sisa": s["tow"]["sisa"],
                    "tow_do_nothing": s["tow"]["do_nothing"],
                    "sisa_speedup": s["sisa_speedup_vs_retrain"],
                    "retrain_s": s["time_s"]["retrain"],
                    "l2ul_forward_s": s["time_s"]["l2ul_forward"],
                    "meta_training_s": res["l2ul_prepare"]["timings"]["total_s"],
                    "l2ul_m": res["l2ul_m"],
                    "break_even_requests": s["break_even_requests"],
                    "purge_time_s": (s["purge"] or {}).get("purge_time_s_including_estimated_replenish", float("nan")),
                    "purge_replenish_estimated": (s["purge"] or {}).get("replenish_estimated"),
                    "requests": s["requests"],
                }
            results["summary"] = summary
            args.out.write_text(json.dumps(results, indent=1, default=float))
    results["machine"]["loadavg_end"] = os.getloadavg()
    results["wall_time_s"] = time.perf_counter() - t_start
    results["summary"] = summary
    args.out.write_text(json.dumps(results, indent=1, default=float))
    if summary:
        plot(summary, args.out.with_suffix(".png"))
        print_table(summary, log)
    log(f"wrote {args.out} ({results['wall_time_s']:.0f}s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

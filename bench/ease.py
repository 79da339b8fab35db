"""EASE benchmark on the synthetic federated CLIP: client, class and sample deletion against the retrain reference.

    .venv/bin/python -m bench.ease            # full: 5 clients × 200 pairs, 20 rounds (2 CPU cores, < 15 min)
    .venv/bin/python -m bench.ease --quick    # the same code on smaller sizes (< 3 min with a warm cache)
    .venv/bin/python -m bench.ease --scale 4  # 4× the data per client and test set (for a GPU)

For each scenario it trains nothing new except what each method itself costs: the original federation (FedAvg with
LoRA) is trained once, then every method unlearns from the same state. It reports forget / retain / test R@1 (mean
of image→text and text→image, in points; forget and retain sets are retrieved against a gallery that also holds the
held-out test pairs, see app/ml/verification/retrieval.py) of the original, retrain, EASE, the baselines and the
ablations; wall time and bytes relative to retrain; and the re-anchoring test: further FedAvg rounds of the retained
data after unlearning, with and without the forget lock (plot in bench/results/ease_relearn.png).

It first prints the gap between the original and retrain forget R@1: without a clear gap no method can show forgetting.
Results: bench/results/ease.json (every figure, and a ``summary`` keyed by scenario).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

from app.ml.clip import ClipLoRA
from app.ml.data.captions import CaptionDataset
from app.ml.federation import DemoFederation, FederatedProblem, FedSettings, make_demo_federation
from app.ml.unlearning.base import UnlearningResult, get_method
from app.ml.unlearning.ease import EaseConfig, ForgetLock
from app.ml.verification.retrieval import evaluate_retrieval

RESULTS = Path(__file__).parent / "results"


@dataclasses.dataclass(frozen=True)
class Sizes:
    n_clients: int = 5
    pairs_per_client: int = 200
    n_test: int = 300
    rounds: int = 20
    relearn_rounds: int = 10


FULL = Sizes()
QUICK = Sizes(n_clients=5, pairs_per_client=60, n_test=100, rounds=8, relearn_rounds=3)


def evaluate(model: ClipLoRA, theta: torch.Tensor, problem: FederatedProblem, test: CaptionDataset) -> dict[str, Any]:
    """Forget / retain / test R@1 (points) of θ. Forget and retain galleries include the test pairs as distractors."""
    model.set_theta(theta)
    forget = problem.forget_data()
    retain = CaptionDataset.concat([d for d in problem.retained_datasets() if len(d)])
    out = {
        "forget": evaluate_retrieval(model, forget, test).to_dict(),
        "retain": evaluate_retrieval(model, retain, test).to_dict(),
        "test": evaluate_retrieval(model, test).to_dict(),
    }
    return {**{f"{k}_r1": round(v["mean_r1"], 2) for k, v in out.items()}, "detail": out}


def run_method(name: str, settings: dict[str, Any], problem: FederatedProblem) -> tuple[UnlearningResult, float]:
    """Run one method; returns its result and wall seconds (CPU seconds of this process go to ``result.info``).

    CPU time is recorded too because the wall time of a shared 2-core machine depends on what else runs.
    """
    start, cpu = time.perf_counter(), time.process_time()
    result = get_method(name).build(settings).unlearn(problem)
    result.info["cpu_seconds"] = time.process_time() - cpu
    return result, time.perf_counter() - start


def relearn(
    problem: FederatedProblem,
    theta: torch.Tensor,
    rounds: int,
    lock: ForgetLock | None,
    test: CaptionDataset,
    round_offset: int,
) -> list[float]:
    """Forget R@1 after each of ``rounds`` further FedAvg rounds of the retained data (with or without the lock)."""
    model = problem.get_model()
    fed = problem.federation()
    curve = []
    for r in range(rounds):
        res = fed.run_round(
            theta,
            problem.retained_clients(),
            round_index=round_offset + r,
            projection=lock.project if lock is not None else None,
            penalty=lock.penalty if lock is not None else None,
        )
        theta = res.theta
        model.set_theta(theta)
        curve.append(round(evaluate_retrieval(model, problem.forget_data(), test).mean_r1, 2))
    return curve


ABLATIONS: dict[str, dict[str, Any]] = {
    "ease_image_only": {"excision_towers": ["image"]},
    "ease_text_only": {"excision_towers": ["text"]},
    "ease_gsd_whole": {"gsd": "whole"},
    "ease_no_excision": {"excision_steps": 0},
    "ease_no_gsd": {"gsd": "none"},
}


def run_scenario(
    demo: DemoFederation,
    scope: str,
    sizes: Sizes,
    ease_settings: dict[str, Any],
    do_relearn: bool,
    log: Any,
) -> dict[str, Any]:
    problem = demo.problem(scope)
    model = problem.get_model()
    test = demo.data.test
    rows: dict[str, dict[str, Any]] = {}
    rows["original"] = {**evaluate(model, demo.theta, problem, test), "seconds": 0.0, "cpu_seconds": 0.0, "bytes": 0}

    rt, rt_s = run_method("fed_retrain", {}, problem)
    rows["retrain"] = {
        **evaluate(model, rt.theta, problem, test),
        "seconds": rt_s,
        "cpu_seconds": rt.info["cpu_seconds"],
        "bytes": rt.info["bytes_total"],
    }
    gap = rows["original"]["forget_r1"] - rows["retrain"]["forget_r1"]
    log(
        f"[{scope}] forget R@1: original {rows['original']['forget_r1']:.1f} vs retrain "
        f"{rows['retrain']['forget_r1']:.1f} → gap {gap:+.1f} pts"
        + ("" if gap >= 5 else "  (WARNING: too small a gap to show forgetting)")
    )

    methods: list[tuple[str, str, dict[str, Any]]] = [
        ("ease", "ease", ease_settings),
        ("gradient_ascent", "fed_gradient_ascent", {}),
        ("federaser", "federaser", {}),
        ("fedosd", "fedosd", {}),
    ] + [(label, "ease", {**ease_settings, **extra}) for label, extra in ABLATIONS.items()]
    results: dict[str, UnlearningResult] = {}
    for label, name, settings in methods:
        res, secs = run_method(name, settings, problem)
        results[label] = res
        rows[label] = {
            **evaluate(model, res.theta, problem, test),
            "seconds": secs,
            "cpu_seconds": res.info["cpu_seconds"],
            "bytes": res.info["bytes_total"],
        }
        if label == "ease":
            rows[label]["info"] = res.info
        log(
            f"[{scope}] {label:18s} forget {rows[label]['forget_r1']:5.1f} retain {rows[label]['retain_r1']:5.1f} "
            f"test {rows[label]['test_r1']:5.1f}  {secs:6.1f}s"
        )
    rt_cpu = rows["retrain"]["cpu_seconds"]
    for row in rows.values():
        row["time_ratio"] = round(row["seconds"] / rt_s, 4) if rt_s else None
        row["cpu_time_ratio"] = round(row["cpu_seconds"] / rt_cpu, 4) if rt_cpu else None
        row["bytes_ratio"] = round(row["bytes"] / rows["retrain"]["bytes"], 4) if rows["retrain"]["bytes"] else None

    ease = rows["ease"]
    summary = {
        "original_forget_gap_pts": round(gap, 2),
        "forget_r1_gap_pts": round(abs(ease["forget_r1"] - rows["retrain"]["forget_r1"]), 2),
        "retain_r1_drop_pts": round(rows["retrain"]["retain_r1"] - ease["retain_r1"], 2),
        "test_r1_drop_pts": round(rows["retrain"]["test_r1"] - ease["test_r1"], 2),
        "time_ratio": ease["time_ratio"],
        "cpu_time_ratio": ease["cpu_time_ratio"],
        "bytes_ratio": ease["bytes_ratio"],
        "bytes_ratio_with_lock_broadcast": round(
            (ease["bytes"] + ease["info"]["lock_broadcast_bytes"]) / rows["retrain"]["bytes"], 4
        ),
    }
    out: dict[str, Any] = {"methods": rows, "summary": summary}

    if do_relearn:
        lock = ForgetLock.from_bytes(results["ease"].artifacts["forget_lock"])
        n = sizes.relearn_rounds
        offset = 50_000
        curves = {
            "retrain": relearn(problem, rt.theta, n, None, test, offset),
            "ease_lock": relearn(problem, results["ease"].theta, n, lock, test, offset),
            "ease_no_lock": relearn(problem, results["ease"].theta, n, None, test, offset),
        }
        curves["original"] = [rows["original"]["forget_r1"]] * n
        lock_gap = max(abs(a - b) for a, b in zip(curves["ease_lock"], curves["retrain"], strict=True))
        nolock_gap = max(abs(a - b) for a, b in zip(curves["ease_no_lock"], curves["retrain"], strict=True))
        static = rows["retrain"]["forget_r1"]
        out["relearn"] = {
            "rounds": n,
            "forget_r1_per_round": curves,
            "reference": "retrain continued with the same further rounds of the retained data",
            "lock_max_gap_pts": round(lock_gap, 2),
            "nolock_max_gap_pts": round(nolock_gap, 2),
            "lock_max_gap_vs_static_retrain_pts": round(max(abs(a - static) for a in curves["ease_lock"]), 2),
            "nolock_max_gap_vs_static_retrain_pts": round(max(abs(a - static) for a in curves["ease_no_lock"]), 2),
        }
        summary["lock_max_gap_pts"] = out["relearn"]["lock_max_gap_pts"]
        summary["nolock_max_gap_pts"] = out["relearn"]["nolock_max_gap_pts"]
        log(f"[{scope}] relearn forget R@1 per round: " + json.dumps(curves))
    return out


def plot_relearn(relearn_data: dict[str, Any], path: Path, original: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = relearn_data["forget_r1_per_round"]
    xs = list(range(1, relearn_data["rounds"] + 1))
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot(xs, curves["retrain"], "k-o", label="retrain (continued)")
    ax.plot(xs, curves["ease_lock"], "-s", color="tab:blue", label="EASE with forget lock")
    ax.plot(xs, curves["ease_no_lock"], "--^", color="tab:red", label="EASE without lock")
    ax.axhline(original, color="gray", ls=":", label="original model")
    ax.set_xlabel("further FedAvg round (retained clients)")
    ax.set_ylabel("forget R@1 (points)")
    ax.set_title("Re-anchoring after client unlearning")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_table(report: dict[str, Any]) -> None:
    for scope, sc in report["scenarios"].items():
        print(f"\n== {scope} ==")
        print(f"{'method':20s} {'forget':>7s} {'retain':>7s} {'test':>7s} {'time×':>7s} {'cpu×':>7s} {'bytes×':>7s}")
        for name, row in sc["methods"].items():
            tr, cr, br = (
                "" if row[k] is None else f"{row[k]:.3f}" for k in ("time_ratio", "cpu_time_ratio", "bytes_ratio")
            )
            print(
                f"{name:20s} {row['forget_r1']:7.1f} {row['retain_r1']:7.1f} {row['test_r1']:7.1f} "
                f"{tr:>7s} {cr:>7s} {br:>7s}"
            )
    print("\n== summary (aims: forget gap ≤ 2, retain drop ≤ 3, time/bytes ≤ 0.10, lock gap ≤ 2) ==")
    keys = [
        "original_forget_gap_pts",
        "forget_r1_gap_pts",
        "retain_r1_drop_pts",
        "time_ratio",
        "cpu_time_ratio",
        "bytes_ratio",
        "lock_max_gap_pts",
        "nolock_max_gap_pts",
    ]
    print(f"{'scenario':10s} " + " ".join(f"{k[:18]:>18s}" for k in keys))
    for scope, s in report["summary"].items():
        print(f"{scope:10s} " + " ".join(f"{s.get(k, float('nan')):18.3f}" for k in keys))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller sizes (same code), under three minutes")
    ap.add_argument("--scale", type=int, default=1, help="multiply pairs per client and the test set")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scenarios", default="client,class,samples")
    ap.add_argument("--ease", default="{}", help="JSON overrides of EaseConfig")
    ap.add_argument("--no-relearn", action="store_true")
    ap.add_argument("--out", type=Path, default=None, help="results JSON (default bench/results/ease[_quick].json)")
    ap.add_argument("--cache-dir", default=None, help="pretraining/federation cache (default ~/.cache/lethe)")
    ap.add_argument(
        "--threads", type=int, default=1, help="torch intra-op CPU threads (tiny ops gain nothing from more; 0 = keep)"
    )
    args = ap.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)

    sizes = QUICK if args.quick else FULL
    if args.scale > 1:
        sizes = dataclasses.replace(
            sizes, pairs_per_client=sizes.pairs_per_client * args.scale, n_test=sizes.n_test * args.scale
        )
    ease_settings = {**json.loads(args.ease)}
    EaseConfig(**ease_settings)  # validate early
    start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - start:7.1f}s] {msg}", flush=True)

    log(f"building the federation: {sizes}")
    demo = make_demo_federation(
        seed=args.seed,
        n_clients=sizes.n_clients,
        pairs_per_client=sizes.pairs_per_client,
        n_test=sizes.n_test,
        fed_settings=FedSettings(rounds=sizes.rounds, seed=args.seed),
        cache_dir=args.cache_dir,
        cache_training=True,
        progress=lambda f, m: None,
    )
    log(f"federation ready (p = {demo.model.num_params} LoRA parameters, device {demo.model.device})")
    report: dict[str, Any] = {
        "sizes": dataclasses.asdict(sizes),
        "seed": args.seed,
        "quick": args.quick,
        "scale": args.scale,
        "ease_config": dataclasses.asdict(EaseConfig(**ease_settings)),
        "fed_settings": dataclasses.asdict(demo.fed_settings),
        "device": str(demo.model.device),
        "machine": {
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "platform": platform.platform(),
            "torch_threads": torch.get_num_threads(),
        },
        "scenarios": {},
        "summary": {},
    }
    for scope in [s.strip() for s in args.scenarios.split(",") if s.strip()]:
        sc = run_scenario(
            demo, scope, sizes, ease_settings, do_relearn=scope == "client" and not args.no_relearn, log=log
        )
        report["scenarios"][scope] = sc
        report["summary"][scope] = sc["summary"]
    report["wall_seconds"] = round(time.perf_counter() - start, 1)
    out = args.out or RESULTS / ("ease_quick.json" if args.quick else "ease.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    if "client" in report["scenarios"] and "relearn" in report["scenarios"]["client"]:
        png = out.with_name(out.stem.replace("ease", "ease_relearn") + ".png")
        plot_relearn(
            report["scenarios"]["client"]["relearn"],
            png,
            report["scenarios"]["client"]["methods"]["original"]["forget_r1"],
        )
    print_table(report)
    log(f"wrote {out}")
    return report


if __name__ == "__main__":
    main()

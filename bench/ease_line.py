"""EASE's excision line scanned on the tuning seeds: what a control on the probe split can and cannot reach (issue 24).

    .venv/bin/python -m bench.ease_line --scenario class              # tuning seeds 0, 1, 100–105
    .venv/bin/python -m bench.ease_line --scenario samples
    .venv/bin/python -m bench.ease_line --scenario class --ease '{"repair_epochs": 3}'
    .venv/bin/python -m bench.ease_line --quick                       # smaller sizes, seeds 0 and 1
    .venv/bin/python -m bench.ease_line --scenario class --sizes '{"n_test": 900, "pairs_per_client": 400}' --tag big

For each seed, EASE's line θ_p + s·E + Δ_rep (method.py step 4: what the strength search moves along) is measured
at a grid of scales on both splits — the probe split (the forget pairs and gallery half the control sees) and the
held-out split (what bench.ease scores) — beside retraining (and retraining with another data order) and version 1
on both splits. From that grid, without rerunning the search, it reads off where a control that matched a level on
the probe split would land — strength.search_scale itself, with EASE's band, first scale and probe budget, its probes
read off the scan by linear interpolation, and capped at the grid's largest scale (4; the service's cap is
``scale_max``, 16) —: with version 1's level as the target (the class default; for samples the default runs at the
fixed scale 1, the ``fixed_1`` row, and this row is ``target="reference"``), with retraining's own probe level (an
oracle), and every fixed scale. The held-out level and the retained R@1 at a chosen scale between two grid points
are interpolated too, not measured. The figures are |forget R@1 − retrain| on the held-out split and the retained
drop, means over seeds; ``probe_transfer_pts`` is retraining's own |probe level − held-out level|. Settings the
scan does not mirror (a fixed strength, ``excision_norm``, ``repair_at_scale``) are refused.

``--grid``: the scales scanned (default GRID; a finer grid where the line is steep, e.g. between 0.5 and 1).

``--sizes``: bench.ease's ``Sizes`` fields to change (a larger class and gallery: does the probe split then resolve
retraining's level?); the results file records them.

Seeds: the tuning seeds only (0, 1, 100–105) by default: this is where settings are chosen, and bench.ease reports
2–11 (bench/ease.py). Results: bench/results/item3/line_<scenario>[_<tag>].json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from app.ml.clip import pretrain_tiny_clip
from app.ml.federation.accounting import Ledger
from app.ml.unlearning.base import get_method
from app.ml.unlearning.ease import EaseConfig
from app.ml.unlearning.ease.method import ProbeJudge
from app.ml.unlearning.ease.strength import search_scale
from bench.ease import FULL, QUICK, build, evaluate, git_commit, other_order, run_method, scenario_problem

RESULTS = Path(__file__).parent / "results" / "item3"
TUNING_SEEDS = (0, 1, 100, 101, 102, 103, 104, 105)
GRID = (0.0, 0.5, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0)
REGIME = {"class": "concepts", "samples": "subject"}


def scan(
    seed: int,
    scenario: str,
    sizes: Any,
    settings: dict[str, Any],
    cache_dir: str | None,
    grid: tuple[float, ...] = GRID,
) -> dict[str, Any]:
    """One seed: the levels of version 1, retraining (two data orders) and the line at every grid scale, on both
    splits (probe: ProbeJudge, as the control measures; held-out: bench.ease.evaluate, as the benchmark scores)."""
    demo = build(seed, sizes, REGIME[scenario], cache_dir)
    problem, gallery = scenario_problem(demo, scenario, sizes.probe_fraction)
    model = problem.get_model()
    judge = ProbeJudge(problem, model, Ledger())

    def both(theta: torch.Tensor) -> dict[str, float]:
        held = evaluate(model, theta, problem, gallery)
        return {"probe": round(judge.level(theta), 3), "held": held["forget_r1"], "retain": held["retain_r1"]}

    out: dict[str, Any] = {
        "version_1": both(problem.theta_init),
        "original": both(problem.theta),
        "retrain": both(run_method("fed_retrain", {}, problem)[0].theta),
        "retrain_other_order": both(run_method("fed_retrain", {}, other_order(problem))[0].theta),
    }
    line = get_method("ease").build(settings).line(problem, Ledger())
    out["line"] = [{"scale": s, **both(line.at(s))} for s in grid]
    return out


def controlled(line: list[dict[str, float]], target: float, cfg: EaseConfig) -> float:
    """The scale strength.search_scale would choose on the scanned line with EASE's band, first scale and probe
    budget (its probes read off the scan by linear interpolation instead of measured)."""
    scales = [p["scale"] for p in line]
    levels = [p["probe"] for p in line]

    def response(s: float) -> float:
        return float(np.interp(s, scales, levels))

    start, top = cfg.excision_scale, min(cfg.scale_max, scales[-1])
    return search_scale(response, target, cfg.target_band, start=start, scale_max=top, max_probes=cfg.max_probes).scale


def crossing(r: dict[str, Any]) -> float:
    """The scale (to 1/200 of the grid) whose interpolated held-out forget level lies nearest retraining's."""
    scales, held = [p["scale"] for p in r["line"]], [p["held"] for p in r["line"]]
    fine = np.linspace(scales[0], scales[-1], 201)
    return float(fine[np.argmin(np.abs(np.interp(fine, scales, held) - r["retrain"]["held"]))])


def summarise(per_seed: dict[str, dict[str, Any]], cfg: EaseConfig) -> dict[str, Any]:
    """|forget R@1 − retrain| (held-out) and retained drop, means over seeds, for each way of choosing the scale."""

    def at(line: list[dict[str, float]], s: float, key: str) -> float:
        return float(np.interp(s, [p["scale"] for p in line], [p[key] for p in line]))

    def row(choose) -> dict[str, float]:
        gaps, signed, drops = [], [], []
        for r in per_seed.values():
            s = choose(r)
            d = at(r["line"], s, "held") - r["retrain"]["held"]
            gaps.append(abs(d))
            signed.append(d)
            drops.append(r["retrain"]["retain"] - at(r["line"], s, "retain"))
        return {
            "forget_r1_gap_pts": round(float(np.mean(gaps)), 2),
            "forget_r1_signed_gap_pts": round(float(np.mean(signed)), 2),
            "retain_r1_drop_pts": round(float(np.mean(drops)), 2),
        }

    rows = {
        "version_1_target": row(lambda r: controlled(r["line"], r["version_1"]["probe"], cfg)),
        "oracle_target": row(lambda r: controlled(r["line"], r["retrain"]["probe"], cfg)),
        # no rule beats this on the line: the scale where the held-out level comes nearest retraining's (an oracle on
        # the scored split itself; its retained drop is what the line costs at retraining's level)
        "crossing": row(crossing),
    }
    for s in (p["scale"] for p in next(iter(per_seed.values()))["line"]):  # the grid the scan ran
        rows[f"fixed_{s:g}"] = row(lambda r, s=s: s)

    def mean_abs(a: str, key_a: str, b: str, key_b: str) -> float:
        return round(float(np.mean([abs(r[a][key_a] - r[b][key_b]) for r in per_seed.values()])), 2)

    return {
        "rows": rows,
        "retrain_noise_pts": mean_abs("retrain_other_order", "held", "retrain", "held"),
        "probe_transfer_pts": mean_abs("retrain", "probe", "retrain", "held"),
        "version_1_floor_pts": mean_abs("version_1", "held", "retrain", "held"),
    }


def _fits(default: Any, value: Any) -> bool:
    """A ``--sizes`` value of its field's type (JSON writes a whole float as an int; a bool is not an int here)."""
    if isinstance(value, bool) or isinstance(default, bool):
        return isinstance(value, bool) and isinstance(default, bool)
    return isinstance(value, type(default)) or (isinstance(default, float) and isinstance(value, int))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", choices=sorted(REGIME), default="class")
    ap.add_argument("--seeds", default=None, help="comma-separated (default: the tuning seeds 0,1,100-105)")
    ap.add_argument("--ease", default="{}", help="EASE settings as JSON (default: EaseConfig's defaults)")
    ap.add_argument("--sizes", default="{}", help="bench.ease Sizes fields to change, as JSON (default: none)")
    ap.add_argument("--tag", default="", help="suffix of the results file")
    ap.add_argument("--grid", default=None, help="comma-separated scales from 0, ascending (default: GRID)")
    ap.add_argument("--quick", action="store_true", help="bench.ease's quick sizes and seeds 0, 1")
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    sizes = QUICK if args.quick else FULL
    resized = json.loads(args.sizes)
    if not isinstance(resized, dict):
        ap.error("--sizes takes a JSON object of Sizes fields")
    # fields the scan never reads (its seeds are --seeds; no baselines, ablations, re-anchoring or verdicts run here)
    unread = {"seeds", "baselines", "ablations", "relearn_rounds", "relearn_orders", "verdict"}
    unknown = set(resized) - ({f.name for f in dataclasses.fields(sizes)} - unread)
    if unknown:
        ap.error(f"--sizes: {sorted(unknown)} are not Sizes fields the scan reads")
    wrong = [k for k, v in resized.items() if not _fits(getattr(sizes, k), v)]
    if wrong:
        ap.error(f"--sizes: {sorted(wrong)} need the type of their default")
    try:
        grid = tuple(float(x) for x in args.grid.split(",")) if args.grid else GRID
    except ValueError:
        ap.error(f"--grid: {args.grid!r} is not a comma-separated list of numbers")
    if grid[0] != 0 or any(b <= a for a, b in zip(grid, grid[1:], strict=False)):
        ap.error("--grid: scales from 0, strictly ascending")
    if (resized or grid != GRID) and not args.tag:
        ap.error("--sizes and --grid need --tag: the default results file is not overwritten by another scan")
    sizes = dataclasses.replace(sizes, **resized)
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else ([0, 1] if args.quick else list(TUNING_SEEDS))
    settings = json.loads(args.ease)
    unmirrored = {k for k in ("strength", "excision_norm", "repair_at_scale") if k in settings}
    if unmirrored:
        ap.error(f"the scan does not mirror {sorted(unmirrored)}: it scans the line and simulates the adaptive search")
    pretrain_tiny_clip(cache_dir=args.cache_dir)
    start = time.perf_counter()
    per_seed: dict[str, dict[str, Any]] = {}
    for seed in seeds:
        per_seed[str(seed)] = scan(seed, args.scenario, sizes, settings, args.cache_dir, grid)
        r = per_seed[str(seed)]
        print(
            f"seed {seed}: version 1 {r['version_1']['probe']:.1f}/{r['version_1']['held']:.1f}, retrain "
            f"{r['retrain']['probe']:.1f}/{r['retrain']['held']:.1f} (probe/held-out); line "
            + " ".join(f"{p['scale']:g}:{p['probe']:.0f}/{p['held']:.0f}" for p in r["line"]),
            flush=True,
        )
    summary = summarise(per_seed, EaseConfig(**settings))
    print(
        f"\n{args.scenario}, {len(seeds)} seeds: retrain noise {summary['retrain_noise_pts']:.2f}, retrain |probe − "
        f"held-out| {summary['probe_transfer_pts']:.2f}, |version 1 − retrain| (held-out) "
        f"{summary['version_1_floor_pts']:.2f}"
    )
    for label, row in summary["rows"].items():
        print(
            f"  {label:18s} |gap| {row['forget_r1_gap_pts']:6.2f} (signed {row['forget_r1_signed_gap_pts']:+6.2f})"
            f"  retain drop {row['retain_r1_drop_pts']:6.2f}"
        )
    report = {
        "scenario": args.scenario,
        "seeds": seeds,
        "quick": args.quick,
        "ease_settings": settings,
        "sizes": dataclasses.asdict(sizes),
        "grid": list(grid),
        "summary": summary,
        "per_seed": per_seed,
        "run": {"wall_seconds": round(time.perf_counter() - start, 1), **git_commit()},
    }
    name = f"line_{args.scenario}{'_' + args.tag if args.tag else ''}{'_quick' if args.quick else ''}.json"
    out = args.out or RESULTS / name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")
    return report


if __name__ == "__main__":
    main()

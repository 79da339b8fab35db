"""The federated verdict's reference: the registration shadows against the deletion's own reference.

    .venv/bin/python -m bench.clip_reference            # seeds 2–11 × {client, class, samples}
    .venv/bin/python -m bench.clip_reference --quick    # seed 2, client: the same code in a few minutes
    .venv/bin/python -m bench.clip_reference --seeds 0,1 --out bench/results/clip_reference_tuning.json

bench.ease's federations and methods, the same seeds (2–11; the reference and its null were chosen on tuning seeds 0 and
1 — README "Stop 46" — and nothing here is tuned). For every deletion the forget excess of each method's θ′
(clip_evidence.excess: the audited forget pairs' shadow-standardised LiRA statistic minus the verifier's non-members')
is measured against two OUT references: the model's registration shadows (random halves: each forget pair's OUT runs
trained on about half of its own client, class or subject), and the deletion's reference that the worker trains before
its verdict (clip_shadows.shadows_without: the recipe retrained on what remains, one run per shadow, each with its own
data order — since stop 47 run 0 in the recipe's, exact retraining itself, so that ``retrain`` and
``retrain_as_approximate`` are in its sample and retraining with another order is the calibration —), with that
reference's own leave-one-out draws of E (clip_evidence.null_excess: the verdict's null). A reference is calibrated when
exact retraining — and retraining with another data order, judged as an approximate method, i.e. what a perfect
approximate method would hand in — lands within the null, and informative when doing nothing lands far above. Then the
service's verdict (clip_verdict.federated_verdict via bench.ease.verdict_of, default policy) against the deletion's
reference, for every row; the registration reference's verdicts on the same rows are
bench/results/ease_stop44.json's (stop 44's run, same seeds, same code for the methods: the forget R@1 of every row is
compared to check the θ′ are the same).

Rows: version 1 (θ₀) and the original (E only), ``retrain`` (exact: the verifier replays the recipe where the excess
does not decide), ``retrain_as_approximate`` (the same θ′ judged as an approximate method: no replay),
``retrain_other_order`` (judged as approximate), ``ease`` (defaults), the baselines gradient ascent, FedOSD and
FedEraser. Results: bench/results/clip_reference.json (``--quick``: clip_reference_quick.json), written after every
seed (``partial`` until the last).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from app.ml.data.captions import CaptionDataset
from app.ml.verification.clip_evidence import excess, split_reference
from app.ml.verification.clip_shadows import ClipShadowSet, audit_clip_deletion, pair_phi
from app.ml.verification.clip_verdict import audited_positions, deletion_retrieval
from bench import ease

RESULTS = Path(__file__).resolve().parent / "results"
SCENARIOS = ("client", "class", "samples")
REGIME = {"client": "concepts", "class": "concepts", "samples": "subject"}
ROWS = (
    ("retrain", "fed_retrain", True),
    ("retrain_other_order", "fed_retrain", False),
    ("ease", "ease", False),
    ("gradient_ascent", "fed_gradient_ascent", False),
    ("fedosd", "fedosd", False),
    ("federaser", "federaser", False),
)


def signed_excess(
    model: Any, shadows: ClipShadowSet, forget: CaptionDataset, held: list[int], nonmembers: CaptionDataset, thetas
) -> dict[str, list[float]]:
    """[E, SE] of each θ against one OUT reference, on the same audited pairs (the shadows' φ computed once), and the
    reference's own leave-one-out draws of E (clip_evidence.null_excess; None for the registration set)."""
    audited = CaptionDataset.concat([forget, nonmembers])
    shadow_phi = np.stack([pair_phi(model, th, audited) for th in shadows.thetas])
    out, null = {}, None
    for name, theta in thetas.items():
        _, scores = audit_clip_deletion(
            shadows, model, forget, held, nonmembers, thetas["original"], theta, shadow_phi=shadow_phi
        )
        e, se = excess(scores, "unlearned")
        out[name] = [round(e, 3), round(se, 3)]
        null = scores.null_excess
    return out, None if null is None else [round(float(v), 3) for v in null]


def run_scenario(demo: Any, scenario: str, registration: ClipShadowSet, cache_dir: str | None, log) -> dict:
    problem, gallery = ease.scenario_problem(demo, scenario)
    model = problem.get_model()
    reference = ease.reference_for(demo, problem, registration, cache_dir, log)
    results, thetas = {}, {"version_1": problem.theta_init, "original": problem.theta}
    for label, name, _ in ROWS:
        prob = ease.other_order(problem) if label == "retrain_other_order" else problem
        results[label], _ = ease.run_method(name, {}, prob)
        thetas[label] = results[label].theta
    # the pairs every row's E is measured on: the held-out forget pairs (those no strength control measured)
    ids = [pid for c in problem.clients for pid in c.ids]
    positions = np.flatnonzero(np.concatenate(problem.forget_masks)).tolist()
    held, _ = audited_positions(problem, ids, positions, True)
    forget = CaptionDataset.concat(problem.clients).subset(held)
    nonmembers = split_reference(demo.data.heldout if demo.data.heldout is not None else demo.data.test)[1]
    rows: dict[str, dict[str, Any]] = {
        name: {"forget_r1": ease.evaluate(model, theta, problem, gallery)["forget_r1"]}
        for name, theta in thetas.items()
    }
    null_draws = None
    for ref_name, shadows in (("registration", registration), ("reference", reference)):
        excesses, draws = signed_excess(model, shadows, forget, held, nonmembers, thetas)
        null_draws = draws if ref_name == "reference" else null_draws
        for name, value in excesses.items():
            rows[name][f"excess_{ref_name}"] = value
    before = deletion_retrieval(model, problem, problem.theta)
    judged = [(label, results[label], exact) for label, _, exact in ROWS]
    judged.append(("retrain_as_approximate", results["retrain"], False))
    rows["retrain_as_approximate"] = dict(rows["retrain"])  # the same θ′ and figures, judged without the replay
    for label, res, exact in judged:
        rows[label]["verdict"] = v = ease.verdict_of(problem, model, reference, nonmembers, res, exact, before)
        log(
            f"[{scenario}] {label:22s} R@1 {rows[label]['forget_r1']:5.1f}  E registration "
            f"{rows[label]['excess_registration'][0]:+.2f}  reference {rows[label]['excess_reference'][0]:+.2f}"
            f"  verdict {v['verdict']} {v['failed']}"
        )
    for name in ("version_1", "original"):
        log(
            f"[{scenario}] {name:22s} R@1 {rows[name]['forget_r1']:5.1f}  E registration "
            f"{rows[name]['excess_registration'][0]:+.2f}  reference {rows[name]['excess_reference'][0]:+.2f}"
        )
    spread = None if not null_draws else round(float(np.sqrt(np.mean(np.square(null_draws)))), 3)
    log(f"[{scenario}] the reference runs' own draws of E {null_draws} (root mean square {spread})")
    return {
        "rows": rows,
        "n_audited": len(held),
        "n_nonmembers": len(nonmembers),
        "null_draws": null_draws,
        "null_spread": spread,
    }


def summarise(per_seed: dict[str, dict[str, Any]], scenarios: list[str]) -> dict[str, Any]:
    """Per scenario and row: mean E against each reference, mean |forget R@1 − retrain's|, certified seeds."""
    out: dict[str, Any] = {}
    for scenario in scenarios:
        seeds = [s for s in per_seed if scenario in per_seed[s]]
        if not seeds:
            continue
        rows = per_seed[seeds[0]][scenario]["rows"]
        table = {}
        for name in rows:
            get = [per_seed[s][scenario]["rows"][name] for s in seeds]
            entry: dict[str, Any] = {"seeds": len(get)}
            for ref in ("registration", "reference"):
                values = [g[f"excess_{ref}"][0] for g in get]
                entry[f"excess_{ref}_mean"] = round(float(np.mean(values)), 3)
                entry[f"excess_{ref}_range"] = [round(min(values), 3), round(max(values), 3)]
            gaps = [
                abs(g["forget_r1"] - per_seed[s][scenario]["rows"]["retrain"]["forget_r1"])
                for s, g in zip(seeds, get, strict=True)
            ]
            entry["forget_r1_gap_pts"] = round(float(np.mean(gaps)), 2)
            if all("verdict" in g for g in get):
                entry["certified_seeds"] = sum(g["verdict"]["verdict"] == "pass" for g in get)
                entry["replayed_seeds"] = sum(bool(g["verdict"]["replayed"]) for g in get)
                failed: dict[str, int] = {}
                for g in get:
                    for check in g["verdict"]["failed"]:
                        failed[check] = failed.get(check, 0) + 1
                entry["failed_checks"] = failed
            table[name] = entry
        spreads = [per_seed[s][scenario].get("null_spread") for s in seeds]
        if all(v is not None for v in spreads):
            table["null_spread"] = {"mean": round(float(np.mean(spreads)), 3), "range": [min(spreads), max(spreads)]}
        out[scenario] = table
    return out


def registration_verdicts(scenarios: list[str], seeds: list[int]) -> dict[str, Any]:
    """Stop 44's verdicts of the same rows against the registration shadows (bench/results/ease_stop44.json), with
    their forget R@1 (the same θ′ where they match this run's)."""
    path = RESULTS / "ease_stop44.json"
    if not path.exists():
        return {}
    stored = json.loads(path.read_text())["seeds"]
    out: dict[str, Any] = {}
    for scenario in scenarios:
        for seed in seeds:
            rows = stored.get(str(seed), {}).get(scenario, {}).get("methods", {})
            for name, row in rows.items():
                if "verdict" in row:
                    out.setdefault(scenario, {}).setdefault(name, {})[str(seed)] = {
                        "forget_r1": row["forget_r1"],
                        "verdict": row["verdict"]["verdict"],
                    }
    return out


def print_table(summary: dict[str, Any]) -> None:
    for scenario, table in summary.items():
        print(f"\n{scenario}: mean forget excess E (registration → reference), |R@1 − retrain|, certified (reference)")
        for name, e in table.items():
            if name == "null_spread":
                print(f"  the reference runs' own spread of E: mean {e['mean']:.2f}, range {e['range']}")
                continue
            cert = f"{e['certified_seeds']}/{e['seeds']}" if "certified_seeds" in e else "—"
            print(
                f"  {name:22s} E {e['excess_registration_mean']:+6.2f} → {e['excess_reference_mean']:+6.2f}"
                f"   gap {e['forget_r1_gap_pts']:5.2f}   certified {cert}"
            )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="seed 2, client scenario only")
    parser.add_argument("--seeds", default=None, help="comma-separated seeds (default 2–11)")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--out", default=None)
    parser.add_argument("--cache-dir", default=None)
    args = parser.parse_args(argv)
    seeds = [2] if args.quick else list(range(2, 12))
    if args.seeds:
        seeds = [int(s) for s in args.seeds.split(",")]
    scenarios = ["client"] if args.quick else [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = [s for s in scenarios if s not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenarios {unknown}; expected some of {list(SCENARIOS)}")
    out_path = (
        Path(args.out) if args.out else RESULTS / ("clip_reference_quick.json" if args.quick else "clip_reference.json")
    )
    start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - start:7.1f}s] {msg}", flush=True)

    report: dict[str, Any] = {
        "what": __doc__.split("\n\n")[0],
        "seeds": seeds,
        "scenarios": scenarios,
        "sizes": dataclasses.asdict(ease.FULL),
        "shadows": dataclasses.asdict(ease.SHADOWS),
        **ease.git_commit(),
        "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "per_seed": {},
    }
    for seed in seeds:
        report["per_seed"][str(seed)] = {}
        for regime in dict.fromkeys(REGIME[s] for s in scenarios):
            demo = ease.build(seed, ease.FULL, regime, args.cache_dir)
            registration = ease.shadows_for(demo, args.cache_dir, log)
            for scenario in [s for s in scenarios if REGIME[s] == regime]:
                log(f"seed {seed}: {scenario}")
                report["per_seed"][str(seed)][scenario] = run_scenario(
                    demo, scenario, registration, args.cache_dir, log
                )
        report["summary"] = summarise(report["per_seed"], scenarios)
        report["partial"] = seed != seeds[-1]
        report["wall_seconds"] = round(time.perf_counter() - start, 1)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(report, indent=1) + "\n")
    report["registration_verdicts_stop44"] = registration_verdicts(scenarios, seeds)
    out_path.write_text(json.dumps(report, indent=1) + "\n")
    print_table(report["summary"])
    log(f"wrote {out_path}")
    return report


if __name__ == "__main__":
    sys.exit(0 if main() else 1)

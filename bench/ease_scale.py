"""EASE at scale (issue 11 item 7): a ViT-B-32-sized LoRA on the real-federation path, prepared for a GPU machine.

    bench/ease_gpu.sh                        # on the GPU machine: checks, then the run (python -m bench.ease --scale)
    python -m bench.ease --scale --dry-run   # anywhere: the same code, a tiny architecture, CPU, seconds

What it does, in order, printing each figure:

1. **Data through the real-federation path.** With ``--captions/--images/--assignment`` (a mounted Flickr30K/COCO
   Karpathy file, its images and an image → client assignment) those files; otherwise the seeded generator's pairs
   are *written* as PNGs + a Karpathy JSON + an assignment CSV (``export_karpathy``) and read back by
   ``federation_from_spec`` — the loader the service uses —, decoded with the architecture's open_clip transform.
2. **The backbone**: ``--arch`` (ViT-B-32) from ``--checkpoint`` (a local open_clip file), or randomly initialised
   when none is given (nothing can be downloaded: the figures then describe the code paths and their cost, not
   retrieval quality — the output says so).
3. **CUDA-path checks** (``checks``): every parameter and buffer on the chosen device, LoRA tensors float32 and
   trainable, the frozen backbone frozen; θ round-trips through ``set_theta``/``get_theta``; one forward/backward on
   the device with a finite loss and a gradient on every LoRA tensor (on the device); peak device memory and the
   time of one local step (synchronised).
4. **The federation**: ``--rounds`` of FedAvg, then a client deletion (client 0 leaves) by EASE and by retraining,
   with forget / retain / test R@1 and the costs (bytes, compute, critical path).

Results: ``--out`` (default bench/results/ease_scale.json; the dry run: ease_scale_dryrun.json).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

RESULTS = Path(__file__).parent / "results"
SCALE = {"arch": "ViT-B-32", "clients": 5, "pairs_per_client": 400, "test": 500, "rounds": 10, "batch": 64, "rank": 8}
DRY = {"arch": "lethe-mini-vit", "clients": 3, "pairs_per_client": 12, "test": 10, "rounds": 2, "batch": 6, "rank": 2}
DRY_EASE = {"excision_steps": 2, "excision_batch": 6, "replay_points": 2, "max_probes": 2}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cuda_checks(model, data, device: torch.device, batch: int) -> dict[str, Any]:
    """Device placement, dtypes, a θ round trip and one forward/backward on ``device``; raises on a failed check."""
    from app.ml.clip import caption_labels, clip_loss, lora_parameters

    out: dict[str, Any] = {"device": str(device)}
    named = list(model.model.named_parameters()) + list(model.model.named_buffers())
    off = [n for n, t in named if t.device.type != device.type]
    lora = lora_parameters(model.model)
    out["tensors"] = len(named)
    out["lora_tensors"] = len(lora)
    out["tensors_off_device"] = off[:10]
    out["lora_dtypes"] = sorted({str(p.dtype) for _, p in lora})
    out["frozen_trainable"] = [n for n, p in model.model.named_parameters() if p.requires_grad and "lora_" not in n]
    theta = model.get_theta()
    probe = theta + 0.01 * torch.randn_like(theta)
    model.set_theta(probe)
    out["theta_roundtrip_max_err"] = float((model.get_theta() - probe).abs().max())
    # the forward/backward runs at the perturbed θ: at LoRA's initialisation B = 0, so A's gradient is exactly zero
    n = min(batch, len(data))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    _sync(device)
    start = time.perf_counter()
    img, txt, scale = model.encode(data.images[:n], model.tokens(data.captions[:n]))
    loss = clip_loss(img, txt, scale, caption_labels(data.captions[:n]))
    for _, p in lora:
        p.grad = None
    loss.backward()
    _sync(device)
    out["step_seconds"] = round(time.perf_counter() - start, 4)
    out["embedding_device"] = str(img.device)
    out["embedding_dtype"] = str(img.dtype)
    out["loss"] = float(loss.detach())
    grads = [p.grad for _, p in lora]
    out["lora_without_grad"] = sum(1 for g in grads if g is None or not bool(g.abs().sum() > 0))
    out["grad_devices"] = sorted({str(g.device) for g in grads if g is not None})
    for _, p in lora:
        p.grad = None
    model.set_theta(theta)
    if device.type == "cuda":
        out["peak_memory_mib"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
        out["gpu"] = torch.cuda.get_device_name(device)
    failed = []
    if off:
        failed.append(f"{len(off)} tensors not on {device}")
    if out["lora_dtypes"] != ["torch.float32"]:
        failed.append(f"LoRA dtypes {out['lora_dtypes']}")
    if out["frozen_trainable"]:
        failed.append("frozen backbone tensors are trainable")
    if out["theta_roundtrip_max_err"] > 1e-6:
        failed.append("θ does not round-trip")
    if img.device.type != device.type or not np.isfinite(out["loss"]):
        failed.append("forward not on the device or loss not finite")
    if out["lora_without_grad"] or any(not d.startswith(device.type) for d in out["grad_devices"]):
        failed.append(f"{out['lora_without_grad']} LoRA tensors without a gradient on {device}")
    out["passed"] = not failed
    out["failed"] = failed
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    from app.ml.clip import ClipLoRA, ClipSpec, LoraSettings
    from app.ml.data.captions import export_karpathy, federation_from_spec, make_synthetic_federation
    from app.ml.federation import FederatedProblem, Federation, FedSettings
    from app.ml.unlearning.base import get_method
    from bench.ease import evaluate

    size = dict(DRY if args.dry_run else SCALE)
    for key in ("arch", "clients", "pairs_per_client", "test", "rounds", "batch", "rank"):
        if getattr(args, f"scale_{key}", None) is not None:
            size[key] = getattr(args, f"scale_{key}")
    if args.dry_run:
        device = torch.device("cpu")
    elif args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible (torch.cuda.is_available() is False)")
    start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - start:7.1f}s] {msg}", flush=True)

    report: dict[str, Any] = {
        "dry_run": args.dry_run,
        "size": size,
        "device": str(device),
        "machine": {
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "platform": platform.platform(),
        },
        "checkpoint": args.checkpoint,
        "note": None
        if args.checkpoint
        else "no checkpoint: a randomly initialised backbone — the figures describe the code paths and their cost, "
        "not retrieval quality",
    }
    spec = ClipSpec(
        arch=size["arch"], checkpoint=args.checkpoint, lora=LoraSettings(rank=size["rank"], alpha=2.0 * size["rank"])
    )
    model = ClipLoRA(spec, device=device)
    log(f"{size['arch']} on {device}: {model.num_params:,} LoRA parameters")
    report["lora_params"] = model.num_params

    with tempfile.TemporaryDirectory(prefix="lethe-scale-") as tmp:
        if args.captions:
            data_spec = {
                "kind": "karpathy",
                "captions_path": args.captions,
                "image_root": args.images,
                "assignment_path": args.assignment,
            }
            report["data"] = "mounted"
        else:
            synthetic = make_synthetic_federation(
                args.seed, n_clients=size["clients"], pairs_per_client=size["pairs_per_client"], n_test=size["test"]
            )
            image_size = int(model.model.visual.image_size[0])
            paths = export_karpathy(synthetic, tmp, image_size=image_size)
            data_spec = {"kind": "karpathy", **{k: str(v) for k, v in paths.items()}}
            report["data"] = f"synthetic, written as Karpathy files ({image_size}px PNGs) and read back"
        t0 = time.perf_counter()
        fed_data, names = federation_from_spec(data_spec, model.preprocess())
        report["load_seconds"] = round(time.perf_counter() - t0, 2)
    log(
        f"data: {report['data']}; {len(names)} clients, {[len(c) for c in fed_data.clients]} pairs, "
        f"test {len(fed_data.test)}"
    )

    report["checks"] = cuda_checks(model, fed_data.clients[0], device, size["batch"])
    log(f"checks: {json.dumps(report['checks'])}")
    if not report["checks"]["passed"]:
        log("CHECKS FAILED: " + "; ".join(report["checks"]["failed"]))
        return report

    settings = FedSettings(rounds=size["rounds"], batch_size=size["batch"], seed=args.seed)
    fed = Federation(model, fed_data.clients, settings)
    _sync(device)
    t0 = time.perf_counter()
    trained = fed.train(model.theta_init, progress=lambda f, m: log(f"federation {m}") if args.verbose else None)
    _sync(device)
    report["federation"] = {
        "rounds": size["rounds"],
        "wall_seconds": round(time.perf_counter() - t0, 2),
        "bytes": trained.bytes_total,
        "critical_seconds": round(trained.critical_seconds, 2),
    }
    log(f"federation: {json.dumps(report['federation'])}")

    masks = [np.full(len(c), k == 0, dtype=bool) for k, c in enumerate(fed_data.clients)]
    problem = FederatedProblem(
        spec=spec,
        theta=trained.theta,
        theta_init=model.theta_init.clone(),
        history=trained.history,
        clients=fed_data.clients,
        forget_masks=masks,
        scope="client",
        forget_client=0,
        fed_settings=settings,
        weights=trained.weights,
        model=model,
        gallery=fed_data.test,
    )
    rows: dict[str, Any] = {"original": evaluate(model, trained.theta, problem, fed_data.test)}
    ease_settings = DRY_EASE if args.dry_run else {}
    for label, name, settings_ in (("retrain", "fed_retrain", {}), ("ease", "ease", ease_settings)):
        _sync(device)
        t0, cpu = time.perf_counter(), time.process_time()
        result = get_method(name).build(settings_).unlearn(problem)
        _sync(device)
        row = {
            **evaluate(model, result.theta, problem, fed_data.test),
            "wall_seconds": round(time.perf_counter() - t0, 2),
            "cpu_seconds": round(time.process_time() - cpu, 2),
            "bytes": result.info.get("bytes_total"),
            "critical_seconds": result.info.get("critical_seconds"),
        }
        if name == "ease":
            row["strength"] = result.info.get("strength")
        rows[label] = row
        log(
            f"{label}: forget {row['forget_r1']:.1f} retain {row['retain_r1']:.1f} test {row['test_r1']:.1f} "
            f"wall {row['wall_seconds']}s bytes {row['bytes']}"
        )
    base, ease = rows["retrain"], rows["ease"]
    rows["ratios"] = {
        "forget_r1_gap_pts": round(abs(ease["forget_r1"] - base["forget_r1"]), 2),
        "bytes_ratio": round(ease["bytes"] / base["bytes"], 4) if base["bytes"] else None,
        "wall_ratio": round(ease["wall_seconds"] / base["wall_seconds"], 4) if base["wall_seconds"] else None,
        "critical_path_ratio": round(ease["critical_seconds"] / base["critical_seconds"], 4)
        if base.get("critical_seconds")
        else None,
    }
    report["methods"] = rows
    if device.type == "cuda":
        report["peak_memory_mib"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
    report["wall_seconds"] = round(time.perf_counter() - start, 1)
    log(f"ratios: {json.dumps(rows['ratios'])}; total {report['wall_seconds']} s")
    return report


def add_arguments(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("--scale (issue 11 item 7)")
    g.add_argument("--scale", action="store_true", help="the ViT-B-32-sized run on the real-federation path")
    g.add_argument("--dry-run", action="store_true", help="with --scale: tiny architecture and sizes, on CPU")
    g.add_argument("--device", default="auto", help="with --scale: cuda, cpu or auto")
    g.add_argument("--checkpoint", default=None, help="with --scale: a local open_clip checkpoint for --scale-arch")
    g.add_argument("--captions", default=None, help="with --scale: a mounted Karpathy-layout caption file")
    g.add_argument("--images", default=None, help="with --scale: its image folder")
    g.add_argument("--assignment", default=None, help="with --scale: image → client assignment (CSV or JSON)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--verbose", action="store_true")
    for key, kind in (("arch", str), ("clients", int), ("pairs_per_client", int), ("test", int), ("rounds", int)):
        g.add_argument(f"--scale-{key.replace('_', '-')}", dest=f"scale_{key}", type=kind, default=None)
    g.add_argument("--scale-batch", dest="scale_batch", type=int, default=None)
    g.add_argument("--scale-rank", dest="scale_rank", type=int, default=None)


def main(args: argparse.Namespace) -> dict[str, Any]:
    if args.captions and not (args.images and args.assignment):
        raise SystemExit("--captions needs --images and --assignment")
    report = run(args)
    out = args.out or RESULTS / ("ease_scale_dryrun.json" if args.dry_run else "ease_scale.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str))
    print(f"wrote {out}")
    if not report.get("checks", {}).get("passed", False):
        raise SystemExit(1)
    return report

#!/usr/bin/env bash
# EASE at scale on a GPU machine (issue 11 item 7): one prepared script.
#
#   bench/ease_gpu.sh                      # synthetic data written as Karpathy files, ViT-B-32 randomly initialised
#   CHECKPOINT=/models/ViT-B-32.bin bench/ease_gpu.sh
#   CAPTIONS=/data/dataset_flickr30k.json IMAGES=/data/flickr30k-images ASSIGNMENT=/data/clients.csv \
#     CHECKPOINT=/models/ViT-B-32.bin bench/ease_gpu.sh
#
# First the environment (nvidia-smi, torch's CUDA), then a dry run of the same code on CPU (seconds: a broken install
# shows here, not after an hour), then the scale run on cuda; it prints every check and figure and writes
# bench/results/ease_scale.json. Exits non-zero when a CUDA-path check fails. Extra arguments go to bench.ease,
# e.g. --scale-rounds 20 --scale-pairs-per-client 1000.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
export PYTHONPATH=${PYTHONPATH:-$PWD}

echo "== environment"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || echo "nvidia-smi: not available"
"$PY" - <<'PYEOF'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if not torch.cuda.is_available():
    raise SystemExit("no CUDA device visible to torch: stop here")
x = torch.randn(1024, 1024, device="cuda", requires_grad=True)
(x @ x).sum().backward()
torch.cuda.synchronize()
print("cuda matmul + backward ok on", torch.cuda.get_device_name(0), "grad on", x.grad.device)
PYEOF

echo "== dry run (tiny architecture, CPU)"
"$PY" -m bench.ease --scale --dry-run --out /tmp/ease_scale_dryrun.json

echo "== scale run (cuda)"
ARGS=(--scale --device cuda)
[[ -n "${CHECKPOINT:-}" ]] && ARGS+=(--checkpoint "$CHECKPOINT")
[[ -n "${CAPTIONS:-}" ]] && ARGS+=(--captions "$CAPTIONS" --images "$IMAGES" --assignment "$ASSIGNMENT")
"$PY" -m bench.ease "${ARGS[@]}" --threads 0 "$@"

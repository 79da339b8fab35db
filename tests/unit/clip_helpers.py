"""Small shared builders for the CLIP/federation/EASE unit tests (tiny sizes: the suite runs on 2 CPU cores)."""

from __future__ import annotations

import functools
import tempfile

import torch

from app.ml.clip import ClipLoRA, ClipSpec, LoraSettings, PretrainSettings, pretrain_tiny_clip
from app.ml.federation import DemoFederation, FedSettings, make_demo_federation

TINY_PRETRAIN = PretrainSettings(n_pairs=64, steps=3, batch_size=32)

# The tiny model's ops are far too small to gain from intra-op threads; on a shared 2-core machine a second thread
# only spins (a 512×512 matmul ran 4× slower with 2 threads than with 1 while another process held a core).
torch.set_num_threads(1)


@functools.lru_cache(maxsize=1)
def tiny_checkpoint() -> str:
    """A barely-pretrained tiny CLIP in a per-process temporary cache (cold cache every test session)."""
    return str(pretrain_tiny_clip(TINY_PRETRAIN, cache_dir=tempfile.mkdtemp(prefix="lethe-test-")))


def tiny_model(rank: int = 2) -> ClipLoRA:
    torch.manual_seed(0)
    return ClipLoRA(ClipSpec(checkpoint=tiny_checkpoint(), lora=LoraSettings(rank=rank)), device="cpu")


@functools.lru_cache(maxsize=1)
def tiny_demo() -> DemoFederation:
    """3 clients × 24 pairs, 2 FedAvg rounds: enough to exercise every code path."""
    return make_demo_federation(
        seed=0,
        n_clients=3,
        pairs_per_client=24,
        n_test=16,
        fed_settings=FedSettings(rounds=2, batch_size=12, lr=3e-3),
        pretrain=TINY_PRETRAIN,
        lora=LoraSettings(rank=2),
        cache_dir=tempfile.mkdtemp(prefix="lethe-test-"),
        device="cpu",
    )

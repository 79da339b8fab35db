"""open_clip models with LoRA on both towers, the flat LoRA vector, and a cached tiny pretraining.

Why LoRA on *both* towers: EASE's Bilateral Knowledge Excision displaces image and text embeddings together
(ease-notes §1 "LoRA placement … must be on both the vision and text towers [INFERENCE]", §2). peft adapts
``nn.MultiheadAttention`` (targeted as ``attn``; peft's LoRA-MHA covers in_proj and out_proj) and the MLP linears
``c_fc``/``c_proj`` of every open_clip residual block; a test proves that every LoRA tensor receives gradient.

Why one flat vector: FedAvg, the update history, principal angles and projections (ease-notes §3–4) are all linear
algebra on θ ∈ R^p, the concatenation of every LoRA tensor in a fixed (name-sorted) order.

Architectures come from open_clip's config registry: the built-in ones (``ViT-B-32`` …) and ``lethe-tiny-clip``
(``app/ml/clip_configs/``, registered with ``open_clip.add_model_config``), a 2+2-layer CLIP on 32×32 images with
the compact word vocabulary of :mod:`app.ml.data.captions`, small enough to train on CPU for tests and the demo.
Checkpoints are always local paths (nothing is downloaded at run time).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import open_clip
import torch
import torch.nn.functional as F
from torch import nn

from app.ml.data.captions import CaptionDataset, WordTokenizer, make_pretraining_set, simple_preprocess

CONFIG_DIR = Path(__file__).with_name("clip_configs")
SHIPPED_DIR = Path(__file__).with_name("clip_weights")
SHIPPED_SHA256 = {
    "lethe-tiny-clip-2d797ae01a4d00fc.safetensors": "8c7b280da4a2140c43c071d48684c7015f3e46f037c340a5e3cbce99aee42f21",
}
"""Checkpoints shipped with the code (issue 24): ``lethe-tiny-clip`` pretrained on CPU with the default settings and
the pinned torch. Pretraining is deterministic on one machine but not across machines (two 2-core CPU machines gave
8c7b280d… and 742714f7… for the same key, and every EASE figure and the demo's federated verdict moved with it), so
a CPU machine starts from these bytes instead of its own; the digest guards against a damaged copy (it is then
pretrained as before)."""
TINY_ARCH = "lethe-tiny-clip"
_registered = False


def register_configs() -> None:
    """Make the repository's architectures (``lethe-tiny-clip``) known to ``open_clip.create_model`` (idempotent)."""
    global _registered
    if not _registered:
        open_clip.add_model_config(CONFIG_DIR)
        _registered = True


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def create_clip(arch: str, checkpoint: str | os.PathLike[str] | None = None, device: str | torch.device = "cpu"):
    """Build ``arch`` from open_clip's registry and load a local checkpoint if given.

    A real ViT-B-32 loads the same way: ``create_clip("ViT-B-32", "/models/ViT-B-32.bin")`` — open_clip's own
    ``create_model(name, pretrained=path)`` accepts a file path (``.bin``/``.pt``/``.safetensors``).
    """
    register_configs()
    import logging

    level = logging.getLogger().level
    logging.getLogger().setLevel(logging.ERROR)  # open_clip warns "initialized randomly" when no weights are given
    try:
        model = open_clip.create_model(arch, pretrained=str(checkpoint) if checkpoint else None, device=device)
    finally:
        logging.getLogger().setLevel(level)
    return model


def get_tokenizer(arch: str) -> Callable[[Sequence[str]], torch.Tensor]:
    """The compact word tokenizer for the tiny architecture, open_clip's tokenizer for every other one."""
    if arch == TINY_ARCH:
        cfg = open_clip.get_model_config(arch) if _registered else json.loads((CONFIG_DIR / f"{arch}.json").read_text())
        return WordTokenizer(context_length=cfg["text_cfg"]["context_length"], vocab_size=cfg["text_cfg"]["vocab_size"])
    return open_clip.get_tokenizer(arch)


# ------------------------------------------------------------------------------------------------ LoRA


@dataclass(frozen=True)
class LoraSettings:
    """LoRA placement and size. Rank/alpha are [UNKNOWN] in the paper (ease-notes §1); defaults fit the tiny model."""

    rank: int = 4
    alpha: float = 8.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ("attn", "c_fc", "c_proj")
    init_seed: int = 0


def add_lora(model: nn.Module, settings: LoraSettings) -> nn.Module:
    """Inject LoRA adapters in place (peft) and freeze everything else. The init is seeded: θ₀ is reproducible."""
    import peft

    for p in model.parameters():
        p.requires_grad_(False)
    config = peft.LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=list(settings.target_modules),
    )
    devices = {p.device for p in model.parameters()}
    with torch.random.fork_rng(devices=[d for d in devices if d.type == "cuda"]):
        torch.manual_seed(settings.init_seed)
        model = peft.inject_adapter_in_model(config, model)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    return model


def lora_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Every LoRA tensor, sorted by name: the fixed order of the flat vector θ."""
    return sorted(((n, p) for n, p in model.named_parameters() if "lora_" in n), key=lambda item: item[0])


def lora_vector(model: nn.Module) -> torch.Tensor:
    """θ: the concatenation of every LoRA tensor (detached, float32, on the model's device)."""
    return torch.cat([p.detach().reshape(-1).float() for _, p in lora_parameters(model)])


def set_lora_vector(model: nn.Module, theta: torch.Tensor) -> None:
    params = lora_parameters(model)
    total = sum(p.numel() for _, p in params)
    if theta.numel() != total:
        raise ValueError(f"θ has {theta.numel()} entries, the model's LoRA has {total}")
    offset = 0
    with torch.no_grad():
        for _, p in params:
            n = p.numel()
            p.copy_(theta[offset : offset + n].view_as(p).to(p.device, p.dtype))
            offset += n


def lora_layout(model: nn.Module) -> list[dict[str, Any]]:
    """Name, shape, offset and tower of each LoRA tensor in θ (used for per-tower masks and for reports)."""
    out, offset = [], 0
    for name, p in lora_parameters(model):
        out.append({"name": name, "shape": list(p.shape), "offset": offset, "tower": tower_of(name)})
        offset += p.numel()
    return out


def tower_of(name: str) -> str:
    return "image" if name.startswith("visual.") else "text"


def tower_mask(model: nn.Module, tower: str) -> torch.Tensor:
    """Boolean mask over θ selecting the ``"image"`` or ``"text"`` tower's LoRA entries."""
    pieces = [torch.full((p.numel(),), tower_of(n) == tower, dtype=torch.bool) for n, p in lora_parameters(model)]
    return torch.cat(pieces)


def _mha_base_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The frozen in_proj/out_proj weights of every LoRA-adapted ``nn.MultiheadAttention``, by name.

    peft's LoRA for MultiheadAttention merges the adapter into these weights before each forward and subtracts it
    afterwards, replacing the parameter objects; (W + ΔW) − ΔW is not W in floating point, so the frozen weights
    drift by a rounding error per forward. :class:`ClipLoRA` snapshots them once and restores them on every
    ``set_theta`` so that a client's local update depends only on θ and its data.
    """
    out = {}
    for name, module in model.named_modules():
        if type(module).__name__ == "MultiheadAttention" and hasattr(module, "lora_A"):
            base = module.get_base_layer()
            out[f"{name}.in_proj_weight"] = base.in_proj_weight
            out[f"{name}.out_proj.weight"] = base.out_proj.get_base_layer().weight
    return out


def _snapshot_mha(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in _mha_base_weights(model).items()}


def _restore_mha(model: nn.Module, snapshot: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for k, v in _mha_base_weights(model).items():
            v.copy_(snapshot[k])


# ------------------------------------------------------------------------------------------------ model wrapper


@dataclass(frozen=True)
class ClipSpec:
    """What identifies a federated CLIP: architecture, frozen backbone checkpoint, and LoRA settings."""

    arch: str = TINY_ARCH
    checkpoint: str | None = None
    lora: LoraSettings = field(default_factory=LoraSettings)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["lora"]["target_modules"] = list(self.lora.target_modules)
        return d

    @staticmethod
    def from_dict(d: dict[str, Any]) -> ClipSpec:
        lora = dict(d.get("lora", {}))
        if "target_modules" in lora:
            lora["target_modules"] = tuple(lora["target_modules"])
        return ClipSpec(arch=d["arch"], checkpoint=d.get("checkpoint"), lora=LoraSettings(**lora))


class ClipLoRA:
    """A frozen open_clip backbone with LoRA on both towers, driven through the flat vector θ."""

    def __init__(self, spec: ClipSpec, device: str | torch.device | None = None):
        self.spec = spec
        self.device = torch.device(device) if device is not None else default_device()
        model = create_clip(spec.arch, spec.checkpoint, device="cpu")
        self.model = add_lora(model, spec.lora).to(self.device)
        self.model.eval()  # no dropout anywhere: local training is deterministic given the data order
        self.tokenizer = get_tokenizer(spec.arch)
        self.theta_init = lora_vector(self.model).cpu()
        self.num_params = self.theta_init.numel()
        self._frozen_mha = _snapshot_mha(self.model)

    # θ access -----------------------------------------------------------------------------------------------
    def get_theta(self) -> torch.Tensor:
        return lora_vector(self.model).cpu()

    def set_theta(self, theta: torch.Tensor) -> None:
        _restore_mha(self.model, self._frozen_mha)
        set_lora_vector(self.model, theta)

    def parameters(self) -> list[nn.Parameter]:
        return [p for _, p in lora_parameters(self.model)]

    def tower_mask(self, tower: str) -> torch.Tensor:
        return tower_mask(self.model, tower)

    # encoding -----------------------------------------------------------------------------------------------
    def preprocess(self) -> Callable[[Any], torch.Tensor]:
        """PIL image → normalised tensor for this backbone: the generator's normalisation for the tiny architecture
        (what it was pretrained on), open_clip's evaluation transform (resize, centre crop, the architecture's mean
        and std) for every other one. Real image files go through this (app.ml.data.captions.federation_from_spec)."""
        if self.spec.arch == TINY_ARCH:
            return simple_preprocess(int(self.model.visual.image_size[0]))
        cfg = open_clip.get_model_preprocess_cfg(self.model)
        return open_clip.image_transform(
            cfg["size"],
            is_train=False,
            mean=cfg.get("mean"),
            std=cfg.get("std"),
            resize_mode=cfg.get("resize_mode"),
            interpolation=cfg.get("interpolation"),
        )

    def tokens(self, captions: Sequence[str]) -> torch.Tensor:
        return self.tokenizer(list(captions))

    def encode(self, images: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """L2-normalised image and text embeddings and the (frozen) logit scale."""
        img = self.model.encode_image(images.to(self.device), normalize=True)
        txt = self.model.encode_text(tokens.to(self.device), normalize=True)
        return img, txt, self.model.logit_scale.exp()

    @torch.no_grad()
    def embed(self, data: CaptionDataset, batch_size: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
        """Embeddings of every pair (CPU tensors), for retrieval metrics."""
        imgs, txts = [], []
        tokens = self.tokens(data.captions)
        for start in range(0, len(data), batch_size):
            img, txt, _ = self.encode(data.images[start : start + batch_size], tokens[start : start + batch_size])
            imgs.append(img.float().cpu())
            txts.append(txt.float().cpu())
        if not imgs:
            return torch.empty(0), torch.empty(0)
        return torch.cat(imgs), torch.cat(txts)


def clip_loss(
    img: torch.Tensor, txt: torch.Tensor, scale: torch.Tensor, labels: torch.Tensor | None = None
) -> torch.Tensor:
    """Symmetric InfoNCE (CLIP's loss): cross-entropy of image→text and text→image logits, averaged.

    ``labels`` (one caption-text id per pair) make pairs with identical captions count as positives of each other
    (soft targets spread over them) instead of false negatives — a batch of a small attribute world holds many.
    """
    logits = scale * img @ txt.T
    if labels is None:
        target = torch.arange(img.shape[0], device=img.device)
        return 0.5 * (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target))
    labels = labels.to(img.device)
    same = (labels[:, None] == labels[None, :]).float()
    target = same / same.sum(dim=1, keepdim=True)
    return 0.5 * (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target))


def caption_labels(captions: Sequence[str]) -> torch.Tensor:
    """One integer per caption, equal for equal texts (case- and whitespace-insensitive)."""
    vocab: dict[str, int] = {}
    return torch.tensor([vocab.setdefault(c.strip().lower(), len(vocab)) for c in captions], dtype=torch.long)


# ------------------------------------------------------------------------------------------------ tiny pretraining


@dataclass(frozen=True)
class PretrainSettings:
    """Full-parameter pretraining of the tiny CLIP on base concepts (the frozen "foundation" model of the demo)."""

    n_pairs: int = 4000
    steps: int = 400
    batch_size: int = 128
    lr: float = 3e-3
    weight_decay: float = 0.05
    seed: int = 0


def default_cache_dir() -> Path:
    return Path(os.environ.get("LETHE_CACHE_DIR", Path.home() / ".cache" / "lethe"))


PRETRAIN_THREADS = 1
"""Intra-op threads during pretraining. Pinned because the bits depend on it: single- and multi-threaded CPU
reductions sum in different orders, and two checkpoints under one cache name once gave seed-1 class EASE 54.7 and
23.6 (measured-findings §EASE "reproducibility"). The cache key names it, with deterministic algorithms, the device
type and the torch version, so that the key describes the bits."""


@functools.cache
def _shipped_intact(path: Path) -> bool:
    """A shipped checkpoint exists and has its pinned digest (read once per process, not per call)."""
    return path.exists() and checkpoint_sha256(path) == SHIPPED_SHA256.get(path.name)


def checkpoint_sha256(path: str | os.PathLike[str]) -> str:
    """sha256 of a checkpoint file (what benchmark results record next to their figures)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def pretrain_tiny_clip(
    settings: PretrainSettings = PretrainSettings(),
    cache_dir: str | os.PathLike[str] | None = None,
    progress: Callable[[float, str], None] | None = None,
) -> Path:
    """Pretrain ``lethe-tiny-clip`` on the generator's base concepts, caching the checkpoint by content key.

    The key hashes the architecture config and the settings, so tests, demo and benchmark share one file and never
    repeat the work; a cold cache costs ``settings.steps`` CLIP steps (≈0.1 s each at batch 128 on 2 idle CPU
    cores; the defaults reach R@1 ≈ 0.9 on base concepts).
    """
    register_configs()
    cfg = open_clip.get_model_config(TINY_ARCH)
    device = default_device()
    pinned = {
        "threads": PRETRAIN_THREADS,
        "deterministic": True,
        "device": device.type,
        "torch": torch.__version__.split("+")[0],
    }
    key = hashlib.sha256(
        json.dumps({"cfg": cfg, "settings": asdict(settings), "pinned": pinned, "v": 2}, sort_keys=True).encode()
    )
    path = Path(cache_dir or default_cache_dir()) / "clip" / f"{TINY_ARCH}-{key.hexdigest()[:16]}.safetensors"
    if path.exists():
        return path
    shipped = SHIPPED_DIR / path.name
    if _shipped_intact(shipped):
        return shipped
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(PRETRAIN_THREADS)
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        return _pretrain(settings, device, path, progress)
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)


def _pretrain(
    settings: PretrainSettings,
    device: torch.device,
    path: Path,
    progress: Callable[[float, str], None] | None,
) -> Path:
    from safetensors.torch import save_file

    torch.manual_seed(settings.seed)
    model = create_clip(TINY_ARCH, device=device)
    tokenizer = get_tokenizer(TINY_ARCH)
    data = make_pretraining_set(settings.seed, settings.n_pairs)
    tokens = tokenizer(data.captions)
    labels = caption_labels(data.captions)
    opt = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=settings.weight_decay)
    warmup = max(1, settings.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(  # linear warm-up, then cosine decay to zero
        opt, lambda s: min((s + 1) / warmup, 0.5 * (1 + math.cos(math.pi * min(s, settings.steps) / settings.steps)))
    )
    gen = torch.Generator().manual_seed(settings.seed)
    model.train()
    start = time.time()
    for step in range(settings.steps):
        idx = torch.randint(0, len(data), (settings.batch_size,), generator=gen)
        img = model.encode_image(data.images[idx].to(device), normalize=True)
        txt = model.encode_text(tokens[idx].to(device), normalize=True)
        loss = clip_loss(img, txt, model.logit_scale.exp(), labels[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        with torch.no_grad():
            model.logit_scale.clamp_(0, 4.6052)
        if progress is not None and step % 25 == 0:
            progress(step / settings.steps, f"pretrain step {step} loss {loss.item():.3f} ({time.time() - start:.0f}s)")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    save_file({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}, str(tmp))
    os.replace(tmp, path)  # atomic: concurrent test processes never read a half-written file
    return path

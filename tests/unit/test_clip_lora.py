from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from app.ml.clip import (
    TINY_ARCH,
    ClipLoRA,
    ClipSpec,
    clip_loss,
    create_clip,
    lora_layout,
    lora_parameters,
    tower_of,
)
from app.ml.data.captions import make_pretraining_set

from .clip_helpers import tiny_model


def test_lora_is_on_both_towers_and_every_tensor_gets_gradient():
    m = tiny_model()
    names = [n for n, _ in lora_parameters(m.model)]
    assert {tower_of(n) for n in names} == {"image", "text"}
    # attention (peft's LoRA for nn.MultiheadAttention, incl. its out_proj) and both MLP linears, in both towers
    for part in ("attn.lora_A", "attn.base_layer.out_proj.lora_A", "mlp.c_fc.lora_A", "mlp.c_proj.lora_A"):
        assert any(n.startswith("visual.") and part in n for n in names), part
        assert any(n.startswith("transformer.") and part in n for n in names), part
    # only LoRA is trainable
    assert all(("lora_" in n) == p.requires_grad for n, p in m.model.named_parameters())
    # LoRA B starts at zero (so A's gradient is zero at init): move θ off the init before checking gradients
    torch.manual_seed(0)
    m.set_theta(m.theta_init + 0.05 * torch.randn(m.num_params))
    data = make_pretraining_set(5, 16)
    img, txt, scale = m.encode(data.images, m.tokens(data.captions))
    clip_loss(img, txt, scale).backward()
    for name, p in lora_parameters(m.model):
        assert p.grad is not None and p.grad.abs().sum() > 0, f"no gradient reaches {name}"


def test_flatten_unflatten_round_trip():
    m = tiny_model()
    theta = torch.randn(m.num_params)
    m.set_theta(theta)
    assert torch.equal(m.get_theta(), theta)
    layout = lora_layout(m.model)
    assert layout[-1]["offset"] + int(torch.tensor(layout[-1]["shape"]).prod()) == m.num_params
    mask = m.tower_mask("image")
    assert 0 < int(mask.sum()) < m.num_params and not (mask & m.tower_mask("text")).any()
    with pytest.raises(ValueError):
        m.set_theta(torch.zeros(m.num_params + 1))


def test_lora_init_is_seeded():
    a, b = tiny_model(), tiny_model()
    assert torch.equal(a.theta_init, b.theta_init)


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_checkpoint_loader_reads_a_local_file(tmp_path, suffix):
    src = create_clip(TINY_ARCH)
    with torch.no_grad():
        src.logit_scale.fill_(1.234)
    state = {k: v.contiguous() for k, v in src.state_dict().items()}
    path = tmp_path / f"tiny{suffix}"
    if suffix == ".safetensors":
        save_file(state, str(path))
    else:
        torch.save(state, path)
    loaded = create_clip(TINY_ARCH, path)
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, state[k]), k
    # and through the LoRA wrapper: the frozen backbone equals the file
    wrapped = ClipLoRA(ClipSpec(checkpoint=str(path)), device="cpu")
    assert float(wrapped.model.logit_scale) == pytest.approx(1.234)


def test_pretraining_is_pinned_whatever_the_callers_threads(tmp_path):
    from app.ml.clip import PretrainSettings, checkpoint_sha256, pretrain_tiny_clip

    settings = PretrainSettings(n_pairs=64, steps=3, batch_size=32)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        a = pretrain_tiny_clip(settings, cache_dir=tmp_path / "a")
        assert torch.get_num_threads() == 2 and not torch.are_deterministic_algorithms_enabled()  # restored
        torch.set_num_threads(1)
        b = pretrain_tiny_clip(settings, cache_dir=tmp_path / "b")
    finally:
        torch.set_num_threads(before)
    assert a.name == b.name and checkpoint_sha256(a) == checkpoint_sha256(b)  # the key describes the bits


def test_the_default_backbone_is_the_shipped_one_on_every_cpu_machine(tmp_path, monkeypatch):
    """Issue 24: pretraining is deterministic per machine, not across machines, so a CPU machine with an empty cache
    loads the shipped checkpoint (its digest checked) instead of pretraining its own; a damaged copy is not used."""
    import shutil

    import app.ml.clip as clip

    if clip.default_device().type != "cpu":
        pytest.skip("the shipped checkpoint is the CPU one")
    trained: list[Path] = []

    def pretrain(settings, device, path, progress):
        trained.append(path)
        return path

    monkeypatch.setattr(clip, "_pretrain", pretrain)
    shipped = clip.pretrain_tiny_clip(cache_dir=tmp_path / "cache")
    assert not trained and shipped.parent == clip.SHIPPED_DIR
    assert clip.checkpoint_sha256(shipped) == clip.SHIPPED_SHA256[shipped.name]

    damaged = tmp_path / "shipped"
    damaged.mkdir()
    shutil.copy(shipped, damaged / shipped.name)
    with open(damaged / shipped.name, "r+b") as fh:
        fh.seek(-1, 2)
        last = fh.read(1)
        fh.seek(-1, 2)
        fh.write(bytes([last[0] ^ 1]))
    monkeypatch.setattr(clip, "SHIPPED_DIR", damaged)
    path = clip.pretrain_tiny_clip(cache_dir=tmp_path / "cache")
    assert trained == [path] and path.parent == tmp_path / "cache" / "clip"

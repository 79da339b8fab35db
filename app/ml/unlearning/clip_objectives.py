"""CLIP objectives and gradients that several federated unlearning methods share (EASE, FedOSD).

Kept apart from any one method so that a baseline never imports another method's internals.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from app.ml.clip import ClipLoRA, caption_labels, clip_loss
from app.ml.data.captions import CaptionDataset

TRAINING_BATCH = 64
"""The clients' training batch size; gradients are means over mini-batches of this size, as in training."""

BatchLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""loss(image embeddings, text embeddings, logit scale, caption labels) of one mini-batch."""


def uce_loss(img: torch.Tensor, txt: torch.Tensor, scale: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """FedOSD's bounded Unlearning Cross-Entropy −log(1 − p_match/2) on both retrieval directions (ease-notes §7).

    A pair's "match" probability counts every caption with the same label (duplicates are matches too)."""
    labels = labels.to(img.device)
    same = labels[:, None] == labels[None, :]
    logits = scale * img @ txt.T
    p_i2t = (F.softmax(logits, dim=1) * same).sum(dim=1)
    p_t2i = (F.softmax(logits.T, dim=1) * same).sum(dim=1)
    return -0.5 * (torch.log1p(-p_i2t.clamp(max=1.0) / 2).mean() + torch.log1p(-p_t2i.clamp(max=1.0) / 2).mean())


def batch_gradient(
    model: ClipLoRA, theta: torch.Tensor, data: CaptionDataset, loss: BatchLoss, batch_size: int = TRAINING_BATCH
) -> torch.Tensor:
    """Gradient of ``loss`` on ``data`` at θ: the mean over mini-batches of ``batch_size`` (a batch of one pair has
    no negatives and is skipped)."""
    model.set_theta(theta)
    params = model.parameters()
    tokens, labels = model.tokens(data.captions), caption_labels(data.captions)
    total = torch.zeros(theta.numel())
    n_batches = 0
    for start in range(0, len(data), batch_size):
        sl = slice(start, start + batch_size)
        if tokens[sl].shape[0] < 2:
            continue
        img, txt, scale = model.encode(data.images[sl], tokens[sl])
        grads = torch.autograd.grad(loss(img, txt, scale, labels[sl]), params)
        total += torch.cat([g.reshape(-1).float().cpu() for g in grads])
        n_batches += 1
    return total / max(n_batches, 1)


def data_gradient(
    model: ClipLoRA, theta: torch.Tensor, data: CaptionDataset, batch_size: int = TRAINING_BATCH
) -> torch.Tensor:
    """Gradient of the CLIP training loss on ``data`` at θ."""
    return batch_gradient(model, theta, data, clip_loss, batch_size)

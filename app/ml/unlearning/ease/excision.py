"""BKE — Bilateral Knowledge Excision (ease-notes §2).

Why bilateral: CLIP's similarity is bilinear in the image and text embeddings, so the InfoNCE gradient of one tower
depends on the other's embeddings; if only one tower is displaced, the untouched one acts as a *modality anchor* that
pulls the forgotten alignment back [PAPER, SECONDARY: knowledge-base]. BKE therefore optimises the LoRA of **both**
towers on the forget pairs (``towers=("image", "text")``; one-sided runs exist only as the ablation).

The objective is not in the retrieved text [UNKNOWN]; following the notes' proposal [INFERENCE] it is *bounded*, so
that excision cannot explode the way plain gradient ascent does (§7):

* ``"uce"`` — FedOSD's unlearning cross-entropy ``−log(1 − p_match/2)`` on both the image→text and the text→image
  softmax over the batch (p_match: probability mass on captions equal to the ground truth);
* ``"hinge"`` — ``relu(s_match − mean s_non-match + margin)`` in both directions: push each matched similarity
  below the non-matched level and stop there;
* ``"reference"`` — ``relu(log p_match(θ) − log p_match(θ_ref) + margin)`` in both directions, with θ_ref a model
  that never saw the forget pairs (the frozen backbone, LoRA at its initialisation): a forget pair may not be matched
  better than by that model. Pairs the backbone already matches (shared, generic knowledge that retrain keeps too)
  feel almost no push; pairs that only the federation taught are pushed back to the backbone's level — a
  per-pair, calibrated bound rather than "as unmatched as possible" [INFERENCE].

The reference of ``"reference"`` is version 1 by default (θ_ref = the LoRA initialisation). For a class deletion
``EaseConfig.excision_reference="concept_masked"`` takes the projected model itself with the class's word taken out of
the forget captions (``reference_captions``, :func:`concept_words`): the bound is then "no better matched than by this
model when it cannot read the concept" — retraining keeps the shapes, sizes and places the federation taught and
loses only the word, where version 1 knows none of them, so pushing a class pair to version 1's level takes the
generic alignment with it (issue 24 item 3, the class scenario's retained drop) [INFERENCE].

Optional terms (settings of :class:`~app.ml.unlearning.ease.method.EaseConfig`): where the holder also has retained
pairs (class/samples scope), they join each batch as negatives (``retain_negatives``) and anchor the retained
alignment (the CLIP loss on them, weight ``anchor_weight``); and a restriction of the total
displacement to a subspace (``basis`` + ``mode``: ``"onto"`` keeps it inside span(U), ``"off"`` keeps it orthogonal
to span(U)), applied after every step (projected optimisation).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from app.ml.clip import ClipLoRA, caption_labels, clip_loss
from app.ml.data.captions import CaptionDataset
from app.ml.unlearning.clip_objectives import uce_loss
from app.ml.unlearning.ease.subspace import project_onto, project_out


def _words(caption: str) -> set[str]:
    return set(re.findall(r"\w+", caption.lower()))


def concept_words(forget: Sequence[str], retained: Sequence[str]) -> list[str]:
    """The words in every forget caption and in no retained caption: the concept a class deletion removes (the
    service's class selector is one such word: CaptionDataset.has_word). A holder computes them from its own pairs."""
    if not forget:
        return []
    common = set.intersection(*(_words(c) for c in forget))
    seen = set().union(*(_words(c) for c in retained)) if retained else set()
    return sorted(common - seen)


def without_words(captions: Sequence[str], words: Sequence[str]) -> list[str]:
    """``captions`` with every whole-word occurrence of ``words`` taken out (spaces collapsed)."""
    if not words:
        return list(captions)
    pattern = re.compile(r"\b(" + "|".join(re.escape(w) for w in words) + r")\b", re.IGNORECASE)
    return [" ".join(pattern.sub(" ", c).split()) for c in captions]


def _log_p_match(logits: torch.Tensor, same: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """log of the softmax mass on ground-truth-equal captions, image→text and text→image."""
    neg_inf = torch.finfo(logits.dtype).min
    lse_i2t = torch.logsumexp(logits, dim=1)
    lse_t2i = torch.logsumexp(logits.T, dim=1)
    pos_i2t = torch.logsumexp(logits.masked_fill(~same, neg_inf), dim=1)
    pos_t2i = torch.logsumexp(logits.T.masked_fill(~same, neg_inf), dim=1)
    return pos_i2t - lse_i2t, pos_t2i - lse_t2i


def excision_loss(
    img: torch.Tensor,
    txt: torch.Tensor,
    scale: torch.Tensor,
    labels: torch.Tensor,
    objective: str = "uce",
    margin: float = 0.0,
    ref: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    n_forget: int | None = None,
) -> torch.Tensor:
    """The bounded unlearning objective on a batch of forget pairs (both retrieval directions).

    ``ref``: the reference model's (image, text embeddings, scale) of the same batch, for ``"reference"``.
    ``n_forget``: only the first ``n_forget`` pairs are forget pairs, the rest serve as extra negatives (the
    holder's retained pairs) — supported by ``"reference"``.
    """
    labels = labels.to(img.device)
    same = labels[:, None] == labels[None, :]
    sims = img @ txt.T
    if objective == "reference":
        if ref is None:
            raise ValueError("the reference objective needs the reference model's embeddings")
        nf = img.shape[0] if n_forget is None else n_forget
        r_img, r_txt, r_scale = ref
        with torch.no_grad():
            ref_i2t, ref_t2i = _log_p_match(r_scale * r_img @ r_txt.T, same)
        lp_i2t, lp_t2i = _log_p_match(scale * sims, same)
        i2t = F.relu(lp_i2t[:nf] - ref_i2t[:nf] + margin).mean()
        t2i = F.relu(lp_t2i[:nf] - ref_t2i[:nf] + margin).mean()
        return 0.5 * (i2t + t2i)
    if objective == "uce":
        return uce_loss(img, txt, scale, labels)
    if objective == "hinge":
        diff = (~same).float()
        n_diff = diff.sum(dim=1).clamp(min=1)
        matched = sims.diagonal()
        neg_i2t = (sims * diff).sum(dim=1) / n_diff
        neg_t2i = (sims.T * diff).sum(dim=1) / n_diff
        return 0.5 * (F.relu(matched - neg_i2t + margin).mean() + F.relu(matched - neg_t2i + margin).mean())
    raise ValueError(f"unknown excision objective {objective!r}")


def bilateral_excision(
    model: ClipLoRA,
    theta: torch.Tensor,
    forget: CaptionDataset,
    *,
    steps: int = 30,
    lr: float = 2e-3,
    batch_size: int = 64,
    objective: str = "uce",
    margin: float = 0.0,
    towers: Sequence[str] = ("image", "text"),
    retain: CaptionDataset | None = None,
    anchor_weight: float = 0.0,
    basis: torch.Tensor | None = None,
    mode: str | None = None,
    reference_theta: torch.Tensor | None = None,
    optimizer: str = "sgd",
    retain_negatives: bool = True,
    seed: int = 0,
    reference_captions: Sequence[str] | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Run BKE from θ on the forget pairs; returns the excised θ and facts for the report.

    ``reference_theta``: the model of the ``"reference"`` objective (default: none; required by that objective);
    ``reference_captions``: the forget pairs' captions as that model reads them (default: their own; the positives
    are still the pairs' own captions).
    """
    if len(forget) == 0 or steps <= 0:
        return theta.clone(), {"steps": 0}
    has_retain = retain is not None and len(retain) > 0
    use_negatives = has_retain and retain_negatives and objective == "reference"
    use_anchor = has_retain and anchor_weight > 0
    ref_emb = ref_retain = None
    if objective == "reference":
        if reference_theta is None:
            raise ValueError("the reference objective needs reference_theta")
        model.set_theta(reference_theta)
        read = forget if reference_captions is None else dataclasses.replace(forget, captions=list(reference_captions))
        ref_emb = model.embed(read)
        if use_negatives:
            ref_retain = model.embed(retain)
        ref_scale = model.model.logit_scale.exp().detach()
    model.set_theta(theta)
    params = model.parameters()
    mask = torch.zeros(theta.numel(), dtype=torch.bool)
    for tower in towers:
        mask |= model.tower_mask(tower)
    # SGD by default: its step is proportional to the gradient, so coordinates the forget pairs barely touch barely
    # move; Adam's per-coordinate normalisation moves every LoRA entry by ~lr and wrecks the retained alignment.
    opt = torch.optim.SGD(params, lr=lr, momentum=0.9) if optimizer == "sgd" else torch.optim.Adam(params, lr=lr)
    gen = torch.Generator().manual_seed(seed)
    all_labels = caption_labels(forget.captions + (retain.captions if has_retain else []))
    f_tokens, f_labels = model.tokens(forget.captions), all_labels[: len(forget)]
    if has_retain:
        r_tokens, r_labels = model.tokens(retain.captions), all_labels[len(forget) :]
    first = last = None
    pair_grads = 0
    for _ in range(steps):
        idx = torch.randperm(len(forget), generator=gen)[: min(batch_size, len(forget))]
        ridx = torch.randperm(len(retain), generator=gen)[: min(batch_size, len(retain))] if has_retain else None
        if use_negatives:
            # the holder's retained pairs join the batch as negatives: the forget pairs must lose their match
            # against captions that differ only in the forgotten concept, not just against each other
            img, txt, scale = model.encode(
                torch.cat([forget.images[idx], retain.images[ridx]]), torch.cat([f_tokens[idx], r_tokens[ridx]])
            )
            labels = torch.cat([f_labels[idx], r_labels[ridx]])
            ref = (
                torch.cat([ref_emb[0][idx], ref_retain[0][ridx]]).to(img.device),
                torch.cat([ref_emb[1][idx], ref_retain[1][ridx]]).to(img.device),
                ref_scale,
            )
            loss = excision_loss(img, txt, scale, labels, objective, margin, ref, n_forget=len(idx))
        else:
            img, txt, scale = model.encode(forget.images[idx], f_tokens[idx])
            ref = None
            if ref_emb is not None:
                ref = (ref_emb[0][idx].to(img.device), ref_emb[1][idx].to(img.device), ref_scale)
            loss = excision_loss(img, txt, scale, f_labels[idx], objective, margin, ref)
        pair_grads += len(idx) + (len(ridx) if (use_negatives or use_anchor) and ridx is not None else 0)
        value = float(loss.detach())
        first = value if first is None else first
        last = value
        if use_anchor:
            if use_negatives:  # the retained pairs are already encoded as the batch's negatives
                r_img, r_txt, r_scale = img[len(idx) :], txt[len(idx) :], scale
            else:
                r_img, r_txt, r_scale = model.encode(retain.images[ridx], r_tokens[ridx])
            loss = loss + anchor_weight * clip_loss(r_img, r_txt, r_scale, r_labels[ridx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        disp = model.get_theta() - theta
        disp = torch.where(mask, disp, torch.zeros_like(disp))
        if basis is not None and basis.shape[1] > 0 and mode == "onto":
            disp = project_onto(disp, basis)
        elif basis is not None and basis.shape[1] > 0 and mode == "off":
            disp = project_out(disp, basis)
        model.set_theta(theta + disp)
    out = model.get_theta()
    return out, {
        "steps": steps,
        "objective": objective,
        "towers": list(towers),
        "loss_first": first,
        "loss_last": last,
        "displacement_norm": float(torch.linalg.norm(out - theta)),
        "pair_grads": pair_grads,
    }

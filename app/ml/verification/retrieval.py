"""Image→text and text→image Recall@K on a set of image–caption pairs.

Why text equality: captions repeat (the synthetic world has a small attribute space; Flickr30K/COCO repeat short
captions too), so a retrieval counts as correct when the retrieved caption's *text* equals the query's ground-truth
text (i→t), or when the retrieved image's own caption equals the query caption (t→i) — retrieving an identical twin
is not an error.

Why an optional distractor gallery: a forget set can share the concept being forgotten in every caption ("every
caption with *purple*"); retrieval inside such a set never needs the concept. Adding a fixed set of distractor pairs
(e.g. the held-out test pairs) to the gallery makes the concept discriminative. The same gallery is used for every
model compared, so it changes difficulty, not ranking fairness.

EASE reports R@1 on the forget side and the retain side (ease-notes §5); whether the paper averages both directions
is [UNKNOWN]; here ``mean_r1`` is the mean of i→t and t→i R@1, in points (0–100).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import torch


@dataclass(frozen=True)
class RetrievalScores:
    """Recalls as fractions in [0, 1]; ``mean_r1`` in points."""

    i2t_r1: float
    i2t_r5: float
    t2i_r1: float
    t2i_r5: float
    n_queries: int
    gallery_size: int

    @property
    def mean_r1(self) -> float:
        return 50.0 * (self.i2t_r1 + self.t2i_r1)

    def to_dict(self) -> dict[str, float]:
        return {**asdict(self), "mean_r1": self.mean_r1}


def _caption_ids(captions: Sequence[str]) -> tuple[dict[str, int], list[int]]:
    vocab: dict[str, int] = {}
    ids = [vocab.setdefault(c.strip().lower(), len(vocab)) for c in captions]
    return vocab, ids


def recall_at_k(
    query: torch.Tensor,
    gallery: torch.Tensor,
    query_labels: torch.Tensor,
    gallery_labels: torch.Tensor,
    ks: Sequence[int] = (1, 5),
    chunk: int = 1024,
) -> dict[int, float]:
    """Fraction of queries whose top-k gallery items contain an item with the same label (label = caption text id)."""
    hits = {k: 0 for k in ks}
    kmax = min(max(ks), gallery.shape[0])
    for start in range(0, query.shape[0], chunk):
        sims = query[start : start + chunk] @ gallery.T
        top = sims.topk(kmax, dim=1).indices
        match = gallery_labels[top] == query_labels[start : start + chunk, None]
        for k in ks:
            hits[k] += int(match[:, : min(k, kmax)].any(dim=1).sum())
    n = max(query.shape[0], 1)
    return {k: hits[k] / n for k in ks}


def retrieval_scores(
    image_emb: torch.Tensor,
    text_emb: torch.Tensor,
    captions: Sequence[str],
    distractor_image_emb: torch.Tensor | None = None,
    distractor_text_emb: torch.Tensor | None = None,
    distractor_captions: Sequence[str] = (),
) -> RetrievalScores:
    """R@1/R@5 both ways for the pairs (image_emb[i], text_emb[i], captions[i]); embeddings are L2-normalised.

    Queries are the set's own pairs; the gallery is the set plus the optional distractor pairs.
    """
    n = len(captions)
    if n == 0:
        return RetrievalScores(0.0, 0.0, 0.0, 0.0, 0, 0)
    all_captions = list(captions) + list(distractor_captions)
    _, ids = _caption_ids(all_captions)
    labels = torch.tensor(ids)
    gal_img, gal_txt = image_emb.float(), text_emb.float()
    if distractor_captions:
        assert distractor_image_emb is not None and distractor_text_emb is not None
        gal_img = torch.cat([gal_img, distractor_image_emb.float()])
        gal_txt = torch.cat([gal_txt, distractor_text_emb.float()])
    i2t = recall_at_k(image_emb.float(), gal_txt, labels[:n], labels)
    t2i = recall_at_k(text_emb.float(), gal_img, labels[:n], labels)
    return RetrievalScores(i2t[1], i2t[5], t2i[1], t2i[5], n_queries=n, gallery_size=len(all_captions))


class _Embedder(Protocol):
    def embed(self, data: Any) -> tuple[torch.Tensor, torch.Tensor]: ...


def evaluate_retrieval(model: _Embedder, data: Any, distractors: Any | None = None) -> RetrievalScores:
    """Embed ``data`` (a CaptionDataset) and optional distractor pairs with ``model`` and score retrieval."""
    img, txt = model.embed(data)
    if distractors is None or len(distractors) == 0:
        return retrieval_scores(img, txt, data.captions)
    d_img, d_txt = model.embed(distractors)
    return retrieval_scores(img, txt, data.captions, d_img, d_txt, distractors.captions)

"""Per-example membership statistics: LiRA's logit-scaled confidence, for tabular classifiers and for CLIP pairs.

LiRA (Carlini et al. 2022, §IV-C; notes Part 2 §2.1) fits Gaussians to φ(p) = log(p_y / (1 − p_y)) because that
statistic, unlike the raw confidence or the cross-entropy loss, is close to Gaussian over the training randomness.
From logits z it is

    φ = log p_y − log Σ_{y′≠y} p_{y′} = z_y − LogSumExp_{y′≠y} z_{y′}

which is exact in float64 for any logits: no probability is formed, so nothing underflows to 0 or rounds to 1 (the
released code instead adds 1e-45 to probabilities, which caps |φ| near 103 and loses resolution long before).

CLIP (notes §2.6, [INFERENCE] there, adopted here): an image–caption pair is treated like an example whose "label" is
its caption inside a fixed caption gallery, so φ is the same statistic over the similarity logits τ·cos(image, c′)
(image→text), and symmetrically over an image gallery for the caption (text→image). The gallery must be the same for
every model compared (target, shadows, retrained), else the statistic changes meaning between them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

ArrayLike = np.ndarray | torch.Tensor | Sequence[float]


def _as_f64(a: ArrayLike) -> np.ndarray:
    if isinstance(a, torch.Tensor):
        return a.detach().to("cpu", torch.float64).numpy()
    return np.asarray(a, dtype=np.float64)


def _binary_to_two_column(logits: np.ndarray) -> np.ndarray:
    """A single logit per row (sigmoid models) means class 0 has logit 0 and class 1 has logit z."""
    z = logits.reshape(-1, 1)
    return np.concatenate([np.zeros_like(z), z], axis=1)


def logit_scaled_confidence(
    logits: ArrayLike, labels: ArrayLike, exclude: np.ndarray | torch.Tensor | None = None
) -> np.ndarray:
    """φ = z_y − LogSumExp_{y′≠y} z_{y′} per row (float64), LiRA's statistic (Carlini et al. 2022, Eq. 4 in logit form).

    ``logits`` is [n, C] (C ≥ 2), or [n] / [n, 1] for a binary sigmoid model (then φ = z for y = 1 and −z for y = 0).
    ``exclude`` (bool [n, C], optional) marks further columns to leave out of the "other classes" sum: for CLIP these
    are gallery items identical to the true one (a repeated caption is not a competitor; retrieval.py's reasoning).
    """
    z = _as_f64(logits)
    y = _as_f64(labels).astype(np.int64).reshape(-1)
    if z.ndim == 1 or (z.ndim == 2 and z.shape[1] == 1):
        z = _binary_to_two_column(z)
    if z.ndim != 2 or z.shape[0] != y.shape[0]:
        raise ValueError(f"logits must be [n, C] with n = len(labels); got {z.shape} and {y.shape}")
    n, c = z.shape
    if n and (y.min() < 0 or y.max() >= c):
        raise ValueError(f"labels must lie in [0, {c})")
    rows = np.arange(n)
    true = z[rows, y]
    if c == 2 and exclude is None:  # one competitor: its LogSumExp is its logit (m + log(e⁰) = m), the same bits
        other = z[rows, 1 - y]
        return true - np.where(np.isfinite(other), other, -np.inf)
    others = z.copy()
    others[rows, y] = -np.inf
    if exclude is not None:
        ex = _as_f64(exclude).astype(bool)
        if ex.shape != z.shape:
            raise ValueError(f"exclude must have the logits' shape {z.shape}; got {ex.shape}")
        others[ex] = -np.inf
    # LogSumExp with the max taken out; a row with no competitor left has lse = -inf and φ = +inf (nothing to beat).
    m = others.max(axis=1)
    finite = np.isfinite(m)
    lse = np.full(n, -np.inf)
    if finite.any():
        shifted = others[finite] - m[finite, None]
        lse[finite] = m[finite] + np.log(np.exp(shifted).sum(axis=1))
    return true - lse


def phi_from_proba(proba: ArrayLike, labels: ArrayLike) -> np.ndarray:
    """φ from probabilities, for models that have no single set of logits (SISA ensembles average probabilities).

    log p_y − log Σ_{y′≠y} p_{y′}, summing the other classes directly (not 1 − p_y, which cancels) and flooring at
    the smallest positive float64, like the released code's +1e-45 guard; |φ| then saturates near 745.
    """
    p = _as_f64(proba)
    y = _as_f64(labels).astype(np.int64).reshape(-1)
    rows = np.arange(p.shape[0])
    masked = p.copy()
    masked[rows, y] = 0.0
    others = masked.sum(axis=1)
    tiny = np.finfo(np.float64).tiny
    return np.log(np.maximum(p[rows, y], tiny)) - np.log(np.maximum(others, tiny))


def hinge_confidence(logits: ArrayLike, labels: ArrayLike) -> np.ndarray:
    """z_y − max_{y′≠y} z_{y′}: the alternative LiRA reports "performs similarly" (notes §2.1); a lower bound of φ."""
    z = _as_f64(logits)
    y = _as_f64(labels).astype(np.int64).reshape(-1)
    if z.ndim == 1 or (z.ndim == 2 and z.shape[1] == 1):
        z = _binary_to_two_column(z)
    rows = np.arange(z.shape[0])
    others = z.copy()
    others[rows, y] = -np.inf
    return z[rows, y] - others.max(axis=1)


def cross_entropy(logits: ArrayLike, labels: ArrayLike) -> np.ndarray:
    """Per-row −log p_y, computed as LogSumExp(z) − z_y (float64; no underflow)."""
    z = _as_f64(logits)
    y = _as_f64(labels).astype(np.int64).reshape(-1)
    if z.ndim == 1 or (z.ndim == 2 and z.shape[1] == 1):
        z = _binary_to_two_column(z)
    m = z.max(axis=1)
    lse = m + np.log(np.exp(z - m[:, None]).sum(axis=1))
    return lse - z[np.arange(z.shape[0]), y]


# ---------------------------------------------------------------------------------------------- CLIP
def similarity_logits(
    query_emb: torch.Tensor, gallery_emb: torch.Tensor, logit_scale: float | torch.Tensor
) -> np.ndarray:
    """τ · cos(query, gallery) as float64 [n_query, n_gallery]; embeddings are L2-normalised here (idempotent)."""
    q = torch.nn.functional.normalize(torch.as_tensor(query_emb).detach().to("cpu", torch.float64), dim=-1)
    g = torch.nn.functional.normalize(torch.as_tensor(gallery_emb).detach().to("cpu", torch.float64), dim=-1)
    return (float(torch.as_tensor(logit_scale)) * (q @ g.T)).numpy()


def _twin_mask(
    query_keys: Sequence[str] | None, gallery_keys: Sequence[str] | None, targets: np.ndarray
) -> np.ndarray | None:
    """Gallery items whose caption text equals the query's true caption (other than the true item itself)."""
    if query_keys is None or gallery_keys is None:
        return None
    norm_g = np.array([k.strip().lower() for k in gallery_keys], dtype=object)
    norm_q = np.array([k.strip().lower() for k in query_keys], dtype=object)
    mask = norm_g[None, :] == norm_q[:, None]
    mask[np.arange(len(targets)), targets] = False
    return mask


def clip_pair_confidence(
    image_emb: torch.Tensor,
    text_emb: torch.Tensor,
    logit_scale: float | torch.Tensor,
    gallery_image_emb: torch.Tensor | None = None,
    gallery_text_emb: torch.Tensor | None = None,
    captions: Sequence[str] | None = None,
    gallery_captions: Sequence[str] | None = None,
) -> dict[str, np.ndarray]:
    """φ for each pair (image_emb[i], text_emb[i]) in both directions, over a fixed gallery (notes §2.6 [INFERENCE]).

    The gallery is the pairs themselves followed by the optional distractor pairs (``gallery_*``; e.g. held-out pairs
    fixed for every model compared), so pair i's true caption is gallery column i. Image→text: the image's logits
    over the gallery captions, label i. Text→image: the caption's logits over the gallery images, label i. With
    ``captions`` (and ``gallery_captions`` for distractors) gallery items whose text equals the true caption are left
    out of the competitors, so a repeated caption does not cap φ. Returns ``{"i2t", "t2i", "mean"}`` (float64 [n]);
    "mean" averages the two directions (notes §2.6 step 3, optional symmetrisation).
    """
    n = int(image_emb.shape[0])
    if int(text_emb.shape[0]) != n:
        raise ValueError("image_emb and text_emb must hold the same pairs")
    gal_txt, gal_img = text_emb, image_emb
    if gallery_text_emb is not None or gallery_image_emb is not None:
        if gallery_text_emb is None or gallery_image_emb is None:
            raise ValueError("give both gallery_image_emb and gallery_text_emb, or neither")
        gal_txt = torch.cat([torch.as_tensor(text_emb), torch.as_tensor(gallery_text_emb).to(text_emb.dtype)])
        gal_img = torch.cat([torch.as_tensor(image_emb), torch.as_tensor(gallery_image_emb).to(image_emb.dtype)])
    targets = np.arange(n)
    keys = None
    if captions is not None:
        keys = list(captions) + list(gallery_captions or [])
        if len(keys) != int(gal_txt.shape[0]):
            raise ValueError("captions (+ gallery_captions) must name every gallery item")
    twins = _twin_mask(list(captions) if captions is not None else None, keys, targets)
    i2t = logit_scaled_confidence(similarity_logits(image_emb, gal_txt, logit_scale), targets, twins)
    t2i = logit_scaled_confidence(similarity_logits(text_emb, gal_img, logit_scale), targets, twins)
    return {"i2t": i2t, "t2i": t2i, "mean": 0.5 * (i2t + t2i)}

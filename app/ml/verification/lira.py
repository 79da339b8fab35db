"""LiRA (Carlini et al., S&P 2022) and U-LiRA distinguishability (Hayes et al. 2025, as run in CLEAR; notes §2.1, §2.3).

LiRA models a target row's statistic φ (signals.py) over the randomness of training as a Gaussian when the row was
IN the training set and another when it was OUT, both fitted from shadow models (shadows.py):

- online (Alg. 1): score = log 𝒩(φ; μ_in, σ²_in) − log 𝒩(φ; μ_out, σ²_out), the log likelihood ratio Λ;
- offline (§VI-C): only OUT shadows, one-sided: Λ = 1 − Pr[Z > φ], Z ~ 𝒩(μ_out, σ²_out). We return the
  equivalent z = (φ − μ_out)/σ_out (Λ = Φ(z) is monotone in it, so every ROC figure is the same) because Φ(z) rounds
  to 1 in float64 for z > 8, which would tie exactly the rows an attack is most sure about.

Variance (§VI-B, notes §2.1): with fewer than 64 shadows σ_in / σ_out are estimated globally and the means per
example; at 64 and above, per example. "Globally" is implemented as the pooled within-example variance (residuals
about each row's own mean, pooled over rows) [INFERENCE]: the paper does not give the formula, and the released
plot.py's ``np.std(dat_in)`` over the raw statistics also counts the spread *between* rows' means, and uses the IN
pool for σ_out too (a bug, notes §2.1).

Metrics (§III-B, notes §2.1 / §2.4): TPR at a fixed low FPR (the largest TPR over thresholds whose FPR ≤ the target,
as ML Privacy Meter computes it) and the full ROC; AUC is reported but LiRA argues it says little about privacy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import stats

PER_EXAMPLE_VARIANCE_MIN_SHADOWS = 64
"""Carlini et al. 2022 §VI-B: below 64 shadows a global variance estimate beats the noisy per-example one."""
MIN_STD = 1e-9
"""Floor on a fitted σ so a degenerate fit (identical φ across shadows) gives a finite, very sharp Gaussian."""
REPORT_FPRS = (0.001, 0.01)
"""LiRA's Table I reports 0.1 % (and 0.001 %); Privacy Meter reports 1 % and 0.1 % (notes §2.4)."""
VARIANCES = ("auto", "global", "per_example")
CENTERS = ("mean", "median")
MODES = ("online", "offline")


# ---------------------------------------------------------------------------------------------- Gaussian fits
@dataclass
class GaussianFit:
    """Per-row IN / OUT Gaussians of φ fitted from shadows (float64 [n] each); counts per row; variance choice."""

    mu_in: np.ndarray
    std_in: np.ndarray
    mu_out: np.ndarray
    std_out: np.ndarray
    n_in: np.ndarray
    n_out: np.ndarray
    variance: str


def _resolve_variance(variance: str, n_shadows: int) -> str:
    if variance not in VARIANCES:
        raise ValueError(f"unknown variance {variance!r}; expected one of {VARIANCES}")
    if variance == "auto":
        return "per_example" if n_shadows >= PER_EXAMPLE_VARIANCE_MIN_SHADOWS else "global"
    return variance


def _masked_center(values: np.ndarray, mask: np.ndarray, center: str) -> np.ndarray:
    """Column mean or median over the masked entries; NaN for a column with none."""
    count = mask.sum(axis=0)
    out = np.full(values.shape[1], np.nan)
    has = count > 0
    if center == "median":
        for j in np.flatnonzero(has):
            out[j] = np.median(values[mask[:, j], j])
    else:
        out[has] = np.where(mask, values, 0.0).sum(axis=0)[has] / count[has]
    return out


def _side(
    values: np.ndarray, mask: np.ndarray, center: str, variance: str, groups: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Mean and σ of the masked entries of each column ([N, n] -> [n], [n]); NaN where a column has < 2 entries.
    A global σ is pooled within each of ``groups`` (column labels; one group by default)."""
    count = mask.sum(axis=0)
    mu = _masked_center(values, mask, center)
    resid2 = np.where(mask, (values - np.nan_to_num(mu)[None, :]) ** 2, 0.0)
    usable = count >= 2
    std = np.full(values.shape[1], np.nan)
    if variance == "global":
        labels = np.zeros(values.shape[1], dtype=np.int64) if groups is None else np.asarray(groups)
        for label in np.unique(labels):
            cols = usable & (labels == label)
            dof = int((count[cols] - 1).sum())
            if dof > 0:
                std[cols] = np.sqrt(resid2[:, cols].sum() / dof)
    else:
        std[usable] = np.sqrt(resid2[:, usable].sum(axis=0) / (count[usable] - 1))
    return mu, np.maximum(std, MIN_STD)


def fit_gaussians(
    shadow_phi: np.ndarray,
    in_mask: np.ndarray,
    variance: str = "auto",
    center: str = "mean",
    groups: np.ndarray | None = None,
) -> GaussianFit:
    """Fit 𝒩(μ_in, σ²_in) and 𝒩(μ_out, σ²_out) per row from shadows' φ [N, n] and membership [N, n] (Alg. 1 l. 6–9).

    ``center`` "mean" follows the paper; "median" is what the released plot.py uses (notes §2.1 [CODE]).
    A row with fewer than two IN (OUT) shadows gets NaN for that side. ``groups``: row labels within which a global
    variance is pooled (a CLIP deletion's forget pairs vary more from run to run than its non-members: clip_shadows).
    """
    phi = np.asarray(shadow_phi, dtype=np.float64)
    mask = np.asarray(in_mask, dtype=bool)
    if phi.ndim != 2 or phi.shape != mask.shape:
        raise ValueError(f"shadow_phi and in_mask must both be [N, n]; got {phi.shape} and {mask.shape}")
    if center not in CENTERS:
        raise ValueError(f"unknown center {center!r}; expected one of {CENTERS}")
    var = _resolve_variance(variance, phi.shape[0])
    mu_in, std_in = _side(phi, mask, center, var, groups)
    mu_out, std_out = _side(phi, ~mask, center, var, groups)
    return GaussianFit(mu_in, std_in, mu_out, std_out, mask.sum(0), (~mask).sum(0), var)


def online_scores(phi_target: np.ndarray, fit: GaussianFit) -> np.ndarray:
    """log Λ = log p(φ | 𝒩_in) − log p(φ | 𝒩_out) per row (Carlini et al. 2022, Alg. 1 line 12, in logs)."""
    phi = np.asarray(phi_target, dtype=np.float64)
    if np.any(fit.n_in < 2) or np.any(fit.n_out < 2):
        raise ValueError("online LiRA needs at least two IN and two OUT shadows for every target row; use offline")
    return stats.norm.logpdf(phi, fit.mu_in, fit.std_in) - stats.norm.logpdf(phi, fit.mu_out, fit.std_out)


def offline_scores(phi_target: np.ndarray, fit: GaussianFit, predictive: bool = False) -> np.ndarray:
    """One-sided offline test (§VI-C): z = (φ − μ_out) / σ_out; Λ = Φ(z) = 1 − Pr[Z > φ] is monotone in z.

    ``predictive`` divides instead by σ_out·√(1 + 1/n_out), the spread of φ − μ̂_out when μ̂_out is the mean of n_out
    shadows [INFERENCE]: rows with fewer OUT shadows (a CLIP audit's forget pairs against its never-trained
    non-members) would otherwise get a wider null distribution and be flagged more often at a low FPR by chance
    alone. Where every row has the same n_out it is a constant factor and changes no ROC.
    """
    phi = np.asarray(phi_target, dtype=np.float64)
    if np.any(fit.n_out < 2):
        raise ValueError("offline LiRA needs at least two OUT shadows for every target row")
    std = fit.std_out * np.sqrt(1.0 + 1.0 / fit.n_out) if predictive else fit.std_out
    return (phi - fit.mu_out) / std


def lira_scores(
    phi_target: np.ndarray,
    shadow_phi: np.ndarray,
    in_mask: np.ndarray,
    mode: str = "online",
    variance: str = "auto",
    center: str = "mean",
) -> np.ndarray:
    """Membership scores (higher = more likely a member) of a target model's φ on rows, given the shadows on them."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")
    fit = fit_gaussians(shadow_phi, in_mask, variance, center)
    return online_scores(phi_target, fit) if mode == "online" else offline_scores(phi_target, fit)


def offline_p_values(phi_target: np.ndarray, fit: GaussianFit) -> np.ndarray:
    """Pr[Z ≥ φ] under the OUT Gaussian: the per-row p-value of "this row was not trained on" (for reports)."""
    return stats.norm.sf(offline_scores(phi_target, fit))


# ---------------------------------------------------------------------------------------------- ROC
@dataclass
class Roc:
    """ROC of "member if score ≥ threshold": fpr, tpr and thresholds (descending, starting at +inf) and AUC."""

    fpr: np.ndarray
    tpr: np.ndarray
    thresholds: np.ndarray
    auc: float
    n_members: int
    n_nonmembers: int


def _clean(scores: np.ndarray, name: str) -> np.ndarray:
    s = np.asarray(scores, dtype=np.float64).reshape(-1)
    if np.isnan(s).any():
        raise ValueError(f"{name} contain NaN")
    return s


def roc_curve(member_scores: np.ndarray, nonmember_scores: np.ndarray) -> Roc:
    """Every distinct threshold t (predict member when score ≥ t), from +inf (0, 0) down to the lowest (1, 1).

    AUC is the trapezoid area, which equals Pr[member score > non-member score] + ½ Pr[tie].
    """
    pos, neg = _clean(member_scores, "member scores"), _clean(nonmember_scores, "non-member scores")
    if pos.size == 0 or neg.size == 0:
        raise ValueError("a ROC needs at least one member and one non-member score")
    scores = np.concatenate([pos, neg])
    labels = np.concatenate([np.ones(pos.size), np.zeros(neg.size)])
    order = np.argsort(-scores, kind="mergesort")
    scores, labels = scores[order], labels[order]
    last_of_value = np.r_[np.flatnonzero(np.diff(scores) != 0), scores.size - 1]
    tp = np.cumsum(labels)[last_of_value]
    fp = (last_of_value + 1) - tp
    tpr = np.r_[0.0, tp / pos.size]
    fpr = np.r_[0.0, fp / neg.size]
    thresholds = np.r_[np.inf, scores[last_of_value]]
    auc = float(np.trapezoid(tpr, fpr))
    return Roc(fpr, tpr, thresholds, auc, int(pos.size), int(neg.size))


def tpr_at_fpr(roc: Roc, fpr: float) -> float:
    """Largest TPR over thresholds whose FPR ≤ ``fpr`` (ML Privacy Meter's definition, notes §2.4).

    Below 1 / n_nonmembers this is the TPR at FPR 0: the fraction of members scoring above every non-member.
    """
    ok = roc.fpr <= fpr + 1e-12
    return float(roc.tpr[ok].max())


def threshold_at_fpr(roc: Roc, fpr: float) -> float:
    """The threshold that attains ``tpr_at_fpr`` (the lowest one with FPR ≤ ``fpr``)."""
    ok = np.flatnonzero(roc.fpr <= fpr + 1e-12)
    best = ok[np.argmax(roc.tpr[ok])]
    return float(roc.thresholds[best])


def attack_summary(
    member_scores: np.ndarray, nonmember_scores: np.ndarray, fprs: tuple[float, ...] = REPORT_FPRS
) -> dict[str, object]:
    """Plain-dict figures of one attack: TPR and member detections at each FPR, AUC, sample sizes.

    The figures of ``roc_curve`` + ``tpr_at_fpr`` without building the curve (one sort of the non-members, then a
    binary search per member): a batch audits hundreds of requests against the same non-members. With the
    non-members sorted descending n_1 ≥ … ≥ n_m and a = ⌊(f + 1e-12)·m⌋ false positives allowed, the best threshold
    lies just above n_(a+1), so TPR@f = #{member > n_(a+1)} / k (every threshold when a ≥ m: TPR 1); the AUC is
    Pr[member > non-member] + ½ Pr[tie], which the trapezoid over the full ROC equals."""
    pos, neg = _clean(member_scores, "member scores"), _clean(nonmember_scores, "non-member scores")
    if pos.size == 0 or neg.size == 0:
        raise ValueError("a ROC needs at least one member and one non-member score")
    k, m = pos.size, neg.size
    asc = np.sort(neg)
    tprs = {}
    for f in fprs:
        allowed = int(np.floor((f + 1e-12) * m))
        if allowed >= m:
            tprs[fpr_key(f)] = 1.0
            continue
        cut = asc[m - 1 - allowed]  # n_(allowed + 1), the (allowed + 1)-th largest
        tprs[fpr_key(f)] = float(np.count_nonzero(pos > cut) / k)
    below = np.searchsorted(asc, pos, side="left")
    tied = np.searchsorted(asc, pos, side="right") - below
    auc = float((below.sum() + 0.5 * tied.sum()) / (k * m))
    return {
        "tpr_at_fpr": tprs,
        "detected_at_fpr": {key: int(round(v * k)) for key, v in tprs.items()},
        "auc": auc,
        "n_members": int(k),
        "n_nonmembers": int(m),
        "fpr_resolution": 1.0 / m,
    }


def fpr_key(fpr: float) -> str:
    """Report key of an FPR: "0.001", "0.01" (JSON keys must be strings)."""
    return format(float(fpr), "g")


# ---------------------------------------------------------------------------------------------- U-LiRA
def ulira_distinguishability(
    phi_unlearned: np.ndarray,
    phi_never: np.ndarray,
    n_folds: int = 2,
    variance: str = "auto",
    center: str = "mean",
    seed: int = 0,
    fprs: tuple[float, ...] = REPORT_FPRS,
) -> dict[str, object]:
    """Per-example U-LiRA: can a Gaussian LRT tell "trained on x, then unlearned" from "never trained on x"?

    Inputs are φ of each example under models of the two kinds: ``phi_unlearned`` [M_u, n] (models whose training
    set held x, with x then unlearned by the method under test) and ``phi_never`` [M_r, n] (models that never saw x,
    ideally retrained without it). NaN marks "this model is not of that kind for this example". Following the
    two-distribution test of Hayes et al. as CLEAR runs it (notes §2.3 [SECONDARY]), each example's models are
    cross-fitted: in each of ``n_folds`` folds, Gaussians are fitted on the other folds' models (the shadows) and the
    held-out models (the targets) are scored with log 𝒩(φ; unlearned) − log 𝒩(φ; never).

    Returns per-example balanced accuracy of the rule "score > 0 ⇒ unlearned" and per-example AUC (float arrays
    [n]; 0.5 is indistinguishable, i.e. perfect unlearning), their means, and the pooled ROC figures over all
    (example, target model) scores — TPR at ``fprs`` with "unlearned" as the positive class.
    """
    pu = np.asarray(phi_unlearned, dtype=np.float64)
    pr = np.asarray(phi_never, dtype=np.float64)
    if pu.ndim != 2 or pr.ndim != 2 or pu.shape[1] != pr.shape[1]:
        raise ValueError("phi_unlearned [M_u, n] and phi_never [M_r, n] must cover the same examples")
    if n_folds < 2:
        raise ValueError("n_folds must be at least 2 (a fold's targets must not be its shadows)")
    rng = np.random.default_rng(seed)
    fold_u = rng.permutation(pu.shape[0]) % n_folds
    fold_r = rng.permutation(pr.shape[0]) % n_folds
    n = pu.shape[1]
    scores_u = np.full(pu.shape, np.nan)
    scores_r = np.full(pr.shape, np.nan)
    for f in range(n_folds):
        fit_u = ~np.isnan(pu) & (fold_u != f)[:, None]
        fit_r = ~np.isnan(pr) & (fold_r != f)[:, None]
        # one fit per side: _side treats the mask as "IN", so reuse it for each group separately
        var = _resolve_variance(variance, int(fit_u.shape[0] + fit_r.shape[0]))
        mu_u, sd_u = _side(np.nan_to_num(pu), fit_u, center, var)
        mu_r, sd_r = _side(np.nan_to_num(pr), fit_r, center, var)
        if np.isnan(mu_u).any() or np.isnan(mu_r).any() or (fit_u.sum(0) < 2).any() or (fit_r.sum(0) < 2).any():
            raise ValueError("every example needs at least two models of each kind outside every fold")

        def llr(phi: np.ndarray, mu_u=mu_u, sd_u=sd_u, mu_r=mu_r, sd_r=sd_r) -> np.ndarray:
            return stats.norm.logpdf(phi, mu_u, sd_u) - stats.norm.logpdf(phi, mu_r, sd_r)

        tu = (fold_u == f)[:, None] & ~np.isnan(pu)
        tr = (fold_r == f)[:, None] & ~np.isnan(pr)
        scores_u = np.where(tu, llr(pu), scores_u)
        scores_r = np.where(tr, llr(pr), scores_r)
    acc = np.full(n, np.nan)
    auc = np.full(n, np.nan)
    for j in range(n):
        su, sr = scores_u[:, j], scores_r[:, j]
        su, sr = su[~np.isnan(su)], sr[~np.isnan(sr)]
        acc[j] = 0.5 * (float((su > 0).mean()) + float((sr <= 0).mean()))
        auc[j] = roc_curve(su, sr).auc
    pooled = attack_summary(scores_u[~np.isnan(scores_u)], scores_r[~np.isnan(scores_r)], fprs)
    return {
        "per_example_accuracy": acc,
        "per_example_auc": auc,
        "mean_accuracy": float(acc.mean()),
        "mean_auc": float(auc.mean()),
        "pooled": pooled,
        "n_examples": int(n),
        "n_models": {"unlearned": int(pu.shape[0]), "never": int(pr.shape[0])},
        "n_folds": int(n_folds),
    }

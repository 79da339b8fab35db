"""What an audit's plots show, as small JSON-safe figures: LiRA's ROC per model and histograms of φ on the forget set
(the reports domain draws them, on demand, in ``app/reports/plots.py``).

Why log-log (Carlini et al. 2022 §III-B, notes §2.1): the privacy-relevant region is the low-FPR corner, which a
linear ROC squeezes into a few pixels. The histograms show what the TPR figures summarise: after exact unlearning
the forget rows' φ should look like the non-members' φ, not like the original model's.

Why data, not PNGs (issue 21): drawing both figures took ~1 s of every deletion's critical path; a deletion now keeps
the curves and bin counts (aggregates, the same as the pictures show, never a row's own score) and a PNG is drawn
the first time someone asks for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from app.ml.verification.audit import AuditScores
from app.ml.verification.lira import roc_curve

HIST_BINS = 30
ROC_POINTS = 1500
"""Most points a stored ROC keeps (a log-spaced FPR grid: the low-FPR corner in full, the rest as a picture needs);
a 1M-row model's 200,000 non-members made every step a point (0.4 s and megabytes of JSON per audit)."""
PLOT_NAMES = ("roc.png", "phi_hist.png")


def roc_data(
    scores: Mapping[str, tuple[np.ndarray, np.ndarray]], title: str = "LiRA on the forget set", chance_fpr: float = 0.01
) -> dict[str, Any]:
    """The ROC per model from (member scores, non-member scores): its steps, AUC and the two counts (the log axes
    start at half the finest resolution, since FPR or TPR 0 cannot be drawn on them)."""
    curves = {}
    for name, (members, nonmembers) in scores.items():
        roc = roc_curve(members, nonmembers)
        fpr, tpr = _thinned(roc.fpr, roc.tpr, 0.5 / roc.n_nonmembers)
        curves[name] = {
            "fpr": np.round(fpr, 6).tolist(),
            "tpr": np.round(tpr, 6).tolist(),
            "auc": round(roc.auc, 6),
            "n_members": roc.n_members,
            "n_nonmembers": roc.n_nonmembers,
        }
    return {"title": title, "chance_fpr": chance_fpr, "curves": curves}


def _thinned(fpr: np.ndarray, tpr: np.ndarray, lowest: float) -> tuple[np.ndarray, np.ndarray]:
    """At most ~ROC_POINTS points of a step curve: at each FPR of a log-spaced grid, the highest TPR reached at or
    below it (what the step curve shows there). Curves that are short already are kept whole."""
    if len(fpr) <= ROC_POINTS:
        return np.asarray(fpr), np.asarray(tpr)
    grid = np.unique(np.r_[0.0, np.geomspace(lowest, 1.0, ROC_POINTS - 1), fpr[-1]])
    at = np.searchsorted(fpr, grid, side="right") - 1
    return grid, np.maximum.accumulate(np.asarray(tpr)[np.clip(at, 0, None)])


def histogram_data(
    forget_phi: Mapping[str, np.ndarray],
    nonmember_phi: Mapping[str, np.ndarray] | None = None,
    title: str = "φ on the forget set",
) -> dict[str, Any]:
    """Per model, density histograms of φ on the forget rows and on the non-members, over one shared set of bins
    (values beyond the finite range are counted in the edge bins)."""
    names = list(forget_phi)
    if not names:
        raise ValueError("nothing to plot")
    nonmember_phi = nonmember_phi or {}
    every = [np.asarray(v, dtype=np.float64) for v in [*forget_phi.values(), *nonmember_phi.values()]]
    finite = np.concatenate([v[np.isfinite(v)] for v in every])
    lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (-1.0, 1.0)
    edges = np.linspace(lo, hi if hi > lo else lo + 1.0, HIST_BINS + 1)

    def density(values) -> dict[str, Any]:
        v = np.clip(np.nan_to_num(np.asarray(values, dtype=np.float64), nan=lo), edges[0], edges[-1])
        counts, _ = np.histogram(v, bins=edges, density=True) if v.size else (np.zeros(HIST_BINS), None)
        return {"density": [round(float(c), 6) for c in counts], "n": int(v.size)}

    return {
        "title": title,
        "edges": [float(e) for e in edges],
        "forget": {name: density(forget_phi[name]) for name in names},
        "nonmembers": {name: density(nonmember_phi[name]) for name in names if name in nonmember_phi},
    }


def plot_data(scores: AuditScores) -> dict[str, dict[str, Any]]:
    """Both figures of an audit: {"roc.png": …, "phi_hist.png": …}, each what ``app.reports.plots`` draws."""
    return {
        "roc.png": roc_data({k: (scores.forget_scores[k], scores.nonmember_scores[k]) for k in scores.forget_scores}),
        "phi_hist.png": histogram_data(scores.forget_phi, scores.nonmember_phi),
    }

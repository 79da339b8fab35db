"""Audit plots as PNG bytes: LiRA's log-log ROC and histograms of φ on the forget set, per model.

Why log-log (Carlini et al. 2022 §III-B, notes §2.1): the privacy-relevant region is the low-FPR corner, which a
linear ROC squeezes into a few pixels. The histograms show what the TPR figures summarise: after exact unlearning
the forget rows' φ should look like the non-members' φ, not like the original model's.

Matplotlib's object API with the Agg canvas (no pyplot): no global backend switch and no shared figure state, so
it is safe in a worker thread.
"""

from __future__ import annotations

import io
from collections.abc import Mapping

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from app.ml.verification.audit import AuditScores
from app.ml.verification.lira import roc_curve

MODEL_COLOURS = {"original": "tab:red", "unlearned": "tab:blue", "retrained": "tab:green"}
HIST_BINS = 30
DPI = 110


def _png(fig: Figure) -> bytes:
    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    return buf.getvalue()


def roc_plot(
    scores: Mapping[str, tuple[np.ndarray, np.ndarray]], title: str = "LiRA on the forget set", chance_fpr: float = 0.01
) -> bytes:
    """Log-log ROC per model from (member scores, non-member scores); the diagonal is chance.

    Points at FPR or TPR 0 cannot be drawn on log axes; the axes start at half the finest resolution instead.
    """
    fig = Figure(figsize=(5.0, 4.6))
    ax = fig.add_subplot()
    lo = 1.0
    for name, (members, nonmembers) in scores.items():
        roc = roc_curve(members, nonmembers)
        lo = min(lo, 0.5 / roc.n_nonmembers, 0.5 / roc.n_members)
        label = f"{name} (AUC {roc.auc:.3f})"
        ax.plot(roc.fpr, roc.tpr, drawstyle="steps-post", color=MODEL_COLOURS.get(name), label=label)
    ax.plot([lo, 1.0], [lo, 1.0], ls="--", color="grey", lw=0.8, label="chance")
    ax.axvline(chance_fpr, color="grey", lw=0.5, ls=":")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, 1.0)
    ax.set_ylim(lo, 1.05)
    ax.set_xlabel("false positive rate (non-members flagged)")
    ax.set_ylabel("true positive rate (forget rows flagged)")
    ax.set_title(title)
    ax.legend(loc="lower right", fontsize="small")
    fig.tight_layout()
    return _png(fig)


def phi_histograms(
    forget_phi: Mapping[str, np.ndarray],
    nonmember_phi: Mapping[str, np.ndarray] | None = None,
    title: str = "φ on the forget set",
) -> bytes:
    """One panel per model: φ of the forget rows, and (outlined) φ of the non-members under the same model."""
    names = list(forget_phi)
    if not names:
        raise ValueError("nothing to plot")
    fig = Figure(figsize=(4.0 * len(names), 3.4))
    axes = fig.subplots(1, len(names), sharex=True, squeeze=False)[0]
    every = [np.asarray(v, dtype=np.float64) for v in forget_phi.values()]
    if nonmember_phi:
        every += [np.asarray(v, dtype=np.float64) for v in nonmember_phi.values()]
    finite = np.concatenate([v[np.isfinite(v)] for v in every])
    lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (-1.0, 1.0)
    bins = np.linspace(lo, hi if hi > lo else lo + 1.0, HIST_BINS + 1)
    for ax, name in zip(axes, names, strict=True):
        colour = MODEL_COLOURS.get(name, "tab:purple")
        f = np.clip(np.asarray(forget_phi[name], dtype=np.float64), bins[0], bins[-1])
        ax.hist(f, bins=bins, density=True, color=colour, alpha=0.6, label=f"forget (n={f.size})")
        if nonmember_phi and name in nonmember_phi:
            nm = np.clip(np.asarray(nonmember_phi[name], dtype=np.float64), bins[0], bins[-1])
            ax.hist(nm, bins=bins, density=True, histtype="step", color="black", label=f"non-members (n={nm.size})")
        ax.set_title(name)
        ax.set_xlabel("φ = log p_y − log Σ others")
        ax.legend(fontsize="x-small")
    fig.suptitle(title)
    fig.tight_layout()
    return _png(fig)


def audit_plots(scores: AuditScores) -> dict[str, bytes]:
    """Both plots from an audit's arrays: {"roc.png": ..., "phi_hist.png": ...}."""
    roc = roc_plot({k: (scores.forget_scores[k], scores.nonmember_scores[k]) for k in scores.forget_scores})
    hist = phi_histograms(scores.forget_phi, scores.nonmember_phi)
    return {"roc.png": roc, "phi_hist.png": hist}

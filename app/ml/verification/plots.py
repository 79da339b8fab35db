"""Audit plots (drawing: app/plots.py): the arrays a report's plots need, stored by the worker and drawn on demand,
and the PNGs themselves for benchmarks and tests. The ROC points are computed here (lira.roc_curve), so the drawing
side needs no statistics.
"""

from __future__ import annotations

import io
from collections.abc import Mapping

import numpy as np

from app.ml.verification.audit import AuditScores
from app.ml.verification.lira import roc_curve
from app.plots import NAMES, phi_histograms, render

__all__ = ["audit_plots", "phi_histograms", "plot_data", "roc_plot"]


def _curve(members: np.ndarray, nonmembers: np.ndarray) -> dict[str, np.ndarray]:
    roc = roc_curve(members, nonmembers)
    return {
        "fpr": np.asarray(roc.fpr, np.float64),
        "tpr": np.asarray(roc.tpr, np.float64),
        "auc": np.asarray(roc.auc, np.float64),
        "n_members": np.asarray(roc.n_members),
        "n_nonmembers": np.asarray(roc.n_nonmembers),
    }


def roc_plot(
    scores: Mapping[str, tuple[np.ndarray, np.ndarray]], title: str = "LiRA on the forget set", chance_fpr: float = 0.01
) -> bytes:
    """Log-log ROC per model from (member scores, non-member scores); the diagonal is chance."""
    from app.plots import roc_figure

    return roc_figure({name: _curve(*pair) for name, pair in scores.items()}, title, chance_fpr)


def plot_data(scores: AuditScores) -> bytes:
    """The arrays both plots of a report are drawn from (app/plots.py ``render``), as one .npz: per model the ROC
    points of the forget rows against the non-members, and their φ. They describe individual erased rows exactly as
    the PNGs would: stored with the report, never elsewhere."""
    models = list(scores.forget_scores)
    arrays: dict[str, np.ndarray] = {"models": np.asarray(models)}
    for m in models:
        for key, value in _curve(scores.forget_scores[m], scores.nonmember_scores[m]).items():
            arrays[f"{m}/{key}"] = value
        arrays[f"{m}/forget_phi"] = np.asarray(scores.forget_phi[m], np.float64)
        arrays[f"{m}/nonmember_phi"] = np.asarray(scores.nonmember_phi[m], np.float64)
    buffer = io.BytesIO()
    np.savez_compressed(buffer, **arrays)
    return buffer.getvalue()


def audit_plots(scores: AuditScores) -> dict[str, bytes]:
    """Both PNGs from an audit's arrays: {"roc.png": ..., "phi_hist.png": ...} (what the endpoints draw)."""
    data = plot_data(scores)
    return {name: render(name, data) for name in NAMES}

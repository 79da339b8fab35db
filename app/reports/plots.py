"""A report's figures drawn as PNG, the first time someone asks for one (from the data its audit stored:
``app/ml/verification/plots.py``); the PNG is then kept, so a figure is drawn once.

Matplotlib's object API with the Agg canvas (no pyplot): no global backend switch and no shared figure state, so it
is safe in a request thread.
"""

from __future__ import annotations

import io
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

MODEL_COLOURS = {"original": "tab:red", "unlearned": "tab:blue", "retrained": "tab:green"}
DPI = 110


def _png(fig: Figure) -> bytes:
    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    return buf.getvalue()


def roc_png(data: dict[str, Any]) -> bytes:
    """Log-log ROC per model; the diagonal is chance."""
    fig = Figure(figsize=(5.0, 4.6))
    ax = fig.add_subplot()
    lo = 1.0
    for name, curve in data["curves"].items():
        lo = min(lo, 0.5 / curve["n_nonmembers"], 0.5 / curve["n_members"])
        label = f"{name} (AUC {curve['auc']:.3f})"
        ax.plot(curve["fpr"], curve["tpr"], drawstyle="steps-post", color=MODEL_COLOURS.get(name), label=label)
    ax.plot([lo, 1.0], [lo, 1.0], ls="--", color="grey", lw=0.8, label="chance")
    ax.axvline(data["chance_fpr"], color="grey", lw=0.5, ls=":")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, 1.0)
    ax.set_ylim(lo, 1.05)
    ax.set_xlabel("false positive rate (non-members flagged)")
    ax.set_ylabel("true positive rate (forget rows flagged)")
    ax.set_title(data["title"])
    ax.legend(loc="lower right", fontsize="small")
    fig.tight_layout()
    return _png(fig)


def histogram_png(data: dict[str, Any]) -> bytes:
    """One panel per model: φ of the forget rows, and (outlined) φ of the non-members under the same model."""
    names, edges = list(data["forget"]), data["edges"]
    fig = Figure(figsize=(4.0 * len(names), 3.4))
    axes = fig.subplots(1, len(names), sharex=True, squeeze=False)[0]
    centres = [(a + b) / 2 for a, b in zip(edges[:-1], edges[1:], strict=True)]
    for ax, name in zip(axes, names, strict=True):
        colour = MODEL_COLOURS.get(name, "tab:purple")
        forget = data["forget"][name]
        ax.hist(
            centres, bins=edges, weights=forget["density"], color=colour, alpha=0.6, label=f"forget (n={forget['n']})"
        )
        if name in data["nonmembers"]:
            nm = data["nonmembers"][name]
            ax.hist(centres, bins=edges, weights=nm["density"], histtype="step", color="black",
                    label=f"non-members (n={nm['n']})")  # fmt: skip
        ax.set_title(name)
        ax.set_xlabel("φ = log p_y − log Σ others")
        ax.legend(fontsize="x-small")
    fig.suptitle(data["title"])
    fig.tight_layout()
    return _png(fig)


RENDERERS = {"roc.png": roc_png, "phi_hist.png": histogram_png}


def render(name: str, data: dict[str, Any]) -> bytes:
    return RENDERERS[name](data)

"""Forget-set membership audit of one tabular deletion: LiRA and a population MIA on the original, unlearned and
(optionally) retrained models, with the audit's power stated.

Design (notes Part 2):
- Positives are the forget rows, negatives are held-out rows of the same distribution that no audited model trained
  on ("matched non-members": Gomez, notes §2.6, shows that non-members from another distribution turn an MIA into
  OOD detection). Both sets are rows of the shadow pool, so LiRA has IN and OUT shadows for each (shadows.py).
- The same shadows and the same negatives score every model, so the three models' figures are comparable.
- Power: unlearning can only be *shown* when the attack could tell the forget rows were members of the ORIGINAL model.
  If the original model's forget-set TPR at the policy FPR is itself within the chance margin (policy.chance_margin),
  the report says ``informative: False``: a chance-level figure after unlearning then means nothing (a
  well-regularised LR deleting one row is the typical case; LiRA cannot see that row even before deletion).

Everything is computed from arrays: the caller (the job's verify step) loads the pool, the shadows and the versions.
The forget rows' features are needed here, so the audit must run before their last copy is erased.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from app.ml import tabular
from app.ml.verification import lira
from app.ml.verification.mia import threshold_attack
from app.ml.verification.policy import VerdictPolicy, chance_margin
from app.ml.verification.shadows import ShadowSet, model_phi, scored_phi, shadow_phi

MIN_SHADOWS_PER_SIDE = 2
"""A Gaussian needs two samples; below that online LiRA cannot fit a side and the audit falls back to offline."""
MODEL_ORDER = ("original", "unlearned", "retrained")


@dataclass
class AuditScores:
    """The arrays behind a report (for plots; they describe individual erased rows, so do not store them)."""

    mode: str
    variance: str
    n_shadows: int
    forget_phi: dict[str, np.ndarray] = field(default_factory=dict)
    nonmember_phi: dict[str, np.ndarray] = field(default_factory=dict)
    forget_scores: dict[str, np.ndarray] = field(default_factory=dict)
    nonmember_scores: dict[str, np.ndarray] = field(default_factory=dict)
    fit: lira.GaussianFit | None = None
    """Shadow Gaussians for the forget rows followed by the non-member rows."""
    null_excess: np.ndarray | None = None
    """A CLIP deletion's reference runs (none saw a forget pair): each run's own forget excess against the others
    (clip_evidence.null_excess), the null draws of the forget excess; None elsewhere (a subset of the forget rows
    would have other draws, so ``forget_subset`` drops it)."""

    def forget_subset(self, index: np.ndarray) -> AuditScores:
        """The same audit restricted to some of its forget rows (``index`` into them), non-members unchanged: one
        request's own rows of a batch audited as a whole. Scores are per row, so each is what auditing the subset
        alone would give, except that the mode (online/offline) and a global variance were chosen on the whole."""
        index = np.asarray(index, dtype=np.int64)
        k = len(next(iter(self.forget_phi.values()))) if self.forget_phi else 0
        cols = np.concatenate([index, np.arange(k, k + len(next(iter(self.nonmember_phi.values()), ())))])
        fit = self.fit
        if fit is not None:
            fit = lira.GaussianFit(
                *(getattr(fit, f)[cols] for f in ("mu_in", "std_in", "mu_out", "std_out", "n_in", "n_out")),
                variance=fit.variance,
            )
        return AuditScores(
            mode=self.mode,
            variance=self.variance,
            n_shadows=self.n_shadows,
            forget_phi={n: v[index] for n, v in self.forget_phi.items()},
            nonmember_phi=dict(self.nonmember_phi),
            forget_scores={n: v[index] for n, v in self.forget_scores.items()},
            nonmember_scores=dict(self.nonmember_scores),
            fit=fit,
        )


def _positions(p: np.ndarray | list[int], n_pool: int, name: str) -> np.ndarray:
    pos = np.asarray(p, dtype=np.int64).reshape(-1)
    if pos.size == 0:
        raise ValueError(f"{name} is empty")
    if pos.min() < 0 or pos.max() >= n_pool or len(np.unique(pos)) != pos.size:
        raise ValueError(f"{name} must be distinct positions in the shadow pool [0, {n_pool})")
    return pos


def forget_set_scores(
    shadows: ShadowSet,
    X_pool: np.ndarray,
    y_pool: np.ndarray,
    forget_positions: np.ndarray,
    nonmember_positions: np.ndarray,
    thetas: dict[str, torch.Tensor],
    mode: str = "auto",
    variance: str = "auto",
    center: str = "mean",
    pool_rows: np.ndarray | None = None,
) -> AuditScores:
    """φ and LiRA scores of each model in ``thetas`` on the forget rows and the non-member rows.

    ``mode`` "auto" is online LiRA when every audited row has ≥ 2 IN and ≥ 2 OUT shadows, offline otherwise.
    ``pool_rows``: X_pool / y_pool are a larger table whose rows ``pool_rows`` are the pool's columns, in order (only
    the audited rows are read: no copy of a 1M-row pool is made).
    """
    X_pool, y_pool = np.asarray(X_pool), np.asarray(y_pool)
    n_pool = shadows.in_mask.shape[1]
    held = len(X_pool) if pool_rows is None else len(pool_rows)
    if held != n_pool or len(y_pool) != len(X_pool):
        raise ValueError(f"X_pool / y_pool must hold the shadow pool's {n_pool} rows")
    f = _positions(forget_positions, n_pool, "forget_positions")
    nm = _positions(nonmember_positions, n_pool, "nonmember_positions")
    if np.intersect1d(f, nm).size:
        raise ValueError("a row cannot be both a forget row and a non-member")
    columns = np.concatenate([f, nm])
    rows = columns if pool_rows is None else np.asarray(pool_rows, dtype=np.int64)[columns]
    X_rows, y_rows = X_pool[rows], y_pool[rows]
    phis = {name: model_phi(shadows.recipe, theta, X_rows, y_rows, shadows.n_classes) for name, theta in thetas.items()}
    kept, phi_kept = scored_phi(shadows, columns)  # rows the shadows were scored on when trained: read, not scored
    phi_sh = np.empty((shadows.n_shadows, columns.size))
    phi_sh[:, kept] = phi_kept
    phi_sh[:, ~kept] = shadow_phi(shadows, X_rows[~kept], y_rows[~kept])
    return scores_from_phi(phi_sh, shadows.in_mask[:, columns], phis, f.size, mode, variance, center)


def scores_from_phi(
    shadow_phi_rows: np.ndarray,
    in_mask_rows: np.ndarray,
    model_phis: dict[str, np.ndarray],
    n_forget: int,
    mode: str = "auto",
    variance: str = "auto",
    center: str = "mean",
    predictive: bool = False,
    groups: np.ndarray | None = None,
) -> AuditScores:
    """LiRA scores from statistics already computed, for any model family (tabular rows, CLIP pairs).

    Columns are the audited rows, the ``n_forget`` forget rows first and the non-members after them:
    ``shadow_phi_rows`` [N, n] and ``in_mask_rows`` [N, n] from the shadows, ``model_phis`` {name: [n]} from each
    audited model. ``mode`` "auto" is online LiRA when every audited row has ≥ 2 IN and ≥ 2 OUT shadows, offline
    otherwise; ``predictive``: see lira.offline_scores (for rows with unequal OUT counts); ``groups``: see
    lira.fit_gaussians.
    """
    fit = lira.fit_gaussians(shadow_phi_rows, in_mask_rows, variance, center, groups)
    if mode == "auto":
        online_ok = fit.n_in.min() >= MIN_SHADOWS_PER_SIDE and fit.n_out.min() >= MIN_SHADOWS_PER_SIDE
        mode = "online" if online_ok else "offline"
    if mode not in lira.MODES:
        raise ValueError(f"unknown mode {mode!r}; expected 'auto' or one of {lira.MODES}")
    k = int(n_forget)
    out = AuditScores(mode=mode, variance=fit.variance, n_shadows=int(np.asarray(in_mask_rows).shape[0]), fit=fit)
    for name, phi in model_phis.items():
        phi = np.asarray(phi, dtype=np.float64)
        score = lira.online_scores(phi, fit) if mode == "online" else lira.offline_scores(phi, fit, predictive)
        out.forget_phi[name], out.nonmember_phi[name] = phi[:k], phi[k:]
        out.forget_scores[name], out.nonmember_scores[name] = score[:k], score[k:]
    return out


def theta_facts(theta: torch.Tensor, theta_new: torch.Tensor, trained_on_forget: bool) -> dict[str, Any]:
    a = torch.as_tensor(theta).detach().cpu().reshape(-1)
    b = torch.as_tensor(theta_new).detach().cpu().reshape(-1)
    if a.shape != b.shape:
        return {"trained_on_forget": trained_on_forget, "shape_changed": True, "bitwise_equal": False,
                "max_abs_change": None, "l2_change": None}  # fmt: skip
    diff = a.to(torch.float64) - b.to(torch.float64)
    return {
        "trained_on_forget": bool(trained_on_forget),
        "shape_changed": False,
        "bitwise_equal": bool(torch.equal(a, b)),
        "max_abs_change": float(diff.abs().max()) if diff.numel() else 0.0,
        "l2_change": float(diff.norm()),
    }


def run_audit(
    shadows: ShadowSet,
    X_pool: np.ndarray,
    y_pool: np.ndarray,
    forget_positions: np.ndarray,
    nonmember_positions: np.ndarray,
    theta_original: torch.Tensor,
    theta_unlearned: torch.Tensor,
    theta_retrained: torch.Tensor | None = None,
    X_test: np.ndarray | None = None,
    y_test: np.ndarray | None = None,
    trained_on_forget: bool = True,
    policy: VerdictPolicy | None = None,
    mode: str = "auto",
    variance: str = "auto",
    center: str = "mean",
    pool_rows: np.ndarray | None = None,
) -> tuple[dict[str, Any], AuditScores]:
    """``audit_forget_set`` plus the arrays behind it (for plots.plot_data); ``pool_rows``: forget_set_scores'."""
    policy = policy or VerdictPolicy()
    thetas = {"original": theta_original, "unlearned": theta_unlearned}
    if theta_retrained is not None:
        thetas["retrained"] = theta_retrained
    scores = forget_set_scores(
        shadows, X_pool, y_pool, forget_positions, nonmember_positions, thetas, mode, variance, center, pool_rows
    )
    k = int(np.asarray(forget_positions).size)
    m = int(np.asarray(nonmember_positions).size)
    utility = None
    if X_test is not None and y_test is not None and len(y_test):
        acc = {
            name: tabular.accuracy(shadows.recipe, th, np.asarray(X_test), np.asarray(y_test), shadows.n_classes)
            for name, th in thetas.items()
        }
        utility = {
            "n_test": int(len(y_test)),
            "accuracy": acc,
            "loss_points": 100.0 * (acc["original"] - acc["unlearned"]),
        }
    report = report_from_scores(
        scores,
        k,
        m,
        policy,
        center,
        theta=theta_facts(theta_original, theta_unlearned, trained_on_forget),
        utility=utility,
        statistic="phi = z_y - logsumexp_{y'!=y} z_y'",
    )
    return report, scores


def report_from_scores(
    scores: AuditScores,
    n_forget: int,
    n_nonmembers: int,
    policy: VerdictPolicy | None = None,
    center: str = "mean",
    theta: dict[str, Any] | None = None,
    utility: dict[str, Any] | None = None,
    statistic: str = "phi = z_y - logsumexp_{y'!=y} z_y'",
) -> dict[str, Any]:
    """The JSON report of an audit from its scores (``audit_forget_set``'s keys): LiRA and the population attack per
    model, the chance margin, and the audit's power (is the ORIGINAL model's forget set flagged above chance?)."""
    policy = policy or VerdictPolicy()
    fprs = tuple(sorted(set(lira.REPORT_FPRS) | {policy.attack_fpr}))
    k, m = int(n_forget), int(n_nonmembers)
    margin = chance_margin(k, policy.attack_fpr, policy.confidence, m, policy.margin)
    key = lira.fpr_key(policy.attack_fpr)

    models: dict[str, Any] = {}
    for name in scores.forget_scores:
        fs, ns = scores.forget_scores[name], scores.nonmember_scores[name]
        fp, npi = scores.forget_phi[name], scores.nonmember_phi[name]
        models[name] = {
            "lira": lira.attack_summary(fs, ns, fprs),
            "population_mia": threshold_attack(fp, npi, policy.attack_fpr),
            "forget_phi_median": float(np.median(fp)),
            "nonmember_phi_median": float(np.median(npi)),
        }

    orig = models["original"]["lira"]
    detected = int(orig["detected_at_fpr"][key])
    informative = detected > margin["max_detected"]
    detail = (
        f"original model: {detected}/{k} forget rows flagged at FPR {key} "
        f"({'>' if informative else '≤'} chance margin {margin['max_detected']}/{k})"
    )
    fit = scores.fit
    assert fit is not None
    return {
        "attack": {
            "name": "lira",
            "mode": scores.mode,
            "variance": scores.variance,
            "center": center,
            "n_shadows": scores.n_shadows,
            "min_in_shadows": int(fit.n_in.min()),
            "min_out_shadows": int(fit.n_out.min()),
            "statistic": statistic,
        },
        "n_forget": k,
        "n_nonmembers": m,
        "fprs": list(fprs),
        "models": models,
        "chance": margin,
        "informative": bool(informative),
        "informative_detail": detail,
        "utility": utility,
        "theta": theta,
    }


def audit_forget_set(
    shadows: ShadowSet,
    X_pool: np.ndarray,
    y_pool: np.ndarray,
    forget_positions: np.ndarray,
    nonmember_positions: np.ndarray,
    theta_original: torch.Tensor,
    theta_unlearned: torch.Tensor,
    theta_retrained: torch.Tensor | None = None,
    X_test: np.ndarray | None = None,
    y_test: np.ndarray | None = None,
    trained_on_forget: bool = True,
    policy: VerdictPolicy | None = None,
    mode: str = "auto",
    variance: str = "auto",
    center: str = "mean",
) -> dict[str, Any]:
    """Plain-dict (JSON-ready) report of the forget-set audit of one deletion.

    ``X_pool`` / ``y_pool`` are the shadows' pool (shadows.in_mask columns); ``forget_positions`` and
    ``nonmember_positions`` index it (forget rows: the erased training rows; non-members: held-out rows no audited
    model trained on). ``X_test`` / ``y_test`` (optional) give the utility figures. ``trained_on_forget`` says the
    original model's training set held the forget rows (the do-nothing rule applies only then).

    Keys: "attack" {name, mode, variance, center, n_shadows, min_in_shadows, min_out_shadows, statistic};
    "n_forget", "n_nonmembers", "fprs"; "models" {original, unlearned[, retrained]: {"lira": attack_summary
    (tpr_at_fpr {"0.001", "0.01"}, detected_at_fpr, auc, n_members, n_nonmembers, fpr_resolution),
    "population_mia": mia.threshold_attack, forget_phi_median, nonmember_phi_median}}; "chance"
    (policy.chance_margin); "informative", "informative_detail"; "utility" {n_test, accuracy {model: acc},
    loss_points} or None; "theta" {trained_on_forget, shape_changed, bitwise_equal, max_abs_change, l2_change}.
    """
    return run_audit(
        shadows,
        X_pool,
        y_pool,
        forget_positions,
        nonmember_positions,
        theta_original,
        theta_unlearned,
        theta_retrained,
        X_test,
        y_test,
        trained_on_forget,
        policy,
        mode,
        variance,
        center,
    )[0]

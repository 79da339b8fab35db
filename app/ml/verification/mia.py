"""Population threshold MIA: one global threshold on a model's loss / confidence, fitted on known non-members.

This is the "population U-MIA" of Hayes et al. (notes §2.3): one attacker for every example, the kind they found to
"overestimate the privacy protection" of inexact unlearning next to per-example attacks such as LiRA. It is reported
beside LiRA because it needs no shadows and because a method that beats it but not LiRA is exactly their warning.

Loss (−log p_y), confidence (p_y) and LiRA's φ = log(p_y / (1 − p_y)) are all strictly monotone in p_y, so a single
global threshold on any of them is the same attack with the same ROC. The score used is φ (higher = member) because it
keeps resolution where p_y rounds to 1 in float64 and the loss to 0, which is exactly where memorised rows sit.
"""

from __future__ import annotations

import numpy as np

from app.ml.verification.lira import REPORT_FPRS, attack_summary

DEFAULT_TARGET_FPR = 0.01


def fit_threshold(nonmember_scores: np.ndarray, target_fpr: float = DEFAULT_TARGET_FPR) -> float:
    """The smallest threshold t with Pr_nonmember[score ≥ t] ≤ ``target_fpr`` on the known non-members.

    "Member if score ≥ t". Ties at t are all counted, so the realised FPR on these rows never exceeds the target;
    with fewer than 1 / target_fpr non-members the threshold sits just above the largest one (FPR 0).
    """
    s = np.sort(np.asarray(nonmember_scores, dtype=np.float64).reshape(-1))[::-1]
    if s.size == 0:
        raise ValueError("need at least one known non-member")
    if not 0.0 <= target_fpr < 1.0:
        raise ValueError("target_fpr must lie in [0, 1)")
    allowed = int(np.floor(target_fpr * s.size + 1e-9))  # non-members we may flag
    # candidate: the score of the (allowed)-th highest non-member; move up past ties that would exceed the budget
    if allowed == 0:
        return float(np.nextafter(s[0], np.inf))
    t = s[allowed - 1]
    if allowed < s.size and s[allowed] == t:  # the next one ties: flagging t would flag too many
        return float(np.nextafter(t, np.inf))
    return float(t)


def threshold_attack(
    member_scores: np.ndarray,
    nonmember_scores: np.ndarray,
    target_fpr: float = DEFAULT_TARGET_FPR,
    calibration_scores: np.ndarray | None = None,
) -> dict[str, object]:
    """Population MIA figures: threshold fitted on ``calibration_scores`` (default: the non-members themselves).

    Returns the threshold, TPR on the members and realised FPR on the non-members at it, plus the attack's full
    ``attack_summary`` (TPR at the report FPRs over all thresholds, AUC) for comparison with LiRA.
    """
    members = np.asarray(member_scores, dtype=np.float64).reshape(-1)
    nonmembers = np.asarray(nonmember_scores, dtype=np.float64).reshape(-1)
    calib = nonmembers if calibration_scores is None else np.asarray(calibration_scores, dtype=np.float64)
    t = fit_threshold(calib, target_fpr)
    return {
        "statistic": "phi",
        "target_fpr": float(target_fpr),
        "threshold": t,
        "tpr": float((members >= t).mean()) if members.size else float("nan"),
        "fpr": float((nonmembers >= t).mean()) if nonmembers.size else float("nan"),
        "calibrated_on": "nonmembers" if calibration_scores is None else "separate",
        **attack_summary(members, nonmembers, REPORT_FPRS),
    }

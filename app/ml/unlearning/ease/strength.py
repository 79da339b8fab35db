"""Adaptive excision strength: the scale of the excision displacement, chosen per request (issue 11 item 1).

Why: BKE's result sits on a cliff. Its step budget, not its objective, sets how much is forgotten (class scenario,
seed 1: forget R@1 64 / 37 / 13 / 7.5 after 10 / 20 / 30 / 40 steps), and the protected repair round rebounds by an
unpredictable +10 to +25 points (measured-findings §EASE "the cliff"). Scaling one excision displacement E by s is a
monotone knob (s = 0.25 … 1.25 → 79 → 6 points, §EASE "a monotone knob"), so the scale can be *searched*: each probe
is judged on the model a deployment would publish, θ_p + s·E + Δ_rep, after the protected round.

The target needs no retrain (§EASE "targets without a retrain"): T = max(version 1's R@1 on the forget pairs — the
federation's starting point, which the holders can evaluate —, the current model's R@1 on matched held-out
non-members where they exist; a samples deletion without them has no target and runs at the fixed scale:
method.py, step 4). The accepted band is [T, T + band]: a model may stay a little above its target
level (the version-1 level lands 1–8 points *below* retrain in the concept scenarios) but never below it.

:func:`search_scale` is the search itself, pure and model-free: a bracketing search on a non-increasing response
(a secant step in log-odds — interpolation inside a bracket, safeguarded towards its middle;
extrapolation, or doubling and halving, until a bracket exists), stopping at the first probe inside the band.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


def _logit(level: float) -> float:
    """R@1 points → log-odds: a cliff-shaped (logistic) response is a straight line in it, so interpolating there
    lands near the band in one or two steps where linear interpolation crawls along the cliff's foot."""
    q = min(max(level / 100.0, 0.005), 0.995)
    return math.log(q / (1 - q))


def _secant(s_a: float, m_a: float, s_b: float, m_b: float, aim: float) -> float:
    """Where the straight line through two probes (in log-odds) reaches ``aim``; the midpoint when they are level."""
    f_a, f_b, f_aim = _logit(m_a), _logit(m_b), _logit(aim)
    if f_a == f_b:
        return (s_a + s_b) / 2
    return s_a + (f_a - f_aim) / (f_a - f_b) * (s_b - s_a)


EXPAND = 2.0
"""The most an extrapolated probe may multiply (or divide) the scale by before a bracket exists."""

SAFEGUARD = 0.15
"""An interpolated probe keeps at least this fraction of the bracket's width from either end (else it would crawl
along one side of a cliff-shaped response, as plain regula falsi does)."""


@dataclass
class ScaleSearch:
    """The chosen scale, its level, every probe (scale, level) in order, and whether the level is in the band."""

    scale: float
    level: float
    target: float
    band: float
    probes: list[tuple[float, float]] = field(default_factory=list)
    in_band: bool = False
    reason: str = ""

    def to_info(self) -> dict[str, Any]:
        return {
            "target_r1": round(self.target, 3),
            "band": [round(self.target, 3), round(self.target + self.band, 3)],
            "scale": round(self.scale, 5),
            "level_r1": round(self.level, 3),
            "in_band": self.in_band,
            "probes": [{"scale": round(s, 5), "r1": round(m, 3)} for s, m in self.probes],
            "reason": self.reason,
        }


def _distance(level: float, target: float, band: float) -> float:
    """How far a level lies outside [target, target + band] (0 inside)."""
    return max(target - level, level - (target + band), 0.0)


def search_scale(
    response: Callable[[float], float],
    target: float,
    band: float,
    *,
    start: float = 1.0,
    scale_max: float = 8.0,
    max_probes: int = 4,
    known: dict[float, float] | None = None,
) -> ScaleSearch:
    """Find s in [0, scale_max] with ``response(s)`` in [target, target + band], ``response`` non-increasing in s.

    ``known``: levels already measured (e.g. ``{0.0: level at s = 0}``), used for brackets but not counted as probes.
    Every call of ``response`` is a probe (at most ``max_probes``). Without a probe in the band, the probe closest
    to it is chosen, preferring one at or above the target (under-forgetting is repaired by a later request;
    over-forgetting destroys retained knowledge too).
    """
    if band < 0 or max_probes < 1 or scale_max <= 0:
        raise ValueError("band must be ≥ 0, max_probes ≥ 1, scale_max > 0")
    aim = target + band / 2
    points: dict[float, float] = dict(known or {})
    probes: list[tuple[float, float]] = []
    s = min(max(start, 0.0), scale_max)
    reason = "probe budget spent"
    for _ in range(max_probes):
        level = float(response(s))
        probes.append((s, level))
        points[s] = level
        if target <= level <= target + band:
            return ScaleSearch(s, level, target, band, probes, True, "in band")
        above = sorted((x, m) for x, m in points.items() if m > target + band)  # too weak: needs a larger scale
        below = sorted((x, m) for x, m in points.items() if m < target)  # too strong: needs a smaller scale
        if above and below and above[-1][0] < below[0][0]:  # a bracket: interpolate inside it
            (s_lo, m_lo), (s_hi, m_hi) = above[-1], below[0]
            width = s_hi - s_lo
            guess = _secant(s_lo, m_lo, s_hi, m_hi, aim)
            s = min(max(guess, s_lo + SAFEGUARD * width), s_hi - SAFEGUARD * width)
        elif above and below:  # the response is not monotone where probed: bisect what is left
            reason = "non-monotone response"
            s = (above[-1][0] + below[0][0]) / 2
        elif above:  # still too weak everywhere probed: extrapolate (or double), at most ×EXPAND
            s_last = above[-1][0]
            if s_last >= scale_max:
                reason = f"too weak even at scale_max = {scale_max}"
                break
            guess = _secant(*above[-2], *above[-1], aim) if len(above) > 1 else 2 * s_last
            s = min(max(guess, 1.25 * s_last), EXPAND * s_last if s_last > 0 else 1.0, scale_max)
        else:  # too strong everywhere probed: extrapolate (or halve) towards 0
            s_first = below[0][0]
            if s_first <= 1e-9:
                reason = "too strong even at scale 0"
                break
            guess = _secant(*below[0], *below[1], aim) if len(below) > 1 else s_first / 2
            s = max(min(guess, s_first / 1.25), s_first / EXPAND)
    best = min(probes, key=lambda p: (_distance(p[1], target, band), p[1] < target, -p[0]))
    return ScaleSearch(best[0], best[1], target, band, probes, False, reason)

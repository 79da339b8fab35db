"""The reports domain's answers. A report's figures depend on the model kind and the evidence that applied (LiRA,
the proven bound, retrieval for CLIP...): the models name what every verdict carries and allow the rest."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from app.registry.schemas import MethodName

Verdict = Literal["pass", "fail"]


class CheckOut(BaseModel):
    """One check of a verdict (app/ml/verification/policy.py ``decide``); evidence checks also carry
    ``informative`` and ``power``."""

    model_config = ConfigDict(extra="allow")
    name: str = Field(..., description="parameters_changed, forget_attack, utility_loss, proven_distance, ...")
    figure: float | None = Field(None, description="The measured figure (None: not measured).")
    threshold: float | None = Field(None, description="The figure's bound (None: reported, not judged).")
    passed: bool | None = Field(..., description="True / False, or None when the check was not evaluated.")
    message: str
    evidence: bool | None = Field(None, description="The check is evidence that the rows were removed.")
    informative: bool | None = Field(None, description="Evidence checks: the figure could have shown a failure.")
    power: float | None = Field(None, description="Evidence checks: how far the test could see.")


class ReportBatch(BaseModel):
    model_config = ConfigDict(extra="allow")
    requests: int = Field(..., description="How many requests the attempt's version served.")


class ReportOut(BaseModel):
    """One verification of one deletion request: the verdict with its checks and reasons, the figures behind them
    (``attack``, ``models``, ``chance``, ``utility``, ``theta``, ``proven``, ``retrieval``...: extra members, by
    model kind) and the plots' links (``GET`` each for a PNG)."""

    model_config = ConfigDict(extra="allow")
    id: str
    request_id: str
    model_id: str
    verdict: Verdict
    created_at: datetime
    attempt: int = Field(..., description="1, or 2 when ``auto`` escalated to exact retraining.")
    method: MethodName = Field(..., description="The method this attempt ran (``auto`` resolved).")
    reasons: list[str] = Field(..., description="The failed checks' messages, or on a pass those that passed.")
    checks: list[CheckOut]
    evidence: list[str] | None = Field(None, description="The informative evidence that passed, by check name.")
    notes: list[str] = Field(default_factory=list)
    policy: dict[str, Any] = Field(default_factory=dict, description="The verdict policy's settings.")
    informative: bool | None = Field(None, description="Whether the membership attack could tell members apart.")
    informative_detail: str | None = None
    n_forget: int | None = Field(None, description="Rows of this request the audit judged.")
    batch: ReportBatch | None = None
    plots: dict[str, str] = Field(..., description="Plot name (``roc.png``...) -> its path; each answers image/png.")


class ReportPage(BaseModel):
    items: list[ReportOut]

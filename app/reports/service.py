"""Verification reports: the reports domain is the only writer of its table."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.problems import Problem
from app.reports.tables import Report
from app.storage import get_store


def add_report(
    session: Session, request_id: str, model_id: str, body: dict[str, Any], verdict: str, plots: dict[str, bytes]
) -> Report:
    """Store one verification: the figures as JSON, each plot as a PNG blob; the ETag covers both."""
    digests = {name: get_store().put_bytes(png) for name, png in plots.items()}
    canonical = json.dumps({"body": body, "plots": digests}, sort_keys=True, default=str).encode()
    report = Report(
        request_id=request_id,
        model_id=model_id,
        verdict=verdict,
        body=body,
        plots=digests,
        etag=hashlib.sha256(canonical).hexdigest(),
    )
    session.add(report)
    session.flush()
    return report


def reports_for(session: Session, request_id: str) -> list[Report]:
    return list(
        session.execute(select(Report).where(Report.request_id == request_id).order_by(Report.created_at)).scalars()
    )


def get_report_or_404(session: Session, report_id: str) -> Report:
    report = session.get(Report, report_id)
    if report is None:
        raise Problem(404, "report-not-found", "No such report", report_id)
    return report


def report_out(report: Report) -> dict[str, Any]:
    return {
        "id": report.id,
        "request_id": report.request_id,
        "model_id": report.model_id,
        "verdict": report.verdict,
        "created_at": report.created_at.isoformat(),
        **report.body,
        "plots": {name: f"/v1/reports/{report.id}/plots/{name}" for name in report.plots},
    }

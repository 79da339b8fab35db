"""Verification reports: the reports domain is the only writer of its table."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.db import new_id
from app.problems import Problem
from app.reports.plots import render
from app.reports.tables import Report
from app.storage import get_store


def store_plots(plots: dict[str, dict[str, Any]]) -> dict[str, str]:
    """Each plot's data (what app/ml/verification/plots.py computed) as a JSON blob: {name: digest}. A batch's
    requests share one audit's plots, so the worker stores them once per attempt."""
    return {name: get_store().put_bytes(json.dumps(data, sort_keys=True).encode()) for name, data in plots.items()}


def add_report(
    session: Session, request_id: str, model_id: str, body: dict[str, Any], verdict: str, plots: dict[str, str]
) -> Report:
    """Store one verification: the figures as JSON and each plot's data blob (``store_plots``), drawn as PNG the
    first time it is asked for (``plot_png``); the ETag covers both."""
    digests = {name: {"data": digest} for name, digest in plots.items()}
    canonical = json.dumps({"body": body, "plots": digests}, sort_keys=True, default=str).encode()
    report = Report(
        id=new_id(),  # set here, not at flush: a batch's reports are flushed together
        request_id=request_id,
        model_id=model_id,
        verdict=verdict,
        body=body,
        plots=digests,
        etag=hashlib.sha256(canonical).hexdigest(),
    )
    session.add(report)
    return report


def plot_png(report: Report, name: str) -> tuple[bytes, str]:
    """A report's plot as PNG bytes and its ETag. Drawn from its data the first time (issue 21: never on a deletion's
    path) and kept on the report (the caller commits); reports written before plots were drawn on demand hold the
    PNG's digest itself."""
    entry = report.plots.get(name)
    if entry is None:
        raise Problem(404, "plot-not-found", "No such plot", f"plots: {sorted(report.plots)}")
    store = get_store()
    if isinstance(entry, str):
        return store.get_bytes(entry), entry
    if entry.get("png") is None or not store.exists(entry["png"]):
        png = render(name, json.loads(store.get_bytes(entry["data"])))
        report.plots = {**report.plots, name: {**entry, "png": store.put_bytes(png)}}
        return png, entry["data"]
    return store.get_bytes(entry["png"]), entry["data"]


def plot_digests(session: Session) -> set[str]:
    """Every blob a report's plots name (data and drawn PNG; an older report's PNG digest itself): referenced."""
    out: set[str] = set()
    for plots in session.execute(select(Report.plots)).scalars():
        for entry in (plots or {}).values():
            if isinstance(entry, str):
                out.add(entry)
            elif isinstance(entry, dict):
                out |= {d for d in (entry.get("data"), entry.get("png")) if isinstance(d, str)}
    return out


def plot_etag(report: Report, name: str) -> str | None:
    """The ETag a plot is served with (its data's digest: the PNG is a function of it), without drawing it."""
    entry = report.plots.get(name)
    return entry if isinstance(entry, str) or entry is None else entry["data"]


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

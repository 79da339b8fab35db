from __future__ import annotations

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import JSONResponse
from sqlalchemy.orm import Session

from app.auth.service import Principal, require_scope
from app.db import get_session
from app.reports.service import get_report_or_404, plot_etag, plot_png, report_out, reports_for

router = APIRouter(prefix="/v1/reports", tags=["reports"])


def _not_modified(request: Request, etag: str) -> bool:
    return request.headers.get("if-none-match", "").strip() in (f'"{etag}"', "*")


@router.get("")
def list_reports(
    request_id: str = Query(..., max_length=36),
    _: Principal = Depends(require_scope("requests:read")),
    session: Session = Depends(get_session),
):
    """A deletion request's verification reports, in order (``auto`` may have escalated: two attempts)."""
    return {"items": [report_out(r) for r in reports_for(session, request_id)]}


@router.get("/{report_id}")
def get_report(
    report_id: str,
    request: Request,
    _: Principal = Depends(require_scope("requests:read")),
    session: Session = Depends(get_session),
):
    """One verification report: every figure with its settings and sample sizes, the verdict and its checks, and the
    plots' links. ``ETag``; ``If-None-Match`` answers ``304 Not Modified`` for pollers."""
    report = get_report_or_404(session, report_id)
    headers = {"ETag": f'"{report.etag}"', "Cache-Control": "private, max-age=0"}
    if _not_modified(request, report.etag):
        return Response(status_code=304, headers=headers)
    return JSONResponse(report_out(report), headers=headers)


@router.get("/{report_id}/plots/{name}")
def get_plot(
    report_id: str,
    name: str,
    request: Request,
    _: Principal = Depends(require_scope("requests:read")),
    session: Session = Depends(get_session),
):
    """A report's plot (PNG): the log-log ROC, or the histograms of the attack statistic on the forget set."""
    report = get_report_or_404(session, report_id)
    etag = plot_etag(report, name)
    headers = {"ETag": f'"{etag}"', "Cache-Control": "private, max-age=86400"}
    if etag is not None and _not_modified(request, etag):
        return Response(status_code=304, headers=headers)
    png, _ = plot_png(report, name)
    session.commit()  # a plot drawn now is kept
    return Response(png, media_type="image/png", headers=headers)

from __future__ import annotations

from fastapi import APIRouter, Depends, Header, Query, Response
from fastapi.responses import JSONResponse
from sqlalchemy.orm import Session

from app.auth.service import Principal, require_scope
from app.db import get_session
from app.openapi import binary, headers, not_modified
from app.reports.schemas import ReportOut, ReportPage
from app.reports.service import get_report_or_404, plot_etag, plot_png, report_out, reports_for

router = APIRouter(prefix="/v1/reports", tags=["reports"])

IfNoneMatch = Header(None, alias="If-None-Match", description="An ETag from an earlier answer: 304 if it still holds.")


def _not_modified(if_none_match: str | None, etag: str) -> bool:
    return (if_none_match or "").strip() in (f'"{etag}"', "*")


@router.get("", response_model=ReportPage)
def list_reports(
    request_id: str = Query(..., max_length=36),
    _: Principal = Depends(require_scope("requests:read")),
    session: Session = Depends(get_session),
):
    """A deletion request's verification reports, in order (``auto`` may have escalated: two attempts)."""
    return JSONResponse({"items": [report_out(r) for r in reports_for(session, request_id)]})


@router.get(
    "/{report_id}",
    response_model=ReportOut,
    responses={200: {"headers": headers("ETag", "Cache-Control")}, **not_modified("ETag", "Cache-Control")},
)
def get_report(
    report_id: str,
    if_none_match: str | None = IfNoneMatch,
    _: Principal = Depends(require_scope("requests:read")),
    session: Session = Depends(get_session),
):
    """One verification report: every figure with its settings and sample sizes, the verdict and its checks, and the
    plots' links. ``ETag``; ``If-None-Match`` answers ``304 Not Modified`` for pollers."""
    report = get_report_or_404(session, report_id)
    response_headers = {"ETag": f'"{report.etag}"', "Cache-Control": "private, max-age=0"}
    if _not_modified(if_none_match, report.etag):
        return Response(status_code=304, headers=response_headers)
    return JSONResponse(report_out(report), headers=response_headers)


@router.get(
    "/{report_id}/plots/{name}",
    response_class=Response,
    responses={
        **binary("image/png", "The plot, drawn from the report's data.", "ETag", "Cache-Control"),
        **not_modified("ETag", "Cache-Control"),
    },
)
def get_plot(
    report_id: str,
    name: str,
    if_none_match: str | None = IfNoneMatch,
    _: Principal = Depends(require_scope("requests:read")),
    session: Session = Depends(get_session),
):
    """A report's plot (PNG): the log-log ROC, or the histograms of the attack statistic on the forget set; the
    report's ``plots`` name them."""
    report = get_report_or_404(session, report_id)
    etag = plot_etag(report, name)
    response_headers = {"ETag": f'"{etag}"', "Cache-Control": "private, max-age=86400"}
    if etag is not None and _not_modified(if_none_match, etag):
        return Response(status_code=304, headers=response_headers)
    png, _ = plot_png(report, name)
    session.commit()  # a plot drawn now is kept
    return Response(png, media_type="image/png", headers=response_headers)

"""The operator's dashboard at ``/dashboard``: server-rendered pages (Jinja2) and one small script that polls.

It reads through the domain services only and acts through the same service functions as the API (so an action
is audited exactly as its API twin); it owns no table. Access: an API key with ``requests:read`` (given once in a
login form; the HttpOnly, SameSite=Strict cookie then holds only a server-side session's random token, see
``session.py``); actions on a request (one
or in bulk) and a model's settings need ``admin`` (approval keeps the API's four eyes: never by the key that submitted
the request), a per-person erasure ``requests:write`` (its API twin's scope), and every form a CSRF token. No key, no
data: every page and fragment checks the key again. A person's reference is only ever posted (never put in a URL):
the server turns it into the keyed hash every request is known by.
"""

from __future__ import annotations

import json
from datetime import UTC, date, datetime, time, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from fastapi import APIRouter, Depends, Form, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse
from fastapi.routing import APIRoute
from fastapi.templating import Jinja2Templates
from pydantic import ValidationError
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from app.audit.service import events_for, latest_events, verify_chain
from app.auth.service import (
    Principal,
    dashboard_principal,
    end_dashboard_session,
    list_keys,
    open_dashboard_session,
    principal_for_key,
)
from app.certificates.service import get_certificate_or_404
from app.certificates.signing import (
    PREDICATE_TYPE,
    SUBJECT_ERASURE_PREDICATE_TYPE,
    InvalidCertificate,
    public_keys,
    verify_envelope,
)
from app.certificates.verify_cli import describe
from app.config import get_settings
from app.dashboard import session as cookies
from app.dashboard.views import (
    ACTIVE_STATUSES,
    actor_label,
    actor_names,
    carried_deletions,
    flat_info,
    lineage_svg,
    method_quality,
    report_figures,
    request_json,
    served_by,
    time_left,
    version_accuracy,
)
from app.db import get_session
from app.ids import short_id
from app.problems import Problem
from app.registry import service as registry
from app.registry.schemas import ModelPatch
from app.reports.service import get_report_or_404, plot_png, report_out, reports_for
from app.requests import service as requests
from app.requests.bulk import BulkFilter, BulkIn
from app.requests.bulk import run as run_bulk
from app.requests.service import APPROVAL_STATUS, CANCELLABLE_STATUSES, REQUEST_STATUSES, TERMINAL_STATUSES
from app.subjects import service as subjects
from app.subjects.schemas import ErasureCreate
from app.webhooks import service as webhooks

HERE = Path(__file__).parent
STATUSES = REQUEST_STATUSES
STATIC = {"dashboard.css": "text/css; charset=utf-8", "dashboard.js": "text/javascript; charset=utf-8"}
POLL_MS = 1000
STALE_FORM = "Missing or stale form token: reload the page and try again."
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
    "frame-ancestors 'none'; form-action 'self'; base-uri 'none'",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-store",
}
DONE = {
    "cancel": "The request was cancelled.",
    "retry": "The request was queued again.",
    "extend": "The deadline was extended.",
    "redeliver": "The webhook event will be sent again.",
    "approve": "The request was approved: its job is created and a worker will take it.",
    "reject": "The request was rejected; the reason is recorded and its callback told.",
    "settings": "The model's settings were saved (each change audited as model.updated).",
    "erasure": "The erasure was received: one deletion request per model holding the person's rows.",
}
BULK_ACTIONS = ("approve", "reject", "cancel", "retry", "extend")
"""What the list's bulk form offers, in the order an operator reaches for them (the API's ``BulkAction``)."""
ERASURE_METHODS = ("auto", "retrain")
"""What the erasure form offers: ``auto`` (each model's best validated method, else exact retraining) or exact
retraining everywhere; the API takes any method name, refused per model when that model cannot run it."""

templates = Jinja2Templates(directory=str(HERE / "templates"))
templates.env.globals.update(
    flat_info=flat_info,
    time_left=time_left,
    active_statuses=ACTIVE_STATUSES,
    statuses=STATUSES,
    served_by=served_by,
    actor_label=actor_label,
    quality=lambda info: method_quality(info, get_settings().auto_max_param_ratio),
)
templates.env.filters["pretty"] = lambda value: json.dumps(value, indent=2, sort_keys=True, default=str)
templates.env.filters["shortid"] = short_id  # an id's last 8 characters: its first ones are its clock's (app.ids)
templates.env.filters["when"] = lambda value: value.strftime("%Y-%m-%d %H:%M:%S UTC") if value else "—"


class _Refused(Exception):
    def __init__(self, response: Response):
        self.response = response


def _render(request: Request, name: str, context: dict[str, Any], status_code: int = 200) -> HTMLResponse:
    context = {"poll_ms": POLL_MS, **context}
    if "principal" in context and context["principal"] is not None:
        context.setdefault("csrf", cookies.csrf_token(request))
    return templates.TemplateResponse(request, name, context, status_code=status_code, headers=SECURITY_HEADERS)


def _login_page(request: Request, message: str | None, status_code: int) -> HTMLResponse:
    nonce, token = cookies.login_token()
    response = _render(request, "login.html", {"message": message, "login_token": token}, status_code)
    cookies.set_login_cookie(response, nonce)
    return response


def _gate(request: Request, scope: str = "requests:read", *, fragment: bool = False) -> Principal:
    """The session's principal holding ``scope``; otherwise raise a refusal: the login page (no session, or one that
    ended: logged out, timed out, its key revoked or expired) or 403 (the key lacks the scope). A fragment or JSON
    call gets a bare 401/403 with no data."""
    token = cookies.session_token(request)
    principal = dashboard_principal(token) if token else None
    if principal is None:
        if fragment:
            response: Response = JSONResponse({"error": "login required"}, status_code=401, headers=SECURITY_HEADERS)
        elif token is None:
            response = RedirectResponse("/dashboard/login", status_code=303, headers=SECURITY_HEADERS)
        else:
            message = "Your session was refused: it ended (logged out or timed out), or its API key was revoked."
            response = _login_page(request, message, 401)
        if token is not None:
            cookies.end_session(response)
        raise _Refused(response)
    if not principal.has(scope) or principal.model_id is not None:
        message = f"This needs an API key with the scope `{scope}`."
        if fragment:
            raise _Refused(JSONResponse({"error": message}, status_code=403, headers=SECURITY_HEADERS))
        raise _Refused(_render(request, "refused.html", {"principal": principal, "message": message}, 403))
    return principal


class DashboardRoute(APIRoute):
    """Answers in HTML: a refusal is its page, a problem (404, 409, a bad filter) an error page with its status."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def answer(request: Request) -> Response:
            try:
                return await handler(request)
            except _Refused as refused:
                return refused.response
            except Problem as problem:
                detail = f"{problem.title}: {problem.detail}" if problem.detail else problem.title
                return _render(request, "refused.html", {"principal": None, "message": detail}, problem.status)
            except RequestValidationError as exc:
                fields = "; ".join(f"{'.'.join(map(str, e['loc'][1:]))}: {e['msg']}" for e in exc.errors())
                return _render(request, "refused.html", {"principal": None, "message": f"Not valid: {fields}"}, 422)

        return answer


router = APIRouter(prefix="/dashboard", include_in_schema=False, route_class=DashboardRoute)


# ------------------------------------------------------------------------------------------------ login and assets


@router.get("")
def home() -> RedirectResponse:
    return RedirectResponse("/dashboard/requests", status_code=303)


@router.get("/login")
def login_form(request: Request) -> HTMLResponse:
    return _login_page(request, None, 200)


@router.post("/login")
def login(request: Request, api_key: str = Form("", max_length=200), csrf: str = Form("", max_length=500)) -> Response:
    if not cookies.login_token_ok(request, csrf):
        return _login_page(request, cookies.plain_http_hint(request) or "The form expired; please try again.", 403)
    principal = principal_for_key(api_key.strip())
    if principal is None:
        return _login_page(request, "Unknown, expired or revoked API key.", 401)
    if not principal.has("requests:read") or principal.model_id is not None:
        return _login_page(request, "This key lacks the scope `requests:read`.", 403)
    end_dashboard_session(cookies.session_token(request) or "", "replaced")  # a login replaces this browser's last
    response = RedirectResponse("/dashboard/requests", status_code=303, headers=SECURITY_HEADERS)
    cookies.start_session(response, open_dashboard_session(principal))
    return response


@router.post("/logout")
def logout(request: Request, csrf: str = Form("", max_length=500)) -> Response:
    if not cookies.csrf_ok(request, csrf):
        return _render(request, "refused.html", {"principal": None, "message": STALE_FORM}, 403)
    end_dashboard_session(cookies.session_token(request) or "")  # the cookie, replayed, opens nothing any more
    response = RedirectResponse("/dashboard/login", status_code=303, headers=SECURITY_HEADERS)
    cookies.end_session(response)
    return response


@router.get("/static/{name}")
def static(name: str) -> Response:
    if name not in STATIC:
        raise Problem(404, "not-found", "No such file", name)
    return Response((HERE / "static" / name).read_bytes(), media_type=STATIC[name],
                    headers={"Cache-Control": "private, max-age=300", "X-Content-Type-Options": "nosniff"})  # fmt: skip


# --------------------------------------------------------------------------------------------------- requests


def _day(text: str | None, field: str) -> datetime | None:
    if not text:
        return None
    try:
        return datetime.combine(date.fromisoformat(text), time(), tzinfo=UTC)
    except ValueError:
        raise Problem(422, "validation-error", "Not a date", f"{field}: write it as YYYY-MM-DD") from None


def _filters(status: str, model_id: str, since: str, until: str, overdue: bool) -> dict[str, Any]:
    """The list's filter as the form gave it, and as the requests service takes it (``query``)."""
    if status and status not in STATUSES:
        raise Problem(422, "validation-error", "The request is not valid", f"status: one of {list(STATUSES)}")
    until_day = _day(until, "until")
    query = {
        "status": status or None,
        "model_id": model_id or None,
        "overdue": overdue,
        "created_from": _day(since, "since"),
        "created_before": until_day + timedelta(days=1) if until_day else None,
    }
    return {"status": status, "model_id": model_id, "since": since, "until": until, "overdue": overdue, "query": query}


def _list_context(
    session: Session, principal: Principal, filters: dict[str, Any], cursor: str | None = None
) -> dict[str, Any]:
    query = filters["query"]
    rows, next_cursor = requests.list_requests(
        session,
        query["status"],
        query["model_id"],
        50,
        cursor,
        overdue=query["overdue"],
        created_from=query["created_from"],
        created_before=query["created_before"],
    )
    shown = {k: v for k, v in filters.items() if k != "query"}
    next_link = None
    if next_cursor:
        link = {k: v for k, v in shown.items() if v} | {"cursor": next_cursor}
        next_link = "/dashboard/requests?" + urlencode({k: ("1" if v is True else v) for k, v in link.items()})
    admin, limit = principal.has("admin"), get_settings().bulk_max_requests
    return {
        "principal": principal,
        "rows": [requests.to_out(r) for r in rows],
        "models": {m.id: m for m in registry.models_overview(session, limit=1000)},
        "filters": shown,
        "filtered": any(shown.values()),
        "matching": requests.count_requests(session, limit + 1, **query) if admin else None,
        "bulk_limit": limit,
        "bulk_actions": BULK_ACTIONS,
        "admin": admin,
        "next_link": next_link,
        "page": "requests",
    }


@router.get("/requests")
def request_list(
    request: Request,
    session: Session = Depends(get_session),
    status: str = Query("", max_length=20),
    model_id: str = Query("", max_length=36),
    since: str = Query("", max_length=10),
    until: str = Query("", max_length=10),
    overdue: bool = Query(False),
    cursor: str | None = Query(None, max_length=500),
) -> HTMLResponse:
    principal = _gate(request)
    filters = _filters(status, model_id, since, until, overdue)
    return _render(request, "requests.html", _list_context(session, principal, filters, cursor))


@router.post("/requests/bulk")
def bulk_action(
    request: Request,
    session: Session = Depends(get_session),
    csrf: str = Form("", max_length=500),
    action: str = Form("", max_length=20),
    selection: str = Form("ids", max_length=10),
    ids: list[str] = Form([]),
    months: int = Form(1, ge=1, le=2),
    reason: str = Form("", max_length=2000),
    status: str = Form("", max_length=20),
    model_id: str = Form("", max_length=36),
    since: str = Form("", max_length=10),
    until: str = Form("", max_length=10),
    overdue: bool = Form(False),
) -> Response:
    """``POST /v1/deletion-requests/bulk`` from the list: the requests ticked (``selection=ids``) or every request
    matching the list's filter (``selection=filter``), through the same function (each request in its own savepoint,
    audited on its own, four eyes kept: a request the approver submitted is skipped). Answers the list again, with
    each request's outcome above it."""
    principal = _gate(request, "admin")
    if not cookies.csrf_ok(request, csrf):
        return _render(request, "refused.html", {"principal": principal, "message": STALE_FORM}, 403)
    filters = _filters(status, model_id, since, until, overdue)
    outcome, error, status_code = None, None, 200
    try:
        if action not in BULK_ACTIONS:
            raise Problem(422, "validation-error", "The request is not valid", f"action: one of {list(BULK_ACTIONS)}")
        if selection not in ("ids", "filter"):
            raise Problem(422, "validation-error", "The request is not valid", "selection: ids or filter")
        if selection == "ids" and not ids:
            raise Problem(422, "bulk-selection-empty", "Nothing is selected",
                          "tick the requests to act on, or choose every request matching the filter")  # fmt: skip
        query = filters["query"]
        matching = BulkFilter(
            status=query["status"],
            model_id=query["model_id"],
            overdue=query["overdue"],
            created_after=query["created_from"],
            created_before=query["created_before"],
        )
        body = BulkIn(
            action=action,
            ids=ids if selection == "ids" else None,
            filter=matching if selection == "filter" else None,
            months=months if action == "extend" else None,
            reason=_reason(reason, "reason") if action in ("reject", "extend") else None,
        )
        outcome = run_bulk(session, principal, body)
        session.commit()
    except (Problem, ValidationError) as exc:
        session.rollback()
        error, status_code = _refusal(exc)
    status_now = {}  # a skipped request's status, which the bulk answer leaves out (it did not change)
    for result in outcome.results if outcome else []:
        if result.outcome == "skipped":
            try:
                status_now[result.id] = requests.get_request_or_404(session, result.id).status
            except Problem:
                continue  # no such request
    context = _list_context(session, principal, filters)
    form = {"action": action, "selection": selection, "months": months, "reason": reason if error else ""}
    extra = {"outcome": outcome, "status_now": status_now, "error": error, "form": form}
    return _render(request, "requests.html", {**context, **extra}, status_code)


@router.get("/api/requests")
def request_states(
    request: Request, session: Session = Depends(get_session), ids: str = Query("", max_length=4000)
) -> JSONResponse:
    """What the polling script needs: the status, progress and deadline of the listed requests (at most 100)."""
    _gate(request, fragment=True)
    wanted = [i for i in dict.fromkeys(ids.split(",")) if i][:100]
    items = []
    for request_id in wanted:
        try:
            items.append(request_json(requests.to_out(requests.get_request_or_404(session, request_id))))
        except Problem:
            continue
    return JSONResponse({"items": items}, headers=SECURITY_HEADERS)


def _request_context(session: Session, principal: Principal, request_id: str) -> dict[str, Any]:
    row = requests.get_request_or_404(session, request_id)
    out = requests.to_out(row)
    model = registry.get_model_or_404(session, row.model_id)
    reports = [report_out(r) for r in reports_for(session, request_id)]
    certificate = None
    if row.certificate_id:
        record = get_certificate_or_404(session, row.certificate_id)
        valid, message = verify_certificate(record.envelope)
        certificate = {
            "id": record.id,
            "digest": record.digest,
            "key_id": record.key_id,
            "subject": record.subject_digest,
            "valid": valid,
            "message": message,
        }
    typed = requests.operator_texts(row)  # the log keeps their digests; the text lives on the request row
    timeline = [
        {"seq": e.seq, "at": e.at, "actor": e.actor, "action": e.action, "payload": e.payload,
         "text": typed.get(e.payload.get("reason_digest") or e.payload.get("note_digest") or "")}
        for e in events_for(session, request_id)
    ] if principal.has("audit:read") else None  # fmt: skip
    submitter = f"api-key:{row.api_key_id}" if row.api_key_id else None
    return {
        "principal": principal,
        "actors": actor_names(list_keys(session)),
        "submitter": submitter,
        "own_request": row.api_key_id is not None and row.api_key_id == principal.key_id,
        "r": out,
        "model": model,
        "reports": [{**rep, "figures": report_figures(rep)} for rep in reports],
        "certificate": certificate,
        "timeline": timeline,
        "deliveries": [webhooks.delivery_out(d) for d in webhooks.deliveries_for(session, request_id)],
        "admin": principal.has("admin"),
        "can_approve": row.status == APPROVAL_STATUS,
        "can_cancel": row.status in CANCELLABLE_STATUSES,
        "can_retry": row.status == "failed",
        "can_extend": row.status not in TERMINAL_STATUSES,
        "page": "requests",
    }


@router.get("/requests/{request_id}")
def request_page(
    request_id: str, request: Request, session: Session = Depends(get_session), done: str = Query("", max_length=20)
) -> HTMLResponse:
    principal = _gate(request)
    context = _request_context(session, principal, request_id)
    return _render(request, "request.html", {**context, "notice": DONE.get(done)})


@router.get("/requests/{request_id}/live")
def request_fragment(request_id: str, request: Request, session: Session = Depends(get_session)) -> HTMLResponse:
    """The request page's body (timeline, attempts, evidence, actions), fetched again when its status changes."""
    principal = _gate(request, fragment=True)
    return _render(request, "_request_body.html", _request_context(session, principal, request_id))


def _action(request: Request, session: Session, request_id: str, csrf: str, name: str, run) -> Response:
    principal = _gate(request, "admin")
    if not cookies.csrf_ok(request, csrf):
        return _render(request, "refused.html", {"principal": principal, "message": STALE_FORM}, 403)
    try:
        run(principal)
        session.commit()
    except (Problem, IntegrityError) as exc:
        session.rollback()
        problem = exc if isinstance(exc, Problem) else Problem(
            409, "deletion-in-progress", "Another unfinished request now holds some of these rows", request_id
        )  # fmt: skip
        context = _request_context(session, principal, request_id)
        error = f"{problem.title}: {problem.detail}" if problem.detail else problem.title
        return _render(request, "request.html", {**context, "error": error}, problem.status)
    return RedirectResponse(f"/dashboard/requests/{request_id}?done={name}", status_code=303, headers=SECURITY_HEADERS)


@router.post("/requests/{request_id}/cancel")
def cancel(request_id: str, request: Request, session: Session = Depends(get_session), csrf: str = Form("")):
    return _action(request, session, request_id, csrf, "cancel",
                   lambda p: requests.cancel_request(session, p, request_id))  # fmt: skip


@router.post("/requests/{request_id}/retry")
def retry(request_id: str, request: Request, session: Session = Depends(get_session), csrf: str = Form("")):
    return _action(request, session, request_id, csrf, "retry",
                   lambda p: requests.retry_request(session, p, request_id))  # fmt: skip


@router.post("/requests/{request_id}/extend")
def extend(
    request_id: str,
    request: Request,
    session: Session = Depends(get_session),
    csrf: str = Form(""),
    months: int = Form(1, ge=1, le=2),
    reason: str = Form("", max_length=2000),
):
    def run(principal: Principal) -> None:
        requests.extend_deadline(session, principal, request_id, months, _reason(reason, "reason"))

    return _action(request, session, request_id, csrf, "extend", run)


def _reason(text: str, what: str) -> str:
    """A reason or note as the API's body takes it: no NUL; a reason says why in 3 characters or more."""
    if "\x00" in text:
        raise Problem(422, "validation-error", "The request is not valid", f"{what}: no NUL characters")
    if what == "reason" and len(text.strip()) < 3:
        raise Problem(422, "validation-error", "The request is not valid", "reason: say why (3 characters or more)")
    return text.strip()


@router.post("/requests/{request_id}/approve")
def approve(
    request_id: str,
    request: Request,
    session: Session = Depends(get_session),
    csrf: str = Form(""),
    note: str = Form("", max_length=2000),
):
    """The API's approve: four eyes (``403 approval-by-submitter`` for the key that submitted it), audited."""

    def run(principal: Principal) -> None:
        requests.approve_request(session, principal, request_id, _reason(note, "note") or None)

    return _action(request, session, request_id, csrf, "approve", run)


@router.post("/requests/{request_id}/reject")
def reject(
    request_id: str,
    request: Request,
    session: Session = Depends(get_session),
    csrf: str = Form(""),
    reason: str = Form("", max_length=2000),
):
    """The API's reject: the reason is told to the data subject (the callback) and audited."""

    def run(principal: Principal) -> None:
        requests.reject_request(session, principal, request_id, _reason(reason, "reason"))

    return _action(request, session, request_id, csrf, "reject", run)


@router.post("/requests/{request_id}/webhooks/{delivery_id}/redeliver")
def redeliver(
    request_id: str, delivery_id: str, request: Request, session: Session = Depends(get_session), csrf: str = Form("")
):
    return _action(request, session, request_id, csrf, "redeliver",
                   lambda p: webhooks.redeliver(session, request_id, delivery_id))  # fmt: skip


# ------------------------------------------------------------------------------------ evidence: plots, certificates


@router.get("/reports/{report_id}/plots/{name}")
def plot(report_id: str, name: str, request: Request, session: Session = Depends(get_session)) -> Response:
    _gate(request, fragment=True)
    png, etag = plot_png(get_report_or_404(session, report_id), name)
    session.commit()  # a plot drawn now is kept
    return Response(png, media_type="image/png",
                    headers={"Cache-Control": "private, max-age=86400", "ETag": f'"{etag}"'})  # fmt: skip


def verify_certificate(envelope: dict[str, Any], predicate_type: str = PREDICATE_TYPE) -> tuple[bool, str]:
    """What ``lethe verify-certificate`` answers, against the keys ``/.well-known/lethe-keys.json`` publishes: a
    deletion certificate, or (``SUBJECT_ERASURE_PREDICATE_TYPE``) a per-person erasure's combined one."""
    keys = public_keys()  # the document, with its retired and revoked marks, not only the keys
    try:
        verified = verify_envelope(json.dumps(envelope).encode(), keys, predicate_type=predicate_type)
    except InvalidCertificate as exc:
        return False, f"INVALID ({exc.code}): {exc.reason}"
    return True, describe(verified)


@router.get("/certificates/{certificate_id}/verify")
def verify(certificate_id: str, request: Request, session: Session = Depends(get_session)) -> JSONResponse:
    _gate(request, fragment=True)
    valid, message = verify_certificate(get_certificate_or_404(session, certificate_id).envelope)
    checked = datetime.now(UTC).strftime("%H:%M:%S UTC")
    return JSONResponse({"valid": valid, "message": message, "checked_at": checked}, headers=SECURITY_HEADERS)


@router.get("/certificates/{certificate_id}/download")
def download(certificate_id: str, request: Request, session: Session = Depends(get_session)) -> Response:
    _gate(request, fragment=True)
    record = get_certificate_or_404(session, certificate_id)
    return Response(
        json.dumps(record.envelope, indent=1),
        media_type="application/json",
        headers={**SECURITY_HEADERS, "Content-Disposition": f'attachment; filename="certificate-{record.id}.json"'},
    )


# ----------------------------------------------------------------------------------------------- models and audit


def _version_dicts(session: Session, model) -> list[dict[str, Any]]:
    return [
        {
            "id": v.id,
            "number": v.number,
            "parent_id": v.parent_id,
            "digest": v.digest,
            "method": v.method,
            "request_id": v.request_id,
            "metrics": v.metrics,
            "accuracy": version_accuracy(v.metrics),
            "created_at": v.created_at,
            "retired_at": v.retired_at,
            "retired_by": v.retired_by,
            "current": v.id == model.current_version_id,
        }  # fmt: skip
        for v in registry.list_versions(session, model.id)
    ]


@router.get("/models")
def model_list(request: Request, session: Session = Depends(get_session)) -> HTMLResponse:
    principal = _gate(request)
    models = []
    for model in registry.models_overview(session):
        out = registry.model_out(session, model)
        versions = _version_dicts(session, model)
        models.append({"m": out, "versions": versions, "lock": model.state.get("forget_lock")})
    return _render(request, "models.html", {"principal": principal, "models": models, "page": "models"})


def _model_context(session: Session, principal: Principal, model_id: str) -> dict[str, Any]:
    model = registry.get_model_or_404(session, model_id)
    versions = _version_dicts(session, model)
    return {
        "principal": principal,
        "m": registry.model_out(session, model),
        "versions": versions,
        "carried": carried_deletions(versions),
        "lineage": lineage_svg(versions),
        "lock": model.state.get("forget_lock"),
        "admin": principal.has("admin"),
        "page": "models",
    }


@router.get("/models/{model_id}")
def model_page(
    model_id: str, request: Request, session: Session = Depends(get_session), done: str = Query("", max_length=20)
) -> HTMLResponse:
    principal = _gate(request)
    context = _model_context(session, principal, model_id)
    return _render(request, "model.html", {**context, "notice": DONE.get(done)})


def _tags(text: str) -> list[str]:
    """Tags as typed in one field: separated by commas or spaces, duplicates dropped (the API checks each)."""
    return list(dict.fromkeys(t for t in text.replace(",", " ").split() if t))


@router.post("/models/{model_id}/settings")
def model_settings(
    model_id: str,
    request: Request,
    session: Session = Depends(get_session),
    csrf: str = Form("", max_length=500),
    requires_approval: bool = Form(False),
    tags: str = Form("", max_length=2000),
    batch_max_requests: str = Form("", max_length=12),
    batch_max_rows: str = Form("", max_length=12),
) -> Response:
    """``PATCH /v1/models/{id}`` from the model page (admin): the same validation (``ModelPatch``) and the same service
    function, so each change is audited as ``model.updated`` exactly as the API's, and a value left as it was changes
    and records nothing. The batch bounds are sent only for a model that has them (a tabular one)."""
    principal = _gate(request, "admin")
    if not cookies.csrf_ok(request, csrf):
        return _render(request, "refused.html", {"principal": principal, "message": STALE_FORM}, 403)
    model = registry.get_model_or_404(session, model_id)
    try:
        change: dict[str, Any] = {"requires_approval": requires_approval, "tags": _tags(tags)}
        if model.spec.get("batch") is not None:
            change["batch"] = {"max_requests": batch_max_requests.strip(), "max_rows": batch_max_rows.strip()}
        registry.update_model(session, principal, model, ModelPatch.model_validate(change))
        session.commit()
    except (Problem, ValidationError) as exc:
        session.rollback()
        message, status_code = _refusal(exc)
        if isinstance(exc, ValidationError):  # a tag as the person typed it, not as the schema's pattern says
            bad = [str(e["input"]) for e in exc.errors() if e["loc"][:1] == ("tags",) and len(e["loc"]) == 2]
            if bad:
                verb = "is not a tag" if len(bad) == 1 else "are not tags"
                message = (f"Not valid: {', '.join(map(repr, bad))} {verb} (lower-case letters, digits and ._:- "
                           "only, at most 64 characters, 16 tags)")  # fmt: skip
        context = _model_context(session, principal, model_id)
        form = {"requires_approval": requires_approval, "tags": tags, "batch_max_requests": batch_max_requests,
                "batch_max_rows": batch_max_rows}  # fmt: skip
        return _render(request, "model.html", {**context, "settings_error": message, "form": form}, status_code)
    location = f"/dashboard/models/{model_id}?done=settings"
    return RedirectResponse(location, status_code=303, headers=SECURITY_HEADERS)


@router.get("/audit")
def audit(request: Request, session: Session = Depends(get_session)) -> HTMLResponse:
    principal = _gate(request, "audit:read")
    verdict = verify_chain(session)
    return _render(
        request,
        "audit.html",
        {
            "principal": principal,
            "verdict": verdict,
            "events": latest_events(session, 50),
            "actors": actor_names(list_keys(session)),
            "page": "audit",
        },
    )


# ------------------------------------------------------------------------------------------- per-person erasure


def _subjects_page(
    request: Request, principal: Principal, error: str | None = None, status_code: int = 200, **form: str
) -> HTMLResponse:
    context = {
        "principal": principal,
        "can_erase": principal.has("requests:write"),
        "methods": ERASURE_METHODS,
        "form": form,
        "error": error,
        "page": "subjects",
    }
    return _render(request, "subjects.html", context, status_code)


def _refusal(exc: Problem | ValidationError) -> tuple[str, int]:
    if isinstance(exc, Problem):
        return (f"{exc.title}: {exc.detail}" if exc.detail else exc.title), exc.status
    fields = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
    return f"Not valid: {fields}", 422


@router.get("/subjects")
def subjects_page(request: Request) -> HTMLResponse:
    """Look a person up, or erase them from every model holding their rows."""
    return _subjects_page(request, _gate(request))


@router.post("/subjects/lookup")
def subject_lookup(
    request: Request, csrf: str = Form("", max_length=500), subject_ref: str = Form("", max_length=500)
) -> Response:
    """The person's reference arrives in a form body (never in a URL, so no log or history keeps it) and leaves as
    its keyed hash, the only name Lethe stores."""
    principal = _gate(request)
    if not cookies.csrf_ok(request, csrf):
        return _render(request, "refused.html", {"principal": principal, "message": STALE_FORM}, 403)
    if not subject_ref.strip() or "\x00" in subject_ref:
        return _subjects_page(request, principal, "Give the person's reference.", 422)
    location = f"/dashboard/subjects/{subjects.subject_hash(subject_ref.strip())}"
    return RedirectResponse(location, status_code=303, headers=SECURITY_HEADERS)


@router.post("/subjects/erasures")
def subject_erasure(
    request: Request,
    session: Session = Depends(get_session),
    csrf: str = Form("", max_length=500),
    subject_ref: str = Form("", max_length=500),
    method: str = Form("auto", max_length=64),
    received: str = Form("", max_length=10),
) -> Response:
    """``POST /v1/subjects/erasures`` from a form: the same service call, audited the same way."""
    principal = _gate(request, "requests:write")
    if not cookies.csrf_ok(request, csrf):
        return _render(request, "refused.html", {"principal": principal, "message": STALE_FORM}, 403)
    try:
        received_at = _day(received, "received")
        if received_at is not None and received_at.date() > datetime.now(UTC).date():
            raise Problem(422, "validation-error", "Not a date", "received: the day the person asked, not later")
        body = ErasureCreate(subject_ref=subject_ref.strip(), method=method, received_at=received_at)
        erasure = subjects.create_erasure(session, principal, body)
        session.commit()
    except (Problem, ValidationError) as exc:
        session.rollback()
        message, status = _refusal(exc)
        return _subjects_page(request, principal, message, status, method=method, received=received)
    location = f"/dashboard/erasures/{erasure.id}?done=erasure"
    return RedirectResponse(location, status_code=303, headers=SECURITY_HEADERS)


@router.get("/subjects/{subject_hash}")
def subject_page(subject_hash: str, request: Request, session: Session = Depends(get_session)) -> HTMLResponse:
    """A person's deletion requests and erasures, found by the keyed hash of their reference."""
    principal = _gate(request)
    found, erasures = subjects.requests_of(session, subject_hash, 200)
    models = {m.id: m for m in registry.models_overview(session, limit=1000)}
    return _render(
        request,
        "subject.html",
        {
            "principal": principal,
            "subject_hash": subject_hash,
            "rows": [requests.to_out(r) for r in found],
            "erasures": [subjects.erasure_out(session, e) for e in erasures],
            "models": models,
            "page": "subjects",
        },
    )


def _erasure_context(session: Session, principal: Principal, erasure_id: str) -> dict[str, Any]:
    erasure = subjects.get_erasure_or_404(session, erasure_id)
    out = subjects.erasure_out(session, erasure)
    certificate = None
    if erasure.certificate is not None:
        valid, message = verify_certificate(erasure.certificate, SUBJECT_ERASURE_PREDICATE_TYPE)
        signatures = erasure.certificate.get("signatures") or [{}]
        certificate = {
            "digest": erasure.certificate_digest,
            "key_id": signatures[0].get("keyid"),
            "valid": valid,
            "message": message,
        }
    return {
        "principal": principal,
        "e": out,
        "models": {m.id: m for m in registry.models_overview(session, limit=1000)},
        "certificate": certificate,
        "following": out.status == "in-progress",
        "page": "subjects",
    }


@router.get("/erasures/{erasure_id}")
def erasure_page(
    erasure_id: str, request: Request, session: Session = Depends(get_session), done: str = Query("", max_length=20)
) -> HTMLResponse:
    principal = _gate(request)
    context = _erasure_context(session, principal, erasure_id)
    return _render(request, "erasure.html", {**context, "notice": DONE.get(done)})


@router.get("/erasures/{erasure_id}/live")
def erasure_fragment(erasure_id: str, request: Request, session: Session = Depends(get_session)) -> HTMLResponse:
    """The erasure page's body, fetched again while the erasure is in progress (the page follows it)."""
    principal = _gate(request, fragment=True)
    return _render(request, "_erasure_body.html", _erasure_context(session, principal, erasure_id))


@router.get("/erasures/{erasure_id}/verify")
def erasure_verify(erasure_id: str, request: Request, session: Session = Depends(get_session)) -> JSONResponse:
    _gate(request, fragment=True)
    erasure = subjects.get_erasure_or_404(session, erasure_id)
    if erasure.certificate is None:
        return JSONResponse({"error": "not issued yet"}, status_code=404, headers=SECURITY_HEADERS)
    valid, message = verify_certificate(erasure.certificate, SUBJECT_ERASURE_PREDICATE_TYPE)
    checked = datetime.now(UTC).strftime("%H:%M:%S UTC")
    return JSONResponse({"valid": valid, "message": message, "checked_at": checked}, headers=SECURITY_HEADERS)


@router.get("/erasures/{erasure_id}/certificate")
def erasure_certificate(erasure_id: str, request: Request, session: Session = Depends(get_session)) -> Response:
    """The combined certificate as signed (a DSSE envelope), to check offline with ``lethe verify-certificate``."""
    _gate(request, fragment=True)
    erasure = subjects.get_erasure_or_404(session, erasure_id)
    if erasure.certificate is None:
        return JSONResponse({"error": "not issued yet"}, status_code=404, headers=SECURITY_HEADERS)
    return Response(
        json.dumps(erasure.certificate, indent=1),
        media_type="application/json",
        headers={**SECURITY_HEADERS, "Content-Disposition": f'attachment; filename="erasure-{erasure.id}.json"'},
    )

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse
from sqlalchemy.orm import Session

from app.auth.service import Principal, require_scope
from app.db import get_session
from app.webhooks.schemas import DeliveryOut, DeliveryPage, SecretIn, SecretOut
from app.webhooks.service import deliveries_for, delivery_out, endpoint_secret, redeliver

router = APIRouter(tags=["webhooks"])


@router.get("/v1/deletion-requests/{request_id}/webhooks", response_model=DeliveryPage)
def list_deliveries(
    request_id: str,
    _: Principal = Depends(require_scope("requests:read")),
    session: Session = Depends(get_session),
):
    """The delivery log of a request's webhook events: attempts, last answer, next retry."""
    return JSONResponse({"items": [delivery_out(d) for d in deliveries_for(session, request_id)]})


@router.post(
    "/v1/deletion-requests/{request_id}/webhooks/{delivery_id}/redeliver", status_code=202, response_model=DeliveryOut
)
def redeliver_event(
    request_id: str,
    delivery_id: str,
    _: Principal = Depends(require_scope("requests:write")),
    session: Session = Depends(get_session),
):
    """Send an event again (same ``webhook-id``, a fresh retry window)."""
    delivery = redeliver(session, request_id, delivery_id)
    session.commit()
    return JSONResponse(delivery_out(delivery), status_code=202)


@router.post("/v1/webhooks/secret", response_model=SecretOut)
def webhook_secret(body: SecretIn, _: Principal = Depends(require_scope("admin"))):
    """The ``whsec_`` secret Lethe signs this callback URL's events with (Standard Webhooks); configure the receiver
    with it. Derived from the master secret for this URL alone, never stored."""
    return {"url": body.url, "secret": endpoint_secret(body.url)}

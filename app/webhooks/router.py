from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse
from sqlalchemy.orm import Session

from app.auth.service import Principal, find_key, require_scope
from app.db import get_session
from app.problems import Problem
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
    _: Principal = Depends(require_scope("admin")),
    session: Session = Depends(get_session),
):
    """Send an event again (same ``webhook-id``, a fresh retry window). Admin only: a redelivery reaches a receiver
    on the requester's behalf, so a key that may submit requests may not replay another requester's events."""
    delivery = redeliver(session, request_id, delivery_id)
    session.commit()
    return JSONResponse(delivery_out(delivery), status_code=202)


@router.post("/v1/webhooks/secret", response_model=SecretOut)
def webhook_secret(
    body: SecretIn, _: Principal = Depends(require_scope("admin")), session: Session = Depends(get_session)
):
    """The ``whsec_`` secret Lethe signs one key's events to this callback URL with (Standard Webhooks); configure
    the receiver with it. Derived from the master secret for this key and URL, never stored."""
    key = find_key(session, body.key)
    if key is None:
        raise Problem(404, "api-key-not-found", "No API key has this id or prefix", body.key)
    return {"url": body.url, "key_id": key.id, "secret": endpoint_secret(body.url, key.id)}

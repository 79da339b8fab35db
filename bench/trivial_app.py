"""The ceiling for bench/intake.py: a trivial FastAPI POST endpoint (one pydantic body, no database), served by the
same uvicorn settings and hit by the same wrk script as the real endpoint."""

from __future__ import annotations

import uuid
from typing import Literal

from fastapi import FastAPI
from pydantic import BaseModel


class Scope(BaseModel):
    kind: Literal["samples"]
    sample_ids: list[str]


class Body(BaseModel):
    subject_ref: str
    model_id: str
    scope: Scope


app = FastAPI()


@app.post("/v1/deletion-requests", status_code=202)
async def create(body: Body) -> dict:
    return {"id": uuid.uuid4().hex, "model_id": body.model_id, "status": "received"}


@app.get("/healthz")
async def healthz() -> dict:
    return {"status": "ok"}

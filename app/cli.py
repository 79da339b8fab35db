"""`lethe`: serve, worker, dispatcher, migrate, keys, demo, submit, status, verify-certificate."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(help="Lethe: unlearning as a service.", no_args_is_help=True)
keys_app = typer.Typer(help="API keys.", no_args_is_help=True)
app.add_typer(keys_app, name="keys")


def _logging(level: str | None = None) -> None:
    """Structured logs (app/logs.py), at LETHE_LOG_LEVEL unless a level is given."""
    from app.config import get_settings
    from app.logs import configure_logging

    settings = get_settings()
    configure_logging(level or settings.log_level, json_lines=settings.log_json)


@app.command()
def migrate() -> None:
    """Create or upgrade the database schema (Alembic)."""
    from app.db import migrate as run_migrations

    run_migrations()
    typer.echo("database at the newest revision")


@keys_app.command("create")
def keys_create(
    scope: Annotated[list[str], typer.Option("--scope", "-s", help="Repeat for several scopes.")],
    name: Annotated[str, typer.Option(help="A label for the key.")] = "cli",
    model: Annotated[
        str | None, typer.Option("--model", help="Bind the key to one model (scopes rounds:write, models:read).")
    ] = None,
    client_id: Annotated[
        str | None, typer.Option("--client-id", help="The federated client the key belongs to (needs --model).")
    ] = None,
    expires_in: Annotated[
        str | None, typer.Option("--expires-in", help="Lifetime: 30d, 12h, 90m, 2w, 45s (default: no expiry).")
    ] = None,
) -> None:
    """Create an API key and print it once (only its HMAC is stored)."""
    from app.auth.service import create_key, parse_duration
    from app.db import migrate as run_migrations
    from app.db import session_scope

    run_migrations()
    try:
        lifetime = parse_duration(expires_in) if expires_in is not None else None
        with session_scope() as session:
            row, key = create_key(session, name, scope, model_id=model, client_id=client_id, expires_in=lifetime)
            key_id, expires_at = row.id, row.expires_at
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    typer.echo(key)
    bound = f"; bound to model {model}" + (f", client {client_id}" if client_id else "") if model else ""
    expiry = f"; expires {expires_at.isoformat(timespec='seconds')}" if expires_at else ""
    typer.echo(f"(key id {key_id}; scopes {sorted(set(scope))}{bound}{expiry}; it will not be shown again)", err=True)


@keys_app.command("list")
def keys_list(as_json: Annotated[bool, typer.Option("--json", help="One JSON object per key.")] = False) -> None:
    """List API keys: id, prefix, name, scopes, binding, expiry, revocation (never the key or its hash)."""
    from app.auth.service import list_keys
    from app.db import migrate as run_migrations
    from app.db import session_scope, utcnow

    run_migrations()
    now = utcnow()
    with session_scope() as session:
        for row in list_keys(session):
            state = (
                "revoked"
                if row.revoked_at
                else ("expired" if row.expires_at is not None and row.expires_at <= now else "active")
            )
            entry = {
                "id": row.id,
                "prefix": row.prefix,
                "name": row.name,
                "scopes": row.scopes,
                "model_id": row.model_id,
                "client_id": row.client_id,
                "created_at": row.created_at.isoformat(timespec="seconds"),
                "expires_at": row.expires_at.isoformat(timespec="seconds") if row.expires_at else None,
                "revoked_at": row.revoked_at.isoformat(timespec="seconds") if row.revoked_at else None,
                "state": state,
            }
            if as_json:
                typer.echo(json.dumps(entry))
            else:
                binding = f" model={row.model_id}" + (f" client={row.client_id}" if row.client_id else "")
                typer.echo(
                    f"{row.id}  lethe_{row.prefix}_…  {state:<8} {row.name!r} {','.join(row.scopes)}"
                    f"{binding if row.model_id else ''}"
                    f"{'  expires ' + entry['expires_at'] if row.expires_at else ''}"
                )


@keys_app.command("revoke")
def keys_revoke(key_id: Annotated[str, typer.Argument(help="The key's id (or its prefix).")]) -> None:
    """Revoke a key: every API process refuses it from its next request on."""
    from app.auth.service import revoke_key
    from app.db import migrate as run_migrations
    from app.db import session_scope

    run_migrations()
    try:
        with session_scope() as session:
            row = revoke_key(session, key_id)
            typer.echo(f"revoked {row.id} ({row.name!r}) at {row.revoked_at.isoformat(timespec='seconds')}")
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc


@keys_app.command("webhook-secret")
def keys_webhook_secret(url: str) -> None:
    """Print the `whsec_` secret Lethe signs this callback URL's webhooks with (Standard Webhooks; derived, never
    stored): configure the receiver with it."""
    from app.webhooks.service import endpoint_secret

    typer.echo(endpoint_secret(url))


@app.command()
def serve(host: str = "127.0.0.1", port: int = 8000, workers: int = 1, log_level: str = "warning") -> None:
    """Run the API (uvicorn). On the embedded default it also runs the in-process executor."""
    import uvicorn

    from app.db import migrate as run_migrations

    run_migrations()
    # access_log=False: the API writes its own access line, JSON with the request id (app/logs.py)
    uvicorn.run("app.asgi:app", host=host, port=port, workers=workers, log_level=log_level, access_log=False)


@app.command()
def worker(queues: str = "gpu,cpu", concurrency: int = 1, loglevel: str = "INFO") -> None:
    """Run a Celery worker (one per GPU, prefetch 1)."""
    from workers.celery_app import celery_app

    celery_app.worker_main(
        [
            "worker",
            "-Q",
            queues,
            "--concurrency",
            str(concurrency),
            "--loglevel",
            loglevel,
            "--prefetch-multiplier",
            "1",
            "-P",
            "prefork" if concurrency > 1 else "solo",
        ]
    )


@app.command()
def dispatcher() -> None:
    """Run the dispatcher and reconciler loop on its own (when the API runs with LETHE_RUN_DISPATCHER=false)."""
    from app.jobs.dispatcher import Dispatcher, celery_sender

    _logging()
    Dispatcher(celery_sender()).run_forever()


@app.command()
def demo(keep: bool = typer.Option(False, help="Keep the demo's folder (var/demo) from the last run.")) -> None:
    """Run the end-to-end demo on the embedded default (SQLite + in-process worker), with real data."""
    from app.demo import run_demo

    run_demo(keep=keep)


def _client():
    import httpx

    base = os.environ.get("LETHE_URL", "http://127.0.0.1:8000")
    key = os.environ.get("LETHE_API_KEY")
    if not key:
        raise typer.BadParameter("set LETHE_API_KEY (create one with `lethe keys create`)")
    return httpx.Client(base_url=base, headers={"authorization": f"Bearer {key}"}, timeout=30)


@app.command()
def submit(
    model_id: str,
    sample_id: Annotated[list[str], typer.Option("--sample-id")],
    subject: str,
    method: str = "retrain",
    wait: bool = True,
) -> None:
    """Submit a deletion request for some rows, and follow it to the end."""
    with _client() as client:
        response = client.post(
            "/v1/deletion-requests",
            json={
                "subject_ref": subject,
                "model_id": model_id,
                "method": method,
                "scope": {"kind": "samples", "sample_ids": sample_id},
            },
        )
        typer.echo(json.dumps(response.json(), indent=2))
        if response.status_code != 202 or not wait:
            raise typer.Exit(0 if response.status_code == 202 else 1)
        location = response.headers["location"]
        while True:
            body = client.get(location).json()
            typer.echo(f"{body['status']:>10}  {body['progress']:.0%}  {body.get('message') or ''}")
            if body["status"] in ("certified", "failed", "rejected"):
                break
            time.sleep(1)


@app.command()
def status(request_id: str) -> None:
    """Show a deletion request."""
    with _client() as client:
        typer.echo(json.dumps(client.get(f"/v1/deletion-requests/{request_id}").json(), indent=2))


@app.command("verify-certificate")
def verify_certificate(
    file: Annotated[Path, typer.Argument(help="A deletion certificate (DSSE envelope JSON).")],
    keys: Annotated[
        str, typer.Option("--keys", help="The keys document: a file, or an https URL of /.well-known/lethe-keys.json.")
    ],
) -> None:
    """Check a deletion certificate offline. Exit 0 valid, 1 invalid, 2 unreadable certificate or keys."""
    from app.certificates.verify_cli import InputUnavailable, verify_file

    try:
        ok, message = verify_file(file, keys)
    except InputUnavailable as exc:
        typer.echo(f"error: {exc.reason}", err=True)
        raise typer.Exit(2) from None
    typer.echo(message)
    raise typer.Exit(0 if ok else 1)


if __name__ == "__main__":
    app()

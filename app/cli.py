"""`lethe`: the operator's command line.

Server side: serve, worker, dispatcher, webhook-sender, migrate, keys (create, list, revoke: straight on the
database), demo. Client side, over the API (app/client.py): submit, status [--watch], list, models, report, cancel,
retry, extend, export, audit-verify; and verify-certificate (offline). Exit codes: 0 done, 1 failed, 2 usage error,
3 not found or unauthorised.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(help="Lethe: unlearning as a service.", no_args_is_help=True)
keys_app = typer.Typer(help="API keys.", no_args_is_help=True)
app.add_typer(keys_app, name="keys")
signing_app = typer.Typer(help="Certificate signing keys (Ed25519).", no_args_is_help=True)
app.add_typer(signing_app, name="signing-keys")
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NOT_FOUND, EXIT_UNAUTHORISED, EXIT_UNREACHABLE = 0, 1, 2, 3, 4, 5
"""0 done; 1 the deletion failed or the operation was refused; 2 a usage error; 3 not found (404, 410); 4 not
authorised (401, 403); 5 the API cannot be reached or is unavailable (503): distinct, so a script can tell "the
erasure failed" from "try again later" (issue 23)."""


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
    typer.echo(f"(in {_database()}: the server must use this database, LETHE_HOME / LETHE_DATABASE_URL)", err=True)


def _database() -> str:
    """The database this process uses, its password hidden (a key made in another home is a key the server rejects:
    say which)."""
    from sqlalchemy.engine import make_url

    from app.config import get_settings

    return make_url(get_settings().resolved_database_url).render_as_string(hide_password=True)


@keys_app.command("list")
def keys_list(as_json: Annotated[bool, typer.Option("--json", help="One JSON object per key.")] = False) -> None:
    """List API keys: id, prefix, name, scopes, binding, expiry, revocation (never the key or its hash)."""
    from rich.table import Table

    from app.auth.service import list_keys
    from app.db import migrate as run_migrations
    from app.db import session_scope, utcnow

    run_migrations()
    now = utcnow()
    table = Table(title="API keys")
    for column in ("id", "prefix", "state", "name", "scopes", "bound to", "expires"):
        table.add_column(column)
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
                continue
            binding = (
                (f"model {row.model_id}" + (f" client {row.client_id}" if row.client_id else ""))
                if row.model_id
                else ""
            )
            table.add_row(
                row.id,
                f"lethe_{row.prefix}_…",
                state,
                row.name,
                ", ".join(row.scopes),
                binding,
                entry["expires_at"] or "",
            )
    if not as_json:
        _console().print(table)


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
    except ValueError as exc:  # the only refusal: no such key
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(EXIT_NOT_FOUND) from None


@signing_app.command("list")
def signing_keys_list() -> None:
    """The signing keys published at /.well-known/lethe-keys.json, oldest first (every one still verifies)."""
    from rich.table import Table

    from app.certificates.signing import default_keystore

    table = Table("key id", "created", "active")
    for key in default_keystore().public_keys()["keys"]:
        table.add_row(key["kid"], key["created"], "yes" if key["active"] else "")
    _console().print(table)


@signing_app.command("rotate")
def signing_keys_rotate() -> None:
    """Make a new active signing key. Older public keys stay published (old certificates keep verifying); the retired
    private key is deleted. Audited as ``signing-key.rotated``."""
    from app.audit.service import append_event
    from app.certificates.signing import default_keystore
    from app.db import migrate as run_migrations
    from app.db import session_scope

    run_migrations()
    store = default_keystore()
    previous = store.active_key_id()
    kid = store.rotate_key()
    with session_scope() as session:
        append_event(
            session,
            actor="cli",
            action="signing-key.rotated",
            entity_type="signing-key",
            entity_id=kid,
            payload={"previous": previous, "active": kid},
        )
    typer.echo(f"signing key rotated: {previous} -> {kid} (the old public key stays published)")


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
    typer.echo(serve_banner(host, port))
    with shared_metrics(workers):
        # access_log=False: the API writes its own access line, JSON with the request id (app/logs.py)
        uvicorn.run("app.asgi:app", host=host, port=port, workers=workers, log_level=log_level, access_log=False)


@contextmanager
def shared_metrics(workers: int):
    """Several API processes answer on one port: a scrape reaches any of them, so each must report the HTTP metrics
    of all (prometheus_client's multiprocess mode, app/ops/metrics.py). Unless the operator named a directory in
    ``PROMETHEUS_MULTIPROC_DIR`` (empty it between runs), a fresh one is made for this run and removed after."""
    if workers <= 1 or os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        yield
        return
    import shutil
    import tempfile

    directory = tempfile.mkdtemp(prefix="lethe-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory  # the worker processes inherit it
    try:
        yield
    finally:
        del os.environ["PROMETHEUS_MULTIPROC_DIR"]
        shutil.rmtree(directory, ignore_errors=True)


def serve_banner(host: str, port: int) -> str:
    """What a person starting the server needs first: where it answers, the dashboard, the home folder, the database
    (its password hidden) and where jobs run."""

    from app.config import get_settings

    settings = get_settings()
    shown = "localhost" if host in ("0.0.0.0", "::") else host
    base = f"http://{shown}:{port}"
    database = _database()
    jobs = "in this process (embedded)" if settings.embedded_executor else "Celery workers via the broker"
    return "\n".join(
        [
            f"Lethe API on {base}  (listening on {host}:{port})",
            f"  dashboard  {base}/dashboard",
            f"  API docs   {base}/docs",
            f"  home       {settings.home.expanduser().resolve()}",
            f"  database   {database}",
            f"  jobs       {jobs}",
        ]
    )


@app.command()
def worker(
    queues: str = "gpu,cpu",
    concurrency: int = 1,
    loglevel: str = "INFO",
    name: Annotated[
        str | None,
        typer.Option(help="Celery node name (default: lethe-<queues>-<pid>@<host>, unique for workers on one host)."),
    ] = None,
) -> None:
    """Run a Celery worker (one per GPU, prefetch 1)."""
    import os

    from workers.celery_app import celery_app

    node = name or f"lethe-{queues.replace(',', '-')}-{os.getpid()}@%h"
    celery_app.worker_main(
        [
            "worker",
            "-n",
            node,
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
def dispatcher(
    webhooks: Annotated[
        bool, typer.Option("--webhooks/--no-webhooks", help="Also run the webhook sender loop in this process.")
    ] = True,
) -> None:
    """Run the dispatcher and reconciler loop on its own (when the API runs with LETHE_RUN_DISPATCHER=false); with
    the webhook sender beside it unless --no-webhooks (then run `lethe webhook-sender`). Several may run at once."""
    from app.config import get_settings
    from app.jobs.dispatcher import Dispatcher, celery_sender
    from app.webhooks.sender import WebhookSender

    _logging()
    loop = Dispatcher(celery_sender())
    if webhooks:
        sender = WebhookSender(get_settings().poll_seconds)
        sender.start()
        loop.companions.append(sender)
    try:
        loop.run_forever()
    finally:
        loop.stop()


@app.command("webhook-sender")
def webhook_sender() -> None:
    """Run the webhook sender loop on its own (delivers the webhook outbox; several may run at once)."""
    from app.config import get_settings
    from app.webhooks.sender import WebhookSender

    _logging()
    WebhookSender(get_settings().poll_seconds).run_forever()


@app.command()
def demo(keep: bool = typer.Option(False, help="Keep the demo's folder (var/demo) from the last run.")) -> None:
    """Run the end-to-end demo on the embedded default (SQLite + in-process worker), with real data."""
    from app.demo import run_demo

    run_demo(keep=keep)


# ------------------------------------------------------------------------------------------- API commands (client)
# They talk to the API through app.client, with LETHE_URL and LETHE_API_KEY (or --url / --api-key). Exit codes:
# 0 done (certified, or the operation succeeded), 1 failed, rejected or cancelled (or the operation failed),
# 2 usage error, 3 not found or not authorised.
_NOT_FOUND_STATUSES = (404, 410)
_UNAUTHORISED_STATUSES = (401, 403)
_STATUS_STYLE = {
    "certified": "green",
    "failed": "red",
    "rejected": "red",
    "cancelled": "yellow",
    "running": "cyan",
    "verifying": "cyan",
}


def _console(stderr: bool = False):
    from rich.console import Console

    return Console(stderr=stderr, highlight=False, soft_wrap=False)


def _client(ctx: typer.Context):
    from app.client import LetheClient

    options = ctx.find_root().obj or {}
    key = options.get("api_key") or os.environ.get("LETHE_API_KEY")
    if not key:
        raise typer.BadParameter("set LETHE_API_KEY or pass --api-key (create a key with `lethe keys create`)")
    return LetheClient(options.get("url") or os.environ.get("LETHE_URL"), key)


def _client_url(ctx: typer.Context) -> str:
    from app.client import DEFAULT_URL

    return (ctx.find_root().obj or {}).get("url") or os.environ.get("LETHE_URL") or DEFAULT_URL


@contextmanager
def _api(ctx: typer.Context):
    """A client, with API errors turned into exit codes (``EXIT_*``): 3 for 404/410, 4 for 401/403, 5 for 503 or an
    unreachable API, 1 for any other problem."""
    import httpx

    from app.client import LetheProblem

    try:
        with _client(ctx) as client:
            yield client
    except LetheProblem as problem:
        extra = {k: v for k, v in problem.extensions.items() if k != "errors"}
        _console(stderr=True).print(
            f"[red]error:[/red] {problem.status} {problem.slug}: {problem.detail or problem.title}"
            + (f" {json.dumps(extra)}" if extra else ""),
            markup=True,
        )
        for error in problem.extensions.get("errors") or []:
            _console(stderr=True).print(f"  {'.'.join(error.get('location', []))}: {error.get('message')}")
        raise typer.Exit(_exit_for_problem(problem.status)) from None
    except httpx.TransportError as exc:
        _console(stderr=True).print(f"error: cannot reach the API at {_client_url(ctx)}: {exc}")
        raise typer.Exit(EXIT_UNREACHABLE) from None


def _exit_for_problem(status: int) -> int:
    if status in _NOT_FOUND_STATUSES:
        return EXIT_NOT_FOUND
    if status in _UNAUTHORISED_STATUSES:
        return EXIT_UNAUTHORISED
    return EXIT_UNREACHABLE if status == 503 else EXIT_FAILED


@app.callback()
def main(
    ctx: typer.Context,
    url: Annotated[str | None, typer.Option("--url", envvar="LETHE_URL", help="The API's base URL.")] = None,
    api_key: Annotated[
        str | None, typer.Option("--api-key", envvar="LETHE_API_KEY", help="An API key.", show_default=False)
    ] = None,
) -> None:
    """Lethe: unlearning as a service. Exit codes: 0 done, 1 failed or refused, 2 usage error, 3 not found,
    4 unauthorised, 5 API unreachable or unavailable."""
    if url and not url.startswith(("http://", "https://")):
        raise typer.BadParameter(f"{url!r} has no scheme: write http://{url} or https://{url}", param_hint="--url")
    ctx.obj = {"url": url, "api_key": api_key}


def _exit_for(status: str) -> int:
    return EXIT_FAILED if status in ("failed", "rejected", "cancelled") else EXIT_OK


def _short(moment) -> str:
    return moment.strftime("%Y-%m-%d %H:%M:%S") if moment else "—"


def _print_request(request, console) -> None:
    style = _STATUS_STYLE.get(request.status, "white")
    console.print(
        f"[bold]{request.id}[/bold]  [{style}]{request.status}[/{style}]  {request.progress:.0%}", markup=True
    )
    rows = [
        ("model", request.model_id),
        ("method", request.method),
        ("scope", json.dumps(request.scope)),
        ("attempts", str(request.attempts)),
        ("message", request.message or "—"),
        ("received", _short(request.received_at)),
        (
            "due",
            _short(request.due_at)
            + (f"  ({request.days_left:.1f} days left)" if not request.done and request.days_left is not None else ""),
        ),
        ("completed", _short(request.completed_at)),
        ("new version", request.result_version_id or "—"),
    ]
    if request.overdue:
        rows.append(("overdue", "yes"))
    if request.error:
        rows.append(("error", f"{request.error.get('type', '')} {request.error.get('detail', '')}".strip()))
    for label, value in rows:
        console.print(f"  {label:<12} {value}", markup=False)


def _print_verdict(client, request, console) -> None:
    """The request's verdict and its checks (from its verification reports)."""
    reports = client.reports(request.id) if request.links.get("reports") else []
    for report in reports:
        style = "green" if report.verdict == "pass" else "red"
        console.print(f"verdict on {report.method or request.method}: [{style}]{report.verdict.upper()}[/{style}]")
        for check in report.checks:
            mark = {True: "[green]✓[/green]", False: "[red]✗[/red]", None: "·"}[check.passed]
            console.print(f"  {mark} {check.message or check.name}")
        if report.informative is not None:
            power = "informative" if report.informative else "UNINFORMATIVE"
            console.print(f"  membership audit: {power}" + (f" — {report.informative_detail}"
                                                             if report.informative_detail else ""))  # fmt: skip
        console.print(f"  evidence class: {', '.join(report.evidence) or 'none'}", markup=False)
    if "certificate" in request.links:
        console.print(f"certificate: {request.links['certificate']}")
    style = _STATUS_STYLE.get(request.status, "white")
    console.print(  # one line however long the reason: the last line says how the request ended
        f"[{style}]{request.status}[/{style}]" + (f": {request.error.get('detail')}" if request.error else ""),
        soft_wrap=True,
    )


def _watch(client, request_id: str, interval: float, timeout: float, console):
    """A live progress bar fed by the request's progress and message, until the request ends."""
    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

    columns = (
        TextColumn("[bold]{task.fields[status]:<10}"),
        BarColumn(bar_width=40),
        TaskProgressColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[note]}"),
    )
    with Progress(*columns, console=console, auto_refresh=False, transient=False) as progress:
        task = progress.add_task("deletion", total=1.0, status="…", note="")

        def show(request) -> None:
            progress.update(task, completed=request.progress, status=request.status, note=request.message or "")
            progress.refresh()
            if not console.is_terminal:  # a log or a pipe: one line per change instead of a redrawn bar
                console.print(f"{request.status:>10}  {request.progress:>4.0%}  {request.message or ''}", markup=False)

        return client.wait(request_id, interval=interval, timeout=timeout, on_progress=show)


@app.command()
def submit(
    ctx: typer.Context,
    model_id: Annotated[str, typer.Argument(help="The model to delete from.")],
    subject: Annotated[str, typer.Option("--subject", help="The data subject (stored only as a keyed hash).")],
    sample_id: Annotated[list[str] | None, typer.Option("--sample-id", help="A row id; repeat for several.")] = None,
    label: Annotated[str | None, typer.Option("--label", help="Delete a whole class.")] = None,
    client_id: Annotated[str | None, typer.Option("--client-id", help="Federated: a client, or its samples.")] = None,
    method: Annotated[str, typer.Option(help="retrain | newton | influence | l2ul | ease | auto ...")] = "retrain",
    callback_url: Annotated[str | None, typer.Option("--callback-url")] = None,
    idempotency_key: Annotated[str | None, typer.Option("--idempotency-key")] = None,
    received_at: Annotated[
        str | None, typer.Option("--received-at", help="ISO 8601 with offset: when the subject asked.")
    ] = None,
    wait: Annotated[bool, typer.Option("--wait/--no-wait", help="Follow the request with a progress bar.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the request as JSON.")] = False,
) -> None:
    """Submit a deletion request: --sample-id (repeat), --label, or --client-id alone (a whole client)."""
    if sample_id:
        scope = {"kind": "samples", "sample_ids": sample_id} | ({"client_id": client_id} if client_id else {})
    elif label is not None:
        scope = {"kind": "class", "label": label}
    elif client_id:
        scope = {"kind": "client", "client_id": client_id}
    else:
        raise typer.BadParameter("give --sample-id (repeatable), --label or --client-id")
    console = _console()
    with _api(ctx) as client:
        request = client.submit_deletion(
            model_id,
            scope,
            subject,
            method=method,
            callback_url=callback_url,
            received_at=received_at,
            idempotency_key=idempotency_key,
        )
        if as_json and not wait:
            typer.echo(request.model_dump_json(indent=2))
            return
        console.print(f"accepted {request.id} ({request.status}); follow it with `lethe status {request.id} --watch`")
        if wait:
            done = _watch(client, request.id, 0.5, 24 * 3600, console)
            _print_verdict(client, done, console)
            raise typer.Exit(_exit_for(done.status))


@app.command()
def status(
    ctx: typer.Context,
    request_id: str,
    watch: Annotated[bool, typer.Option("--watch", "-w", help="A live progress bar until the request ends.")] = False,
    interval: Annotated[float, typer.Option(help="Seconds between polls with --watch.", min=0.05)] = 1.0,
    timeout: Annotated[float, typer.Option(help="Give up watching after this many seconds (exit 1).")] = 24 * 3600,
    as_json: Annotated[bool, typer.Option("--json", help="Print the request as JSON.")] = False,
) -> None:
    """Show a deletion request; with --watch follow it to the end, then print the verdict and its checks.
    Exit 0 certified or still in progress (without --watch), 1 failed/rejected/cancelled, 3 not found/unauthorised."""
    console = _console()
    with _api(ctx) as client:
        if watch:
            try:
                request = _watch(client, request_id, interval, timeout, console)
            except TimeoutError as exc:
                console.print(f"error: {exc}")
                raise typer.Exit(EXIT_FAILED) from None
            _print_verdict(client, request, console)
        else:
            request = client.get_deletion(request_id)
            if as_json:
                typer.echo(request.model_dump_json(indent=2))
            else:
                _print_request(request, console)
    raise typer.Exit(_exit_for(request.status))


@app.command("list")
def list_requests(
    ctx: typer.Context,
    status_: Annotated[str | None, typer.Option("--status", help="received, queued, running, certified...")] = None,
    model: Annotated[str | None, typer.Option("--model", help="Only this model's requests.")] = None,
    overdue: Annotated[bool, typer.Option("--overdue", help="Only unanswered requests past their deadline.")] = False,
    stuck: Annotated[bool, typer.Option("--stuck", help="Only requests no worker has taken.")] = False,
    limit: Annotated[int, typer.Option(help="At most this many (newest first).", min=1)] = 50,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per line.")] = False,
) -> None:
    """Deletion requests, newest first, as a table."""
    from itertools import islice

    from rich.table import Table

    with _api(ctx) as client:
        rows = list(islice(client.iter_deletions(status=status_, model_id=model, overdue=overdue, stuck=stuck), limit))
    if as_json:
        for row in rows:
            typer.echo(row.model_dump_json())
        return
    table = Table(title=f"deletion requests ({len(rows)})")
    table.add_column("id", no_wrap=True, min_width=36)  # whole: it is what the other commands take
    for column in ("model", "method", "status", "progress", "received", "due", "days left"):
        table.add_column(column, justify="right" if column in ("progress", "days left") else "left")
    for row in rows:
        style = _STATUS_STYLE.get(row.status, "white")
        days = f"{row.days_left:.1f}" if row.days_left is not None and not row.done else "—"
        table.add_row(
            row.id,
            row.model_id[:8] + "…",
            row.method,
            f"[{style}]{row.status}[/{style}]" + (" [red]overdue[/red]" if row.overdue else ""),
            f"{row.progress:.0%}",
            _short(row.received_at or row.created_at),
            _short(row.due_at),
            days,
        )
    _console().print(table)


@app.command("models")
def list_models(
    ctx: typer.Context,
    name: Annotated[str | None, typer.Option("--name", help="Exact name.")] = None,
    name_contains: Annotated[str | None, typer.Option("--name-contains")] = None,
    kind: Annotated[str | None, typer.Option("--kind", help="tabular | clip_federated")] = None,
    tag: Annotated[list[str] | None, typer.Option("--tag", help="Repeat for several: models carrying all.")] = None,
    limit: Annotated[int, typer.Option(min=1)] = 50,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per line.")] = False,
) -> None:
    """Registered models, newest first."""
    from itertools import islice

    from rich.table import Table

    with _api(ctx) as client:
        rows = list(islice(client.iter_models(name=name, name_contains=name_contains, kind=kind, tags=tag), limit))
    if as_json:
        for row in rows:
            typer.echo(row.model_dump_json())
        return
    table = Table(title=f"models ({len(rows)})")
    table.add_column("id", no_wrap=True, min_width=36)
    for column in ("name", "kind", "status", "version", "methods", "tags", "created"):
        table.add_column(column)
    for row in rows:
        version = row.current_version.number if row.current_version else "—"
        methods = ", ".join(f"{k}:{v.get('status')}" for k, v in row.unlearning.items()) or "—"
        tags = ", ".join(row.tags) or "—"
        table.add_row(row.id, row.name, row.kind, row.status, str(version), methods, tags, _short(row.created_at))
    _console().print(table)


def _scalar_figures(report) -> list[tuple[str, str]]:
    """The report's top-level numbers and flags (nested figures stay in --json)."""
    skip = {"id", "request_id", "model_id", "verdict", "created_at", "method", "checks", "reasons", "notes", "plots"}
    out = []
    for key, value in report.model_dump(mode="json").items():
        if key in skip or isinstance(value, dict | list) or value is None:
            continue
        out.append((key, f"{value:.4g}" if isinstance(value, float) else str(value)))
    return out


@app.command()
def report(
    ctx: typer.Context,
    request_id: str,
    as_json: Annotated[bool, typer.Option("--json", help="The reports as JSON.")] = False,
) -> None:
    """A deletion's verification report(s): the checks (figure, threshold, outcome) and the figures, as tables.
    Exit 0 every verdict passed, 1 a verdict failed or there is no report yet, 3 not found/unauthorised."""
    from rich.table import Table

    console = _console()
    with _api(ctx) as client:
        client.get_deletion(request_id)  # 404 → exit 3 for an unknown request, not "no report yet"
        reports = client.reports(request_id)
    if as_json:
        typer.echo(json.dumps([r.model_dump(mode="json") for r in reports], indent=2))
    if not reports:
        console.print(f"no verification report for {request_id} yet")
        raise typer.Exit(EXIT_FAILED)
    if not as_json:
        for item in reports:
            style = "green" if item.verdict == "pass" else "red"
            checks = Table(title=f"report {item.id} — {item.method or ''} — verdict [{style}]{item.verdict}[/{style}]")
            for column in ("check", "figure", "threshold", "passed", "message"):
                checks.add_column(column, justify="right" if column in ("figure", "threshold") else "left")
            for check in item.checks:
                checks.add_row(
                    check.name or "",
                    "—" if check.figure is None else f"{check.figure:.4g}",
                    "—" if check.threshold is None else f"{check.threshold:.4g}",
                    {True: "[green]yes[/green]", False: "[red]no[/red]", None: "not evaluated"}[check.passed],
                    check.message or "",
                )
            console.print(checks)
            figures = Table(title="figures")
            figures.add_column("figure")
            figures.add_column("value", justify="right")
            for key, value in _scalar_figures(item):
                figures.add_row(key, value)
            console.print(figures)
            for name, link in item.plots.items():
                console.print(f"plot {name}: {link}")
    raise typer.Exit(EXIT_OK if all(r.verdict == "pass" for r in reports) else EXIT_FAILED)


@app.command()
def cancel(ctx: typer.Context, request_id: str) -> None:
    """Cancel a request no worker has started (admin)."""
    with _api(ctx) as client:
        request = client.cancel(request_id)
    _console().print(f"{request.id} {request.status}")


@app.command()
def approve(
    ctx: typer.Context,
    request_id: str,
    note: Annotated[str | None, typer.Option(help="Recorded in the audit log.")] = None,
) -> None:
    """Approve a request waiting for approval: its job is created now (admin, audited)."""
    with _api(ctx) as client:
        request = client.approve(request_id, note)
    _console().print(f"{request.id} {request.status}")


@app.command()
def reject(
    ctx: typer.Context,
    request_id: str,
    reason: Annotated[str, typer.Option(help="Told to the data subject (GDPR Art. 12(4)) and audited.")],
) -> None:
    """Refuse a request waiting for approval, with the reason (admin, audited)."""
    with _api(ctx) as client:
        request = client.reject(request_id, reason)
    _console().print(f"{request.id} {request.status}")


@app.command()
def retry(ctx: typer.Context, request_id: str) -> None:
    """Run a failed request again (admin)."""
    with _api(ctx) as client:
        request = client.retry(request_id)
    _console().print(f"{request.id} {request.status} (attempt {request.attempts + 1} queued)")


@app.command()
def extend(
    ctx: typer.Context,
    request_id: str,
    months: Annotated[int, typer.Option(min=1, max=2)],
    reason: Annotated[str, typer.Option(help="Told to the data subject (GDPR Art. 12(3)).")],
) -> None:
    """Extend a request's deadline by one or two months in all, with a reason (admin)."""
    with _api(ctx) as client:
        request = client.extend(request_id, months, reason)
    _console().print(f"{request.id} due {_short(request.due_at)}")


REQUEST_COLUMNS = [
    "id", "model_id", "subject_hash", "method", "status", "progress", "attempts", "scope", "received_at", "due_at",
    "overdue", "answered_late", "extensions", "created_at", "started_at", "completed_at", "result_version_id", "error",
]  # fmt: skip
AUDIT_COLUMNS = ["seq", "at", "actor", "action", "entity_type", "entity_id", "payload", "prev_hash", "hash"]


@app.command()
def export(
    ctx: typer.Context,
    what: Annotated[str, typer.Argument(help="requests | audit")],
    fmt: Annotated[str, typer.Option("--format", "-f", help="csv | json")] = "csv",
    output: Annotated[Path | None, typer.Option("--output", "-o", help="A file (default: stdout).")] = None,
    status_: Annotated[str | None, typer.Option("--status", help="requests: only this status.")] = None,
    model: Annotated[str | None, typer.Option("--model", help="requests: only this model's.")] = None,
    entity: Annotated[str | None, typer.Option("--entity", help="audit: only events about this id.")] = None,
) -> None:
    """Export deletion requests or the audit log as CSV or JSON, for record keeping (every page, in full)."""
    import csv
    import io

    if what not in ("requests", "audit"):
        raise typer.BadParameter("export requests or audit")
    if fmt not in ("csv", "json"):
        raise typer.BadParameter("--format csv or json")
    with _api(ctx) as client:
        if what == "requests":
            rows = [r.model_dump(mode="json") for r in client.iter_deletions(status=status_, model_id=model)]
            columns = REQUEST_COLUMNS
        else:
            rows = [e.model_dump(mode="json") for e in client.iter_audit(entity_id=entity)]
            columns = AUDIT_COLUMNS
    if fmt == "json":
        text = json.dumps(rows, indent=1, ensure_ascii=False) + "\n"
    else:
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: json.dumps(v) if isinstance(v, dict | list) else v for k, v in row.items()})
        text = buffer.getvalue()
    if output is None:
        typer.echo(text, nl=False)
    else:
        output.write_text(text, encoding="utf-8")
        _console(stderr=True).print(f"{len(rows)} {what} rows written to {output}")


@app.command("audit-verify")
def audit_verify(ctx: typer.Context) -> None:
    """Recompute the audit log's hash chain on the server. Exit 0 intact, 1 broken."""
    with _api(ctx) as client:
        verdict = client.verify_audit()
    if verdict.ok:
        _console().print(f"audit chain intact: {verdict.checked} events, head {str(verdict.head.get('hash'))[:16]}…")
        return
    _console().print(f"audit chain BROKEN at row {verdict.first_broken_seq}: {verdict.reason}")
    raise typer.Exit(EXIT_FAILED)


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

"""`lethe`: the operator's command line.

Server side: serve, worker, dispatcher, webhook-sender, migrate, db grant-runtime-role, keys (create, list, revoke:
straight on the database), signing-keys (list, rotate, revoke), demo. Client side, over the API (app/client.py):
submit, status [--watch], list, models, model-settings, model-export, predict, report, cancel, approve, reject, retry,
extend, bulk, subjects (erase, status, certificate, requests), export, audit-verify; and verify-certificate (offline).
Exit codes: see ``EXIT_*`` below.

Output: tables fit the terminal's width (short ids and dates, then fewer columns; ids and statuses never cut) and
take their natural width in a pipe; no line is broken by the program. Commands take a request's or a model's id
whole or by its last characters (as the tables show them: an id's first ones are its clock's).
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from app.ids import short_id

HELP = {"no_args_is_help": True, "rich_markup_mode": "markdown"}
"""Markdown: a docstring's paragraphs are reflowed to the terminal's width (its source line breaks are not kept)."""
app = typer.Typer(help="Lethe: unlearning as a service.", **HELP)
keys_app = typer.Typer(help="API keys.", **HELP)
app.add_typer(keys_app, name="keys")
signing_app = typer.Typer(help="Certificate signing keys (Ed25519).", **HELP)
app.add_typer(signing_app, name="signing-keys")
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NOT_FOUND, EXIT_UNAUTHORISED, EXIT_UNREACHABLE = 0, 1, 2, 3, 4, 5
"""0 done; 1 the deletion failed or the operation was refused (also: a bulk action skipped a request, a watch
timed out, an answer that is not the API's); 2 a usage error; 3 not found (404, 410); 4 not authorised (401, 403);
5 the API cannot be reached or is unavailable (503, 429, after the client's retries): distinct, so a script can tell
"the erasure failed" from "try again later" (issue 23)."""


def _logging(level: str | None = None) -> None:
    """Structured logs (app/logs.py), at LETHE_LOG_LEVEL unless a level is given."""
    from app.config import get_settings
    from app.logs import configure_logging

    settings = get_settings()
    configure_logging(level or settings.log_level, json_lines=settings.log_json)


db_app = typer.Typer(help="Database roles (PostgreSQL).", **HELP)
app.add_typer(db_app, name="db")


@app.command()
def migrate() -> None:
    """Create or upgrade the database schema (Alembic), as LETHE_MIGRATION_DATABASE_URL's role when it is set (the
    tables' owner); when LETHE_DATABASE_URL names another role, grant it its runtime rights afterwards (`lethe db
    grant-runtime-role`)."""
    from app.db import migrate as run_migrations
    from app.db import separate_runtime_role

    run_migrations()
    typer.echo("database at the newest revision")
    if separate_runtime_role():
        _grant_runtime_role(None)


def _grant_runtime_role(role: str | None) -> None:
    from app.audit.tables import APPEND_ONLY_TABLES
    from app.db import grant_runtime_role

    try:
        granted = grant_runtime_role(APPEND_ONLY_TABLES, role)
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(EXIT_FAILED) from None
    typer.echo(f"runtime role {granted}: read and write, but only INSERT and SELECT on {', '.join(APPEND_ONLY_TABLES)}")


@db_app.command("grant-runtime-role")
def db_grant_runtime_role(
    role: Annotated[
        str | None, typer.Argument(help="The role the service runs as (default: LETHE_DATABASE_URL's user).")
    ] = None,
) -> None:
    """Create (when missing) and grant the PostgreSQL role the service runs as: no ownership, and on the audit log
    INSERT and SELECT only, so it cannot rewrite the chain. Connects as LETHE_MIGRATION_DATABASE_URL's role (the
    owner), else LETHE_DATABASE_URL's; the password is LETHE_DATABASE_URL's when it names the role. Idempotent."""
    _grant_runtime_role(role)


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
    """List API keys: id, prefix, name, scopes, binding, expiry, revocation (never the key or its hash). `keys
    revoke` takes the id or the prefix."""
    from app.auth.service import list_keys
    from app.db import migrate as run_migrations
    from app.db import session_scope, utcnow

    run_migrations()
    now = utcnow()
    rows = []
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
            rows.append((entry, row.expires_at))
    if as_json:
        return

    def binding(entry: dict, short: bool) -> str:
        if not entry["model_id"]:
            return ""
        client = f" client {entry['client_id']}" if entry["client_id"] else ""
        return f"model {_short_id(entry['model_id'], short)}{client}"

    columns = [
        _id_column("id", [e["id"] for e, _ in rows]),
        _Column("prefix", [f"lethe_{e['prefix']}_…" for e, _ in rows], [e["prefix"] for e, _ in rows]),
        _Column("state", [e["state"] for e, _ in rows]),
        _Column("name", [e["name"] for e, _ in rows]),
        _Column("scopes", [", ".join(e["scopes"]) for e, _ in rows], wrap=True),
        _Column("bound to", [binding(e, False) for e, _ in rows], [binding(e, True) for e, _ in rows], wrap=True),
        _moment_column("expires", [expires for _, expires in rows]),
    ]
    # the prefix names a key as well as its id does (`keys revoke` takes either): the id goes first when narrow
    steps = [("short", "id"), ("short", "prefix"), ("short", "bound to"), ("drop", "id"), ("short", "expires"),
             ("drop", "expires")]  # fmt: skip
    console = _console()
    console.print(_fit_table("API keys", columns, steps, console.width))


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
    """The signing keys published at /.well-known/lethe-keys.json, oldest first: a retired key verifies what it signed
    before its retirement, a revoked one nothing."""
    from app.certificates.signing import default_keystore

    keys = default_keystore().public_keys()["keys"]
    columns = [
        _Column("key id", [k["kid"] for k in keys]),
        _Column("created", [k["created"] for k in keys]),
        _Column("active", ["yes" if k["active"] else "" for k in keys]),
        _Column("retired", [k["retired"] or "" for k in keys]),
        _Column("revoked", [f"{k['revoked']} ({k['revocation_reason']})" if k["revoked"] else "" for k in keys]),
    ]
    console = _console()
    console.print(_fit_table("signing keys", columns, [], console.width))


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


@signing_app.command("revoke")
def signing_keys_revoke(
    kid: Annotated[str, typer.Argument(help="The signing key's id (see `lethe signing-keys list`).")],
    reason: Annotated[str, typer.Option("--reason", help="Why: published with the key and audited.")],
) -> None:
    """Revoke a compromised signing key: the keys document marks it `revoked` (time and reason) and verifiers refuse
    EVERY certificate it signed, whatever its date (`key-revoked`). Revoking the active key first rotates to a new
    one. Audited as ``signing-key.revoked``. Exit 3: no such key, 2: no reason."""
    from app.audit.service import append_event
    from app.certificates.signing import default_keystore
    from app.db import migrate as run_migrations
    from app.db import session_scope

    run_migrations()
    store = default_keystore()
    try:
        done = store.revoke_key(kid, reason)
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(EXIT_NOT_FOUND if "no signing key" in str(exc) else EXIT_USAGE) from None
    if not done.newly:
        typer.echo(f"signing key {kid} was already revoked ({done.revoked}: {done.reason})")
        return
    active = store.active_key_id()
    with session_scope() as session:
        append_event(
            session,
            actor="cli",
            action="signing-key.revoked",
            entity_type="signing-key",
            entity_id=kid,
            payload={"revoked": done.revoked, "reason": done.reason, "rotated_to": done.successor, "active": active},
        )
    rotated = f"; it was the active key: {done.successor} signs from now on" if done.successor else ""
    typer.echo(f"signing key {kid} revoked{rotated}. Every certificate it signed now fails verification (key-revoked).")


@keys_app.command("webhook-secret")
def keys_webhook_secret(
    url: str,
    key: Annotated[str, typer.Option("--key", help="The requesting API key's id or prefix (`lethe keys list`).")],
) -> None:
    """Print the `whsec_` secret Lethe signs one key's webhooks to this callback URL with (Standard Webhooks;
    derived, never stored): configure the receiver with it. Another key's events to the URL carry another secret."""
    from app.auth.service import find_key
    from app.db import session_scope
    from app.webhooks.service import endpoint_secret

    with session_scope() as session:
        row = find_key(session, key)
        key_id = row.id if row is not None else None
    if key_id is None:
        typer.echo(f"no API key {key!r}", err=True)
        raise typer.Exit(3)
    typer.echo(endpoint_secret(url, key_id))


@app.command()
def serve(host: str = "127.0.0.1", port: int = 8000, workers: int = 1, log_level: str = "warning") -> None:
    """Run the API (uvicorn). On the embedded default it also runs the in-process executor."""
    from app.db import migrate as run_migrations
    from app.serving import serve as serve_app

    run_migrations()
    typer.echo(serve_banner(host, port))
    with shared_metrics(workers):
        # access_log=False: the API writes its own access line, JSON with the request id (app/logs.py); several
        # workers listen on sockets of their own, so connections spread over them (app/serving.py)
        status = serve_app("app.asgi:app", host, port, workers, log_level=log_level, access_log=False)
    if status:
        raise typer.Exit(status)


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
    from app.jobs.dispatcher import Dispatcher, broker_watch, celery_sender
    from app.webhooks.sender import WebhookSender

    _logging()
    loop = Dispatcher(celery_sender(), broker_watch(get_settings().broker_url))
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
# They talk to the API through app.client, with LETHE_URL and LETHE_API_KEY (or --url / --api-key), and exit with
# the EXIT_* codes above (_api turns the API's problems into them).
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


PIPE_WIDTH = 10_000
"""The width output to a pipe or a file is laid out for: in effect none (a table at its natural width, a line never
broken), so `grep`, `cut` and a log see each row and each value on one line."""


def _console(stderr: bool = False):
    """Rich, on stdout (or stderr). Lines are never broken by rich (``soft_wrap``: a terminal folds a long line and
    copying it gives the command or the id back whole); tables fit a terminal's width (:func:`_fit_table`) and take
    their natural width when the output is not a terminal."""
    from rich.console import Console

    console = Console(stderr=stderr, highlight=False, soft_wrap=True)
    if not console.is_terminal:
        console = Console(stderr=stderr, highlight=False, soft_wrap=True, width=PIPE_WIDTH)
    return console


@dataclass
class _Column:
    """A column of a table that must fit the terminal: ``cells`` as rich markup, ``short`` a narrower rendering of
    the same cells (short ids, short dates), ``wrap`` for a less important column that may wrap at spaces."""

    header: str
    cells: list[str]
    short: list[str] | None = None
    justify: str = "left"
    wrap: bool = False


def _fit_table(title: str, columns: list[_Column], steps: list[tuple[str, str]], width: int):
    """A table no wider than ``width``: ``steps`` (``("short", header)`` or ``("drop", header)``, in order) are
    taken one by one until the columns fit; a column never named in a ``drop`` step is always shown whole (ids,
    statuses), and no cell is cut with an ellipsis. A wrapping column gets at least its longest word and its
    header; the width left is shared among the wrapping columns. At the width of a pipe no step is needed."""
    from rich import box
    from rich.cells import cell_len
    from rich.table import Table
    from rich.text import Text

    shortened: set[str] = set()
    dropped: set[str] = set()

    def cells(column: _Column) -> list[str]:
        return column.short if column.short is not None and column.header in shortened else column.cells

    def widths(column: _Column) -> tuple[int, int]:
        """(least, natural) width."""
        plain = [Text.from_markup(cell).plain for cell in cells(column)]
        natural = max([cell_len(column.header)] + [cell_len(text) for text in plain])
        if not column.wrap:
            return natural, natural
        words = [cell_len(word) for text in plain for word in text.split()]
        return max([cell_len(column.header)] + words), natural

    def shown() -> list[_Column]:
        return [c for c in columns if c.header not in dropped]

    def least() -> int:
        return sum(widths(c)[0] for c in shown()) + 2 * (len(shown()) - 1)

    for action, header in steps:
        if least() <= width:
            break
        (shortened if action == "short" else dropped).add(header)
    given = {c.header: widths(c)[0] for c in shown()}
    spare = width - least()
    growing = [c for c in shown() if c.wrap]
    while spare > 0:  # share what is left among the wrapping columns, up to their natural width
        open_ = [c for c in growing if given[c.header] < widths(c)[1]]
        if not open_:
            break
        share = max(1, spare // len(open_))
        for column in open_:
            grow = min(share, widths(column)[1] - given[column.header], spare)
            given[column.header] += grow
            spare -= grow
    table = Table(
        title=title, title_justify="left", box=box.SIMPLE_HEAD, padding=(0, 1, 0, 0), show_edge=False, pad_edge=False
    )
    for column in shown():
        table.add_column(
            column.header,
            justify=column.justify,
            no_wrap=not column.wrap,
            overflow="fold",
            width=given[column.header] if column.wrap else None,
        )
    for row in zip(*(cells(c) for c in shown()), strict=True):
        table.add_row(*row)
    return table


def _short_id(value: str | None, short: bool = True) -> str:
    if not value:
        return "—"
    return short_id(value) if short else value


def _id_column(header: str, ids: list[str | None]) -> _Column:
    """Whole ids where they fit, their last 8 characters where not (the commands take either)."""
    return _Column(header, [_short_id(i, False) for i in ids], [_short_id(i) for i in ids])


def _moment_column(header: str, moments: list, justify: str = "left") -> _Column:
    """Seconds where they fit, ``MM-DD HH:MM`` where not."""
    return _Column(
        header, [_short(m) for m in moments], [m.strftime("%m-%d %H:%M") if m else "—" for m in moments], justify
    )


def _client(ctx: typer.Context):
    """The API's client, from --url/--api-key or LETHE_URL/LETHE_API_KEY; LETHE_RETRIES (default 4, 0: none) is how
    often a call that is safe to repeat is tried again, each retry told on stderr."""
    from app.client import LetheClient

    options = ctx.find_root().obj or {}
    key = options.get("api_key") or os.environ.get("LETHE_API_KEY")
    if not key:
        raise typer.BadParameter("set LETHE_API_KEY or pass --api-key (create a key with `lethe keys create`)")
    try:
        retries = int(os.environ.get("LETHE_RETRIES", "4"))
        if retries < 0:
            raise ValueError
    except ValueError:
        raise typer.BadParameter("LETHE_RETRIES takes a whole number, 0 or more") from None

    def told(notice) -> None:
        where = f"{notice.method} {notice.url}"
        _console(stderr=True).print(
            f"{where}: {notice.reason}; retry {notice.attempt} of {retries} in {notice.delay:.1f} s", markup=False
        )

    return LetheClient(options.get("url") or os.environ.get("LETHE_URL"), key, retries=retries, on_retry=told)


def _client_url(ctx: typer.Context) -> str:
    from app.client import DEFAULT_URL

    return (ctx.find_root().obj or {}).get("url") or os.environ.get("LETHE_URL") or DEFAULT_URL


RESOLVE_SCAN = 5_000
"""A short id is looked for among this many newest requests (or models); an older one takes its whole id."""


def _resolve(ident: str, kind: str, items) -> str:
    """``ident`` itself when it is a whole id; the one id among ``items`` that ends with it when it is a short one
    (4 to 35 characters of an id's end, as the tables show them). None matching: exit 3; several: exit 2."""
    from itertools import islice

    end = ident.strip().lower()
    if len(end) >= 36 or len(end) < 4 or any(c not in "0123456789abcdef-" for c in end):
        return ident
    found = [item.id for item in islice(items(), RESOLVE_SCAN) if item.id.endswith(end)]
    if len(found) == 1:
        return found[0]
    if found:
        raise typer.BadParameter(f"{ident!r} ends {len(found)} {kind} ids ({', '.join(found[:3])}…): give more of it")
    _console(stderr=True).print(
        f"error: no {kind} id ends with {ident!r} (among the newest {RESOLVE_SCAN:,}: give the whole id)",
        markup=False,
    )
    raise typer.Exit(EXIT_NOT_FOUND)


def _resolve_request(client, ident: str) -> str:
    return _resolve(ident, "request", lambda: client.iter_deletions(limit=500))


def _resolve_model(client, ident: str) -> str:
    return _resolve(ident, "model", lambda: client.iter_models(limit=500))


@contextmanager
def _api(ctx: typer.Context):
    """A client, with API errors turned into exit codes (``EXIT_*``): 3 for 404/410, 4 for 401/403, 5 for 503/429 or
    an unreachable API, 1 for any other problem, an answer that is not the API's, or a wait that timed out; 2 for a
    URL that cannot be used."""
    import httpx
    from pydantic import ValidationError

    from app.client import LetheProblem

    try:
        with _client(ctx) as client:
            yield client
    except LetheProblem as problem:
        extra = {k: _few(v) for k, v in problem.extensions.items() if k != "errors"}
        _console(stderr=True).print(
            f"[red]error:[/red] {problem.status} {problem.slug}: {problem.detail or problem.title}"
            + (f" {json.dumps(extra)}" if extra else ""),
            markup=True,
        )
        for error in problem.extensions.get("errors") or []:
            _console(stderr=True).print(f"  {'.'.join(error.get('location', []))}: {error.get('message')}")
        raise typer.Exit(_exit_for_problem(problem.status)) from None
    except httpx.TransportError as exc:
        _console(stderr=True).print(f"error: cannot reach the API at {_client_url(ctx)}: {exc}", markup=False)
        raise typer.Exit(EXIT_UNREACHABLE) from None
    except httpx.InvalidURL as exc:
        raise typer.BadParameter(f"{_client_url(ctx)!r}: {exc}", param_hint="--url / LETHE_URL") from None
    except TimeoutError as exc:  # a watch or a wait that gave up: the request goes on without us
        _console(stderr=True).print(f"error: {exc}", markup=False)
        raise typer.Exit(EXIT_FAILED) from None
    except (json.JSONDecodeError, ValidationError) as exc:  # not the API's answer (a proxy's page, another service)
        _console(stderr=True).print(
            f"error: the answer from {_client_url(ctx)} is not Lethe's API: {str(exc)[:300]}", markup=False
        )
        raise typer.Exit(EXIT_FAILED) from None


def _few(value, most: int = 5):
    """A problem's list extension (a prediction's ``row_errors``: up to 100) cut to its first few, saying how many."""
    if isinstance(value, list) and len(value) > most:
        return [*value[:most], f"... {len(value) - most} more"]
    return value


def _exit_for_problem(status: int) -> int:
    if status in _NOT_FOUND_STATUSES:
        return EXIT_NOT_FOUND
    if status in _UNAUTHORISED_STATUSES:
        return EXIT_UNAUTHORISED
    return EXIT_UNREACHABLE if status in (503, 429) else EXIT_FAILED


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
    return _follow(
        client,
        console,
        lambda show, reconnect: client.wait(
            request_id, interval=interval, timeout=timeout, on_progress=show, on_reconnect=reconnect
        ),
    )


def _problem_reason(exc: BaseException) -> str:
    from app.client import LetheProblem

    if isinstance(exc, LetheProblem):
        return f"{exc.status} {exc.slug}"
    return f"cannot reach the API: {type(exc).__name__}"


def _follow(client, console, wait):
    """Run ``wait(show, reconnect)`` (a client's wait with its ``on_progress`` and ``on_reconnect``) under a live
    progress bar: status, bar, percentage, a ticking elapsed time, the message. An API that goes away (a restart:
    no connection, 503, 429) does not end it: one ``reconnecting…`` line, the bar says so, and the polls go on
    with backoff until it answers again (``reconnected``) or the timeout."""
    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

    columns = (
        TextColumn("[bold]{task.fields[status]:<11}"),
        BarColumn(bar_width=40 if console.width >= 100 else 20),
        TaskProgressColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[note]}"),
    )
    # auto_refresh: the elapsed time ticks between polls (it froze when the bar was only redrawn on a change)
    with Progress(*columns, console=console, auto_refresh=True, refresh_per_second=4, transient=False) as progress:
        task = progress.add_task("follow", total=1.0, status="…", note="")
        away: list[str] = []  # the failed tries of the outage in progress

        def reconnecting(reason: str, delay: float) -> None:
            if not away:
                progress.console.print(f"reconnecting… ({reason})", markup=False)
            away.append(reason)
            progress.update(task, note=f"reconnecting… try {len(away)}, next in {delay:.1f} s ({reason})")

        def show(value) -> None:
            if away:
                progress.console.print(f"reconnected after {len(away)} failed tries", markup=False)
                away.clear()
            progress.update(task, completed=value.progress, status=value.status, note=value.message or "")
            progress.refresh()  # every change drawn at once, however short-lived
            if not console.is_terminal:  # a log or a pipe: one line per change instead of a redrawn bar
                console.print(f"{value.status:>10}  {value.progress:>4.0%}  {value.message or ''}", markup=False)

        previous = client.on_retry
        client.on_retry = lambda notice: reconnecting(notice.reason, notice.delay)
        try:
            return wait(show, lambda exc, delay: reconnecting(_problem_reason(exc), delay))
        finally:
            client.on_retry = previous


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
            _resolve_model(client, model_id),
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

    A watch waits for an API that restarts. Exit 0 certified or still in progress (without --watch), 1
    failed/rejected/cancelled or the watch timed out, 3 not found, 4 unauthorised, 5 the API unreachable."""
    console = _console()
    with _api(ctx) as client:
        request_id = _resolve_request(client, request_id)
        if watch:
            request = _watch(client, request_id, interval, timeout, console)
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

    with _api(ctx) as client:
        model = _resolve_model(client, model) if model else None
        rows = list(islice(client.iter_deletions(status=status_, model_id=model, overdue=overdue, stuck=stuck), limit))
    if as_json:
        for row in rows:
            typer.echo(row.model_dump_json())
        return
    console = _console()
    console.print(_requests_table(f"deletion requests ({len(rows)})", rows, console.width))


_REQUEST_STEPS = [
    ("short", "id"), ("short", "model"), ("short", "received"), ("short", "due"), ("drop", "received"),
    ("drop", "days left"), ("drop", "method"), ("drop", "due"), ("drop", "progress"), ("drop", "model"),
]  # fmt: skip
"""How a request table narrows: ids and dates first, then the columns one can do without (id and status stay)."""


def _requests_table(title: str, rows: list, width: int):
    def status_cell(row) -> str:
        style = _STATUS_STYLE.get(row.status, "white")
        return f"[{style}]{row.status}[/{style}]" + (" [red]overdue[/red]" if row.overdue else "")

    columns = [
        _id_column("id", [r.id for r in rows]),
        _id_column("model", [r.model_id for r in rows]),
        _Column("method", [r.method for r in rows]),
        _Column("status", [status_cell(r) for r in rows]),
        _Column("progress", [f"{r.progress:.0%}" for r in rows], justify="right"),
        _moment_column("received", [r.received_at or r.created_at for r in rows]),
        _moment_column("due", [r.due_at for r in rows]),
        _Column(
            "days left",
            [f"{r.days_left:.1f}" if r.days_left is not None and not r.done else "—" for r in rows],
            justify="right",
        ),
    ]
    return _fit_table(title, columns, _REQUEST_STEPS, width)


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

    with _api(ctx) as client:
        rows = list(islice(client.iter_models(name=name, name_contains=name_contains, kind=kind, tags=tag), limit))
    if as_json:
        for row in rows:
            typer.echo(row.model_dump_json())
        return
    console = _console()
    columns = [
        _id_column("id", [r.id for r in rows]),
        _Column("name", [r.name for r in rows]),
        _Column("kind", [r.kind for r in rows]),
        _Column("status", [r.status for r in rows]),
        _Column("version", [str(r.current_version.number) if r.current_version else "—" for r in rows], "right"),
        _Column(
            "methods",
            [", ".join(f"{k}:{v.get('status')}" for k, v in r.unlearning.items()) or "—" for r in rows],
            wrap=True,
        ),  # fmt: skip
        _Column("tags", [", ".join(r.tags) or "—" for r in rows], wrap=True),
        _moment_column("created", [r.created_at for r in rows]),
    ]
    steps = [("short", "id"), ("short", "created"), ("drop", "created"), ("drop", "kind"), ("drop", "tags"),
             ("drop", "methods"), ("drop", "version")]  # fmt: skip
    console.print(_fit_table(f"models ({len(rows)})", columns, steps, console.width))


PASSED = {True: "[green]yes[/green]", False: "[red]no[/red]", None: "not evaluated"}


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
    console = _console()
    with _api(ctx) as client:
        request_id = _resolve_request(client, request_id)
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
            title = f"report {item.id} — {item.method or ''} — verdict [{style}]{item.verdict}[/{style}]"
            rows = item.checks
            columns = [
                _Column("check", [c.name or "" for c in rows]),
                _Column("figure", ["—" if c.figure is None else f"{c.figure:.4g}" for c in rows], justify="right"),
                _Column("threshold", ["—" if c.threshold is None else f"{c.threshold:.4g}" for c in rows], "right"),
                _Column("passed", [PASSED[c.passed] for c in rows]),
                _Column("message", [c.message or "" for c in rows], wrap=True),
            ]
            console.print(_fit_table(title, columns, [("drop", "threshold")], console.width))
            figures = _scalar_figures(item)
            columns = [
                _Column("figure", [k for k, _ in figures]),
                _Column("value", [v for _, v in figures], justify="right", wrap=True),
            ]
            console.print(_fit_table("figures", columns, [], console.width))
            for name, link in item.plots.items():
                console.print(f"plot {name}: {link}")
    raise typer.Exit(EXIT_OK if all(r.verdict == "pass" for r in reports) else EXIT_FAILED)


@app.command()
def cancel(ctx: typer.Context, request_id: str) -> None:
    """Cancel a request no worker has started (admin)."""
    with _api(ctx) as client:
        request = client.cancel(_resolve_request(client, request_id))
    _console().print(f"{request.id} {request.status}")


@app.command()
def approve(
    ctx: typer.Context,
    request_id: str,
    note: Annotated[str | None, typer.Option(help="Recorded in the audit log.")] = None,
) -> None:
    """Approve a request waiting for approval: its job is created now (admin, audited)."""
    with _api(ctx) as client:
        request = client.approve(_resolve_request(client, request_id), note)
    _console().print(f"{request.id} {request.status}")


@app.command()
def reject(
    ctx: typer.Context,
    request_id: str,
    reason: Annotated[str, typer.Option(help="Told to the data subject (GDPR Art. 12(4)) and audited.")],
) -> None:
    """Refuse a request waiting for approval, with the reason (admin, audited)."""
    with _api(ctx) as client:
        request = client.reject(_resolve_request(client, request_id), reason)
    _console().print(f"{request.id} {request.status}")


@app.command()
def retry(
    ctx: typer.Context,
    request_id: str,
    method: Annotated[
        str | None, typer.Option(help="Run it with this method instead (e.g. retrain after a failed verdict).")
    ] = None,
) -> None:
    """Run a failed request again (admin), with its own method or another."""
    with _api(ctx) as client:
        request = client.retry(_resolve_request(client, request_id), method=method)
    _console().print(f"{request.id} {request.status} with {request.method} (attempt {request.attempts + 1} queued)")


@app.command()
def extend(
    ctx: typer.Context,
    request_id: str,
    months: Annotated[int, typer.Option(min=1, max=2)],
    reason: Annotated[str, typer.Option(help="Told to the data subject (GDPR Art. 12(3)).")],
) -> None:
    """Extend a request's deadline by one or two months in all, with a reason (admin)."""
    with _api(ctx) as client:
        request = client.extend(_resolve_request(client, request_id), months, reason)
    _console().print(f"{request.id} due {_short(request.due_at)}")


BULK_ACTIONS = ("cancel", "retry", "approve", "reject", "extend")


def _aware(value: str | None, option: str):
    """An ISO 8601 moment with its offset (usage error without one)."""
    from datetime import datetime

    if value is None:
        return None
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        raise typer.BadParameter(f"{value!r} is not an ISO 8601 moment", param_hint=option) from None
    if moment.tzinfo is None:
        raise typer.BadParameter(f"{value!r} has no offset (write 2026-01-31T00:00:00Z)", param_hint=option)
    return moment


@app.command()
def bulk(
    ctx: typer.Context,
    action: Annotated[str, typer.Argument(help="cancel | retry | approve | reject | extend")],
    request_ids: Annotated[
        list[str] | None, typer.Argument(help="Request ids (whole or short); or select with the filter options.")
    ] = None,
    status_: Annotated[str | None, typer.Option("--status", help="Filter: requests in this status.")] = None,
    model: Annotated[str | None, typer.Option("--model", help="Filter: this model's requests.")] = None,
    overdue: Annotated[bool, typer.Option("--overdue", help="Filter: unanswered past their deadline.")] = False,
    stuck: Annotated[bool, typer.Option("--stuck", help="Filter: no worker has taken them.")] = False,
    created_after: Annotated[str | None, typer.Option("--created-after", help="Filter: ISO 8601 with offset.")] = None,
    created_before: Annotated[str | None, typer.Option("--created-before", help="Filter: ISO 8601, offset.")] = None,
    every: Annotated[bool, typer.Option("--all", help="Select every request (no filter).")] = False,
    months: Annotated[int | None, typer.Option(min=1, max=2, help="extend: one or two months in all.")] = None,
    reason: Annotated[str | None, typer.Option(help="extend and reject: told to the data subject.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the outcome as JSON.")] = False,
) -> None:
    """One action (cancel, retry, approve, reject, extend) over many deletion requests (admin).

    The ids given, or the requests a filter selects (--status, --model, --overdue, --stuck, --created-after,
    --created-before; --all for every one). Each request is acted on and audited on its own; one that cannot take
    the action is skipped with the reason. Exit 0 every selected request took it, 1 one was skipped or the selection
    was refused (empty, or above LETHE_BULK_MAX_REQUESTS)."""
    if action not in BULK_ACTIONS:
        raise typer.BadParameter(f"{action!r}: one of {', '.join(BULK_ACTIONS)}", param_hint="ACTION")
    filtered = any((status_, model, overdue, stuck, created_after, created_before))
    if request_ids and (filtered or every):
        raise typer.BadParameter("give request ids or a filter, not both")
    if not request_ids and not filtered and not every:
        raise typer.BadParameter("give request ids, a filter (--status, --model, ...) or --all")
    if action == "extend" and (months is None or reason is None):
        raise typer.BadParameter("extend needs --months and --reason")
    if action == "reject" and reason is None:
        raise typer.BadParameter("reject needs --reason (told to the data subject)")
    window = {"created_after": _aware(created_after, "--created-after"),
              "created_before": _aware(created_before, "--created-before")}  # fmt: skip
    console = _console()
    with _api(ctx) as client:
        if request_ids:
            ids, selection = [_resolve_request(client, i) for i in request_ids], None
        else:
            model = _resolve_model(client, model) if model else None
            ids, selection = None, {"status": status_, "model_id": model, "overdue": overdue, "stuck": stuck} | window
        outcome = client.bulk(action, ids=ids, filter=selection, months=months, reason=reason)
    if as_json:
        typer.echo(outcome.model_dump_json(indent=2))
    else:
        rows = outcome.results
        columns = [
            _id_column("id", [r.id for r in rows]),
            _Column("outcome", [r.outcome if r.outcome == "done" else f"[yellow]{r.outcome}[/yellow]" for r in rows]),
            _Column("status", [r.status or "—" for r in rows]),
            _Column("reason", [": ".join(filter(None, (r.problem_slug, r.reason))) for r in rows], wrap=True),
        ]
        title = f"{outcome.action}: {outcome.done} done, {outcome.skipped} skipped of {outcome.selected} selected"
        console.print(_fit_table(title, columns, [("short", "id")], console.width))
    raise typer.Exit(EXIT_OK if outcome.skipped == 0 else EXIT_FAILED)


def _print_settings(model, console) -> None:
    batch = model.batch or {}
    console.print(f"[bold]{model.id}[/bold]  {model.name}  {model.status}", markup=True)
    rows = [
        ("requires approval", "yes" if model.requires_approval else "no"),
        ("tags", ", ".join(model.tags) or "—"),
        (
            "batch",
            f"at most {batch['max_requests']:,} requests, {batch['max_rows']:,} rows per version"
            if batch
            else "— (not a batched model)",
        ),
        ("subject column", getattr(model, "subject_column", None) or "—"),
    ]
    for label, value in rows:
        console.print(f"  {label:<18} {value}", markup=False)


@app.command("model-settings")
def model_settings(
    ctx: typer.Context,
    model_id: Annotated[str, typer.Argument(help="The model (whole or short id).")],
    requires_approval: Annotated[
        bool | None,
        typer.Option("--requires-approval/--no-requires-approval", help="Hold its requests for an admin's approval."),
    ] = None,
    tag: Annotated[list[str] | None, typer.Option("--tag", help="Its tags, replacing the old (repeat).")] = None,
    clear_tags: Annotated[bool, typer.Option("--clear-tags", help="Remove every tag.")] = False,
    batch_max_requests: Annotated[
        int | None, typer.Option(min=1, help="Most requests one version serves (1: no batching).")
    ] = None,
    batch_max_rows: Annotated[int | None, typer.Option(min=1, help="Most rows one batched version deletes.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the model as JSON.")] = False,
) -> None:
    """Show a model's settings, or change them: approval, tags, batch bounds (admin, audited).

    A batch bound not given keeps its current value."""
    if tag and clear_tags:
        raise typer.BadParameter("--tag or --clear-tags, not both")
    console = _console()
    with _api(ctx) as client:
        model_id = _resolve_model(client, model_id)
        batch = None
        if batch_max_requests is not None or batch_max_rows is not None:
            current = client.get_model(model_id).batch or {}
            batch = {
                "max_requests": batch_max_requests or current.get("max_requests"),
                "max_rows": batch_max_rows or current.get("max_rows"),
            }
            batch = {k: v for k, v in batch.items() if v is not None}
        tags = [] if clear_tags else (tag or None)
        if requires_approval is None and tags is None and batch is None:
            model = client.get_model(model_id)
        else:
            model = client.update_model(model_id, requires_approval=requires_approval, tags=tags, batch=batch)
    if as_json:
        typer.echo(model.model_dump_json(indent=2))
    else:
        _print_settings(model, console)


# ------------------------------------------------------------------------------------- a model taken out, and asked
def _card_lines(card: dict, path: Path, size: int) -> list[tuple[str, str]]:
    """A model card (app/ml/export.py) in a few lines an operator reads: what the file is and what it answers."""
    model, version, recipe = card.get("model") or {}, card.get("version") or {}, card.get("recipe") or {}
    encoder, layout, quality = card.get("encoder") or {}, card.get("layout") or {}, card.get("quality") or {}
    parent = f", child of v{version['parent_number']}" if version.get("parent_number") else ""
    made = version.get("method") or "—"
    if version.get("request_id"):
        made += f", for deletion request {version['request_id']}"
    family = str(recipe.get("family") or model.get("family") or "—")
    if family == "mlp":
        family += f", {recipe.get('hidden_units')} hidden units"
    columns = list(encoder.get("feature_columns") or [])
    text = [c for c in columns if c in (encoder.get("categories") or {})]
    accuracy = ", ".join(
        f"{name} {quality[key]:.3f} ({quality.get(rows, 0):,} rows)"
        for name, key, rows in (
            ("held out", "holdout_accuracy", "holdout_rows"),
            ("trained on", "trained_accuracy", "trained_rows"),
        )  # fmt: skip
        if isinstance(quality.get(key), int | float)
    )
    lines = [
        ("model", f"{model.get('name')}  {model.get('id')}"),
        ("version", f"v{version.get('number')}  {version.get('id')}{parent}"),
        ("made by", made),
        ("created", str(version.get("created_at") or "—")[:19].replace("T", " ")),
        ("family", family),
        ("classes", ", ".join(map(str, encoder.get("classes") or [])) or "—"),
        (
            "inputs",
            f"{len(columns)} columns ({len(columns) - len(text)} numbers, {len(text)} text), "
            f"{len(card.get('features') or [])} encoded features",
        ),  # fmt: skip
    ]
    if int(layout.get("members") or 1) > 1:
        lines.append(("members", f"{layout['members']} (SISA: their class probabilities averaged)"))
    lines += [
        ("accuracy", accuracy or "—"),
        ("digest", str(version.get("digest") or "—")),
        ("file", f"{path} ({size:,} bytes; theta checked against the card)"),
    ]
    return lines


@app.command("model-export")
def model_export(
    ctx: typer.Context,
    model_id: Annotated[str, typer.Argument(help="The model (whole or short id).")],
    output: Annotated[Path, typer.Option("--output", "-o", help="The file to write (safetensors).")],
    version: Annotated[
        int | None, typer.Option("--version", min=1, help="A version number (default: current).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the whole model card as JSON.")] = False,
) -> None:
    """Take a model version out: its weights to a file, with its model card, summed up here.

    A tabular version's file is safetensors with the card in its header (README "Taking a model out"); it is read
    back here with app/ml/export.py, which checks the parameters against the card (copy that module next to the file
    to use it without Lethe). Exit 0 written, 1 the model has no version yet or the file does not hold together,
    3 no such model or version, or a retired one (410)."""
    if output.is_dir():
        raise typer.BadParameter(f"{output} is a folder: name the file", param_hint="--output")
    console = _console()
    with _api(ctx) as client:
        model_id = _resolve_model(client, model_id)
        if version is None:
            model = client.get_model(model_id)
            if model.current_version is None:
                _console(stderr=True).print(f"error: model {model_id} has no version yet (status {model.status})")
                raise typer.Exit(EXIT_FAILED)
            version = model.current_version.number
        exported = client.export_version(model_id, version, output)
    if exported.card is None:
        console.print(f"wrote {output} ({exported.size:,} bytes, sha256 {exported.sha256}): version {version} of "
                      f"{model_id}, no model card (a federated version's LoRA vector)", markup=False)  # fmt: skip
        return
    from app.ml.export import ExportError, load

    try:
        load(output)  # the parameters against the card's theta_sha256, the layout against the recipe
    except (ExportError, KeyError, ValueError) as exc:
        _console(stderr=True).print(f"error: {output} does not hold together: {exc}", markup=False)
        raise typer.Exit(EXIT_FAILED) from None
    if as_json:
        typer.echo(json.dumps(exported.card, indent=2))
        return
    console.print(f"[bold]wrote {output}[/bold]: the model card of {exported.card['model'].get('name')} "
                  f"v{exported.card['version'].get('number')}", markup=True)  # fmt: skip
    for label, value in _card_lines(exported.card, output, exported.size):
        console.print(f"  {label:<9} {value}", markup=False)


MISSING_TEXTS = ("", "na", "n/a", "nan", "null", "none")
"""A number cell that means "no value" (sent as null: the encoder's rule for a missing value)."""


def _csv_rows(source: str) -> tuple[list[str], list[dict[str, str]]]:
    import csv
    import io
    import sys

    if source == "-":
        text = sys.stdin.read()
    else:
        path = Path(source)
        if not path.is_file():
            raise typer.BadParameter(f"{source}: no such file", param_hint="--csv")
        text = path.read_text(encoding="utf-8-sig")
    reader = csv.DictReader(io.StringIO(text))
    rows = list(reader)
    if not reader.fieldnames or not rows:
        raise typer.BadParameter(f"{source}: no rows under a header", param_hint="--csv")
    return list(reader.fieldnames), rows


def _typed_rows(source: str, rows: list[dict[str, str]], inputs: dict[str, str] | None) -> list[dict]:
    """The CSV's cells as the API takes them: a number column's cells as numbers (missing: null), a text column's as
    text (empty: null); columns the model does not take are left out (all kept when its inputs are not known)."""
    import math

    if inputs is None:
        return [dict(row) for row in rows]
    out = []
    for n, row in enumerate(rows, start=1):
        typed: dict = {}
        for column, value in row.items():
            if column not in inputs:
                continue
            value = (value or "").strip()
            if inputs[column] != "number":
                typed[column] = value or None
            elif value.lower() in MISSING_TEXTS:
                typed[column] = None
            else:
                try:
                    number: float | None = float(value)
                except ValueError:
                    number = None
                if number is None or not math.isfinite(number):
                    why = "not a number" if number is None else "not a finite number"
                    _console(stderr=True).print(f"error: {source} row {n}: {column} is {value!r}, {why}", markup=False)
                    raise typer.Exit(EXIT_FAILED)
                typed[column] = number
        out.append(typed)
    return out


def _looks_like_ids(values: list[str]) -> bool:
    return bool(values) and all(len(v) == 36 and v.count("-") == 4 for v in values)


@app.command()
def predict(
    ctx: typer.Context,
    model_id: Annotated[str, typer.Argument(help="The model (whole or short id).")],
    csv_file: Annotated[
        str,
        typer.Option("--csv", help="Rows: a CSV with a header naming the model's input columns (- reads stdin)."),
    ],
    version: Annotated[
        int | None, typer.Option("--version", min=1, help="A version number (default: current).")
    ] = None,
    id_column: Annotated[
        str | None, typer.Option("--id-column", help="A CSV column to name each row by (default: its number).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per row.")] = False,
) -> None:
    """Predict labels for the rows of a CSV with a tabular model (its current version, or --version).

    Each row names the model's input columns (`inputs` in `lethe models --json` and `GET /v1/models/{id}`); other
    columns (a row id, the label) are left out, and an empty or NA cell is a missing value. Sent in
    parts the API takes, all to one version. Prints each row's label and class probabilities. Exit 0 answered, 1 the
    rows or the model were refused (not ready, a column missing, a cell of the wrong kind), 2 no such file or no
    rows, 3 no such model or version, or a retired one (410)."""
    header, raw = _csv_rows(csv_file)
    if id_column is not None and id_column not in header:
        raise typer.BadParameter(f"{id_column!r} is not a column of {csv_file} ({', '.join(header)})")
    with _api(ctx) as client:
        model_id = _resolve_model(client, model_id)
        model = client.get_model(model_id)
        inputs = model.inputs
        if inputs is not None:
            left_out = [c for c in header if c not in inputs]
            if left_out:
                _console(stderr=True).print(f"left out (not the model's inputs): {', '.join(left_out)}", markup=False)
        rows = _typed_rows(csv_file, raw, inputs)
        answer = client.predict(model_id, rows, version=version)
    names = [row.get(id_column) or "" for row in raw] if id_column else [str(i) for i in range(1, len(raw) + 1)]
    if as_json:
        for i, (name, label, probabilities) in enumerate(zip(names, answer.labels, answer.probabilities, strict=True)):
            entry = {"row": i + 1} | ({"id": name} if id_column else {})
            entry |= {"label": label, "probabilities": dict(zip(answer.classes, probabilities, strict=True)),
                      "version": answer.version.number}  # fmt: skip
            typer.echo(json.dumps(entry))
        return
    best = [max(p) for p in answer.probabilities]
    columns = [
        _Column(
            id_column or "row",
            names,
            [_short_id(n) for n in names] if _looks_like_ids(names) else None,
            justify="left" if id_column else "right",
        ),  # fmt: skip
        _Column("label", answer.labels),
        _Column("p(label)", [f"{p:.3f}" for p in best], justify="right"),
        *(
            _Column(f"p({name})", [f"{p[k]:.3f}" for p in answer.probabilities], justify="right")
            for k, name in enumerate(answer.classes)
        ),
    ]
    steps = [("short", id_column or "row")] + [("drop", f"p({name})") for name in reversed(answer.classes)]
    console = _console()
    title = f"{model.name} v{answer.version.number}: {len(names)} row(s)"
    console.print(_fit_table(title, columns, steps, console.width))


# --------------------------------------------------------------------------------------------- per-person erasure
subjects_app = typer.Typer(
    help="Per-person erasure across models: erase a data subject, follow it, fetch the combined certificate.", **HELP
)
app.add_typer(subjects_app, name="subjects")


def _exit_for_erasure(status: str) -> int:
    return EXIT_FAILED if status == "failed" else EXIT_OK


def _print_erasure(erasure, console) -> None:
    style = {"certified": "green", "failed": "red"}.get(erasure.status, "cyan")
    found = "no data found: no model held rows of this subject" if erasure.no_data_found else ""
    console.print(
        f"[bold]erasure {erasure.id}[/bold]  [{style}]{erasure.status}[/{style}]  {len(erasure.children)} request(s)"
        + (f"  {found}" if found else ""),
        markup=True,
    )
    rows = [
        ("subject hash", erasure.subject_hash),
        ("method", erasure.method),
        ("created", _short(erasure.created_at)),
        ("completed", _short(erasure.completed_at)),
        ("certificate", erasure.links.get("certificate") or "not issued yet (once every request is certified)"),
    ]
    for label, value in rows:
        console.print(f"  {label:<13} {value}", markup=False)
    children = erasure.children
    columns = [
        _id_column("request", [c.request_id for c in children]),
        _id_column("model", [c.model_id for c in children]),
        _Column("status", [f"[{_STATUS_STYLE.get(c.status, 'white')}]{c.status}[/]" for c in children]),
        _Column("rows", [str(c.n_samples) for c in children], justify="right"),
        _id_column("certificate", [c.certificate_id for c in children]),
    ]
    steps = [("short", "certificate"), ("short", "model"), ("short", "request"), ("drop", "certificate")]
    console.print(_fit_table("its deletion requests", columns, steps, console.width))


def _watch_erasure(client, erasure_id: str, interval: float, timeout: float, console):
    return _follow(
        client,
        console,
        lambda show, reconnect: client.wait_erasure(
            erasure_id, interval=interval, timeout=timeout, on_progress=show, on_reconnect=reconnect
        ),
    )


def _save_certificate(client, erasure_id: str, output: Path, console) -> None:
    envelope = client.erasure_certificate(erasure_id)
    output.write_text(json.dumps(envelope, indent=2) + "\n", encoding="utf-8")
    console.print(f"combined certificate written to {output} (check it: lethe verify-certificate {output} --keys …)")


@subjects_app.command("erase")
def subjects_erase(
    ctx: typer.Context,
    subject: Annotated[
        str, typer.Argument(help="The subject's value in the models' subject_column (kept only as its keyed hash).")
    ],
    method: Annotated[str, typer.Option(help="Each request's method: auto | retrain | ...")] = "auto",
    received_at: Annotated[
        str | None, typer.Option("--received-at", help="ISO 8601 with offset: when the subject asked.")
    ] = None,
    wait: Annotated[bool, typer.Option("--wait/--no-wait", help="Follow it to the end with a progress bar.")] = False,
    certificate: Annotated[
        Path | None, typer.Option("--certificate", "-o", help="With --wait: save the combined certificate here.")
    ] = None,
    interval: Annotated[float, typer.Option(help="Seconds between polls with --wait.", min=0.05)] = 1.0,
    timeout: Annotated[float, typer.Option(help="Give up waiting after this many seconds (exit 1).")] = 24 * 3600,
    as_json: Annotated[bool, typer.Option("--json", help="Print the erasure as JSON.")] = False,
) -> None:
    """Erase a data subject from every model whose subject_column holds rows of theirs.

    One deletion request per model, followed together; certified once every one is, with one combined certificate.
    A subject no model holds rows of is answered the same way: certified at once, with no requests and a certificate
    that says no data was found. Exit 0 accepted or certified, 1 failed."""
    if certificate is not None and not wait:
        raise typer.BadParameter("--certificate needs --wait (or fetch it later: lethe subjects certificate ID)")
    _aware(received_at, "--received-at")
    console = _console()
    with _api(ctx) as client:
        erasure = client.erase_subject(subject, method=method, received_at=received_at)
        if as_json and not wait:
            typer.echo(erasure.model_dump_json(indent=2))
            return
        console.print(
            f"accepted erasure {erasure.id} ({len(erasure.children)} request(s)); follow it with "
            f"`lethe subjects status {erasure.id} --watch`"
        )
        if wait:
            erasure = _watch_erasure(client, erasure.id, interval, timeout, console)
            if certificate is not None and erasure.status == "certified":
                _save_certificate(client, erasure.id, certificate, console)
        if as_json:
            typer.echo(erasure.model_dump_json(indent=2))
        else:
            _print_erasure(erasure, console)
    raise typer.Exit(_exit_for_erasure(erasure.status))


@subjects_app.command("status")
def subjects_status(
    ctx: typer.Context,
    erasure_id: str,
    watch: Annotated[bool, typer.Option("--watch", "-w", help="A live progress bar until the erasure ends.")] = False,
    interval: Annotated[float, typer.Option(help="Seconds between polls with --watch.", min=0.05)] = 1.0,
    timeout: Annotated[float, typer.Option(help="Give up watching after this many seconds (exit 1).")] = 24 * 3600,
    as_json: Annotated[bool, typer.Option("--json", help="Print the erasure as JSON.")] = False,
) -> None:
    """An erasure and its deletion requests; with --watch follow it to the end.

    Exit 0 certified or in progress, 1 failed or the watch timed out, 3 not found."""
    console = _console()
    with _api(ctx) as client:
        erasure = (
            _watch_erasure(client, erasure_id, interval, timeout, console) if watch else client.get_erasure(erasure_id)
        )
    if as_json:
        typer.echo(erasure.model_dump_json(indent=2))
    else:
        _print_erasure(erasure, console)
    raise typer.Exit(_exit_for_erasure(erasure.status))


@subjects_app.command("certificate")
def subjects_certificate(
    ctx: typer.Context,
    erasure_id: str,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="A file (default: stdout).")] = None,
) -> None:
    """The erasure's combined certificate (DSSE envelope JSON), to keep and check offline.

    Check it with `lethe verify-certificate FILE --keys ...`. Exit 0 written, 1 not issued yet (a request is not
    certified), 3 no such erasure."""
    from app.client import LetheProblem

    with _api(ctx) as client:
        try:
            if output is not None:
                _save_certificate(client, erasure_id, output, _console(stderr=True))
                return
            envelope = client.erasure_certificate(erasure_id)
        except LetheProblem as problem:
            if problem.slug != "certificate-not-issued":
                raise
            _console(stderr=True).print(f"not issued yet: {problem.detail or problem.title}", markup=False)
            raise typer.Exit(EXIT_FAILED) from None
    typer.echo(json.dumps(envelope, indent=2))


@subjects_app.command("requests")
def subjects_requests(
    ctx: typer.Context,
    subject: Annotated[
        str,
        typer.Argument(help="The subject's keyed hash (a request's subject_hash), or with --ref their reference."),
    ],
    by_ref: Annotated[
        bool, typer.Option("--ref", help="SUBJECT is the person's reference: the server computes its keyed hash.")
    ] = False,
    limit: Annotated[int, typer.Option(min=1, max=500, help="At most this many, newest first.")] = 100,
    as_json: Annotated[bool, typer.Option("--json", help="Print them as JSON.")] = False,
) -> None:
    """A data subject's deletion requests and erasures, by their keyed hash (subject_hash) or, with --ref, by their
    reference (the raw reference is never stored: the server hashes it with its key and searches for the hash)."""
    console = _console()
    with _api(ctx) as client:
        found = client.lookup_subject(subject, limit=limit) if by_ref else client.subject_requests(subject, limit=limit)
    subject_hash = found.subject_hash
    if as_json:
        typer.echo(found.model_dump_json(indent=2))
        return
    console.print(_requests_table(f"deletion requests of {subject_hash[:16]}… ({len(found.requests)})",
                                  found.requests, console.width))  # fmt: skip
    erasures = found.erasures
    columns = [
        _id_column("erasure", [e.id for e in erasures]),
        _moment_column("created", [e.created_at for e in erasures]),
        _Column("certificate", ["issued" if e.certificate_digest else "not yet" for e in erasures]),
    ]
    console.print(_fit_table(f"erasures ({len(erasures)})", columns, [("short", "erasure")], console.width))


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
        model = _resolve_model(client, model) if model else None
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
    audit_log: Annotated[
        Path | None,
        typer.Option(
            "--audit-log",
            help="The audit log (`lethe export audit --format json`): check it still leads to the certificate's "
            "audit anchor.",
        ),
    ] = None,
) -> None:
    """Check a deletion certificate offline; with --audit-log, also that the log was not rewritten before the
    certificate's audit anchor. Exit 0 valid, 1 invalid, 2 unreadable certificate, keys or log."""
    from app.certificates.verify_cli import InputUnavailable, verify_file

    try:
        ok, message = verify_file(file, keys, audit_log)
    except InputUnavailable as exc:
        typer.echo(f"error: {exc.reason}", err=True)
        raise typer.Exit(2) from None
    typer.echo(message)
    raise typer.Exit(0 if ok else 1)


if __name__ == "__main__":
    app()

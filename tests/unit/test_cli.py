"""The `lethe` CLI against a real embedded service (uvicorn on a loopback port, SQLite, in-process executor): every
command's exit code (0 done, 1 failed, 2 usage, 3 not found, 4 unauthorised, 5 unreachable), `status --watch`
drawing a progress bar on a running request and ending with the verdict, the tables, and the exports."""

from __future__ import annotations

import csv
import fcntl
import io
import json
import os
import pty
import re
import select
import socket
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
import typer
import uvicorn
from rich.cells import cell_len
from typer.testing import CliRunner

from app.cli import _few, _resolve
from app.cli import app as cli
from app.client import LetheClient
from app.ids import short_id
from app.jobs.tabular import holdout_mask
from app.main import create_app
from app.ml.unlearning import base
from app.ml.unlearning.retrain import ExactRetrain, RetrainConfig
from tests.helpers import configure, make_key, wait_for, write_table
from tests.unit.scripted_server import ScriptedServer, json_answer, problem

SCOPES = ["models:write", "models:read", "requests:write", "requests:read", "audit:read", "admin"]
CAROL, DAVE = "carol.cli-test@example.org", "dave.cli-test@example.org"
GATE = threading.Event()
"""The gated method waits here: a request stays `running` until the test has seen it running."""


class GatedRetrain(ExactRetrain):
    """Exact retraining that first waits at the test's gate (so a watcher sees a running request)."""

    def unlearn(self, problem):
        problem.progress(0.5, "waiting at the test's gate")
        GATE.wait(60)
        return super().unlearn(problem)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    """One embedded service for the module, a ready tabular model, and keys."""
    home = tmp_path_factory.mktemp("cli")
    configure(home, poll_seconds="0.05")
    base.register_method("test-gated", RetrainConfig, GatedRetrain, model_kinds={"tabular"}, scopes={"samples"},
                         exact=True)  # fmt: skip
    base.register_method(
        "test-nothing",
        "app.ml.unlearning.baselines.sisa:DoNothingConfig",
        "app.ml.unlearning.baselines.sisa:DoNothing",
        model_kinds={"tabular"},
        scopes={"samples"},
    )
    key = make_key(SCOPES, name="cli-admin")
    reader = make_key(["requests:read"], name="cli-reader")
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(run_background=True), host="127.0.0.1", port=port,
                                           log_level="warning"))  # fmt: skip
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, timeout=30, what="uvicorn")
    url = f"http://127.0.0.1:{port}"
    source = home / "t.csv"
    frame = write_table(source, n=200, seed=5)
    trained = [i for i, held in enumerate(holdout_mask(200, 0.2, seed=0)) if not held]
    frame["person"] = [f"other-{i % 31}" for i in range(len(frame))]
    frame.loc[trained[-2:], "person"] = CAROL  # two rows each, kept for `lethe subjects erase`
    frame.loc[trained[-4:-2], "person"] = DAVE
    frame.to_csv(source, index=False)
    metadata = {
        "name": "cli-table",
        "verification": {"shadows": 8},
        "dataset": {"row_id_column": "row_id", "label_column": "label", "subject_column": "person"},
    }
    client = LetheClient(url, key)
    model = client.register_model(metadata, source)
    model = client.wait_model(model.id, timeout=120)
    assert model.status == "ready", model
    rows = iter(f"r{i}" for i in trained[:-4])
    try:
        yield {"url": url, "key": key, "reader": reader, "model": model, "client": client, "rows": rows}
    finally:
        GATE.set()
        client.close()
        server.should_exit = True
        thread.join(timeout=15)
        for name in ("test-gated", "test-nothing"):
            base._REGISTRY.pop(name, None)


def run(service, *args, key: str | None = None, env: dict | None = None):
    environment = {"LETHE_URL": service["url"], "LETHE_API_KEY": key or service["key"], "COLUMNS": "160"}
    return CliRunner().invoke(cli, list(args), env=environment | (env or {}), catch_exceptions=False)


def test_watch_shows_a_progress_bar_on_a_running_request_and_ends_with_the_verdict(service, monkeypatch):
    GATE.clear()
    client: LetheClient = service["client"]
    request = client.submit_deletion(service["model"].id, {"kind": "samples", "sample_ids": [next(service["rows"])]},
                                     "watch", method="test-gated")  # fmt: skip
    seen: list[str] = []
    real_get = LetheClient.get_deletion

    def spy(self, request_id):  # opens the gate once the watcher itself has seen the request running, with progress
        out = real_get(self, request_id)
        seen.append(out.status)
        if out.status == "running" and out.progress > 0:
            GATE.set()
        return out

    monkeypatch.setattr(LetheClient, "get_deletion", spy)
    result = run(
        service, "status", request.id, "--watch", "--interval", "0.1", env={"TTY_COMPATIBLE": "1", "NO_COLOR": "1"}
    )
    assert result.exit_code == 0, result.output
    assert "running" in seen and seen[-1] == "certified"
    frames = result.output
    running = [line for line in frames.splitlines() if "running" in line]
    assert running and any("━" in line and "%" in line for line in running), frames  # the bar, drawn while running
    assert re.search(r"running.*━.*\d+% \d+:\d\d:\d\d \w", frames), frames  # with the request's message
    tail = frames.strip().splitlines()
    assert "verdict on test-gated: PASS" in frames and tail[-1].strip() == "certified"
    assert any("✓" in line for line in tail)  # the verdict's checks


def test_status_list_report_and_models_exit_0_on_a_certified_request(service):
    client: LetheClient = service["client"]
    rows = [next(service["rows"]), next(service["rows"])]
    submitted = run(service, "submit", service["model"].id, "--subject", "alice", "--sample-id", rows[0],
                    "--sample-id", rows[1], "--wait")  # fmt: skip
    assert submitted.exit_code == 0, submitted.output
    request_id = submitted.output.split()[1]
    assert client.get_deletion(request_id).status == "certified"
    assert "certified" in submitted.output.strip().splitlines()[-1]

    status = run(service, "status", request_id)
    assert status.exit_code == 0 and "certified" in status.output
    as_json = run(service, "status", request_id, "--json")
    assert as_json.exit_code == 0 and json.loads(as_json.output)["id"] == request_id

    listing = run(service, "list", "--status", "certified", "--model", service["model"].id)
    assert listing.exit_code == 0 and request_id in listing.output and "deletion requests" in listing.output
    lines = run(service, "list", "--status", "certified", "--json")
    assert request_id in [json.loads(line)["id"] for line in lines.output.splitlines()]
    assert run(service, "list", "--status", "nonsense").exit_code == 1  # the API's 422 names the bad filter

    report = run(service, "report", request_id)
    assert report.exit_code == 0, report.output
    assert "verdict pass" in report.output and "threshold" in report.output and "n_forget" in report.output
    reports = json.loads(run(service, "report", request_id, "--json").output)
    assert reports[0]["request_id"] == request_id and reports[0]["verdict"] == "pass"

    models = run(service, "models", "--name", "cli-table")
    assert models.exit_code == 0 and service["model"].id in models.output
    assert run(service, "models", "--name", "no-such-model", "--json").output == ""
    assert run(service, "audit-verify").exit_code == 0


def test_a_failed_deletion_exits_1_and_can_be_retried(service):
    row = next(service["rows"])
    failed = run(service, "submit", service["model"].id, "--subject", "bob", "--sample-id", row, "--method",
                 "test-nothing", "--wait")  # fmt: skip
    assert failed.exit_code == 1, failed.output
    request_id = failed.output.split()[1]
    assert "FAIL" in failed.output and failed.output.strip().splitlines()[-1].startswith("failed")
    assert run(service, "status", request_id).exit_code == 1
    assert run(service, "report", request_id).exit_code == 1  # its verdict failed
    retried = run(service, "retry", request_id)
    assert retried.exit_code == 0, retried.output
    watched = run(service, "status", request_id, "--watch", "--interval", "0.1")
    assert watched.exit_code == 1 and "failed" in watched.output  # plain lines when not a terminal
    assert run(service, "retry", service["model"].id).exit_code == 3  # not a request


def test_cancel_extend_and_refusals(service):
    client: LetheClient = service["client"]
    model_id = service["model"].id
    GATE.clear()
    blocker = client.submit_deletion(model_id, {"kind": "samples", "sample_ids": [next(service["rows"])]}, "c",
                                     method="test-gated")  # fmt: skip
    wait_for(lambda: client.get_deletion(blocker.id).status == "running", timeout=60, what="the gated request")
    waiting = client.submit_deletion(model_id, {"kind": "samples", "sample_ids": [next(service["rows"])]}, "d")
    try:
        # jobs on one model run one at a time: the second waits behind the gated one, so it can be cancelled
        assert run(service, "cancel", waiting.id).exit_code == 0
        assert run(service, "status", waiting.id).exit_code == 1  # cancelled: the erasure did not happen
        extended = run(service, "extend", blocker.id, "--months", "1", "--reason", "a complex request")
        assert extended.exit_code == 0 and "due" in extended.output
        assert run(service, "extend", blocker.id, "--months", "3", "--reason", "too long").exit_code == 2
        # a reader may look but not act: 403 is exit 3
        assert run(service, "cancel", blocker.id, key=service["reader"]).exit_code == 4
        assert run(service, "status", blocker.id, key=service["reader"]).exit_code == 0
    finally:
        GATE.set()
    done = client.wait(blocker.id, timeout=120)
    assert done.status == "certified"
    assert run(service, "cancel", blocker.id).exit_code == 1  # 409 request-started: the operation failed


def test_approve_and_reject_a_pending_request(service):
    """Issue 23, item 4: the operator's approval is in the CLI and the typed client too, not only the API."""
    import time

    from app.requests.intake import MODEL_TTL

    client: LetheClient = service["client"]
    model_id = service["model"].id
    assert client.request("PATCH", f"/v1/models/{model_id}", json={"requires_approval": True}).status_code == 200
    time.sleep(MODEL_TTL + 0.1)  # the intake's snapshot of the model is at most MODEL_TTL old
    try:
        first, second = (
            client.submit_deletion(model_id, {"kind": "samples", "sample_ids": [next(service["rows"])]}, s)
            for s in ("approve-me", "reject-me")
        )
        assert first.status == second.status == "pending-approval"
        assert run(service, "approve", first.id, key=service["reader"]).exit_code == 4  # 403: admins only
        assert run(service, "approve", first.id).exit_code == 4  # 403: not by the key that submitted it
        approver = make_key(SCOPES, name="approver")
        approved = run(service, "approve", first.id, "--note", "checked the identity", key=approver)
        assert approved.exit_code == 0 and first.id in approved.output
        assert run(service, "reject", second.id).exit_code == 2  # the reason is required
        rejected = run(service, "reject", second.id, "--reason", "no such person in our records")
        assert rejected.exit_code == 0 and "rejected" in rejected.output
        assert client.wait(first.id, timeout=120).status == "certified"
        assert client.get_deletion(second.id).status == "rejected"
        assert run(service, "approve", second.id, key=approver).exit_code == 1  # 409: no longer waiting
        actions = [e.action for e in client.iter_audit(entity_id=first.id)]
        assert "deletion_request.approved" in actions
    finally:
        client.request("PATCH", f"/v1/models/{model_id}", json={"requires_approval": False})
        time.sleep(MODEL_TTL + 0.1)


def test_unauthorised_not_found_and_usage_errors(service):
    model_id = service["model"].id
    unknown = "00000000-0000-0000-0000-000000000000"
    assert run(service, "status", unknown).exit_code == 3
    assert run(service, "report", unknown).exit_code == 3
    bad_key = run(service, "status", unknown, key="lethe_nothere_0000000000000000")
    assert bad_key.exit_code == 4 and "401" in bad_key.output  # `lethe status` used to exit 0 on a 401
    assert run(service, "list", key="lethe_nothere_0000000000000000").exit_code == 4
    closed = _free_port()  # nothing listens there (loopback)
    unreachable = run(service, "status", unknown, env={"LETHE_URL": f"http://127.0.0.1:{closed}", "LETHE_RETRIES": "1"})
    assert unreachable.exit_code == 5 and f"127.0.0.1:{closed}" in unreachable.output
    assert "retry 1 of 1" in unreachable.output  # tried again once, then exit 5
    assert run(service, "--url", "127.0.0.1:8000", "status", unknown).exit_code == 2  # no scheme: a usage error
    no_key = run(service, "status", unknown, env={"LETHE_API_KEY": ""})
    assert no_key.exit_code == 2 and "LETHE_API_KEY" in no_key.output
    assert run(service, "submit", model_id, "--subject", "x").exit_code == 2  # no scope given
    assert run(service, "status").exit_code == 2  # missing argument
    assert run(service, "no-such-command").exit_code == 2
    assert run(service, "submit", unknown, "--subject", "x", "--sample-id", "r1").exit_code == 3  # model-not-found
    typo = run(service, "submit", model_id, "--subject", "x", "--sample-id", "r9999")
    assert typo.exit_code == 1 and "unknown-sample-ids" in typo.output
    unreachable = run(service, "status", unknown, env={"LETHE_URL": f"http://127.0.0.1:{_free_port()}",
                                                       "LETHE_RETRIES": "0"})  # fmt: skip
    assert unreachable.exit_code == 5 and "cannot reach" in unreachable.output


def test_export_requests_and_audit_log(service, tmp_path):
    client: LetheClient = service["client"]
    ids = {r.id for r in client.iter_deletions()}
    assert ids, "the earlier tests left requests to export"
    target = tmp_path / "requests.csv"
    written = run(service, "export", "requests", "--format", "csv", "--output", str(target))
    assert written.exit_code == 0, written.output
    rows = list(csv.DictReader(io.StringIO(target.read_text())))
    assert {r["id"] for r in rows} == ids and json.loads(rows[0]["scope"])["kind"] == "samples"
    audit = run(service, "export", "audit", "--format", "json")
    assert audit.exit_code == 0
    events = json.loads(audit.output)
    seqs = [e["seq"] for e in events]
    assert seqs == sorted(seqs) and len(seqs) == client.verify_audit().checked
    assert {e["entity_id"] for e in events} >= ids
    one = json.loads(run(service, "export", "audit", "-f", "json", "--entity", rows[0]["id"]).output)
    assert one and {e["entity_id"] for e in one} == {rows[0]["id"]}
    assert run(service, "export", "models").exit_code == 2
    assert run(service, "export", "audit", "--format", "xml").exit_code == 2


def test_verify_certificate_from_the_api(service, tmp_path):
    client: LetheClient = service["client"]
    certified = next(r for r in client.iter_deletions(status="certified") if "certificate" in r.links)
    envelope = client.certificate(certified.links["certificate"])
    cert, keys = tmp_path / "cert.json", tmp_path / "keys.json"
    cert.write_text(json.dumps(envelope))
    keys.write_text(json.dumps(client.signing_keys()))
    assert run(service, "verify-certificate", str(cert), "--keys", str(keys)).exit_code == 0
    assert run(service, "verify-certificate", str(cert), "--keys", f"{service['url']}/.well-known/lethe-keys.json")\
        .exit_code == 0  # fmt: skip
    envelope["payload"] = envelope["payload"][:-8] + ("A" * 8 if not envelope["payload"].endswith("A" * 8) else "B" * 8)
    cert.write_text(json.dumps(envelope))
    assert run(service, "verify-certificate", str(cert), "--keys", str(keys)).exit_code == 1
    assert run(service, "verify-certificate", str(tmp_path / "missing.json"), "--keys", str(keys)).exit_code == 2


def test_keys_create_list_revoke(service):
    created = run(service, "keys", "create", "--scope", "requests:read", "--name", "cli-made")
    assert created.exit_code == 0
    key = created.stdout.strip().splitlines()[0]
    assert key.startswith("lethe_")
    assert "sqlite:///" in created.output and "lethe.db" in created.output  # which database holds it (issue 23)
    listing = run(service, "keys", "list")
    assert listing.exit_code == 0 and "cli-made" in listing.output and "API keys" in listing.output
    entry = next(json.loads(line) for line in run(service, "keys", "list", "--json").output.splitlines()
                 if json.loads(line)["name"] == "cli-made")  # fmt: skip
    assert run(service, "list", key=key).exit_code == 0
    assert run(service, "keys", "revoke", entry["id"]).exit_code == 0
    assert wait_for(lambda: run(service, "list", key=key).exit_code == 4, timeout=30, what="revocation")
    assert run(service, "keys", "revoke", "no-such-key").exit_code == 3
    assert run(service, "keys", "create", "--scope", "nonsense").exit_code == 2
    events = list(service["client"].iter_audit(entity_id=entry["id"]))  # creation and revocation are audited
    assert [e.action for e in events] == ["api_key.created", "api_key.revoked"]
    assert events[0].payload["name"] == "cli-made" and events[0].payload["scopes"] == ["requests:read"]
    assert key not in json.dumps([e.payload for e in events]) and key.split("_")[-1] not in str(events)


def test_serve_worker_and_demo_are_wired():
    """The long-running commands are registered with their options (running them is the integration tests' and
    `make demo`'s job)."""
    for command, option in (("serve", "--port"), ("worker", "--queues"), ("dispatcher", "--no-webhooks"),
                            ("webhook-sender", "--help"), ("demo", "--keep")):  # fmt: skip
        result = CliRunner().invoke(cli, [command, "--help"])
        assert result.exit_code == 0 and option in result.output, (command, result.output)


# ------------------------------------------------------------------------------- a real terminal, and a pipe
# `lethe` as a person runs it: a child process in a pseudo-terminal whose window is 80 columns (no COLUMNS set: rich
# reads the window size, as in a terminal emulator), or with its output piped.

REPO = Path(__file__).resolve().parents[2]
ESCAPES = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07|\x1b[()][A-Z0-9]")
SHORT_ID = re.compile(r"^[0-9a-f]{8}$")


def _environment(service, key: str | None = None, **extra: str) -> dict[str, str]:
    unset = ("COLUMNS", "LINES", "TTY_COMPATIBLE", "FORCE_COLOR", "NO_COLOR", "TERM", "LETHE_RETRIES")
    environment = {k: v for k, v in os.environ.items() if k not in unset}
    return environment | {"LETHE_URL": service["url"], "LETHE_API_KEY": key or service["key"],
                          "PYTHONPATH": str(REPO), "TERM": "xterm-256color"} | extra  # fmt: skip


def in_terminal(service, *args: str, columns: int = 80, timeout: float = 60, **env: str) -> tuple[int, str]:
    """`lethe ARGS` in a pseudo-terminal ``columns`` wide: its exit code and what the screen got, colours and cursor
    moves stripped, each redraw (carriage return) on a line of its own."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    child = subprocess.Popen([sys.executable, "-m", "app.cli", *args], stdin=slave, stdout=slave, stderr=slave,
                             env=_environment(service, **env), cwd=REPO, start_new_session=True)  # fmt: skip
    os.close(slave)
    output = bytearray()
    deadline = time.monotonic() + timeout
    try:
        while True:
            ready, _, _ = select.select([master], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError(f"lethe {' '.join(args)} still running after {timeout} s: {output[-2000:]!r}")
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            output += chunk
    finally:
        os.close(master)
        if child.poll() is None and time.monotonic() > deadline:
            child.kill()
    code = child.wait(timeout=30)
    text = ESCAPES.sub("", output.decode("utf-8", "replace"))
    return code, text.replace("\r\n", "\n").replace("\r", "\n")


def piped(service, *args: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess:
    """`lethe ARGS` with stdout and stderr piped, COLUMNS=80 set (a pipe has no width: it must not take that one)."""
    return subprocess.run([sys.executable, "-m", "app.cli", *args], capture_output=True, text=True, timeout=timeout,
                          env=_environment(service, COLUMNS="80", **env), cwd=REPO)  # fmt: skip


def _row(screen: str, short_id: str) -> list[str]:
    """The words of the one table row that starts with ``short_id``."""
    rows = [line.split() for line in screen.splitlines() if line.split()[:1] == [short_id]]
    assert len(rows) == 1, (short_id, screen)
    return rows[0]


def test_tables_fit_80_columns_in_a_terminal_with_every_short_id_and_status_whole(service):
    """Issue 23: at 80 columns every column used to be cut to two letters (`ce…`). Now ids shrink to their last 8
    characters, dates to minutes, and less important columns go or wrap; ids and statuses are never cut."""
    client: LetheClient = service["client"]
    requests = list(client.iter_deletions())
    assert {"certified", "failed", "cancelled", "rejected"} <= {r.status for r in requests}

    code, screen = in_terminal(service, "list", "--limit", "500")
    assert code == 0, screen
    assert all(cell_len(line.rstrip()) <= 80 for line in screen.splitlines()), screen
    assert "…" not in screen  # nothing cut
    assert screen.splitlines()[1].split()[:4] == ["id", "model", "method", "status"], screen
    for request in requests:
        row = _row(screen, short_id(request.id))
        assert request.status in row and short_id(request.model_id) in row, (request.status, row)

    code, screen = in_terminal(service, "models")
    assert code == 0 and all(cell_len(line.rstrip()) <= 80 for line in screen.splitlines()), screen
    model = service["model"]
    row = _row(screen, short_id(model.id))
    assert model.name in row and "ready" in row, row

    code, screen = in_terminal(service, "keys", "list")
    assert code == 0 and all(cell_len(line.rstrip()) <= 80 for line in screen.splitlines()), screen
    rows = [line.split() for line in screen.splitlines() if SHORT_ID.match(line.split()[0] if line.split() else "")]
    assert len(rows) >= 4 and all({"active", "revoked"} & set(words) for words in rows), screen
    assert "cli-reader" in {words[3] for words in rows}  # names whole; the scopes wrap at their commas
    assert "requests:read" in screen.split() and "requests:read," in screen.split()

    certified = next(r for r in requests if r.status == "certified")
    code, screen = in_terminal(service, "report", short_id(certified.id))  # a short id is taken back
    tables = [line for line in screen.splitlines() if not line.startswith("plot ")]  # links are printed whole
    assert code == 0 and all(cell_len(line.rstrip()) <= 80 for line in tables), screen
    for check in client.reports(certified.id)[0].checks:
        assert any(line.split()[:1] == [check.name] for line in screen.splitlines()), (check.name, screen)


def test_piped_output_has_no_hard_wraps(service):
    """To a pipe, tables take their natural width (whole ids, whole dates) and no line is broken, however narrow
    COLUMNS says the terminal is."""
    client: LetheClient = service["client"]
    requests = list(client.iter_deletions())
    listing = piped(service, "list", "--limit", "500")
    assert listing.returncode == 0, listing.stderr
    lines = listing.stdout.splitlines()
    assert max(len(line) for line in lines) > 80
    for request in requests:
        (row,) = [line.split() for line in lines if line.startswith(request.id)]
        assert request.status in row and request.model_id in row

    submitted = piped(service, "submit", service["model"].id, "--subject", "piped", "--sample-id",
                      next(service["rows"]))  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr
    request_id = submitted.stdout.split()[1]
    assert f"follow it with `lethe status {request_id} --watch`" in submitted.stdout.splitlines()[0]
    client.wait(request_id, timeout=120)

    failed = next(r for r in requests if r.status == "failed" and r.error and len(r.error.get("detail", "")) > 60)
    shown = piped(service, "status", failed.id)
    assert shown.returncode == 1
    error = next(line for line in shown.stdout.splitlines() if line.strip().startswith("error"))
    assert failed.error["detail"] in error  # on one line

    models = piped(service, "models").stdout.splitlines()
    assert any(line.startswith(service["model"].id) for line in models)  # the whole id


def test_short_ids_are_taken_back_and_an_unknown_or_ambiguous_one_is_refused(service):
    client: LetheClient = service["client"]
    request = next(client.iter_deletions(status="certified"))
    shown = run(service, "status", short_id(request.id))
    assert shown.exit_code == 0 and request.id in shown.output
    assert run(service, "list", "--model", short_id(service["model"].id)).exit_code == 0
    missing = run(service, "status", "ffffffff")
    assert missing.exit_code == 3 and "no request id ends with" in missing.output
    pair = [SimpleNamespace(id="1-0000abcd"), SimpleNamespace(id="2-0000abcd"), SimpleNamespace(id="bcde")]
    with pytest.raises(typer.BadParameter):
        _resolve("abcd", "request", lambda: pair)
    assert _resolve("bcd", "request", lambda: pair) == "bcd"  # under 4 characters: taken as it is
    assert _resolve("2-0000abcd", "request", lambda: pair) == "2-0000abcd"
    assert _resolve("0000abcd", "request", lambda: pair[1:]) == "2-0000abcd"  # an id's end, as the tables show it


# ------------------------------------------------------------------------- watching through an API that restarts
# A scripted API on 127.0.0.1 (tests/unit/scripted_server.py) plays one request's life, and goes away when told.

RUNNING = {
    "id": "00000000-0000-4000-8000-00000000abcd", "model_id": "m", "subject_hash": "h", "scope": {},
    "method": "retrain", "status": "running", "progress": 0.5, "message": "unlearning",
    "created_at": "2026-01-01T00:00:00Z", "updated_at": "2026-01-01T00:00:00Z",
}  # fmt: skip
CERTIFIED = RUNNING | {"status": "certified", "progress": 1.0, "message": "certified"}


def test_a_watch_in_a_terminal_keeps_its_elapsed_time_ticking_between_changes(service):
    """The request stays at 50% for 2.5 s: the bar is redrawn meanwhile, its elapsed time counting (it used to be
    drawn only on a change, so the time froze)."""
    started: list[float] = []

    def answer(arrival, index):
        started.append(arrival.at)
        return json_answer(200, RUNNING if arrival.at - started[0] < 2.5 else CERTIFIED)

    with ScriptedServer(answer) as api:
        code, screen = in_terminal(service, "status", RUNNING["id"], "--watch", "--interval", "1",
                                   LETHE_URL=api.url)  # fmt: skip
    assert code == 0, screen
    frames = [line for line in screen.splitlines() if line.startswith("running") and "50%" in line]
    elapsed = {re.search(r"\d+:\d\d:\d\d", frame).group() for frame in frames}
    assert {"0:00:00", "0:00:01", "0:00:02"} <= elapsed, screen  # ticking while nothing changed
    assert all(cell_len(frame.rstrip()) <= 80 for frame in frames), frames
    assert screen.strip().splitlines()[-1] == "certified"


@pytest.mark.parametrize("retries", ["0", "1"])
def test_a_watch_rides_out_a_restart_of_the_api_and_says_it_is_reconnecting(service, retries):
    """The API stops (connections refused), comes back answering 503 with Retry-After, then answers: the watcher
    says `reconnecting…` once, goes on, and ends with the request's verdict (exit 0), not exit 5. With the client's
    own retries (LETHE_RETRIES=1) or without (0: the watch's own polling rides it out)."""
    first = ScriptedServer(lambda arrival, index: json_answer(200, RUNNING)).start()
    port = first.port
    again = iter([problem(503, "unavailable", **{"Retry-After": "1"})])
    second = ScriptedServer(lambda arrival, index: next(again, json_answer(200, CERTIFIED)), port=port)
    watcher = subprocess.Popen([sys.executable, "-m", "app.cli", "status", RUNNING["id"], "--watch", "--interval",
                                "0.2"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                               env=_environment(service, LETHE_URL=first.url, LETHE_RETRIES=retries))  # fmt: skip
    try:
        wait_for(lambda: len(first.arrivals) >= 2, timeout=30, what="the watcher's first polls")
        first.stop()  # the API goes away
        time.sleep(1.5)
        second.start()  # and comes back on the same port, unavailable at first
        output, _ = watcher.communicate(timeout=60)
    finally:
        watcher.kill()
        first.stop()
        second.stop()
    assert watcher.returncode == 0, output
    assert output.count("reconnecting…") == 1 and "reconnected after" in output, output
    assert "retry 1 of" not in output  # the client's own retries are the watch's reconnecting, not a line each
    assert second.arrivals[1].at - second.arrivals[0].at >= 0.95  # its Retry-After
    assert output.strip().splitlines()[-1] == "certified"


def test_exit_codes_for_a_timeout_an_answer_not_from_lethe_a_bad_url_and_throttling(service):
    forever = ScriptedServer(lambda arrival, index: json_answer(200, RUNNING))
    with forever as api:
        watched = run(service, "status", RUNNING["id"], "--watch", "--interval", "0.05", "--timeout", "0.3",
                      env={"LETHE_URL": api.url})  # fmt: skip
    assert watched.exit_code == 1 and "did not finish" in watched.output  # gave up watching: 1 (not a traceback)
    with ScriptedServer(lambda arrival, index: (200, {"content-type": "text/html"}, b"<html>a proxy</html>")) as api:
        odd = run(service, "status", RUNNING["id"], env={"LETHE_URL": api.url})
    assert odd.exit_code == 1 and "not Lethe's API" in odd.output
    assert run(service, "status", RUNNING["id"], env={"LETHE_URL": "http://127.0.0.1:abc"}).exit_code == 2
    for status in (429, 503):
        with ScriptedServer(lambda arrival, index, status=status: problem(status, "busy")) as api:
            busy = run(service, "list", env={"LETHE_URL": api.url, "LETHE_RETRIES": "1"})
        assert busy.exit_code == 5 and f"{status} busy" in busy.output and len(api.arrivals) == 2  # retried once
    assert run(service, "list", env={"LETHE_RETRIES": "-1"}).exit_code == 2


# ---------------------------------------------------------------------------------- the operator's other actions


def _approval(client: LetheClient, model_id: str, required: bool) -> None:
    from app.requests.intake import MODEL_TTL

    client.update_model(model_id, requires_approval=required)
    time.sleep(MODEL_TTL + 0.1)  # the intake's snapshot of the model is at most MODEL_TTL old


def test_model_settings_show_and_change_a_model(service):
    client: LetheClient = service["client"]
    model = service["model"]
    shown = run(service, "model-settings", short_id(model.id))
    assert shown.exit_code == 0 and "requires approval  no" in shown.output and model.id in shown.output
    assert run(service, "model-settings", model.id, "--batch-max-rows", "500").exit_code == 0
    batched = run(service, "model-settings", model.id, "--batch-max-requests", "7")
    assert batched.exit_code == 0 and "at most 7 requests, 500 rows" in batched.output
    assert client.get_model(model.id).batch == {"max_requests": 7, "max_rows": 500}  # the other bound kept
    tagged = run(service, "model-settings", model.id, "--tag", "prod", "--tag", "team:privacy", "--json")
    assert tagged.exit_code == 0 and json.loads(tagged.output)["tags"] == ["prod", "team:privacy"]
    listed = run(service, "models", "--tag", "team:privacy", "--json").output.splitlines()
    assert [json.loads(line)["id"] for line in listed] == [model.id]
    assert run(service, "model-settings", model.id, "--clear-tags").exit_code == 0
    assert client.get_model(model.id).tags == []
    assert run(service, "model-settings", model.id, "--tag", "x", "--clear-tags").exit_code == 2
    assert run(service, "model-settings", model.id, "--batch-max-rows", "0").exit_code == 2
    assert run(service, "model-settings", model.id, "--tag", "Not A Tag").exit_code == 1  # 422
    assert run(service, "model-settings", model.id, key=service["reader"]).exit_code == 0  # reading is allowed
    assert run(service, "model-settings", model.id, "--requires-approval", key=service["reader"]).exit_code == 4
    assert run(service, "model-settings", "00000000-0000-0000-0000-000000000000").exit_code == 3
    assert run(service, "model-settings", "ffffffff").exit_code == 3  # no model id ends with it
    restored = run(service, "model-settings", model.id, "--batch-max-requests", "2000", "--batch-max-rows", "20000")
    assert restored.exit_code == 0 and client.get_model(model.id).batch == {"max_requests": 2000, "max_rows": 20_000}


def test_bulk_actions_and_their_exit_codes(service):
    client: LetheClient = service["client"]
    model_id = service["model"].id
    _approval(client, model_id, True)
    try:
        first, second = (
            client.submit_deletion(model_id, {"kind": "samples", "sample_ids": [next(service["rows"])]}, s)
            for s in ("bulk-a", "bulk-b")
        )
        unknown = "00000000-0000-0000-0000-000000000000"
        partly = run(service, "bulk", "reject", short_id(first.id), unknown, "--reason", "not a customer of ours")
        assert partly.exit_code == 1, partly.output  # one skipped
        assert "1 done, 1 skipped of 2 selected" in partly.output and "request-not-found" in partly.output
        assert client.get_deletion(first.id).status == "rejected"
        extended = run(service, "bulk", "extend", "--status", "pending-approval", "--model", short_id(model_id),
                       "--months", "1", "--reason", "three systems to search", "--json")  # fmt: skip
        assert extended.exit_code == 0, extended.output
        outcome = json.loads(extended.output)
        assert (outcome["selected"], outcome["done"]) == (1, 1) and outcome["results"][0]["id"] == second.id
        assert run(service, "bulk", "cancel", "--status", "pending-approval", "--model", model_id).exit_code == 0
        assert client.get_deletion(second.id).status == "cancelled"
        empty = run(service, "bulk", "cancel", "--status", "pending-approval", "--model", model_id)
        assert empty.exit_code == 1 and "bulk-selection-empty" in empty.output  # refused as a whole
        usages = (["cancel"], ["reject", first.id], ["extend", "--all", "--months", "1"], ["explode", first.id],
                  ["cancel", first.id, "--status", "failed"], ["cancel", "--created-after", "2026-01-01"])  # fmt: skip
        for usage in usages:
            assert run(service, "bulk", *usage).exit_code == 2, usage
        assert run(service, "bulk", "cancel", first.id, key=service["reader"]).exit_code == 4
        closed = {"LETHE_URL": f"http://127.0.0.1:{_free_port()}", "LETHE_RETRIES": "0"}
        assert run(service, "bulk", "cancel", first.id, env=closed).exit_code == 5
    finally:
        _approval(client, model_id, False)


def test_a_person_is_erased_followed_and_certified_from_the_cli(service, tmp_path):
    client: LetheClient = service["client"]
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps(client.signing_keys()))
    certificate = tmp_path / "combined.json"
    erased = run(service, "subjects", "erase", CAROL, "--method", "retrain", "--wait", "--interval", "0.1",
                 "--certificate", str(certificate))  # fmt: skip
    assert erased.exit_code == 0, erased.output
    erasure_id = erased.output.split()[2]
    assert f"lethe subjects status {erasure_id} --watch" in erased.output
    erasure = client.get_erasure(erasure_id)
    assert erasure.status == "certified" and f"erasure {erasure_id}  certified" in erased.output
    assert run(service, "verify-certificate", str(certificate), "--keys", str(keys)).exit_code == 0

    assert run(service, "subjects", "status", erasure_id).exit_code == 0
    assert json.loads(run(service, "subjects", "status", erasure_id, "--json").output)["status"] == "certified"
    printed = run(service, "subjects", "certificate", erasure_id)
    assert printed.exit_code == 0 and json.loads(printed.output) == json.loads(certificate.read_text())
    found = run(service, "subjects", "requests", erasure.subject_hash)
    assert found.exit_code == 0 and erasure.children[0].request_id in found.output and erasure_id in found.output
    by_ref = run(service, "subjects", "requests", "--ref", CAROL, "--json")  # the server hashes the reference
    assert by_ref.exit_code == 0 and json.loads(by_ref.output)["subject_hash"] == erasure.subject_hash

    nothing = run(service, "subjects", "erase", CAROL)  # nothing left of hers: answered, certified, says so
    assert nothing.exit_code == 0 and "no data found" in nothing.output, nothing.output
    assert run(service, "subjects", "status", "00000000-0000-0000-0000-000000000000").exit_code == 3
    assert run(service, "subjects", "certificate", "00000000-0000-0000-0000-000000000000").exit_code == 3
    assert run(service, "subjects", "erase", DAVE, "--certificate", str(certificate)).exit_code == 2  # needs --wait
    assert run(service, "subjects", "erase", DAVE, key=service["reader"]).exit_code == 4
    closed = {"LETHE_URL": f"http://127.0.0.1:{_free_port()}", "LETHE_RETRIES": "0"}
    assert run(service, "subjects", "status", erasure_id, env=closed).exit_code == 5

    model_id = service["model"].id
    _approval(client, model_id, True)
    try:  # an erasure whose request waits for approval: no certificate yet (1), in progress (0), then failed (1)
        waiting = run(service, "subjects", "erase", DAVE, "--json")
        assert waiting.exit_code == 0, waiting.output
        pending = json.loads(waiting.output)
        assert run(service, "subjects", "certificate", pending["id"]).exit_code == 1
        assert run(service, "subjects", "status", pending["id"]).exit_code == 0
        child = pending["children"][0]["request_id"]
        assert run(service, "reject", child, "--reason", "not the person they claim").exit_code == 0
        ended = run(service, "subjects", "status", pending["id"])
        assert ended.exit_code == 1 and "failed" in ended.output and "rejected" in ended.output
    finally:
        _approval(client, model_id, False)


def _rows_csv(path: Path, n: int = 12, **cells) -> Path:
    """The first ``n`` rows of the service's table as a CSV, with its row id, label and subject columns (which
    `lethe predict` leaves out); ``cells``: ``{"x0": (row, value)}`` overrides one cell."""
    frame = write_table(path, n=200, seed=5).head(n)
    frame["person"] = "someone"
    for column, (row, value) in cells.items():
        frame[column] = frame[column].astype(object)
        frame.loc[row, column] = value
    frame.to_csv(path, index=False)
    return path


def test_model_export_writes_the_card_and_predict_answers_as_the_exported_model(service, tmp_path, monkeypatch):
    from app.ml.export import load
    from app.registry import service as registry_service

    client: LetheClient = service["client"]
    model = client.get_model(service["model"].id)
    current = model.current_version
    out = tmp_path / "model.safetensors"
    written = run(service, "model-export", short_id(model.id), "-o", str(out))
    assert written.exit_code == 0, written.output
    predictor = load(out)  # the exported file's card, read back (theta checked against it)
    card = predictor.card
    assert card["model"]["id"] == model.id and card["version"]["number"] == current.number
    lines = written.output.splitlines()
    assert lines[0] == f"wrote {out}: the model card of {model.name} v{current.number}"
    # "v7  <id>, child of v6" once deletions made the current version (other tests of this module do)
    assert any(line.startswith(f"  version   v{current.number}  {current.id}") for line in lines), lines
    assert f"  digest    {current.digest}" in lines
    assert "  classes   " + ", ".join(card["encoder"]["classes"]) in lines
    assert any(line.startswith("  accuracy  held out 0.") for line in lines)
    assert json.loads(run(service, "model-export", model.id, "-o", str(out), "--json").output) == card
    assert run(service, "model-export", model.id, "-o", str(out), "--version", "999").exit_code == 3
    assert run(service, "model-export", "00000000-0000-0000-0000-000000000000", "-o", str(out)).exit_code == 3
    assert run(service, "model-export", model.id, "-o", str(tmp_path)).exit_code == 2  # a folder
    assert run(service, "model-export", model.id, "-o", str(out), key=service["reader"]).exit_code == 4

    rows = _rows_csv(tmp_path / "rows.csv")
    frame = write_table(tmp_path / "same.csv", n=200, seed=5).head(12)[predictor.feature_columns]
    expected = predictor.predict(frame.to_dict("records"))
    answered = run(service, "predict", short_id(model.id), "--csv", str(rows), "--id-column", "row_id")
    assert answered.exit_code == 0, answered.output
    assert "left out (not the model's inputs): row_id, label, person" in answered.output
    table = {line.split()[0]: line.split() for line in answered.output.splitlines() if line.startswith("r")}
    assert [table[f"r{i}"][1] for i in range(12)] == expected  # each row's label, as the exported model says
    monkeypatch.setattr(registry_service, "MAX_PREDICT_ROWS", 5)  # the API takes 5 a call: sent in parts
    as_json = run(service, "predict", model.id, "--csv", str(rows), "--json")
    monkeypatch.undo()
    objects = [json.loads(line) for line in as_json.output.splitlines() if line.startswith("{")]
    assert (
        as_json.exit_code == 0
        and [o["label"] for o in objects] == expected
        and [o["row"] for o in objects] == list(range(1, 13))
    )
    probabilities = predictor.predict_proba(frame.to_dict("records"))
    for entry, expected_row in zip(objects, probabilities, strict=True):
        assert entry["version"] == current.number
        assert [entry["probabilities"][c] for c in predictor.classes] == pytest.approx(list(expected_row), abs=1e-12)

    code, screen = in_terminal(service, "predict", short_id(model.id), "--csv", str(rows), "--id-column", "row_id")
    assert code == 0 and all(cell_len(line.rstrip()) <= 80 for line in screen.splitlines()), screen
    assert [_row(screen, f"r{i}")[1] for i in range(12)] == expected

    not_a_number = _rows_csv(tmp_path / "bad.csv", x0=(2, "abc"))
    refused = run(service, "predict", model.id, "--csv", str(not_a_number))
    assert refused.exit_code == 1 and "row 3: x0 is 'abc', not a number" in refused.output
    missing = tmp_path / "missing.csv"
    pd.read_csv(rows).drop(columns=["x1"]).to_csv(missing, index=False)
    short = run(service, "predict", model.id, "--csv", str(missing))
    assert short.exit_code == 1 and "invalid-rows" in short.output and "x1" in short.output  # the API's 422
    (tmp_path / "empty.csv").write_text("x0,x1\n")
    assert run(service, "predict", model.id, "--csv", str(tmp_path / "empty.csv")).exit_code == 2
    assert run(service, "predict", model.id, "--csv", str(tmp_path / "nowhere.csv")).exit_code == 2
    assert run(service, "predict", model.id, "--csv", str(rows), "--id-column", "nope").exit_code == 2
    assert run(service, "predict", model.id, "--csv", str(rows), "--version", "999").exit_code == 3
    assert _few([{"row": i} for i in range(8)]) == [
        {"row": 0},
        {"row": 1},
        {"row": 2},
        {"row": 3},
        {"row": 4},
        "... 3 more",
    ]  # a problem's 100 row errors, shown in short


def test_the_readme_cli_section_names_real_commands_and_every_exit_code():
    """The README's CLI examples run commands `lethe` has, with options it takes; its exit-code table lists 0 to 5."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("## The CLI and the Python client", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash", 1)[1].split("```", 1)[0]
    groups = {"keys", "signing-keys", "subjects"}
    seen = set()
    for statement in re.findall(r"lethe ([a-z][^;#|&$)\n]*)", block):
        words = statement.split()
        command = words[:2] if words[0] in groups else words[:1]
        options = [w.split("=")[0] for w in words if w.startswith("--")]
        result = CliRunner().invoke(cli, [*command, "--help"], env={"COLUMNS": "200"})
        assert result.exit_code == 0, (command, result.output)
        for option in options:
            assert option in result.output, (command, option)
        seen.add(" ".join(command))
    assert {"bulk", "model-settings", "model-export", "predict", "subjects erase", "subjects status",
            "subjects certificate", "subjects requests", "approve", "reject"} <= seen  # fmt: skip
    table = dict(re.findall(r"^\| (\d) \| (.+) \|$", section, flags=re.MULTILINE))
    assert sorted(table) == ["0", "1", "2", "3", "4", "5"], table
    assert "503" in table["5"] and "401" in table["4"] and "404" in table["3"] and "usage" in table["2"]

"""The `lethe` CLI against a real embedded service (uvicorn on a loopback port, SQLite, in-process executor): every
command's exit code (0 done, 1 failed, 2 usage, 3 not found, 4 unauthorised, 5 unreachable), `status --watch`
drawing a progress bar on a running request and ending with the verdict, the tables, and the exports."""

from __future__ import annotations

import csv
import io
import json
import re
import socket
import threading

import pytest
import uvicorn
from typer.testing import CliRunner

from app.cli import app as cli
from app.client import LetheClient
from app.jobs.tabular import holdout_mask
from app.main import create_app
from app.ml.unlearning import base
from app.ml.unlearning.retrain import ExactRetrain, RetrainConfig
from tests.helpers import configure, make_key, wait_for, write_table

SCOPES = ["models:write", "models:read", "requests:write", "requests:read", "audit:read", "admin"]
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
    write_table(source, n=200, seed=5)
    metadata = {
        "name": "cli-table",
        "verification": {"shadows": 8},
        "dataset": {"row_id_column": "row_id", "label_column": "label"},
    }
    client = LetheClient(url, key)
    model = client.register_model(metadata, source)
    model = client.wait_model(model.id, timeout=120)
    assert model.status == "ready", model
    trained = [f"r{i}" for i, held in enumerate(holdout_mask(200, 0.2, seed=0)) if not held]
    try:
        yield {"url": url, "key": key, "reader": reader, "model": model, "client": client, "rows": iter(trained)}
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
    unreachable = run(service, "status", unknown, env={"LETHE_URL": f"http://127.0.0.1:{closed}"})
    assert unreachable.exit_code == 5 and f"127.0.0.1:{closed}" in unreachable.output
    assert run(service, "--url", "127.0.0.1:8000", "status", unknown).exit_code == 2  # no scheme: a usage error
    no_key = run(service, "status", unknown, env={"LETHE_API_KEY": ""})
    assert no_key.exit_code == 2 and "LETHE_API_KEY" in no_key.output
    assert run(service, "submit", model_id, "--subject", "x").exit_code == 2  # no scope given
    assert run(service, "status").exit_code == 2  # missing argument
    assert run(service, "no-such-command").exit_code == 2
    assert run(service, "submit", unknown, "--subject", "x", "--sample-id", "r1").exit_code == 3  # model-not-found
    typo = run(service, "submit", model_id, "--subject", "x", "--sample-id", "r9999")
    assert typo.exit_code == 1 and "unknown-sample-ids" in typo.output
    unreachable = run(service, "status", unknown, env={"LETHE_URL": f"http://127.0.0.1:{_free_port()}"})
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

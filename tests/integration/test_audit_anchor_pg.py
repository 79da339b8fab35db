"""Issue 22 on PostgreSQL: the service runs as a runtime role that is not the tables' owner (`lethe migrate` with
LETHE_MIGRATION_DATABASE_URL grants it), so the database itself refuses UPDATE, DELETE and TRUNCATE on the audit log
and its checkpoints; the service still certifies a deletion, whose certificate anchors the log; and what only the
owner can do (rewrite the chain with the triggers disabled and delete the checkpoints) no longer verifies, and the
certificate's anchor shows it."""

from __future__ import annotations

import base64
import json
import uuid

import psycopg
import pytest
from fastapi.testclient import TestClient
from sqlalchemy.engine import make_url
from typer.testing import CliRunner

from app.certificates.verify_cli import verify_file
from app.cli import app as cli
from app.db import migrate, reset_engine_cache
from app.main import create_app
from tests.audit_rewrite import rewritten_rows
from tests.helpers import configure, make_key, wait_for, wait_model, write_table
from tests.stack import PG_ADMIN, fresh_database

EVERY = 3


@pytest.fixture
def runtime(tmp_path):
    """A fresh database owned by the admin role, and the name of a runtime role (dropped afterwards)."""
    role = f"lethe_rt_{uuid.uuid4().hex[:8]}"
    with fresh_database("lethe_anchor") as owner_url:
        yield owner_url, role
        reset_engine_cache()  # close the runtime role's connections before the database goes
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'DROP ROLE IF EXISTS "{role}"')


def _libpq(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


def test_the_runtime_role_cannot_rewrite_the_log_and_the_certificate_anchors_it(runtime, tmp_path):
    owner_url, role = runtime
    runtime_url = make_url(owner_url).set(username=role, password=None).render_as_string(hide_password=False)
    configure(tmp_path, database_url=runtime_url, migration_database_url=owner_url, audit_checkpoint_every=str(EVERY))
    result = CliRunner().invoke(cli, ["migrate"])
    assert result.exit_code == 0 and f"runtime role {role}" in result.output, result.output
    migrate(runtime_url)  # what `lethe serve` does on start, as the runtime role: a no-op at the newest revision

    with psycopg.connect(_libpq(runtime_url), autocommit=True) as conn:
        assert conn.execute("SELECT current_user").fetchone()[0] == role
        for statement in (
            "UPDATE audit_events SET actor = 'mallory'",
            "DELETE FROM audit_events",
            "TRUNCATE audit_events",
            "UPDATE audit_checkpoints SET hash = 'x'",
            "DELETE FROM audit_checkpoints",
            "TRUNCATE audit_checkpoints",
        ):
            with pytest.raises(psycopg.errors.InsufficientPrivilege, match="permission denied"):
                conn.execute(statement)  # refused by the grants, before any trigger runs
        with pytest.raises(psycopg.errors.InsufficientPrivilege, match="must be owner"):
            conn.execute("ALTER TABLE audit_events DISABLE TRIGGER USER")

    key = make_key()
    with TestClient(create_app(run_background=True)) as client:
        client.headers["authorization"] = f"Bearer {key}"
        table = tmp_path / "data" / "t.csv"
        write_table(table, n=150)
        metadata = {"name": "anchor", "dataset": {"row_id_column": "row_id", "label_column": "label"}}
        with table.open("rb") as handle:
            response = client.post(
                "/v1/models", data={"metadata": json.dumps(metadata)}, files={"file": ("t.csv", handle, "text/csv")}
            )
        assert response.status_code == 202, response.text
        assert wait_model(client, response.json()["id"], timeout=120)["status"] == "ready"
        body = {
            "subject_ref": "s",
            "model_id": response.json()["id"],
            "scope": {"kind": "samples", "sample_ids": ["r1"]},
        }
        location = client.post("/v1/deletion-requests", json=body).headers["location"]
        done = wait_for(
            lambda: (b := client.get(location).json())["status"] in ("certified", "failed") and b, timeout=120
        )
        assert done["status"] == "certified", done
        envelope = client.get(done["links"]["certificate"]).json()
        anchor = json.loads(base64.b64decode(envelope["payload"]))["predicate"]["audit_anchor"]
        assert anchor["seq"] >= EVERY and anchor["seq"] % EVERY == 0 and anchor["every"] == EVERY, anchor
        assert client.get("/v1/audit/verify").json()["ok"] is True

        files = {name: tmp_path / f"{name}.json" for name in ("cert", "keys", "log")}
        files["cert"].write_text(json.dumps(envelope))
        files["keys"].write_text(json.dumps(client.get("/.well-known/lethe-keys.json").json()))
        files["log"].write_text(json.dumps(client.get("/v1/audit", params={"limit": 1000}).json()))
        ok, message = verify_file(files["cert"], str(files["keys"]), files["log"])
        assert ok, message

        # only the owner can do this: triggers off, events 2..anchor rewritten and re-linked, checkpoints gone
        with psycopg.connect(_libpq(owner_url), autocommit=True) as conn:
            rows = conn.execute("SELECT seq, hash, canonical FROM audit_events ORDER BY seq").fetchall()
            conn.execute("ALTER TABLE audit_events DISABLE TRIGGER USER")
            conn.execute("ALTER TABLE audit_checkpoints DISABLE TRIGGER USER")
            for seq, prev_hash, hash_, canonical, payload in rewritten_rows(rows, 2, anchor["seq"]):
                conn.execute(
                    "UPDATE audit_events SET prev_hash = %s, hash = %s, canonical = %s, payload = %s::jsonb "
                    "WHERE seq = %s",
                    (prev_hash, hash_, canonical, payload, seq),
                )
            conn.execute("DELETE FROM audit_checkpoints")
            conn.execute("ALTER TABLE audit_events ENABLE TRIGGER USER")
            conn.execute("ALTER TABLE audit_checkpoints ENABLE TRIGGER USER")
        verdict = client.get("/v1/audit/verify").json()
        assert verdict["ok"] is False and verdict["code"] == "checkpoint-missing", verdict
        assert verdict["first_broken_seq"] == EVERY, verdict
        files["log"].write_text(json.dumps(client.get("/v1/audit", params={"limit": 1000}).json()))
        ok, message = verify_file(files["cert"], str(files["keys"]), files["log"])
        assert not ok and message.startswith("INVALID (anchor-mismatch)"), message


def test_the_log_is_verified_in_one_snapshot_while_it_grows(tmp_path, monkeypatch):
    """verify_chain reads the checkpoints, then the rows: events (with their checkpoints) committed between the two
    reads must not make the log look broken. Red when each read takes its own snapshot: the rows then reach past
    checkpoints the verifier never saw ("checkpoint-missing")."""
    from app.audit import service as audit
    from app.db import session_scope

    with fresh_database("lethe_snapshot") as url:
        configure(tmp_path, database_url=url, audit_checkpoint_every=str(EVERY))
        try:
            with session_scope() as session:
                for i in range(EVERY + 1):
                    audit.append_event(session, actor="t", action="a", entity_type="e", entity_id=f"before-{i}")
            checkpoint_problem = audit._checkpoint_problem

            def then_more_events(*args):  # runs after the checkpoints were read, before the rows are
                with session_scope() as other:
                    for i in range(2 * EVERY):
                        audit.append_event(other, actor="t", action="a", entity_type="e", entity_id=f"during-{i}")
                return checkpoint_problem(*args)

            monkeypatch.setattr(audit, "_checkpoint_problem", then_more_events)
            with session_scope() as session:
                verdict = audit.verify_chain(session)
            assert verdict.ok, verdict
            assert verdict.checked == EVERY + 1  # the snapshot of the first read: none of the later events
            monkeypatch.setattr(audit, "_checkpoint_problem", checkpoint_problem)
            with session_scope() as session:
                assert audit.verify_chain(session).checked == 3 * EVERY + 1
        finally:
            reset_engine_cache()

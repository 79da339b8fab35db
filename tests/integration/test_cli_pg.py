"""The `lethe` CLI against the production shape: the API and a Celery worker as processes on PostgreSQL and Redis.
A deletion submitted and followed by the CLI ends certified (exit 0); the list, the report and the exports read it
back; a bad key is exit 3."""

from __future__ import annotations

import csv
import io
import json

from typer.testing import CliRunner

from app.cli import app as cli
from app.client import LetheClient
from app.jobs.tabular import holdout_mask
from tests.helpers import write_table


def test_cli_on_postgresql_and_celery(stack, tmp_path):
    client = LetheClient(stack.base_url, stack.key)
    source = tmp_path / "t.csv"
    write_table(source, n=200, seed=11)
    metadata = {"name": "cli-pg", "verification": {"shadows": 8},
                "dataset": {"row_id_column": "row_id", "label_column": "label"}}  # fmt: skip
    model = client.wait_model(client.register_model(metadata, source).id, timeout=300)
    assert model.status == "ready", model
    row = next(f"r{i}" for i, held in enumerate(holdout_mask(200, 0.2, seed=0)) if not held)

    def run(*args, key=stack.key):
        env = {"LETHE_URL": stack.base_url, "LETHE_API_KEY": key, "COLUMNS": "160"}
        return CliRunner().invoke(cli, list(args), env=env, catch_exceptions=False)

    submitted = run("submit", model.id, "--subject", "pg-subject", "--sample-id", row, "--wait")
    assert submitted.exit_code == 0, submitted.output
    request_id = submitted.output.split()[1]
    assert submitted.output.strip().splitlines()[-1] == "certified"
    assert run("status", request_id).exit_code == 0
    assert request_id in run("list", "--model", model.id).output
    assert run("report", request_id).exit_code == 0
    rows = list(csv.DictReader(io.StringIO(run("export", "requests", "--model", model.id).output)))
    assert [r["id"] for r in rows] == [request_id] and rows[0]["status"] == "certified"
    events = json.loads(run("export", "audit", "-f", "json", "--entity", request_id).output)
    assert events[0]["action"] == "deletion_request.received" and events[-1]["action"] == "deletion_request.certified"
    listed = [json.loads(line)["id"] for line in run("models", "--name", "cli-pg", "--json").output.splitlines()]
    assert listed == [model.id]
    assert run("status", request_id, key="lethe_nothere_0000").exit_code == 4  # 401: unauthorised
    assert run("status", "00000000-0000-0000-0000-000000000000").exit_code == 3

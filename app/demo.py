"""`make demo`: the whole service on the embedded default (SQLite file + in-process worker), driven over HTTP.

It uses real data that ships with scikit-learn (the Wisconsin breast-cancer table, 569 rows), registers a model,
deletes a data subject's rows, and prints the request's journey and the accuracy of the old and new versions.
"""

from __future__ import annotations

import os
import shutil
import socket
import threading
import time
from pathlib import Path

import httpx

HOME = Path("var/demo")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _write_dataset(path: Path) -> int:
    from sklearn.datasets import load_breast_cancer

    frame = load_breast_cancer(as_frame=True).frame
    frame.insert(0, "patient_id", [f"P{i:04d}" for i in range(len(frame))])
    frame["target"] = frame["target"].map({0: "malignant", 1: "benign"})
    frame.to_csv(path, index=False)
    return len(frame)


def _wait(client: httpx.Client, url: str, done, label: str, timeout: float = 600) -> dict:
    started, last = time.monotonic(), None
    while True:
        body = client.get(url).json()
        line = f"  {label}: {body['status']}" + (
            f"  {body.get('progress', 0):.0%} {body.get('message') or ''}" if "progress" in body else ""
        )
        if line != last:
            print(line, flush=True)
            last = line
        if done(body):
            return body
        if time.monotonic() - started > timeout:
            raise TimeoutError(f"{label} did not finish in {timeout} s")
        time.sleep(0.25)


def run_demo(keep: bool = False) -> None:
    if HOME.exists() and not keep:
        shutil.rmtree(HOME)
    HOME.mkdir(parents=True, exist_ok=True)
    os.environ.update({"LETHE_HOME": str(HOME), "LETHE_POLL_SECONDS": "0.2"})
    os.environ.pop("LETHE_DATABASE_URL", None)
    os.environ.pop("LETHE_BROKER_URL", None)

    import uvicorn

    from app.auth.service import create_key
    from app.config import get_settings
    from app.db import migrate, reset_engine_cache, session_scope

    get_settings.cache_clear()
    reset_engine_cache()
    settings = get_settings()
    print(f"Lethe demo — embedded default: {settings.resolved_database_url}, in-process executor\n")
    migrate()
    with session_scope() as session:
        _, key = create_key(session, "demo", ["admin"])

    from app.main import create_app

    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        with httpx.Client(
            base_url=f"http://127.0.0.1:{port}", headers={"authorization": f"Bearer {key}"}, timeout=60
        ) as client:
            _tabular_story(client)
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def _tabular_story(client: httpx.Client) -> None:
    data_path = HOME / "breast_cancer.csv"
    n_rows = _write_dataset(data_path)
    print(f"1. Register a logistic-regression model on {n_rows} rows (scikit-learn's breast-cancer table)")
    metadata = {
        "name": "breast-cancer-lr",
        "family": "logistic_regression",
        "dataset": {"row_id_column": "patient_id", "label_column": "target"},
    }
    with data_path.open("rb") as handle:
        response = client.post(
            "/v1/models",
            data={"metadata": __import__("json").dumps(metadata)},
            files={"file": ("breast_cancer.csv", handle, "text/csv")},
        )
    response.raise_for_status()
    model = response.json()
    model = _wait(client, f"/v1/models/{model['id']}", lambda b: b["status"] in ("ready", "failed"), "model")
    v1 = model["current_version"]
    print(
        f"   version 1 {v1['digest'][:12]}…  train acc {v1['metrics']['accuracy_train']:.3f}  "
        f"holdout acc {v1['metrics']['accuracy_holdout']:.3f}\n"
    )

    subject = ["P0003", "P0010", "P0042", "P0100", "P0321"]
    print(f"2. A data subject asks to be forgotten: rows {subject}")
    bad = client.post(
        "/v1/deletion-requests",
        json={
            "subject_ref": "alice@example.org",
            "model_id": model["id"],
            "scope": {"kind": "samples", "sample_ids": ["P9999"]},
        },
    )
    print(
        f"   (a typo first: {bad.status_code} {bad.json()['type'].rsplit('/', 1)[-1]} "
        f"{bad.json().get('unknown_sample_ids')})"
    )
    response = client.post(
        "/v1/deletion-requests",
        headers={"Idempotency-Key": "demo-request-1"},
        json={
            "subject_ref": "alice@example.org",
            "model_id": model["id"],
            "method": "retrain",
            "scope": {"kind": "samples", "sample_ids": subject},
        },
    )
    print(f"   POST /v1/deletion-requests → {response.status_code}, Location {response.headers['location']}")
    request = _wait(
        client, response.headers["location"], lambda b: b["status"] in ("completed", "failed", "rejected"), "request"
    )
    if request["status"] != "completed":
        raise SystemExit(f"the deletion did not complete: {request['error']}")

    versions = client.get(f"/v1/models/{model['id']}/versions").json()
    new = versions[-1]
    before, after = new["metrics"]["before"], new["metrics"]["after"]
    print("\n3. The request's journey (audit log):")
    events = client.get("/v1/audit", params={"entity_id": request["id"]}).json()["items"]
    for event in events:
        print(f"   #{event['seq']:<3} {event['at'][11:23]}  {event['action']:<28} by {event['actor']}")
    print(
        f"   received {request['created_at'][11:23]} → started {request['started_at'][11:23]} → "
        f"completed {request['completed_at'][11:23]}  (attempts: {request['attempts']})"
    )
    print("\n4. Old and new version:")
    print(f"   {'':<12}{'version':>8}{'retain acc':>12}{'forget acc':>12}{'holdout acc':>13}")
    for label, number, m in (("original", versions[-2]["number"], before), ("retrained", new["number"], after)):
        print(
            f"   {label:<12}{number:>8}{m['accuracy_retain']:>12.4f}{m['accuracy_forget']:>12.4f}"
            f"{m['accuracy_holdout']:>13.4f}"
        )
    print(
        f"   lineage: v{versions[-2]['number']} {versions[-2]['digest'][:12]}… → v{new['number']} "
        f"{new['digest'][:12]}… ({new['method']}, {new['metrics']['unlearn_seconds']:.3f} s)"
    )
    verdict = client.get("/v1/audit/verify").json()
    print(
        f"\n5. Audit chain: {'intact' if verdict['ok'] else 'BROKEN at ' + str(verdict['first_broken_seq'])}, "
        f"{verdict['checked']} events, head {verdict['head']['hash'][:16]}…"
    )

"""Least privilege, secrets and bad input (issue 8), on the embedded default (SQLite), through HTTP where it can.

Each test names the item it covers. PostgreSQL-only behaviour (JSONB numbers, NUL bytes reaching the database, the
column lengths SQLite does not enforce) is in tests/integration/test_security_pg.py.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import io
import json
import multiprocessing
import os
import stat
import struct
import threading
import time
from datetime import timedelta
from pathlib import Path

import pandas as pd
import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from app.config import Settings, get_settings
from app.db import session_scope
from app.main import create_app
from tests.helpers import TEST_SECRET, configure, make_key, wait_model, write_table

PROBLEMS = "https://lethe.dev/problems/"


def _problem(response, status: int, slug: str) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    body = response.json()
    assert body["type"] == PROBLEMS + slug, body
    return body


@pytest.fixture
def api(tmp_path):
    """The API without the background executor: validation only, nothing trains."""
    configure(tmp_path)
    key = make_key()
    with TestClient(create_app(run_background=False)) as client:
        client.headers["authorization"] = f"Bearer {key}"
        yield client


@pytest.fixture
def live(tmp_path):
    """The API with the in-process executor, and one trained tabular model."""
    configure(tmp_path, poll_seconds="0.05")
    key = make_key()
    with TestClient(create_app(run_background=True)) as client:
        client.headers["authorization"] = f"Bearer {key}"
        path = tmp_path / "table.csv"
        write_table(path, n=200)
        response = _upload(client, path)
        assert response.status_code == 202, response.text
        model_id = response.json()["id"]
        model = wait_model(
            client,
            model_id,
            timeout=60,
            what="training",
        )
        assert model["status"] == "ready", model
        client.model = model
        yield client


def _upload(client, path: Path, name: str | None = None, **metadata):
    meta = {"name": "m", "dataset": {"row_id_column": "row_id", "label_column": "label"}, **metadata}
    return client.post(
        "/v1/models",
        data={"metadata": json.dumps(meta)},
        files={"file": (name or path.name, path.read_bytes(), "application/octet-stream")},
    )


def _fake_federated_model(**state) -> str:
    """A ready clip_federated model row (no training): enough for the round-upload checks."""
    from app.registry.tables import Model

    with session_scope() as session:
        model = Model(
            name="fed",
            kind="clip_federated",
            status="ready",
            spec={},
            state={"clients": ["c0", "c1", "c2"], "n_params": 4, "removed": [], **state},
        )
        session.add(model)
        session.flush()
        return model.id


def _safetensors(header: object, payload: bytes = b"") -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + payload


# ---------------------------------------------------------------- item 8: data roots, no file content in problems


def test_item8_no_data_roots_by_default_so_paths_are_refused(tmp_path, monkeypatch):
    configure(tmp_path)
    monkeypatch.delenv("LETHE_DATA_ROOTS")
    get_settings.cache_clear()
    assert get_settings().data_roots == []
    key = make_key()
    table = tmp_path / "t.csv"
    write_table(table, n=20)
    monkeypatch.chdir(tmp_path)  # the old default root was the working directory
    with TestClient(create_app(run_background=False)) as client:
        response = client.post(
            "/v1/models",
            headers={"authorization": f"Bearer {key}"},
            json={"name": "x", "dataset": {"path": str(table), "row_id_column": "row_id", "label_column": "label"}},
        )
    _problem(response, 422, "dataset-path-not-allowed")


@pytest.mark.parametrize("what", ["home", "artifacts", "env", "inside-home", "inside-artifacts"])
def test_item8_a_data_root_holding_the_services_files_is_refused_at_start(tmp_path, what):
    root = tmp_path / "root"
    root.mkdir()
    kwargs = {"home": tmp_path / "elsewhere", "secret_key": TEST_SECRET, "data_roots": [root]}
    if what == "home":
        kwargs["home"] = root / "var"
    elif what == "artifacts":
        kwargs["artifact_url"] = f"file://{root / 'store'}"
    elif what == "inside-home":  # e.g. the home's signing-key folder: a registration could read the private key
        kwargs["home"], kwargs["data_roots"] = root, [root / "keys"]
    elif what == "inside-artifacts":
        kwargs["artifact_url"], kwargs["data_roots"] = f"file://{root}", [root / "ab"]
    else:
        (root / ".env").write_text("LETHE_SECRET_KEY=x\n")
    with pytest.raises(ValidationError, match="LETHE_DATA_ROOTS") as info:
        Settings(_env_file=None, **kwargs)
    expected = {"home": "contains the service's home", "artifacts": "contains the artifact store", "env": ".env"}
    expected |= {"inside-home": "inside the service's home", "inside-artifacts": "inside the artifact store"}
    assert expected[what] in str(info.value)


def test_item8_a_data_root_is_judged_by_where_it_leads(tmp_path):
    """Roots and paths are compared resolved: ``home/data`` linked to a folder beside the home is that folder (the
    tests' own layout, tests/helpers.py) and is accepted; a link in it that leads back into the home is refused."""
    home = tmp_path / "home"
    configure(home)
    assert get_settings().data_roots == [(tmp_path / "home.data").resolve()]
    key = make_key()
    table = home / "data" / "t.csv"  # through the link
    write_table(table, n=40)
    (home / "private.csv").write_text((home / "data" / "t.csv").read_text())  # a file of the home's own
    (home / "data" / "back.csv").symlink_to(home / "private.csv")
    with TestClient(create_app(run_background=False)) as client:
        client.headers["authorization"] = f"Bearer {key}"
        spec = {"row_id_column": "row_id", "label_column": "label"}
        fine = client.post("/v1/models", json={"name": "x", "dataset": {"path": str(table), **spec}})
        assert fine.status_code == 202, fine.text
        link = str(home / "data" / "back.csv")
        back = client.post("/v1/models", json={"name": "y", "dataset": {"path": link, **spec}})
        _problem(back, 422, "dataset-path-not-allowed")


def test_item8_problems_never_echo_a_server_files_content(tmp_path):
    configure(tmp_path)
    key = make_key()
    data = tmp_path / "data"
    (data / "secret.key").write_text("TOPSECRET-0123456789-token\n")
    (data / "creds.csv").write_text("user,TOPSECRET_password\nalice,hunter2\n")
    with TestClient(create_app(run_background=False)) as client:
        client.headers["authorization"] = f"Bearer {key}"
        for name in ("secret.key", "creds.csv"):
            response = client.post(
                "/v1/models",
                json={"name": "x", "dataset": {"path": str(data / name), "row_id_column": "id", "label_column": "y"}},
            )
            assert response.status_code == 422, response.text
            assert "TOPSECRET" not in response.text and "hunter2" not in response.text
            assert response.json()["type"] in (PROBLEMS + "unknown-column", PROBLEMS + "invalid-dataset")
        # an upload is the caller's own file: its columns are listed to help
        response = client.post(
            "/v1/models",
            data={"metadata": json.dumps({"name": "x", "dataset": {"row_id_column": "id", "label_column": "y"}})},
            files={"file": ("creds.csv", (data / "creds.csv").read_bytes(), "text/csv")},
        )
        assert _problem(response, 422, "unknown-column")["columns"] == ["user", "TOPSECRET_password"]


# ---------------------------------------------------------------- item 9: derived keys, secret handling, file modes


def test_item9_keys_are_derived_per_purpose_with_hkdf(tmp_path):
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    configure(tmp_path)
    settings = get_settings()
    purposes = ["api-key", "subject-hash", "row-id-hash", "request-fingerprint", "webhook-signing", "audit-checkpoint"]
    keys = {p: settings.derived_key(p) for p in purposes}
    assert len(set(keys.values())) == len(purposes) and all(len(k) == 32 for k in keys.values())
    assert settings.secret() not in keys.values()
    expected = HKDF(hashes.SHA256(), 32, salt=b"lethe-kdf-v1", info=b"lethe:api-key").derive(TEST_SECRET.encode())
    assert keys["api-key"] == expected
    with pytest.raises(ValueError, match="purpose"):
        settings.derived_key("api-keys")


@pytest.mark.parametrize("secret", ["", "short", "x" * 31])
def test_item9_an_empty_or_short_secret_is_refused_at_start(tmp_path, secret):
    with pytest.raises(ValidationError, match="at least 32 bytes"):
        Settings(_env_file=None, home=tmp_path, secret_key=secret)
    assert Settings(_env_file=None, home=tmp_path, secret_key="x" * 32).secret() == b"x" * 32


def _secret_in_process(home: str, barrier, out) -> None:
    barrier.wait()
    try:
        out.put(Settings(_env_file=None, home=Path(home), secret_key=None).secret().decode())
    except Exception as exc:  # reported, not raised: the parent counts failures
        out.put(f"ERROR {type(exc).__name__}: {exc}")


def test_item9_workers_starting_together_end_with_one_secret(tmp_path):
    """Two API workers starting at once: one secret, whoever wins; nobody reads a half-written file."""
    context = multiprocessing.get_context("fork")  # the children only create and read one file
    for attempt in range(6):
        home = tmp_path / f"home{attempt}"
        barrier, out = context.Barrier(6), context.Queue()
        procs = [context.Process(target=_secret_in_process, args=(str(home), barrier, out)) for _ in range(6)]
        for proc in procs:
            proc.start()
        results = [out.get(timeout=60) for _ in procs]
        for proc in procs:
            proc.join(timeout=60)
        assert len(set(results)) == 1, results
        assert results[0] == (home / "secret.key").read_text().strip() and len(results[0]) >= 32
        assert stat.S_IMODE((home / "secret.key").stat().st_mode) == 0o600
        assert [p.name for p in home.iterdir()] == ["secret.key"]  # no temporary file left behind
    # and threads of one process
    home = tmp_path / "threads"
    barrier, results = threading.Barrier(8), []

    def run():
        barrier.wait()
        try:
            results.append(Settings(_env_file=None, home=home, secret_key=None).secret())
        except Exception as exc:
            results.append(repr(exc))

    threads = [threading.Thread(target=run) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(results)) == 1 and results[0] == (home / "secret.key").read_text().strip().encode()


def test_item9_database_file_and_artifact_folder_are_private(tmp_path):
    old = os.umask(0o022)  # a usual umask: files 0644, folders 0755 unless the code says otherwise
    try:
        home = tmp_path / "svc"
        configure(home)
        from app.storage import get_store

        get_store().put_bytes(b"a data set")
    finally:
        os.umask(old)
    assert stat.S_IMODE((home / "lethe.db").stat().st_mode) & 0o077 == 0
    assert stat.S_IMODE((home / "artifacts").stat().st_mode) == 0o700


def test_item9_stored_hashes_are_keyed_with_their_purpose_keys(live):
    from app.auth.tables import ApiKey
    from app.requests.tables import DeletionRequest

    settings = get_settings()
    body = {
        "subject_ref": "alice@example.com",
        "model_id": live.model["id"],
        "scope": {"kind": "samples", "sample_ids": ["r1"]},
    }
    response = live.post("/v1/deletion-requests", json=body)
    assert response.status_code == 202, response.text
    key = live.headers["authorization"][7:]
    with session_scope() as session:
        request = session.get(DeletionRequest, response.json()["id"])
        api_key = session.execute(select(ApiKey)).scalars().first()
    from app.requests.schemas import DeletionRequestCreate

    dumped = DeletionRequestCreate.model_validate(body).model_dump(mode="json")
    canonical = json.dumps(dumped, sort_keys=True, separators=(",", ":"))
    # the fingerprint is keyed: the database alone cannot test a guess of the subject
    assert request.body_hash != hashlib.sha256(canonical.encode()).hexdigest()
    fingerprint_key = settings.derived_key("request-fingerprint")
    assert request.body_hash == hmac.new(fingerprint_key, canonical.encode(), hashlib.sha256).hexdigest()
    subject_key = settings.derived_key("subject-hash")
    assert request.subject_hash == hmac.new(subject_key, b"alice@example.com", hashlib.sha256).hexdigest()
    from app.registry.versions import hash_row_id

    # row ids have their own key: a subject reference equal to a row id does not hash to that row's stored hash
    row_key = settings.derived_key("row-id-hash")
    assert hash_row_id("alice@example.com") == hmac.new(row_key, b"alice@example.com", hashlib.sha256).hexdigest()
    assert hash_row_id("alice@example.com") != request.subject_hash
    assert api_key.key_hash == hmac.new(settings.derived_key("api-key"), key.encode(), hashlib.sha256).hexdigest()
    from app.webhooks.service import endpoint_secret

    # per-endpoint Standard Webhooks secrets come from the webhook-signing key, never from the master secret
    url = "https://hooks.example.com/lethe"
    message = f"{api_key.id}\nhttps://hooks.example.com:/lethe".encode()  # bound to the requesting key
    raw = hmac.new(settings.derived_key("webhook-signing"), message, "sha256").digest()
    assert endpoint_secret(url, api_key.id) == "whsec_" + base64.b64encode(raw).decode()


# ---------------------------------------------------------------- item 10: scopes, bound keys, expiry, revocation


def test_redelivery_and_webhook_secrets_are_admin_only(api):
    """A webhook redelivery reaches a receiver on the requester's behalf; a key that may submit requests may not
    replay events (its own or another requester's), nor read a receiver's secret."""
    writer = {"authorization": f"Bearer {make_key(['requests:write', 'requests:read'], name='writer')}"}
    admin = {"authorization": f"Bearer {make_key(['admin'], name='admin')}"}
    path = "/v1/deletion-requests/some-request/webhooks/some-delivery/redeliver"
    assert _problem(api.post(path, headers=writer), 403, "forbidden")["required_scope"] == "admin"
    assert api.post(path, headers=admin).status_code == 404  # past the scope check: no such delivery
    body = {"url": "https://hooks.example.com/lethe", "key": "nosuchkey"}
    assert _problem(api.post("/v1/webhooks/secret", json=body, headers=writer), 403, "forbidden")
    _problem(api.post("/v1/webhooks/secret", json=body, headers=admin), 404, "api-key-not-found")


def test_item10_weights_and_lock_need_models_read(live):
    model_id = live.model["id"]
    reader = make_key(["requests:read"], name="reader")
    weights = f"/v1/models/{model_id}/versions/1/weights"
    response = live.get(weights, headers={"authorization": f"Bearer {reader}"})
    assert _problem(response, 403, "forbidden")["required_scope"] == "models:read"
    _problem(
        live.get(f"/v1/models/{model_id}/forget-lock.safetensors", headers={"authorization": f"Bearer {reader}"}),
        403,
        "forbidden",
    )
    assert live.get(f"/v1/models/{model_id}", headers={"authorization": f"Bearer {reader}"}).status_code == 200
    downloader = make_key(["models:read"], name="downloader")
    assert live.get(weights, headers={"authorization": f"Bearer {downloader}"}).status_code == 200
    admin = make_key(["admin"], name="admin")
    assert live.get(weights, headers={"authorization": f"Bearer {admin}"}).status_code == 200


def test_item10_a_client_key_reaches_its_model_only(live):
    from typer.testing import CliRunner

    from app.cli import app as cli

    model_id = live.model["id"]
    other_id = _fake_federated_model()
    runner = CliRunner()
    result = runner.invoke(
        cli,
        [
            "keys",
            "create",
            "--model",
            model_id,
            "--client-id",
            "c3",
            "--scope",
            "rounds:write",
            "--scope",
            "models:read",
        ]
        + ["--expires-in", "30d", "--name", "hospital-3"],
    )
    assert result.exit_code == 0, result.output
    key = result.stdout.strip().splitlines()[0]
    assert key.startswith("lethe_")
    auth = {"authorization": f"Bearer {key}"}
    assert live.get(f"/v1/models/{model_id}/versions/1/weights", headers=auth).status_code == 200
    assert live.get(f"/v1/models/{model_id}", headers=auth).status_code == 200
    _problem(live.get(f"/v1/models/{model_id}/forget-lock", headers=auth), 404, "no-forget-lock")
    blob = _safetensors({"updates": {"dtype": "F32", "shape": [3, 4], "data_offsets": [0, 48]}}, b"\0" * 48)
    octet = {**auth, "content-type": "application/octet-stream"}
    # its own model: past authorisation (a tabular model takes no rounds); any other model does not exist for it
    _problem(live.post(f"/v1/models/{model_id}/rounds", content=blob, headers=octet), 422, "scope-not-supported")
    _problem(live.post(f"/v1/models/{other_id}/rounds", content=blob, headers=octet), 404, "model-not-found")
    _problem(live.get(f"/v1/models/{other_id}/versions/1/weights", headers=auth), 404, "model-not-found")
    _problem(live.get(f"/v1/models/{other_id}", headers=auth), 404, "model-not-found")
    # nothing else
    body = {"subject_ref": "s", "model_id": model_id, "scope": {"kind": "samples", "sample_ids": ["r1"]}}
    _problem(live.post("/v1/deletion-requests", json=body, headers=auth), 403, "forbidden")
    _problem(live.get("/v1/deletion-requests", headers=auth), 403, "forbidden")
    _problem(live.get("/v1/audit", headers=auth), 403, "forbidden")
    _problem(live.post("/v1/models", json={"name": "x"}, headers=auth), 403, "forbidden")
    listing = runner.invoke(cli, ["keys", "list", "--json"])
    assert listing.exit_code == 0, listing.output
    entries = [json.loads(line) for line in listing.stdout.splitlines()]
    mine = next(e for e in entries if e["name"] == "hospital-3")
    assert mine["model_id"] == model_id and mine["client_id"] == "c3" and mine["state"] == "active"
    assert mine["expires_at"] is not None and "key_hash" not in mine
    # a bound key holds only what a federated client needs
    refused = runner.invoke(cli, ["keys", "create", "--model", model_id, "--scope", "requests:write"])
    assert refused.exit_code != 0 and "bound to a model" in refused.output


def test_item10_a_forgotten_clients_key_may_not_send_rounds(api):
    from app.auth.service import create_key

    model_id = _fake_federated_model(removed=["c2"])
    with session_scope() as session:
        key = create_key(session, "c2", ["rounds:write"], model_id=model_id, client_id="c2")[1]
    blob = _safetensors({"updates": {"dtype": "F32", "shape": [3, 4], "data_offsets": [0, 48]}}, b"\0" * 48)
    response = api.post(
        f"/v1/models/{model_id}/rounds",
        content=blob,
        headers={"authorization": f"Bearer {key}", "content-type": "application/octet-stream"},
    )
    _problem(response, 403, "client-removed")


def test_a_round_is_checked_for_its_values_and_a_client_key_sends_only_its_own_row(api):
    """Issue 22: a federated client's key could upload other clients' rows and any weights (NaN, negative, 1e30: the
    aggregate became NaN, or one client's). Before the values reach a job: updates finite; a client key's round holds
    only its own row and weight; a weight finite, >= 0 and at most the client's registered pair count."""
    import numpy as np
    from safetensors.numpy import save

    from app.auth.service import create_key

    model_id = _fake_federated_model(client_sizes=[10, 20, 30])
    with session_scope() as session:
        key = create_key(session, "c1", ["rounds:write"], model_id=model_id, client_id="c1")[1]
    headers = {"authorization": f"Bearer {key}", "content-type": "application/octet-stream"}

    def send(updates, weights=None):
        tensors = {"updates": np.asarray(updates, np.float32)}
        if weights is not None:
            tensors["weights"] = np.asarray(weights, np.float32)
        return api.post(f"/v1/models/{model_id}/rounds", content=save(tensors), headers=headers)

    own = np.zeros((3, 4))
    own[1] = 0.01
    assert send(own, [0, 20, 0]).status_code == 202  # its own row, its own weight: accepted
    other = own.copy()
    other[2] = 0.01
    assert "only its own row" in _problem(send(other), 403, "forbidden")["title"]
    assert "only its own weight" in _problem(send(own, [10, 20, 0]), 403, "forbidden")["title"]
    nan = own.copy()
    nan[1, 0] = np.nan
    _problem(send(nan), 422, "invalid-round")
    for weights in ([0, np.nan, 0], [0, -1, 0], [0, 1e30, 0]):
        _problem(send(own, weights), 422, "invalid-round")


def test_item10_revoked_and_expired_keys_are_refused_at_once(api):
    from typer.testing import CliRunner

    from app.auth.service import create_key
    from app.auth.tables import ApiKey
    from app.cli import app as cli

    key = make_key(["requests:read"], name="to-revoke")
    auth = {"authorization": f"Bearer {key}"}
    assert api.get("/v1/deletion-requests", headers=auth).status_code == 200  # used: any cache now holds it
    with session_scope() as session:
        key_id = session.execute(select(ApiKey.id).where(ApiKey.name == "to-revoke")).scalar_one()
    result = CliRunner().invoke(cli, ["keys", "revoke", key_id])
    assert result.exit_code == 0, result.output
    _problem(api.get("/v1/deletion-requests", headers=auth), 401, "unauthorized")

    with session_scope() as session:
        short = create_key(session, "short-lived", ["requests:read"], expires_in=timedelta(seconds=1))[1]
    auth = {"authorization": f"Bearer {short}"}
    assert api.get("/v1/deletion-requests", headers=auth).status_code == 200
    time.sleep(1.1)
    _problem(api.get("/v1/deletion-requests", headers=auth), 401, "unauthorized")
    listing = CliRunner().invoke(cli, ["keys", "list", "--json"])
    states = {json.loads(line)["name"]: json.loads(line)["state"] for line in listing.stdout.splitlines()}
    assert states["to-revoke"] == "revoked" and states["short-lived"] == "expired"


# ---------------------------------------------------------------- item 11: method settings


def test_item11_a_request_may_not_change_method_settings(live):
    body = {"subject_ref": "s", "model_id": live.model["id"], "scope": {"kind": "samples", "sample_ids": ["r1"]}}
    for method, settings, key in (
        ("retrain", {"purge_meta_tasks": False}, "purge_meta_tasks"),
        ("l2ul", {"workers": 64}, "workers"),
        ("auto", {"seed": 1}, "seed"),
        ("ease", {"excision_steps": 100}, "excision_steps"),  # ease allows leaving_client only
    ):
        response = live.post("/v1/deletion-requests", json={**body, "method": method, "method_settings": settings})
        problem = _problem(response, 422, "method-setting-not-allowed")
        assert problem["setting"] == key and key in problem["detail"]


def test_item11_an_allowlisted_key_is_accepted_and_bounded(live, monkeypatch):
    from app.requests import policy

    monkeypatch.setitem(policy.REQUEST_SETTINGS, "sisa", frozenset({"seed"}))
    body = {"subject_ref": "s", "model_id": live.model["id"], "method": "sisa"}
    body["scope"] = {"kind": "samples", "sample_ids": ["r1"]}
    problem = _problem(
        live.post("/v1/deletion-requests", json={**body, "method_settings": {"seed": -1}}), 422, "validation-error"
    )
    assert problem["errors"][0]["location"][-1] == "seed"
    # within bounds it passes this check (and meets the next one: sisa is not prepared for this model)
    _problem(
        live.post("/v1/deletion-requests", json={**body, "method_settings": {"seed": 3}}), 409, "method-not-prepared"
    )


@pytest.mark.parametrize(
    ("extra", "location"),
    [
        ({"method_settings": {"l2ul": {"workers": 10_000}}}, ["method_settings", "l2ul", "workers"]),
        ({"method_settings": {"l2ul": {"purge_refit": "never"}}}, ["method_settings", "l2ul", "purge_refit"]),
        ({"method_settings": {"l2ul": {"epochs": 10**9}}}, ["method_settings", "l2ul", "epochs"]),
        ({"method_settings": {"l2ul": {"typo": 1}}}, ["method_settings", "l2ul", "typo"]),
        ({"method_settings": {"ease": {}}}, ["method_settings", "ease"]),
        ({"method_settings": {"magic": {}}}, ["method_settings", "magic"]),
        ({"recipe": {"seed": 2**80}}, ["recipe", "seed"]),
        ({"recipe": {"max_iter": 10**9}}, ["recipe", "max_iter"]),
        ({"holdout_fraction": 0.95}, ["holdout_fraction"]),
    ],
)
def test_item11_registration_settings_are_bounded_at_the_api(api, tmp_path, extra, location):
    path = tmp_path / "t.csv"
    write_table(path, n=30)
    problem = _problem(_upload(api, path, **extra), 422, "validation-error")
    assert any(e["location"][-len(location) :] == location for e in problem["errors"]), problem


@pytest.mark.parametrize(
    ("extra", "location"),
    [
        ({"fed_settings": {"rounds": 10**9}}, ["fed_settings", "rounds"]),
        ({"fed_settings": {"lr": -1}}, ["fed_settings", "lr"]),
        ({"fed_settings": {"bogus": 1}}, ["fed_settings", "bogus"]),
        ({"clip": {"lora": {"rank": "x"}}}, ["clip", "lora", "rank"]),
        ({"clip": {"lora": {"rank": 100_000}}}, ["clip", "lora", "rank"]),
        ({"method_settings": {"ease": {"gsd": "all"}}}, ["method_settings", "ease", "gsd"]),
        ({"method_settings": {"l2ul": {}}}, ["method_settings", "l2ul"]),
        ({"data": {"n_clients": 3, "seed": -1}}, ["data", "seed"]),
    ],
)
def test_item11_federated_registration_settings_are_bounded_at_the_api(api, extra, location):
    response = api.post("/v1/models", json={"name": "f", "kind": "clip_federated", **extra})
    problem = _problem(response, 422, "validation-error")
    assert any(e["location"][-len(location) :] == location for e in problem["errors"]), problem


def test_item11_the_api_bounds_match_the_method_configs():
    """The API's copies of the config fields (it may not import torch) must not drift from app/ml."""
    import dataclasses

    from app.ml.clip import LoraSettings
    from app.ml.federation import FedSettings
    from app.ml.tabular import TabularRecipe
    from app.ml.unlearning.base import _ref_name, available_methods
    from app.registry.settings import (
        METHOD_SETTINGS,
        NOT_ON_THE_API,
        FedSettingsIn,
        LoraSettingsIn,
        TabularRecipeIn,
    )

    builtin = [s for s in available_methods() if _ref_name(s.config_ref).startswith("app.ml.")]
    assert len(builtin) >= 8
    for spec in builtin:
        assert spec.name in METHOD_SETTINGS, f"{spec.name} has no settings bounds in app/registry/settings.py"
        fields = {f.name for f in dataclasses.fields(spec.config_cls)}
        withheld = NOT_ON_THE_API.get(spec.name, frozenset())
        assert withheld <= fields and set(METHOD_SETTINGS[spec.name].model_fields) == fields - withheld, spec.name
        api = dataclasses.asdict(spec.make_config(METHOD_SETTINGS[spec.name]().model_dump()))
        own = dataclasses.asdict(spec.config_cls())
        # a nested method's settings left {} mean that method's own defaults (checked under its own name)
        differ = {k for k in own if api[k] != own[k] and own[k] != {}}
        assert not differ, f"{spec.name}: the API's documented defaults differ from the method's in {differ}"
    for name, withheld in NOT_ON_THE_API.items():  # refused at registration, as any unknown field
        for field in withheld:
            with pytest.raises(ValueError, match=field):
                METHOD_SETTINGS[name](**{field: 1.0})
    assert set(FedSettingsIn.model_fields) == {f.name for f in dataclasses.fields(FedSettings)}
    assert set(LoraSettingsIn.model_fields) == {f.name for f in dataclasses.fields(LoraSettings)}
    from app.ml.verification.clip_shadows import ClipShadowSettings
    from app.registry.settings import ClipShadowSettingsIn

    assert set(ClipShadowSettingsIn.model_fields) == {f.name for f in dataclasses.fields(ClipShadowSettings)}
    assert ClipShadowSettings(**ClipShadowSettingsIn().model_dump()) == ClipShadowSettings()  # the defaults agree
    assert set(TabularRecipeIn.model_fields) <= {f.name for f in dataclasses.fields(TabularRecipe)}
    from app.ml.verification.policy import VerdictPolicy
    from app.registry.settings import VerdictPolicyIn

    assert set(VerdictPolicyIn.model_fields) == {f.name for f in dataclasses.fields(VerdictPolicy)}
    assert VerdictPolicy.from_dict(VerdictPolicyIn().model_dump()) == VerdictPolicy()  # the defaults agree


# ---------------------------------------------------------------- item 12: clip.arch allowlist


@pytest.mark.parametrize("arch", ["hf-hub:laion/CLIP-ViT-B-32-laion2B-s34B-b79K", "local-dir:/tmp/x", "../x", "nope"])
def test_item12_clip_arch_is_an_allowlist(api, arch):
    response = api.post("/v1/models", json={"name": "f", "kind": "clip_federated", "clip": {"arch": arch}})
    problem = _problem(response, 422, "validation-error")
    assert problem["errors"][0]["location"][-2:] == ["clip", "arch"]


def test_item12_known_architectures_pass():
    from app.registry.settings import allowed_clip_archs

    names = allowed_clip_archs()
    assert {"lethe-tiny-clip", "ViT-B-32", "RN50"} <= names
    assert not any(":" in n or "/" in n for n in names)


# ---------------------------------------------------------------- item 13: NUL bytes


@pytest.mark.parametrize(
    "change",
    [
        {"subject_ref": "alice\x00"},
        {"scope": {"kind": "samples", "sample_ids": ["r1", "r\x002"]}},
        {"scope": {"kind": "class", "label": "y\x00es"}},
        {"callback_url": "https://example.com/\x00hook"},
        {"method_settings": {"se\x00ed": 1}},
        {"method_settings": {"seed": "1\x00"}},
        {"method": "retrain\x00"},
    ],
)
def test_item13_a_nul_anywhere_in_a_request_is_a_422_at_the_schema(live, change):
    body = {"subject_ref": "s", "model_id": live.model["id"], "scope": {"kind": "samples", "sample_ids": ["r1"]}}
    problem = _problem(live.post("/v1/deletion-requests", json={**body, **change}), 422, "validation-error")
    assert "NUL" in json.dumps(problem)


def test_item13_a_nul_in_the_idempotency_key_is_a_422(live):
    body = {"subject_ref": "s", "model_id": live.model["id"], "scope": {"kind": "samples", "sample_ids": ["r1"]}}
    response = live.post("/v1/deletion-requests", json=body, headers={"Idempotency-Key": "k\x00ey"})
    problem = _problem(response, 422, "validation-error")
    assert problem["errors"][0]["location"] == ["header", "Idempotency-Key"]


@pytest.mark.parametrize(
    ("content", "headers"),
    [
        ('{"subject_ref": "s"}', {}),  # valid JSON, invalid body
        ('{"subject_ref": ', {}),  # malformed JSON
        (
            '{"subject_ref": "s", "model_id": "m", "scope": {"kind": "samples", "sample_ids": ["r1"]}}',
            {"content-type": "text/plain"},
        ),
        (
            '{"subject_ref": "s", "model_id": "m", "scope": {"kind": "samples", "sample_ids": ["r1"]}}',
            {"Idempotency-Key": "k" * 300},
        ),
        ('{"subject_ref": "s", "model_id": "m", "scope": {"kind": "samples"}, "method_settings": {"seed": 1}}', {}),
    ],
)
def test_intake_authenticates_before_it_validates(api, content, headers):
    """A caller without a valid key learns nothing about the schema: wrong key + bad body is 401, not 422/400/415;
    a key without ``requests:write`` is 403; a good key still gets the validation problem."""
    url, base = "/v1/deletion-requests", {"content-type": "application/json", **headers}
    wrong = _problem(
        api.post(url, content=content, headers={**base, "authorization": "Bearer lethe_x_y"}), 401, "unauthorized"
    )
    assert "errors" not in wrong and "subject_ref" not in json.dumps(wrong)
    reader = make_key(["requests:read"], name="reader")
    _problem(api.post(url, content=content, headers={**base, "authorization": f"Bearer {reader}"}), 403, "forbidden")
    response = api.post(url, content=content, headers=base)
    assert response.status_code in (400, 415, 422), response.text


def test_intake_body_schema_is_documented(api):
    spec = api.get("/openapi.json").json()
    body = spec["paths"]["/v1/deletion-requests"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    name = body["$ref"].rsplit("/", 1)[1]
    assert {"subject_ref", "model_id", "scope"} <= set(spec["components"]["schemas"][name]["properties"])


# ---------------------------------------------------------------- item 14: audit canonical text and checkpoints


def test_item14_checkpoints_anchor_the_head_and_catch_a_cut_tail(tmp_path):
    import sqlite3

    from app.audit.service import append_event, verify_chain

    configure(tmp_path, audit_checkpoint_every="4")
    for i in range(10):
        with session_scope() as session:
            append_event(session, actor="t", action="x", entity_type="x", entity_id=str(i), payload={"v": 2.5e16})
    with session_scope() as session:
        verdict = verify_chain(session)
    assert verdict.ok and verdict.checkpoints == 2 and verdict.last_checkpoint_seq == 8
    raw = sqlite3.connect(tmp_path / "lethe.db")
    raw.execute("DROP TRIGGER audit_events_no_delete")
    raw.execute("DELETE FROM audit_events WHERE seq > 6")
    raw.commit()
    with session_scope() as session:
        verdict = verify_chain(session)
    assert not verdict.ok and verdict.first_broken_seq == 7
    assert "checkpoint 8" in verdict.reason and "truncated" in verdict.reason


def test_item14_a_changed_payload_column_is_caught_even_though_the_text_is_kept(tmp_path):
    import sqlite3

    from app.audit.service import append_event, verify_chain

    configure(tmp_path)
    for i in range(3):
        with session_scope() as session:
            append_event(session, actor="t", action="x", entity_type="x", entity_id=str(i), payload={"n": i})
    raw = sqlite3.connect(tmp_path / "lethe.db")
    raw.execute("DROP TRIGGER audit_events_no_update")
    raw.execute("UPDATE audit_events SET payload = json('{\"n\": true}') WHERE seq = 2")
    raw.commit()
    with session_scope() as session:
        verdict = verify_chain(session)
    assert not verdict.ok and verdict.first_broken_seq == 2 and "columns" in verdict.reason


def test_item14_non_finite_numbers_are_written_as_strings(tmp_path):
    from app.audit.service import append_event, verify_chain
    from app.audit.tables import AuditEvent

    configure(tmp_path)
    with session_scope() as session:
        append_event(session, actor="t", action="x", entity_type="x", entity_id="1", payload={"auc": float("nan")})
    with session_scope() as session:
        assert session.get(AuditEvent, 1).payload == {"auc": "NaN"}
        assert verify_chain(session).ok


# ---------------------------------------------------------------- item 15: every 500 becomes a 4xx


def test_item15_a_cursor_with_a_naive_datetime_is_a_400(api):
    cursor = base64.urlsafe_b64encode(json.dumps(["2024-01-01T00:00:00", "x"]).encode()).decode()
    _problem(api.get("/v1/deletion-requests", params={"cursor": cursor}), 400, "invalid-cursor")


@pytest.mark.parametrize("after_seq", [2**63, 2**64, 10**30])
def test_item15_after_seq_beyond_64_bits_is_a_422(api, after_seq):
    _problem(api.get("/v1/audit", params={"after_seq": after_seq}), 422, "validation-error")


@pytest.mark.parametrize(
    "path", ["/v1/deletion-requests/a%00b", "/v1/models/a%00b", "/v1/audit?entity_id=a%00", "/v1/jobs/%00"]
)
def test_item15_a_nul_in_the_path_or_query_is_a_422(api, path):
    _problem(api.get(path), 422, "validation-error")


@pytest.mark.parametrize(
    "header",
    [
        {"updates": 5},
        {"updates": [4, 3]},
        {"updates": {"dtype": "F32", "shape": [3, 4], "data_offsets": [0, 48]}, "weights": "x"},
        {"__metadata__": {}, "updates": None},
    ],
)
def test_item15_a_round_whose_tensor_entries_are_not_objects_is_a_422(api, header):
    model_id = _fake_federated_model()
    response = api.post(
        f"/v1/models/{model_id}/rounds",
        content=_safetensors(header, b"\0" * 48),
        headers={"content-type": "application/octet-stream"},
    )
    _problem(response, 422, "invalid-round")


def test_item15_raw_rounds_have_their_own_size_limit(tmp_path):
    configure(tmp_path, max_round_bytes=str(3 * 1024 * 1024))
    key = make_key()
    model_id = _fake_federated_model()
    headers = {"authorization": f"Bearer {key}", "content-type": "application/octet-stream"}
    with TestClient(create_app(run_background=False)) as client:
        # a 2 MB round (more than the 1 MB JSON limit) reaches validation
        p = 180_000  # 3 x 180,000 float32: a 2.2 MB round (of another model: this one has 4 parameters)
        header = {"updates": {"dtype": "F32", "shape": [3, p], "data_offsets": [0, 12 * p]}}
        big = _safetensors(header, b"\0" * (12 * p))
        _problem(client.post(f"/v1/models/{model_id}/rounds", content=big, headers=headers), 422, "invalid-round")
        huge = b"\0" * (3 * 1024 * 1024 + 1)
        _problem(client.post(f"/v1/models/{model_id}/rounds", content=huge, headers=headers), 413, "payload-too-large")


def test_large_body_limits_follow_the_route_and_come_after_the_key(tmp_path):
    """Issue 22: the 512 MB upload limit went to any multipart body before authentication, so a caller with no key
    could make the API read 300 MB into memory (a JSON route reads its body before the batched key check). Now only
    the upload route gets it, and only once the key holds models:write; rounds need rounds:write."""
    configure(tmp_path)
    reader = make_key(["requests:read"])
    multipart = {"content-type": "multipart/form-data; boundary=x"}
    two_mb = b"\0" * (2 * 1024 * 1024)  # over the 1 MB JSON limit, far under the upload limit
    with TestClient(create_app(run_background=False)) as client:
        # a JSON route with a multipart content type: the JSON limit for a key (checked later, in its batch); no
        # key at all is refused first (issue 22, item 3: the key before the body, on every route)
        keyed = {**multipart, "authorization": f"Bearer {reader}"}
        _problem(client.post("/v1/deletion-requests", content=two_mb, headers=keyed), 413, "payload-too-large")
        _problem(client.post("/v1/deletion-requests", content=two_mb, headers=multipart), 401, "unauthorized")
        # the upload route: no key, or a key without models:write, is refused before the body is read
        _problem(client.post("/v1/models", content=two_mb, headers=multipart), 401, "unauthorized")
        bad = {**multipart, "authorization": "Bearer lethe_not_a_key"}
        _problem(client.post("/v1/models", content=two_mb, headers=bad), 401, "unauthorized")
        weak = {**multipart, "authorization": f"Bearer {reader}"}
        _problem(client.post("/v1/models", content=two_mb, headers=weak), 403, "forbidden")
        rounds = {"authorization": f"Bearer {reader}", "content-type": "application/octet-stream"}
        _problem(client.post("/v1/models/m/rounds", content=two_mb, headers=rounds), 403, "forbidden")


def test_a_parquet_bomb_is_refused_from_its_decoded_size_before_it_is_expanded(api, tmp_path):
    """Issue 22: a few kB of Parquet (one 1 MB string, dictionary-encoded 2,500 times, zstd) decode to 2.6 GB and
    passed every limit. The decoded size is computed from the dictionary's lengths over its indices, never built."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    n = 2_500
    text = pa.DictionaryArray.from_arrays(pa.array([0] * n, pa.int32()), pa.array(["x" * 1_048_576]))
    table = pa.table({"row_id": [f"r{i}" for i in range(n)], "label": [i % 2 for i in range(n)], "note": text})
    path = tmp_path / "bomb.parquet"
    pq.write_table(table, path, compression="zstd")
    assert path.stat().st_size < 100_000  # small on the wire
    metadata = {"name": "b", "dataset": {"row_id_column": "row_id", "label_column": "label"}}
    response = api.post(
        "/v1/models",
        data={"metadata": json.dumps(metadata)},
        files={"file": ("bomb.parquet", path.read_bytes(), "application/octet-stream")},
    )
    body = _problem(response, 413, "table-too-large")
    assert "decoded" in body["title"] and body["limit_bytes"] == 1024**3


def test_item15_non_file_multipart_fields_have_a_small_limit(api, tmp_path):
    path = tmp_path / "t.csv"
    write_table(path, n=30)
    metadata = {"name": "m", "dataset": {"row_id_column": "row_id", "label_column": "label"}, "pad": "x" * 200_000}
    response = api.post(
        "/v1/models",
        data={"metadata": json.dumps(metadata)},
        files={"file": ("t.csv", path.read_bytes(), "text/csv")},
    )
    _problem(response, 413, "payload-too-large")


def test_item15_a_multipart_filename_longer_than_the_column_is_a_422(api, tmp_path):
    path = tmp_path / "t.csv"
    write_table(path, n=30)
    problem = _problem(_upload(api, path, name="x" * 300 + ".csv"), 422, "validation-error")
    assert problem["errors"][0]["location"] == ["body", "file", "filename"]


def test_item15_tables_are_bounded_in_rows_times_columns(tmp_path):
    configure(tmp_path, max_table_cells="10000")
    key = make_key()
    frame = pd.DataFrame({"row_id": [f"r{i}" for i in range(5000)], "x": 0.0, "label": "a"})
    buffer = io.BytesIO()
    frame.to_parquet(buffer, index=False)  # ~15,000 cells in a few KB
    with TestClient(create_app(run_background=False)) as client:
        metadata = {"name": "m", "dataset": {"row_id_column": "row_id", "label_column": "label"}}
        response = client.post(
            "/v1/models",
            headers={"authorization": f"Bearer {key}"},
            data={"metadata": json.dumps(metadata)},
            files={"file": ("t.parquet", buffer.getvalue(), "application/octet-stream")},
        )
    assert _problem(response, 413, "table-too-large")["limit_cells"] == 10000


def test_item15_a_models_error_is_its_first_line_only(api):
    from app.registry.tables import Model

    traceback = 'ValueError: bad recipe\nTraceback (most recent call last):\n  File "/srv/app/jobs/pipeline.py"'
    with session_scope() as session:
        model = Model(name="x", kind="tabular", status="failed", spec={}, state={})
        session.add(model)
        session.flush()
        model.error = traceback
        model_id = model.id
    body = api.get(f"/v1/models/{model_id}").json()
    assert body["error"] == "ValueError: bad recipe"
    with session_scope() as session:
        assert session.get(Model, model_id).error == "ValueError: bad recipe"  # stored: the first line only


# ---------------------------------------------------------------- item 18: SQL parameters stay out of logs


def test_item18_sql_parameters_are_hidden(tmp_path, caplog):
    from app.auth.tables import ApiKey

    configure(tmp_path)
    secret_hash = "f" * 60 + "beef"
    with session_scope() as session:
        session.add(ApiKey(name="a", prefix="p", key_hash=secret_hash, scopes=["admin"]))
    with pytest.raises(IntegrityError) as info, session_scope() as session:
        session.add(ApiKey(name="b", prefix="p", key_hash=secret_hash, scopes=["admin"]))
    assert secret_hash not in str(info.value) and "hidden" in str(info.value)


@pytest.mark.parametrize(
    ("policy", "field"),
    [({"no_such_key": 1}, "no_such_key"), ({"max_retain_r1_drop_points": 101}, "max_retain_r1_drop_points"),
     ({"attack_fpr": 1.5}, "attack_fpr")],
)  # fmt: skip
def test_a_bad_verdict_policy_is_refused_at_registration(api, policy, field):
    """Checked at the door (app/registry/settings.VerdictPolicyIn), not at the first verdict in a worker."""
    response = api.post("/v1/models", json={"name": "f", "kind": "clip_federated", "verification": {"policy": policy}})
    problem = _problem(response, 422, "validation-error")
    assert field in problem["errors"][0]["location"]


@pytest.mark.parametrize("url", ["/v1/deletion-requests/bulk", "/v1/subjects/erasures"])
def test_the_key_is_checked_before_the_media_type(api, url):
    """Issue 22: the bulk and subject-erasure routes answered an anonymous caller 415 before checking the key. Now
    no key or a wrong one is 401 whatever the body; a key with the scope and a non-JSON body is 415."""
    anonymous = TestClient(api.app)  # the fixture's client carries a key; this one carries none
    for client, auth in ((anonymous, {}), (api, {"authorization": "Bearer lethe_x_y"})):
        for content_type in ("text/plain", "application/xml"):
            response = client.post(url, content="<not json>", headers={**auth, "content-type": content_type})
            _problem(response, 401, "unauthorized")
    admin = make_key(["admin", "requests:write"], name="json-check")
    response = api.post(url, content="<x/>", headers={"authorization": f"Bearer {admin}", "content-type": "text/xml"})
    _problem(response, 415, "unsupported-media-type")

"""Shared test plumbing: point Lethe at a database/artifact folder, migrate it, make keys, wait for jobs."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd

from app.auth.service import create_key
from app.config import get_settings
from app.db import migrate, reset_engine_cache, session_scope
from app.storage import get_store

ALL_SCOPES = [
    "models:write", "models:read", "rounds:write", "requests:write", "requests:read", "audit:read", "metrics:read"
]  # fmt: skip
TEST_SECRET = "test-secret-key-0123456789abcdef-0123456789"  # >= 32 bytes, as the settings demand


def configure(home: Path, **env: str) -> None:
    """Set LETHE_* for this process and forget every cached settings/engine/store. Data-set paths may lie under
    ``home/data``: a link to the sibling folder ``<home>.data``, the data root (a root may neither contain the
    service's home nor lie inside it; roots are checked on resolved paths)."""
    for key in [k for k in os.environ if k.startswith("LETHE_")]:
        del os.environ[key]
    os.environ["LETHE_HOME"] = str(home)
    os.environ["LETHE_SECRET_KEY"] = TEST_SECRET
    os.environ["LETHE_DATA_ROOTS"] = f'["{data_root(home)}"]'
    for key, value in env.items():
        os.environ[f"LETHE_{key.upper()}"] = value
    get_settings.cache_clear()
    get_store.cache_clear()
    reset_engine_cache()
    migrate()


def data_root(home: Path) -> Path:
    """The data root beside ``home`` (created), reachable as ``home/data`` through a symbolic link."""
    root = home.parent / f"{home.name}.data"
    root.mkdir(parents=True, exist_ok=True)
    home.mkdir(parents=True, exist_ok=True)
    link = home / "data"
    if not link.is_symlink():
        if link.is_dir():  # a folder made before configure(): its files move to the root
            for item in link.iterdir():
                item.rename(root / item.name)
            link.rmdir()
        link.symlink_to(root, target_is_directory=True)
    return root


def make_key(scopes: list[str] | None = None, name: str = "test") -> str:
    with session_scope() as session:
        return create_key(session, name, scopes or ALL_SCOPES)[1]


def write_table(path: Path, n: int = 400, seed: int = 0, n_features: int = 6, classes: int = 2) -> pd.DataFrame:
    """A small CSV with a row-id column, numeric and categorical features and a label that depends on them."""
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, n_features))
    colour = rng.choice(["red", "green", "blue"], size=n)
    score = X[:, 0] - 0.5 * X[:, 1] + (colour == "red") * 0.8 + rng.normal(scale=0.5, size=n)
    if classes == 2:
        label = np.where(score > 0, "yes", "no")
    else:
        label = np.array(["low", "mid", "high"])[np.digitize(score, np.quantile(score, [1 / 3, 2 / 3]))]
    frame = pd.DataFrame(X, columns=[f"x{i}" for i in range(n_features)])
    frame.insert(0, "row_id", [f"r{i}" for i in range(n)])
    frame["colour"] = colour
    frame["label"] = label
    if path.suffix == ".parquet":
        frame.to_parquet(path, index=False)
    else:
        frame.to_csv(path, index=False)
    return frame


def wait_for(predicate: Callable[[], object], timeout: float = 120, interval: float = 0.1, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(interval)


def wait_model(client, model_id: str, timeout: float = 300, interval: float = 0.1, what: str = "registration") -> dict:
    """Poll a model until it has left ``registering`` (ready or failed); returns its last representation."""
    return wait_for(
        lambda: (b := client.get(f"/v1/models/{model_id}").json())["status"] != "registering" and b,
        timeout=timeout,
        interval=interval,
        what=what,
    )


def wait_request(client, request_id: str, timeout: float = 600, interval: float = 0.3) -> dict:
    """Poll a deletion request until it completes, fails or is rejected; returns its last representation."""
    return wait_for(
        lambda: (
            (b := client.get(f"/v1/deletion-requests/{request_id}").json())["status"]
            in ("certified", "failed", "rejected")
            and b
        ),
        timeout=timeout,
        interval=interval,
        what=f"deletion request {request_id}",
    )


def delete_rows(client, model_id: str, ids: list[str], method: str, timeout: float = 300) -> dict:
    """POST a one-subject deletion of these sample ids (202 asserted) and wait for it to end."""
    response = client.post(
        "/v1/deletion-requests",
        json={
            "subject_ref": "s",
            "model_id": model_id,
            "method": method,
            "scope": {"kind": "samples", "sample_ids": ids},
        },
    )
    assert response.status_code == 202, response.text
    return wait_request(client, response.json()["id"], timeout=timeout)

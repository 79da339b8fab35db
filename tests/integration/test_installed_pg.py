"""Issue 23, item 1: Lethe as the images install it — a wheel, not an editable checkout — migrates a PostgreSQL
database from the Dockerfile's working directory (which holds no ``alembic.ini`` or ``migrations/`` any more) and
serves until ``/readyz`` answers 200. The compose ``migrate`` step failed exactly here (``Path doesn't exist:
…/site-packages/migrations``). No Docker needed: a fresh virtual environment gets the wheel; its dependencies come
from this environment's site-packages as a plain path (so this checkout's editable install is not seen). The installed
service also serves ``/docs`` and ``/redoc`` with every asset they load (issue 23: no CDN; the assets are the
``fastapi-offline`` dependency's package data)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import httpx
import pytest
from sqlalchemy import create_engine, inspect

from tests.helpers import TEST_SECRET
from tests.stack import fresh_database

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A virtual environment with the wheel of this checkout installed (not editable); returns its bin folder."""
    tmp = tmp_path_factory.mktemp("installed")
    dist, venv = tmp / "dist", tmp / "venv"
    build = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "-q",
        "-w",
        str(dist),
        str(ROOT),
    ]
    subprocess.run(build, check=True, capture_output=True, timeout=300)
    (wheel,) = dist.glob("lethe-*.whl")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = Path(subprocess.check_output([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                        text=True).strip())  # fmt: skip
    install = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--no-deps",
        "--no-index",
        "-q",
        "--target",
        str(site),
        str(wheel),
    ]
    subprocess.run(install, check=True, capture_output=True, timeout=300)
    (site / "zz_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return venv / "bin"


def test_the_installed_wheel_migrates_postgres_and_serves_ready(installed, tmp_path):
    srv = tmp_path / "srv"  # the images' WORKDIR: the package is installed, nothing of the checkout is here
    srv.mkdir()
    python = installed / "python"
    where = subprocess.check_output([python, "-c", "import app; print(app.__file__)"], cwd=srv, text=True).strip()
    assert str(installed.parent) in where, f"the test must run the installed package, not the checkout: {where}"
    with fresh_database("lethe_installed") as url:
        env = {k: v for k, v in os.environ.items() if not k.startswith("LETHE_")}
        env |= {"LETHE_HOME": str(tmp_path / "home"), "LETHE_SECRET_KEY": TEST_SECRET, "LETHE_DATABASE_URL": url}
        lethe = [str(python), "-m", "app.cli"]  # the console script's entry point, with this environment's python
        migrated = subprocess.run([*lethe, "migrate"], cwd=srv, env=env, capture_output=True, text=True, timeout=300)
        assert migrated.returncode == 0, migrated.stderr[-2000:]
        engine = create_engine(url)
        try:
            tables = set(inspect(engine).get_table_names())
        finally:
            engine.dispose()
        assert {"deletion_requests", "datasets", "audit_events", "alembic_version"} <= tables
        port = _free_port()
        server = subprocess.Popen([*lethe, "serve", "--host", "127.0.0.1", "--port", str(port)], cwd=srv, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
        try:
            deadline, status = time.monotonic() + 120, None
            while time.monotonic() < deadline and server.poll() is None:
                try:
                    status = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=5).status_code
                except httpx.TransportError:
                    status = None
                if status == 200:
                    break
                time.sleep(0.5)
            assert status == 200, (status, server.poll())
            _assert_docs_served(f"http://127.0.0.1:{port}")
        finally:
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()


def _assert_docs_served(base: str) -> None:
    for page in ("/docs", "/redoc"):
        html = httpx.get(base + page, timeout=30)
        assert html.status_code == 200, (page, html.status_code)
        assets = re.findall(r'(?:src|href)="([^"]+)"', html.text)
        assert len(assets) >= 2 and all(url.startswith("/docs-assets/") for url in assets), (page, assets)
        for url in assets:
            answer = httpx.get(base + url, timeout=30)
            assert answer.status_code == 200 and answer.content, (url, answer.status_code)

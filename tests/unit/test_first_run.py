"""Issue 23, item 6 (first run): list settings written as people write them, settings errors as one line naming
the variable and never its value, and `lethe serve` saying where it answers, its home and its database."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from app.cli import serve_banner
from app.config import get_settings
from tests.helpers import TEST_SECRET, configure

ROOT = Path(__file__).resolve().parents[2]


def _env(tmp_path: Path, **settings: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LETHE_")}
    env |= {"LETHE_HOME": str(tmp_path / "home"), "LETHE_SECRET_KEY": TEST_SECRET, "PYTHONPATH": str(ROOT)}
    env |= {f"LETHE_{k.upper()}": v for k, v in settings.items()}
    return env


def test_list_settings_take_comma_separated_values_or_json(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    read = "from app.config import get_settings as g; s = g(); "
    read += "print(s.webhook_allowed_hosts, [p.name for p in s.data_roots])"
    for hosts, roots in (("127.0.0.1, ::1", f"{a},{b}"), ('["127.0.0.1", "::1"]', f'["{a}", "{b}"]')):
        env = _env(tmp_path, webhook_allowed_hosts=hosts, data_roots=roots)
        out = subprocess.run([sys.executable, "-c", read], env=env, capture_output=True, text=True, cwd=tmp_path)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == "['127.0.0.1', '::1'] ['a', 'b']"
    single = subprocess.run([sys.executable, "-c", read], env=_env(tmp_path, webhook_allowed_hosts="127.0.0.1"),
                            capture_output=True, text=True, cwd=tmp_path)  # fmt: skip
    assert single.stdout.strip() == "['127.0.0.1'] []"


def test_a_bad_setting_is_one_line_naming_it_and_never_its_value(tmp_path):
    secret = "too-short-secret-9f3a"
    env = _env(tmp_path, secret_key=secret, webhook_allowed_hosts="[not json")
    out = subprocess.run([sys.executable, "-m", "app.cli", "migrate"], env=env, capture_output=True, text=True,
                         cwd=tmp_path, timeout=120)  # fmt: skip
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert "LETHE_SECRET_KEY" in lines[0] and "at least 32 bytes" in lines[0]
    assert "LETHE_WEBHOOK_ALLOWED_HOSTS" in lines[0]
    assert secret not in out.stderr and "[not json" not in out.stderr


def test_serve_says_where_it_answers_its_home_and_database(tmp_path):
    configure(tmp_path / "home")
    banner = serve_banner("127.0.0.1", 8123)
    assert "http://127.0.0.1:8123/dashboard" in banner and "http://127.0.0.1:8123/docs" in banner
    assert str((tmp_path / "home").resolve()) in banner and "sqlite:///" in banner and "embedded" in banner
    os.environ["LETHE_DATABASE_URL"] = "postgresql+psycopg://lethe:s3cret-pw@db.internal/lethe"
    os.environ["LETHE_BROKER_URL"] = "redis://127.0.0.1:6379/0"
    get_settings.cache_clear()
    try:
        banner = serve_banner("0.0.0.0", 8000)
        assert "http://localhost:8000/dashboard" in banner and "listening on 0.0.0.0:8000" in banner
        assert "lethe:***@db.internal/lethe" in banner and "s3cret-pw" not in banner and "Celery" in banner
    finally:
        del os.environ["LETHE_DATABASE_URL"], os.environ["LETHE_BROKER_URL"]
        get_settings.cache_clear()

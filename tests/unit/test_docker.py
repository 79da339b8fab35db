"""docker/compose.yaml and the Dockerfiles, checked without Docker (no images are built here): the compose file
parses, names every process the README's "Scaling out" describes, runs commands the `lethe` CLI really has with
options it accepts, sets only settings Lethe knows, has its health checks and migration step, and each image's base
offers the Python the project installs."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import typer
import yaml

from app.cli import app as cli
from app.config import Settings

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
SERVICES = COMPOSE["services"]
LETHE = ["migrate", "api", "dispatcher", "webhook-sender", "worker-cpu", "worker-gpu"]
CONDITIONS = {"service_started", "service_healthy", "service_completed_successfully"}


def test_the_stack_has_every_process():
    assert set(SERVICES) == {"postgres", "redis", *LETHE}
    assert set(COMPOSE["volumes"]) == {"pgdata", "lethe-data"}


@pytest.mark.parametrize("name", LETHE)
def test_each_lethe_command_exists_with_its_options(name):
    command = SERVICES[name]["command"]
    assert command[0] == "lethe"
    group = typer.main.get_command(cli)
    root = group.make_context("lethe", list(command[1:]), resilient_parsing=True)
    sub = group.get_command(root, command[1])
    assert sub is not None, command
    sub.make_context(command[1], list(command[2:]), parent=root)  # raises on an unknown option or a bad value


@pytest.mark.parametrize("name", LETHE)
def test_settings_migration_and_shared_state(name):
    service = SERVICES[name]
    env = service["environment"]
    unknown = [k for k in env if k.removeprefix("LETHE_") not in {f.upper() for f in Settings.model_fields}]
    assert not unknown, unknown
    assert env["LETHE_RUN_DISPATCHER"] == "false"  # one dispatcher service, not one per API process
    assert "lethe-data:/var/lib/lethe" in service["volumes"]  # artifacts and signing keys, shared
    depends = service["depends_on"]
    assert all(d["condition"] in CONDITIONS for d in depends.values())
    if name == "migrate":
        assert depends == {"postgres": {"condition": "service_healthy"}} and service["restart"] == "no"
    else:
        assert depends["migrate"] == {"condition": "service_completed_successfully"}


def test_health_checks():
    for name in ("postgres", "redis", "api", "worker-cpu", "worker-gpu"):
        check = SERVICES[name]["healthcheck"]
        assert check["test"][0] in ("CMD", "CMD-SHELL"), name
        assert set(check) <= {"test", "interval", "timeout", "retries", "start_period", "start_interval"}
    assert any("/readyz" in part for part in SERVICES["api"]["healthcheck"]["test"])
    assert "inspect ping" in SERVICES["worker-gpu"]["healthcheck"]["test"][1]
    devices = SERVICES["worker-gpu"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert "--queues" in SERVICES["worker-gpu"]["command"] and "gpu" in SERVICES["worker-gpu"]["command"]
    assert SERVICES["worker-cpu"]["command"][SERVICES["worker-cpu"]["command"].index("--queues") + 1] == "cpu"


@pytest.mark.parametrize("dockerfile", ["Dockerfile.api", "Dockerfile.worker"])
def test_each_image_base_offers_the_python_it_installs(dockerfile):
    text = (ROOT / "docker" / dockerfile).read_text()
    base = re.search(r"^FROM (\S+)", text, re.M).group(1)
    match = re.fullmatch(r"python:(\d+)\.(\d+)(-[\w.-]+)?", base)
    assert match, f"{dockerfile}: the base {base} is not an official Python image"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["requires-python"] == ">=3.11,<3.13" and (int(match[1]), int(match[2])) == (3, 11)
    assert "apt-get install" not in text  # no second Python from the distribution
    pins = {d.split("==")[0]: d for d in project["dependencies"] if d.startswith(("torch==", "torchvision=="))}
    for pin in pins.values():
        assert pin in text, f"{dockerfile} must install {pin}, as pinned"


def test_the_readme_scaling_out_section_names_every_service():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Scaling out", 1)[1].split("\n## ", 1)[0]
    for name in SERVICES:
        assert f"`{name}`" in section, name


def _compose_cli() -> list[str] | None:
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    return ["docker-compose"] if shutil.which("docker-compose") else None


def test_docker_compose_config_accepts_the_file():
    """`docker compose config` (or docker-compose v1), offline: the file as Compose itself reads it. Skipped where
    neither is installed; the checks above still run."""
    command = _compose_cli()
    if command is None:
        pytest.skip("no docker compose here")
    path = str(ROOT / "docker" / "compose.yaml")
    env = {**os.environ, "LETHE_SECRET_KEY": "compose-config-check-0123456789abcdef"}
    done = subprocess.run([*command, "-f", path, "config", "-q"], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    missing = {k: v for k, v in env.items() if k != "LETHE_SECRET_KEY"}
    refused = subprocess.run([*command, "-f", path, "config", "-q"], capture_output=True, text=True, env=missing)
    assert refused.returncode != 0 and "LETHE_SECRET_KEY" in refused.stderr  # no stack without a master secret

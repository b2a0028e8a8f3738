"""The wheel holds what an installed user runs: every module of connector/ (``pushkv demo``,
``pushkv bench`` and their tools included), telemetry/, dashboard/ with its static files,
and the ``pushkv`` command; nothing of tests/ or bench/.

Builds from a copy of the sources in a temporary folder (setuptools' PEP 517 backend, no
isolation, no network), so no ``build/`` or egg-info lands in the checkout.
"""

from __future__ import annotations

import configparser
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("connector", "telemetry", "dashboard")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    pytest.importorskip("setuptools")
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    build = "import sys; from setuptools import build_meta; build_meta.build_wheel(sys.argv[1])"
    done = subprocess.run(
        [sys.executable, "-c", build, str(out)], cwd=src, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (whl,) = out.glob("pushkv-*.whl")
    return zipfile.ZipFile(whl)


def _sources(pattern: str) -> set[str]:
    return {p.relative_to(ROOT).as_posix() for p in ROOT.glob(pattern) if p.is_file()}


def test_every_module_is_in_the_wheel(wheel: zipfile.ZipFile) -> None:
    names = set(wheel.namelist())
    modules = set().union(*(_sources(f"{pkg}/**/*.py") for pkg in PACKAGES))
    assert {"connector/tools/demo.py", "connector/tools/bench/serve_bench.py"} <= modules
    assert {"dashboard/app.py", "telemetry/schema.py"} <= modules
    assert modules - names == set()


def test_dashboard_static_files_are_in_the_wheel(wheel: zipfile.ZipFile) -> None:
    static = _sources("dashboard/static/*")
    assert any(name.endswith(".js") for name in static)
    assert static - set(wheel.namelist()) == set()


def test_the_pushkv_command_and_nothing_else_at_top_level(wheel: zipfile.ZipFile) -> None:
    (info,) = {n.split("/")[0] for n in wheel.namelist() if ".dist-info/" in n}
    entry_points = configparser.ConfigParser()
    entry_points.read_string(wheel.read(f"{info}/entry_points.txt").decode())
    assert entry_points["console_scripts"]["pushkv"] == "connector.cli:main"
    top = {n.split("/")[0] for n in wheel.namelist()} - {info}
    assert top == set(PACKAGES)

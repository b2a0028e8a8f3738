"""``ClientZygote`` with a stand-in command (tests/fake_cli.py) in place of ``vllm``: each run
a fork of one process that preloaded its modules, logging where ``run_bench_serve`` logs,
its exit status and a run killed at its limit reported as before."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from connector.tools.bench.client_zygote import ClientZygote
from connector.tools.bench.vllm_bench import run_bench_serve
from connector.tools.procgroup import group_pids
from tests.docs.commands import ROOT

MODULE = "tests.fake_cli"
CMD = [sys.executable, "-m", MODULE]


@pytest.fixture
def zygote(tmp_path: Path) -> Iterator[ClientZygote]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with ClientZygote(tmp_path / "zygote.log", env, MODULE, ("colorsys",)) as z:
        yield z


def _said(log: Path) -> dict[str, str]:
    line = next(ln for ln in log.read_text().splitlines() if ln.startswith("argv "))
    m = re.match(r"argv (.*) cwd (.*) parent (\d+) preloaded (\w+)$", line)
    assert m, line
    return dict(zip(("argv", "cwd", "parent", "preloaded"), m.groups(), strict=True))


def test_runs_are_forks_of_one_process_that_preloaded_its_modules(
    zygote: ClientZygote, tmp_path: Path
) -> None:
    parents = set()
    for i in range(2):
        log = tmp_path / f"point{i}" / "run.log"
        assert run_bench_serve([*CMD, "run", str(i)], log, 30.0, zygote) is None
        said = _said(log)
        assert log.read_text().startswith(f"$ {' '.join(CMD)} run {i}\n")
        assert said["argv"] == f"['run', '{i}']" and said["cwd"] == str(log.parent)
        assert said["preloaded"] == "True"
        assert "# client scheduling class: " in log.read_text()
        parents.add(said["parent"])
    assert len(parents) == 1 and zygote.pid is not None and parents == {str(zygote.pid)}


def test_exit_codes_and_exceptions_fail_the_run_with_the_logs_last_line(
    zygote: ClientZygote, tmp_path: Path
) -> None:
    failure = run_bench_serve([*CMD, "exit", "3"], tmp_path / "a.log", 30.0, zygote)
    assert failure is not None and not failure.hung
    assert failure.reason.startswith("vllm bench serve exited 3")
    failure = run_bench_serve([*CMD, "raise", "boom"], tmp_path / "b.log", 30.0, zygote)
    assert failure is not None and failure.reason.endswith("RuntimeError: boom")
    assert run_bench_serve([*CMD, "exit", "0"], tmp_path / "c.log", 30.0, zygote) is None


def test_a_run_past_its_limit_is_killed_with_its_zygote_and_the_next_run_gets_a_new_one(
    zygote: ClientZygote, tmp_path: Path
) -> None:
    first = zygote.pid
    assert first is not None
    failure = run_bench_serve([*CMD, "sleep", "600"], tmp_path / "hung.log", 1.0, zygote)
    assert failure is not None and failure.hung
    assert zygote.pid is None and group_pids(first) == []  # the sleeping fork is gone too
    assert run_bench_serve([*CMD, "run"], tmp_path / "next.log", 30.0, zygote) is None
    assert _said(tmp_path / "next.log")["parent"] not in ("", str(first))


def test_a_command_of_another_module_runs_as_a_process_of_its_own(
    zygote: ClientZygote, tmp_path: Path
) -> None:
    assert not zygote.accepts([sys.executable, "-m", "json.tool", "--help"])
    cmd = [sys.executable, "-c", "import os; print('parent', os.getppid())"]
    assert run_bench_serve(cmd, tmp_path / "own.log", 30.0, zygote) is None
    assert f"parent {os.getpid()}" in (tmp_path / "own.log").read_text()

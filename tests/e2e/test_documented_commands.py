"""The README's commands, run as a user runs them: real vLLM P and D and the router.

``test_readme_pd_stack_as_written``: the README's blocks tagged ``e2e pd-stack`` (start P, D
and the router and wait until healthy; send a completion; stop all three), joined into one
bash script with only the ``P_PORT``/``D_PORT``/``ROUTER_PORT`` numbers replaced by free
ports. Checked: it exits 0, the completion came back, the block's own ``kill ...; wait``
left no process of the session behind, and the request is one trace across the router's,
P's and D's files. ``test_make_demo_recipe``: the Makefile's ``demo`` recipe (what ``make
demo`` runs once the venv is installed), with the Makefile's exported environment.

Each runs in its own session (stopped by process group whatever happens) and temp folder.
tests/docs checks that every other command of the documents is tagged and checked.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from connector.tools.procgroup import group_pids, stop_process_group
from connector.tools.stack import DROPPED_ENV
from connector.transport.ports import free_port
from telemetry.schema import Service, Span
from telemetry.traces import read_run
from tests.docs.commands import PORT_VARS, ROOT, all_blocks, group, with_ports

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1200)]

SCRIPT_TIMEOUT_S = 600.0  # two vLLM start-ups on a busy 2-core box, one request, the stop
STOPPED_WAIT_S = 30.0  # after `wait` returns, stragglers (an engine's child) may still exit
LOG_TAIL_LINES = 40


def _child_env() -> dict[str, str]:
    """A user's shell with the venv active: no tracing or run-folder overrides inherited
    from the test run, and none of the variables that override vLLM's flags."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in DROPPED_ENV and not k.startswith("OTEL_") and k != "PUSHKV_RUN_DIR"
    }
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(Path(sys.executable).parent.parent)
    return env


def _tails(folder: Path) -> str:
    out = []
    for log in sorted(folder.glob("*.log")) + sorted(folder.glob("*.txt")):
        lines = log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
        out.append(f"--- {log.name}\n" + "\n".join(lines))
    return "\n".join(out)


def _run_in_session(cmd: list[str], cwd: Path, env: dict[str, str]) -> tuple[int, list[int]]:
    """Run ``cmd`` in a session of its own; return its exit code and the processes of its
    group still alive ``STOPPED_WAIT_S`` after it ended. Whatever is left is stopped."""
    with (cwd / "stdout.txt").open("wb") as out:
        proc = subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        rc = proc.wait(timeout=SCRIPT_TIMEOUT_S)
        deadline = time.monotonic() + STOPPED_WAIT_S
        while group_pids(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        return rc, group_pids(proc.pid)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{cmd} still running after {SCRIPT_TIMEOUT_S:.0f} s\n{_tails(cwd)}")
    finally:
        stop_process_group(proc, 30.0)


def _answer(stdout: str) -> dict[str, Any]:
    start = stdout.find("{")
    assert start >= 0, f"no JSON answer in the output:\n{stdout[-2000:]}"
    answer, _ = json.JSONDecoder().raw_decode(stdout[start:])
    assert isinstance(answer, dict)
    return answer


def test_readme_pd_stack_as_written(tmp_path: Path) -> None:
    if not hasattr(os, "sched_getaffinity") or not {0, 1} <= os.sched_getaffinity(0):
        pytest.skip("the README pins P to CPU 0 and D to CPU 1")
    blocks = group(all_blocks([ROOT / "README.md"]), "pd-stack")
    assert len(blocks) == 3, [b.where for b in blocks]
    ports: dict[str, int] = {}
    while len(set(ports.values())) < len(PORT_VARS):
        ports = {name: free_port() for name in PORT_VARS}
    script = with_ports("".join(b.text for b in blocks), ports)
    (tmp_path / "readme-pd.sh").write_text(script)

    rc, left = _run_in_session(["bash", "readme-pd.sh"], tmp_path, _child_env())

    assert rc == 0, f"exit {rc}\n{_tails(tmp_path)}"
    assert not left, f"still running after the README's stop: {left}\n{_tails(tmp_path)}"
    answer = _answer((tmp_path / "stdout.txt").read_text())
    assert answer.get("object") == "text_completion", answer
    assert answer["choices"] and answer["usage"]["completion_tokens"] >= 1, answer
    # Where the three processes wrote their spans: runs/latest under the folder they ran in.
    run = read_run(tmp_path / "runs" / "latest")
    requests = [t for t in run.traces if t.named(Span.REQUEST.value)]
    assert len(requests) == 1, f"{len(requests)} request traces: {run.problems}"
    services = {sp.service for sp in requests[0].spans}
    assert services == {s.value for s in Service}, services
    assert requests[0].named(Span.WRITE.value), "P's WRITE is not in the request's trace"


def _makefile_recipe(target: str, env: dict[str, str]) -> list[str]:
    """The recipe lines of ``target``; ``env`` gets the variables the Makefile exports
    (``?=`` only where unset, as make does) and loses those it unexports."""
    text = (ROOT / "Makefile").read_text()
    m = re.search(rf"^{re.escape(target)}:[^\n]*\n((?:\t[^\n]*\n)+)", text, flags=re.M)
    assert m is not None, f"no `{target}` rule with a recipe in the Makefile"
    for name, op, value in re.findall(r"^export\s+(\w+)\s*([?:]?)=\s*(\S+)\s*$", text, re.M):
        if op != "?" or name not in env:
            env[name] = value
    for name in re.findall(r"^unexport\s+(\w+)\s*$", text, re.M):
        env.pop(name, None)
    return [line.strip() for line in m[1].splitlines()]


def test_make_demo_recipe(tmp_path: Path) -> None:
    env = _child_env()
    recipe = _makefile_recipe("demo", env)
    assert recipe == ["$(VENV)/bin/pushkv demo"], recipe
    venv = Path(sys.executable).parent.parent
    command = recipe[0].replace("$(VENV)", str(venv)).split()

    rc, left = _run_in_session(command, tmp_path, env)

    stdout = (tmp_path / "stdout.txt").read_text(errors="replace")
    assert rc == 0, f"`make demo`'s recipe exited {rc}\n{stdout[-4000:]}"
    assert not left, f"the demo left processes behind: {left}"
    assert "pushkv dashboard" in stdout, stdout[-2000:]  # it ends with how to open its traces
    assert (tmp_path / "runs" / "latest").is_dir()

"""``vllm bench serve`` runs forked from one process that imported vLLM once.

Owns ``ClientZygote`` (the caller's handle: starts the zygote, runs one command line in a
fresh fork of it, kills it at a time limit) and the zygote itself (``python -m
connector.tools.bench.client_zygote``). Why: the client's own start-up is importing vLLM,
which costs seconds (12 of a sweep point's 16-20 s on the 2-core box) and happens again for
every point; a fork of the zygote starts with it done. Each run is still a process of its
own, started from the command line ``vllm_bench.bench_command`` builds and logging to its
own file, as a fresh ``vllm`` process would.

The zygote runs ``python -m connector.tools.bench.client_zygote MODULE [PRELOAD...]``: it
imports the PRELOAD modules, then takes one JSON request a line on its stdin (``argv``,
``log``, ``cwd``), forks a child that runs ``MODULE.main()`` as ``python -m MODULE`` would,
waits, and answers one JSON line ``{"rc": N}`` (negative: killed by that signal) on what was
its stdout. Its own output goes to its log.

The handle must not import vLLM (the zygote does, in its own process).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import select
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from connector.tools.procgroup import stop_process_group
from connector.tools.stack import StartStop

# What `python -m vllm.entrypoints.cli.main bench serve` imports before it runs (its main()
# imports the subcommands lazily); a module this vLLM lacks is left to the child.
PRELOAD: tuple[str, ...] = (
    "vllm.entrypoints.cli.main",
    "vllm.entrypoints.cli.benchmark.main",
    "vllm.entrypoints.cli.benchmark.latency",
    "vllm.entrypoints.cli.benchmark.mm_processor",
    "vllm.entrypoints.cli.benchmark.serve",
    "vllm.entrypoints.cli.benchmark.startup",
    "vllm.entrypoints.cli.benchmark.sweep",
    "vllm.entrypoints.cli.benchmark.throughput",
    "vllm.entrypoints.cli.collect_env",
    "vllm.entrypoints.cli.download_kernels",
    "vllm.entrypoints.cli.launch",
    "vllm.entrypoints.cli.openai",
    "vllm.entrypoints.cli.preload",
    "vllm.entrypoints.cli.run_batch",
    "vllm.entrypoints.cli.serve",
    "vllm.entrypoints.cli.snapshot",
)
VLLM_MODULE = "vllm.entrypoints.cli.main"  # what the command lines run with `python -m`
CLIENT_PRIORITY = 10  # SCHED_FIFO priority of the load generator, where allowed
SCHED_CLASS = {
    getattr(os, "SCHED_FIFO", -1): "SCHED_FIFO",
    getattr(os, "SCHED_OTHER", -2): "SCHED_OTHER",
}


class ClientZygote(StartStop):
    """The caller's side: the zygote started on entry (its imports overlap what the caller
    does meanwhile), each ``run`` a fork of it, and the zygote stopped on exit. After a run
    killed at its limit the zygote is gone too; the next run starts a new one."""

    def __init__(
        self,
        log_path: Path,
        env: dict[str, str],
        module: str = VLLM_MODULE,
        preload: Sequence[str] = PRELOAD,
    ) -> None:
        self.log_path = log_path
        self.env = env
        self.module = module
        self.preload = tuple(preload)
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def pid(self) -> int | None:
        """The zygote's PID (it leads its process group); None while none runs."""
        return self._proc.pid if self._proc is not None else None

    def start(self) -> subprocess.Popen[bytes]:
        """The zygote, started unless it runs."""
        if self._proc is None or self._proc.poll() is not None:
            self.stop()
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = self.log_path.open("ab")
            self._proc = subprocess.Popen(
                [sys.executable, "-m", __name__, self.module, *self.preload],
                env=self.env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self._log,
                start_new_session=True,  # a run killed at its limit takes the group with it
            )
        return self._proc

    def accepts(self, cmd: Sequence[str]) -> bool:
        """Whether ``cmd`` is ``python -m MODULE`` of this interpreter (what a fork runs)."""
        return list(cmd[:3]) == [sys.executable, "-m", self.module]

    def run(self, cmd: Sequence[str], log_path: Path, limit_s: float) -> int | None:
        """Run ``cmd`` (``accepts``) in a fork, its output appended to ``log_path`` and its
        working directory that file's folder; its exit status (negative: the signal that
        ended it), or None when it was still running at ``limit_s`` and was killed."""
        if not self.accepts(cmd):
            raise ValueError(f"not python -m {self.module} of this interpreter: {cmd[:3]}")
        proc = self.start()
        assert proc.stdin is not None and proc.stdout is not None
        request = {"argv": list(cmd[3:]), "log": str(log_path), "cwd": str(log_path.parent)}
        try:
            proc.stdin.write((json.dumps(request) + "\n").encode())
            proc.stdin.flush()
            ready, _, _ = select.select([proc.stdout], [], [], limit_s)
            line = proc.stdout.readline() if ready else None
        except BaseException:
            self.stop()
            raise
        if line is None:
            self.stop()
            return None
        if not line:  # the zygote died: say so where the run's log is read
            died = proc.wait()
            self.stop()
            with log_path.open("a") as log:
                log.write(f"# the client zygote exited {died} (its log: {self.log_path})\n")
            return died or 1
        return int(json.loads(line)["rc"])

    def stop(self) -> None:
        """Stop the zygote and any run of it (by process group); idempotent."""
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.stdin is not None:
                with contextlib.suppress(OSError):
                    proc.stdin.close()
            # The whole group at once: a run still going (killed at its limit) goes with it.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            stop_process_group(proc, 10.0)
            if proc.stdout is not None:
                proc.stdout.close()
        if self._log is not None:
            self._log.close()
            self._log = None


# --- the zygote -------------------------------------------------------------------------------


def _preload(names: Sequence[str]) -> None:
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as exc:  # the child imports it (or fails) itself
            print(f"client zygote: {name} not preloaded: {exc!r}", file=sys.stderr)


def _child(module: str, request: dict[str, Any]) -> None:
    """In the fork: become ``python -m module`` with ``request``'s arguments; never returns."""
    code = 1
    try:
        null = os.open(os.devnull, os.O_RDONLY)
        log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.chdir(request["cwd"])
        with contextlib.suppress(OSError):  # not root: the normal class, and the log says so
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(CLIENT_PRIORITY))
        policy = os.sched_getscheduler(0)
        print(f"# client scheduling class: {SCHED_CLASS.get(policy, policy)}", flush=True)
        sys.argv = [module, *request["argv"]]
        importlib.import_module(module).main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def serve(module: str, preload: Sequence[str]) -> None:
    """The zygote: preload, then one fork per request line until end of input."""
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # what imports print goes to the log, not into the answers
    requests = os.fdopen(os.dup(0), "r")
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    _preload(preload)
    for line in requests:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            requests.close()
            replies.close()
            _child(module, request)
        _, status = os.waitpid(pid, 0)
        replies.write(json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\n")
        replies.flush()


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2:])

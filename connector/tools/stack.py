"""Process management for real vLLM servers: ``make demo``, the end-to-end tests, the benchmarks.

Owns: the vLLM command line and child environment we run with (``VllmServer``), starting a
server in its own session, waiting for ``/health``, stopping it by process group
(procgroup.py; ``ChildProcess``, which ``pdstack.RouterProcess`` shares), and ``Stack``,
which starts several services concurrently and always stops them all, in reverse order.

Must not import vLLM, NIXL or torch: servers are child processes started with this interpreter
(``python -m vllm.entrypoints.openai.api_server``, which works even where the ``vllm`` command
does not, e.g. without a `vllm` dist-info). Needs only httpx.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Any, ClassVar, Protocol, Self

import httpx

from connector.core.errors import PushkvError

# Re-exported (the noqa'd names): many callers (tests/e2e, connector/tools/bench/, bench/)
# pick and check ports, and the benchmarks count a stack's processes and CPU, through here.
from connector.tools.procgroup import (
    group_cpu_s,  # noqa: F401
    group_pids,  # noqa: F401
    group_rss_bytes,
    group_stopped,
    stop_process_group,
)
from connector.transport.ports import free_port, port_is_free  # noqa: F401

KV_CACHE_MEMORY_BYTES = 256 << 20  # ample for the tiny model; it is resident in every server

# The child environment every server gets. UCX on loopback only; no hub access.
BASE_ENV: dict[str, str] = {
    "HF_HUB_OFFLINE": "1",
    "UCX_TLS": "tcp,sm,self",
    "UCX_NET_DEVICES": "lo",
    "PYTHONUNBUFFERED": "1",
}
# VLLM_CPU_KVCACHE_SPACE, when set, overrides --kv-cache-memory-bytes on the CPU platform
# (vllm/platforms/cpu.py, "Legacy setting"), so it must not leak into the child.
DROPPED_ENV = ("VLLM_CPU_KVCACHE_SPACE",)
SHUTDOWN_TIMEOUT_S = 5  # vLLM's --shutdown-timeout: engines exit on their own, spans flushed


class ServerError(PushkvError):
    """A managed server failed to start, exited early or did not become healthy in time."""


def tail_lines(path: Path, n: int) -> str:
    try:
        with path.open("r", errors="replace") as f:
            return "".join(deque(f, maxlen=n))
    except OSError as exc:
        return f"<log {path} unreadable: {exc}>"


def first_traceback(path: Path, max_lines: int = 40) -> str:
    """The log's first Python traceback, through its exception line ("" if none): a server
    that dies in start-up often ends with a traceback of its own that says "see root cause
    above", and on a busy box that cause is far above the log's tail."""
    try:
        with path.open("r", errors="replace") as f:
            lines = f.readlines()
    except OSError:
        return ""
    start = next((i for i, line in enumerate(lines) if "Traceback (most recent" in line), None)
    if start is None:
        return ""
    # The exception line is the first one after the frames that is not indented (a process
    # prefix such as "(EngineCore pid=1) " counts as part of the line).
    end = start + 1
    while end < len(lines):
        body = lines[end].split(") ", 1)[1] if lines[end].startswith("(") else lines[end]
        end += 1
        if body.strip() and not body.startswith((" ", "\t")):
            break
    picked = lines[start:end]
    if len(picked) > max_lines:
        picked = picked[:5] + ["...\n"] + picked[-(max_lines - 6) :]
    return "".join(picked)


class Service(Protocol):
    """What ``Stack`` manages: anything that starts, becomes healthy and stops."""

    def start(self) -> None: ...
    def wait_healthy(self, timeout_s: float) -> None: ...
    def stop(self, timeout_s: float = ...) -> None: ...


class ChildProcess:
    """A service run as a child process in its own session, with ``/health`` on ``url``:
    spawning, the health wait and the stop that ``VllmServer`` and ``pdstack.RouterProcess``
    share. Subclasses are dataclasses that declare these fields and give ``command()``."""

    kind: ClassVar[str]  # what error messages call it
    host: str
    port: int
    log_path: Path | None
    _proc: subprocess.Popen[bytes] | None
    _log_file: IO[bytes] | None

    def command(self) -> list[str]:
        raise NotImplementedError

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def log_tail(self, n: int = 40) -> str:
        return tail_lines(self.log_path, n) if self.log_path else "<no log>"

    def _spawn(self, env: Mapping[str, str], preexec_fn: Callable[[], Any] | None = None) -> None:
        """Start ``command()`` in a session of its own (so stopping can signal its whole
        group), its output after the command line to ``log_path``, or nowhere."""
        if self._proc is not None:
            raise ServerError(f"{self.kind} on port {self.port} already started (pid {self.pid})")
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log_file = self.log_path.open("wb")
            self._log_file.write(("$ " + " ".join(self.command()) + "\n").encode())
            self._log_file.flush()
        self._proc = subprocess.Popen(
            self.command(),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._log_file or subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=preexec_fn,
        )

    def ready(self, health: httpx.Response) -> bool:
        """Whether a /health answer means ready to serve as this service should."""
        return health.status_code == 200

    def wait_healthy(self, timeout_s: float = 180.0) -> None:
        """Poll GET /health until 200. Raise ServerError at once if the process exits, or
        after ``timeout_s``; either message carries the last 40 log lines."""
        if self._proc is None:
            raise ServerError(f"{self.kind} on port {self.port} was never started")
        deadline = time.monotonic() + timeout_s
        last = "no answer"
        with httpx.Client(timeout=2.0, trust_env=False) as client:  # no proxies for loopback
            while True:
                rc = self._proc.poll()
                if rc is not None:
                    first = first_traceback(self.log_path) if self.log_path else ""
                    raise ServerError(
                        f"{self.kind} on port {self.port} exited with code {rc} before it "
                        f"was healthy; last lines of {self.log_path}:\n{self.log_tail(40)}"
                        + (f"\nits first traceback:\n{first}" if first else "")
                    )
                try:
                    r = client.get(f"{self.url}/health")
                    if self.ready(r):
                        return
                    last = f"{r.status_code} {r.text[:200]}"
                except httpx.HTTPError as exc:  # not listening yet: ask again
                    last = repr(exc)
                if time.monotonic() >= deadline:
                    raise ServerError(
                        f"{self.kind} on port {self.port} not healthy after "
                        f"{timeout_s:.0f} s (last /health: {last}); last lines of "
                        f"{self.log_path}:\n{self.log_tail(40)}"
                    )
                time.sleep(0.5)

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the leader, then (after half of ``timeout_s``) its whole process group,
        then SIGKILL the group at ``timeout_s``. Idempotent; a no-op if never started.

        Why the leader first: vLLM's API server stops its EngineCore itself; SIGTERM to the
        whole group at once kills the engine under it and logs an EngineDeadError on every stop.
        """
        proc, self._proc = self._proc, None
        if proc is not None:
            stop_process_group(proc, timeout_s)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def paused(self) -> contextlib.AbstractContextManager[None]:
        """The whole process group stopped (SIGSTOP) for a ``with`` block and continued
        (SIGCONT) after it, even when the block raises: a hung host (fault tests)."""
        if self._proc is None:
            raise ServerError(f"{self.kind} on port {self.port} is not running")
        return group_stopped(self._proc.pid)

    def kill(self) -> None:
        """SIGKILL the whole process group at once, as a crash would (fault tests); the
        service can be started again afterwards."""
        proc, self._proc = self._proc, None
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None


class StartStop:
    """``with``: ``start()``, then ``stop()`` on the way out (``VllmServer``, ``Stack``,
    ``PdStack``, ``HostStack``)."""

    def start(self) -> object:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # Leaving on an error: that error is the one to see, not a failed stop after it.
        with contextlib.suppress(ServerError) if exc is not None else contextlib.nullcontext():
            self.stop()


@dataclass
class VllmServer(ChildProcess, StartStop):
    """One vLLM OpenAI-compatible server as a child process (config plus lifecycle).

    ``env`` is added to the child environment (e.g. ``VLLM_NIXL_SIDE_CHANNEL_PORT``);
    ``extra_args`` go after the standard flags, so they can override them (argparse keeps
    the last value). The log defaults to a file in the temp directory named by the port.
    """

    kind: ClassVar[str] = "vLLM"
    model: Path
    port: int
    served_model_name: str = "tiny"
    kv_transfer_config: dict[str, Any] | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    extra_args: Sequence[str] = ()
    log_path: Path | None = None
    host: str = "127.0.0.1"
    max_model_len: int = 2048
    kv_cache_memory_bytes: int = KV_CACHE_MEMORY_BYTES
    seed: int = 0
    # vLLM's CPU build runs eager; on a GPU, CUDA graphs (vLLM's default) are what users run
    # and what decides a decode step's time there.
    eager: bool = True
    python: str = sys.executable
    # CPUs the whole server (API server, EngineCore, their threads) starts on, like a host
    # of its own (pushkv's transfer thread stays inside it); None: wherever the OS puts it.
    cpu_affinity: frozenset[int] | None = None
    _proc: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)
    _log_file: IO[bytes] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.log_path is None:
            self.log_path = Path(tempfile.gettempdir()) / f"pushkv-vllm-{self.port}.log"

    # --- configuration -----------------------------------------------------------------

    @property
    def log(self) -> Path:
        assert self.log_path is not None  # set in __post_init__
        return self.log_path

    def command(self) -> list[str]:
        cmd = [
            self.python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model),
            "--served-model-name",
            self.served_model_name,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--dtype",
            "bfloat16",
            "--max-model-len",
            str(self.max_model_len),
            *(["--enforce-eager"] if self.eager else []),
            "--seed",
            str(self.seed),
            "--kv-cache-memory-bytes",
            str(self.kv_cache_memory_bytes),
            # 0.32 has no --disable-log-requests: request logging is opt-in
            # (--enable-log-requests). Say so explicitly; also drop uvicorn's access log,
            # which would otherwise log every /health poll.
            "--no-enable-log-requests",
            "--disable-uvicorn-access-log",
            # vLLM's default (0) SIGKILLs EngineCore and its workers the moment it stops,
            # before they can flush their spans (the last request's D spans would be lost).
            "--shutdown-timeout",
            str(SHUTDOWN_TIMEOUT_S),
        ]
        if self.kv_transfer_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(self.kv_transfer_config)]
        return cmd + list(self.extra_args)

    def child_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in DROPPED_ENV}
        env.update(BASE_ENV)
        env.update(self.env)
        return env

    # --- lifecycle ---------------------------------------------------------------------

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        """Spawn the server in its own session (so stop() can signal the whole group:
        the API server plus its EngineCore child). Returns at once; see wait_healthy()."""
        cpus = self.cpu_affinity
        self._spawn(
            self.child_env(),
            # children inherit the mask; set in the child before exec (no threads there yet)
            None if cpus is None else lambda: os.sched_setaffinity(0, cpus),
        )

    def rss_bytes(self) -> int:
        """Summed RSS of the server's process group (API server + engine); 0 if not running."""
        return group_rss_bytes(self._proc.pid) if self._proc is not None else 0

    def __enter__(self) -> Self:
        self.start()
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self


class Stack(StartStop):
    """Several services started together: all are spawned first (their start-ups overlap),
    then waited on under one deadline. Stopping stops them all at once and reaches every
    service even if some stop() fails; if start-up fails, everything started is stopped."""

    def __init__(self, services: Sequence[Service]) -> None:
        self.services = list(services)
        self._started: list[Service] = []

    def start(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        try:
            for service in self.services:
                self._started.append(service)  # before start(): a half-started one is stopped
                service.start()
            for service in self.services:
                service.wait_healthy(max(1.0, deadline - time.monotonic()))
        except BaseException:
            self.stop()
            raise

    def stop(self, timeout_s: float = 30.0) -> None:
        # All at once: each vLLM server takes its --shutdown-timeout and teardown (about 6 s on
        # two cores), so stopping them one after another multiplied that by the stack's size.
        started, self._started = self._started[::-1], []
        with concurrent.futures.ThreadPoolExecutor(max(1, len(started))) as pool:
            futures = [pool.submit(service.stop, timeout_s) for service in started]
        errors = [exc for f in futures if (exc := f.exception()) is not None]
        if errors:
            raise ServerError(f"{len(errors)} service(s) failed to stop: {errors!r}") from errors[0]

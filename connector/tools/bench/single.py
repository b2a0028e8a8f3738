"""The sweep's ideal: one plain vLLM instance, no disaggregation (configuration ``single``).

Owns: ``SingleStack``, one ``VllmServer`` with no KV connector and no router, pinned like one
engine of a pair (``VLLM_CPU_OMP_THREADS_BIND`` = P's CPU and, unless ``pin_servers`` is off,
its whole process tree on that CPU), with the same model, flags and KV size as P and D. It
answers the same calls as ``connector.tools.bench.stacks.BenchStack`` that the sweep makes
(``url``, ``start``, ``stop``, ``ports``, ``group_leaders``, ``describe``), so a sweep runs
it like any other configuration. It writes no traces: vLLM alone has no pushkv spans, so its
points have a TTFT but no decomposition, and there is no router hop, transfer or first step
on D: what is left is the part of TTFT no disaggregation can remove.

Must not import vLLM (the server is a child process).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from connector.tools.pdstack import cpu_set
from connector.tools.stack import VllmServer, free_port

SINGLE = "single"
SINGLE_DESCRIPTION = "one plain vLLM instance, no KV connector, no router (the ideal)"


@dataclass
class SingleStack:
    model: Path
    run_dir: Path
    server_args: Sequence[str] = ()
    cpus: str = "0"  # P's CPU in a pair
    pin_servers: bool = True
    gpus: str | None = None  # CUDA_VISIBLE_DEVICES on a GPU host: P's GPU(s) in a pair
    server: VllmServer = field(init=False)
    start_duration_s: float | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        wanted = cpu_set(self.cpus)
        pin = self.pin_servers and hasattr(os, "sched_getaffinity")
        env = {"VLLM_CPU_OMP_THREADS_BIND": self.cpus, "OTEL_SDK_DISABLED": "true"}
        if self.gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.gpus
        self.server = VllmServer(
            self.model,
            free_port(),
            env=env,
            extra_args=list(self.server_args),
            log_path=self.run_dir / "single.log",
            eager=self.gpus is None,
            cpu_affinity=wanted if pin and wanted <= os.sched_getaffinity(0) else None,
        )

    @property
    def url(self) -> str:
        return self.server.url

    def start(self, timeout_s: float = 300.0) -> float:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        self.server.start()
        try:
            self.server.wait_healthy(timeout_s)
        except BaseException:
            self.server.stop()
            raise
        self.start_duration_s = time.monotonic() - t0
        return self.start_duration_s

    def stop(self, timeout_s: float = 30.0) -> None:
        self.server.stop(timeout_s)

    def ports(self) -> dict[str, int]:
        return {SINGLE: self.server.port}

    def group_leaders(self) -> list[int]:
        return [] if self.server.pid is None else [self.server.pid]

    def describe(self) -> str:
        return f"{SINGLE:8} {self.url:24} pid {self.server.pid}  log {self.server.log}"

"""A disaggregated pair on one machine: a prefill (P) server, a decode (D) server and the router.

Owns: ``RouterProcess`` (``pushkv router`` as a child process: start, ``/health``, stop by
process group), ``PdStack`` (the P and D command lines and environments per connector, the
ports, the CPU binding, the run folder with one log per process), ``CONNECTORS`` (which
router mode and loading each supported connector needs), and ``metric_sum``, which reads one
metric out of a server's Prometheus ``/metrics`` text (tests and the demo take deltas of it).

Why the CPU binding: vLLM's CPU worker pins each engine to the cores of its OpenMP pool, and
with ``VLLM_CPU_OMP_THREADS_BIND=auto`` both P and D land on CPU 0 and starve each other
(stalls of tens of seconds on 2 cores). P gets core 0, D core 1 unless told otherwise.

Must not import vLLM, NIXL or torch (see ``connector.tools.stack``). Needs only httpx.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, ClassVar

import httpx

from connector.tools.procgroup import group_cpu_s
from connector.tools.stack import (
    ChildProcess,
    Stack,
    StartStop,
    VllmServer,
    free_port,
)


@dataclass(frozen=True)
class ConnectorSpec:
    """How one KV connector is loaded, and how the router drives it."""

    module_path: str | None  # kv_connector_module_path; None: vLLM's built-in registry
    router_mode: str
    nixl_side_channel_env: bool  # vLLM's connectors read VLLM_NIXL_SIDE_CHANNEL_{HOST,PORT}


CONNECTORS: dict[str, ConnectorSpec] = {
    "PushConnector": ConnectorSpec("connector", "push", False),
    "NixlConnector": ConnectorSpec(None, "pull", True),
    "NixlPushConnector": ConnectorSpec(None, "vllm-push", True),
}

PREFILL_ENGINE_ID, DECODE_ENGINE_ID = "prefill", "decode"
# On a GPU host the KV is in VRAM: UCX needs its CUDA transports (vLLM's NIXL connectors,
# and pushkv's direct path); still this machine only. PUSHKV_GPU_UCX_TLS replaces the list
# (scripts/gpu/README.md: the pull path's transports without tcp).
GPU_UCX_TLS = "tcp,sm,self,cuda_copy,cuda_ipc"
GPU_UCX_TLS_ENV = "PUSHKV_GPU_UCX_TLS"
# UCX turns cuda_ipc's GET off on a GPU without active NVLink (two processes of one GPU too),
# so vLLM's pull, a READ, fell back to "software emulation" over tcp/lo
# (bench/results/gpu-20261206-h100/): on, as llm-d's deployments set it. A caller's value wins.
GPU_IPC_GET = "UCX_CUDA_IPC_ENABLE_GET_ZCOPY"
ROUTER_HEALTH_TIMEOUT_S = 5.0  # overridable: router_args come later and argparse keeps the last

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def metric_sum(metrics_text: str, name: str, **labels: str) -> float | None:
    """The sum of every sample of ``name`` whose labels include ``labels``, in Prometheus
    text format (``name{a="x",...} value``); None if there is no such sample."""
    total, seen = 0.0, False
    for line in metrics_text.splitlines():
        m = _SAMPLE.match(line)
        if m is None or m[1] != name:
            continue
        have = dict(_LABEL.findall(m[2] or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(m[3])
            seen = True
    return total if seen else None


def cpu_set(spec: str) -> frozenset[int]:
    """CPUs of a ``VLLM_CPU_OMP_THREADS_BIND`` list such as ``0``, ``0-3`` or ``0,2-3``, or
    of one list per TP rank joined by ``|`` (``0|1``): all of them."""
    cpus: set[int] = set()
    for part in spec.replace("|", ",").split(","):
        lo, dash, hi = part.strip().partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise ValueError(f"not a CPU list: {spec!r}")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return frozenset(cpus)


def distinct_free_ports(n: int) -> list[int]:
    ports: list[int] = []
    while len(ports) < n:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


def kv_transfer_config(
    connector_name: str,
    role: str,
    engine_id: str,
    extra: Mapping[str, Any],
    kv_load_failure_policy: str = "recompute",
    kv_buffer_device: str = "cpu",
    spec: ConnectorSpec | None = None,
) -> dict[str, Any]:
    """One server's ``--kv-transfer-config``: ``connector_name`` (a key of ``CONNECTORS``) in
    ``role`` (``kv_producer`` or ``kv_consumer``), ``extra`` its ``kv_connector_extra_config``;
    ``spec`` replaces ``CONNECTORS[connector_name]`` (the benchmark's module-path overrides)."""
    ktc: dict[str, Any] = {
        "kv_connector": connector_name,
        "kv_role": role,
        "engine_id": engine_id,
        "kv_buffer_device": kv_buffer_device,
        "kv_connector_extra_config": dict(extra),
    }
    if (module_path := (spec or CONNECTORS[connector_name]).module_path) is not None:
        ktc["kv_connector_module_path"] = module_path
    if role == "kv_consumer":
        ktc["kv_load_failure_policy"] = kv_load_failure_policy
    return ktc


def server_affinity(cpus: str) -> frozenset[int] | None:
    """The CPUs of ``cpus`` (a ``VLLM_CPU_OMP_THREADS_BIND`` value) to confine a whole server
    to, or None where this process may not use them all (e.g. a 1-CPU machine)."""
    wanted = cpu_set(cpus)
    if not hasattr(os, "sched_getaffinity"):
        return None
    return wanted if wanted <= os.sched_getaffinity(0) else None


def trace_env(run_dir: Path, tracing: bool = True) -> dict[str, str]:
    """Where a child writes its spans (``run_dir``), or tracing off."""
    if not tracing:
        return {"OTEL_SDK_DISABLED": "true"}
    return {"PUSHKV_RUN_DIR": str(run_dir.resolve())}


def _urls(url: str | Sequence[str]) -> list[str]:
    return [url] if isinstance(url, str) else list(url)


@dataclass
class RouterProcess(ChildProcess):
    """``python -m connector.cli router ...`` in its own session; healthy when its
    ``/health`` answers 200 with status "ok" (both backends healthy and, in push mode, P
    probed; "degraded", D alone, is not what a stack is started for)."""

    kind: ClassVar[str] = "router"
    prefill_url: str | Sequence[str]  # one URL, or one per P
    decode_url: str | Sequence[str]
    port: int
    mode: str = "push"
    extra_args: Sequence[str] = ()
    log_path: Path | None = None
    host: str = "127.0.0.1"
    python: str = sys.executable
    env: Mapping[str, str] = field(default_factory=dict)  # added to this environment
    # The stacks share two cores with the engines: the router at SCHED_FIFO where allowed
    # (connector/router/priority.py says why; not allowed, it logs so and runs normally).
    realtime_priority: int = 10
    _proc: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)
    _log_file: IO[bytes] | None = field(default=None, init=False, repr=False)

    def ready(self, health: httpx.Response) -> bool:
        try:
            return health.status_code == 200 and health.json().get("status") == "ok"
        except ValueError:
            return False

    def command(self) -> list[str]:
        return [
            self.python,
            "-m",
            "connector.cli",
            "router",
            # none of a role: a --members-file (in extra_args) lists them
            *(["--prefill", *_urls(self.prefill_url)] if _urls(self.prefill_url) else []),
            *(["--decode", *_urls(self.decode_url)] if _urls(self.decode_url) else []),
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--mode",
            self.mode,
            "--realtime-priority",
            str(self.realtime_priority),
            *self.extra_args,
        ]

    def start(self) -> None:
        self._spawn({**os.environ, **self.env})

    def stop(self, timeout_s: float = 10.0) -> None:
        super().stop(timeout_s)


@dataclass
class PdStack(StartStop):
    """P (kv_producer, engine id ``prefill``), D (kv_consumer, engine id ``decode``) and the
    router, on free ports, logging to ``run_dir``. ``connector_name`` is a key of
    ``CONNECTORS``; the extra configs become each side's ``kv_connector_extra_config``.

    ``start()`` spawns all three at once (their start-ups overlap), waits until every one is
    healthy under one deadline, and stops everything if any fails; ``stop()`` reverses it.
    """

    model: Path
    run_dir: Path
    connector_name: str = "PushConnector"
    prefill_extra_config: Mapping[str, Any] = field(default_factory=dict)
    decode_extra_config: Mapping[str, Any] = field(default_factory=dict)
    kv_load_failure_policy: str = "recompute"
    server_args: Sequence[str] = ()  # appended to both vLLM command lines
    router_args: Sequence[str] = ()
    prefill_cpus: str = "0"  # VLLM_CPU_OMP_THREADS_BIND of each engine (one list per TP rank)
    decode_cpus: str = "1"
    prefill_tp: int = 1  # --tensor-parallel-size of each engine
    decode_tp: int = 1
    # On a GPU host, CUDA_VISIBLE_DEVICES of each server ("0", "1", "0,1" for TP2); None leaves
    # the caller's environment alone (both servers see every GPU: on one GPU they share it).
    prefill_gpus: str | None = None
    decode_gpus: str | None = None
    # Where vLLM's NIXL connectors keep the KV they transfer: "cuda" on a GPU host (pushkv
    # reads the KV where the engine keeps it and ignores this).
    kv_buffer_device: str = "cpu"
    # Also confine each server's processes (API server, EngineCore, workers, their threads)
    # to those CPUs, as if P and D were hosts of their own; the router stays unpinned.
    # pushkv's transfer thread leaves vLLM's OpenMP core but not its server's CPUs
    # (connector/transfer/thread_os.py, unpin). Unpinned, D's API server and EngineCore
    # compete with P's prefill on P's core, which every connector's TTFT shows
    # (``pushkv bench``).
    pin_servers: bool = True
    # Every process writes its spans to run_dir/traces-<service>-<pid>.jsonl (or where the
    # caller's OTEL_* variables say); False sets OTEL_SDK_DISABLED for all three.
    tracing: bool = True
    prefill: VllmServer = field(init=False)
    decode: VllmServer = field(init=False)
    router: RouterProcess = field(init=False)
    start_duration_s: float | None = field(default=None, init=False)
    _stack: Stack = field(init=False, repr=False)

    def __post_init__(self) -> None:
        spec = self._connector()
        p_port, d_port, r_port, p_side, d_side = distinct_free_ports(5)
        self.prefill = self._server(
            "prefill",
            p_port,
            "kv_producer",
            PREFILL_ENGINE_ID,
            self.prefill_extra_config,
            self.prefill_cpus,
            p_side,
            spec,
            self.prefill_gpus,
            self.prefill_tp,
        )
        self.decode = self._server(
            "decode",
            d_port,
            "kv_consumer",
            DECODE_ENGINE_ID,
            self.decode_extra_config,
            self.decode_cpus,
            d_side,
            spec,
            self.decode_gpus,
            self.decode_tp,
        )
        # One health check that times out marks a backend down (503s until the next good
        # check); the router's 1 s default is too short for a busy 2-core box.
        router_args = ["--health-timeout", str(ROUTER_HEALTH_TIMEOUT_S), *self.router_args]
        if spec.router_mode == "vllm-push":  # NixlPushConnector has no probe: say where P is
            router_args = [
                "--prefill-engine-id",
                PREFILL_ENGINE_ID,
                "--prefill-kv-host",
                "127.0.0.1",
                "--prefill-kv-port",
                str(p_side),
                "--prefill-tp-size",
                str(self.prefill_tp),
                *router_args,
            ]
        self.router = RouterProcess(
            self.prefill.url,
            self.decode.url,
            r_port,
            mode=spec.router_mode,
            extra_args=router_args,
            log_path=self.run_dir / "router.log",
            env=self._trace_env(),
        )
        self._stack = Stack([self.prefill, self.decode, self.router])

    def _connector(self) -> ConnectorSpec:
        """How both servers load the connector and how the router drives it."""
        try:
            return CONNECTORS[self.connector_name]
        except KeyError:
            raise ValueError(
                f"unknown connector {self.connector_name!r}; known: {sorted(CONNECTORS)}"
            ) from None

    def _server(
        self,
        name: str,
        port: int,
        role: str,
        engine_id: str,
        extra: Mapping[str, Any],
        cpus: str,
        side_port: int,
        spec: ConnectorSpec,
        gpus: str | None = None,
        tp: int = 1,
    ) -> VllmServer:
        ktc = kv_transfer_config(
            self.connector_name,
            role,
            engine_id,
            extra,
            self.kv_load_failure_policy,
            self.kv_buffer_device,
            spec,
        )
        env = {"VLLM_CPU_OMP_THREADS_BIND": cpus, **self._trace_env()}
        tp_args = ["--tensor-parallel-size", str(tp)] if tp > 1 else []
        if gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpus
            env["UCX_TLS"] = os.environ.get(GPU_UCX_TLS_ENV) or GPU_UCX_TLS
            env[GPU_IPC_GET] = os.environ.get(GPU_IPC_GET) or "on"
        if spec.nixl_side_channel_env:
            env |= {
                "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_port),
            }
        return VllmServer(
            self.model,
            port,
            kv_transfer_config=ktc,
            env=env,
            extra_args=[*tp_args, *self.server_args],
            log_path=self.run_dir / f"{name}.log",
            cpu_affinity=self._affinity(cpus),
            eager=gpus is None,
        )

    def _affinity(self, cpus: str) -> frozenset[int] | None:
        return server_affinity(cpus) if self.pin_servers else None

    def _trace_env(self) -> dict[str, str]:
        return trace_env(self.run_dir, self.tracing)

    # --- lifecycle ---------------------------------------------------------------------

    @property
    def url(self) -> str:
        """The router: where clients send requests."""
        return self.router.url

    @property
    def prefills(self) -> tuple[VllmServer, ...]:
        return (self.prefill,)

    @property
    def decodes(self) -> tuple[VllmServer, ...]:
        return (self.decode,)

    def start(self, timeout_s: float = 300.0) -> float:
        """Start all three and wait until healthy; returns (and records) the seconds it took."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        self._stack.start(timeout_s)
        self.start_duration_s = time.monotonic() - t0
        return self.start_duration_s

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stack.stop(timeout_s)

    def server_cpu_s(self) -> float:
        """CPU seconds used so far by every process of both servers' groups (not the router)."""
        return sum(group_cpu_s(s.pid) for s in (self.prefill, self.decode) if s.pid is not None)

    def describe(self) -> str:
        """URLs, PIDs (each leads its process group) and logs, one line each."""
        rows = [
            ("router", self.router.url, self.router.pid, self.router.log_path),
            ("prefill", self.prefill.url, self.prefill.pid, self.prefill.log),
            ("decode", self.decode.url, self.decode.pid, self.decode.log),
        ]
        return "\n".join(f"{name:8} {url:24} pid {pid}  log {log}" for name, url, pid, log in rows)

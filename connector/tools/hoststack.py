"""Several P and D vLLM servers, each on a simulated host of its own, and one router.

Owns: ``Instance`` (one server's CPUs, TP size and pushkv knobs), ``HostedServer`` (a
``VllmServer`` run inside a ``netbed.Host``: its command behind ``ip netns exec``; its API
server, side channel and doorbell bound to the host's address, which is also the address it
advertises to peers and the router; UCX over TCP on the host's interface only) and
``HostStack`` (xPyD with pushkv and one router in the root namespace, which reaches the
servers over the bed's bridge; started together, stopped together, the bed removed last).
With ``on_hosts=False`` every server binds 127.0.0.1 instead (heterogeneous TP on one host).

This is the model of a multi-host deployment (docs/deploy.md): each instance binds and
advertises its own address, and nothing crosses between instances but TCP and UDP.

Must not import vLLM, NIXL or torch (see ``connector.tools.stack``). Needs root for the bed
(``netbed.Unavailable`` says why not).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from connector.config import parse_config
from connector.tools.netbed import Host, NetBed
from connector.tools.pdstack import (
    ROUTER_HEALTH_TIMEOUT_S,
    RouterProcess,
    distinct_free_ports,
    kv_transfer_config,
    server_affinity,
    trace_env,
)
from connector.tools.stack import ServerError, Stack, StartStop, VllmServer, tail_lines

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class Instance:
    """One P or D server: ``cpus`` is its ``VLLM_CPU_OMP_THREADS_BIND`` (one CPU list per
    worker: TP rank, for each pipeline stage of ``pp``; joined by ``|``), ``extra_config``
    its pushkv knobs beyond the address, ``args`` its own vLLM flags (after the stack's),
    ``eager`` whether it runs with ``--enforce-eager``."""

    cpus: str = "0"
    tp: int = 1
    extra_config: Mapping[str, Any] = field(default_factory=dict)
    pp: int = 1
    args: tuple[str, ...] = ()
    eager: bool = True

    def __post_init__(self) -> None:
        workers = self.tp * self.pp
        if len(self.cpus.split("|")) != workers:
            what = f"{self.tp} TP ranks" + (f" x {self.pp} stages" if self.pp > 1 else "")
            raise ValueError(f"{what} need {workers} CPU lists, got {self.cpus!r}")


@dataclass
class HostedServer(VllmServer):
    """A ``VllmServer`` inside ``where`` (a netbed host), or on this host when None."""

    where: Host | None = None

    def command(self) -> list[str]:
        cmd = super().command()
        return cmd if self.where is None else self.where.argv(cmd)


# Two cores: P i on core i, D i on the other core, so each core runs one P and one D.
TWO_BY_TWO = ((Instance("0"), Instance("1")), (Instance("1"), Instance("0")))


@dataclass
class HostStack(StartStop):
    """``prefills`` and ``decodes`` (pushkv, engine ids ``prefill-<i>``, ``decode-<i>``), each
    on a host of its own when ``on_hosts``, and the router; logs and traces in ``run_dir``."""

    model: Path
    run_dir: Path
    prefill_instances: Sequence[Instance] = TWO_BY_TWO[0]
    decode_instances: Sequence[Instance] = TWO_BY_TWO[1]
    on_hosts: bool = True
    server_args: Sequence[str] = ()  # appended to every vLLM command line
    server_env: Mapping[str, str] = field(default_factory=dict)  # added to every server's
    router_args: Sequence[str] = ()
    kv_load_failure_policy: str = "recompute"
    tracing: bool = True
    pin_servers: bool = True  # confine each server to its CPUs (pdstack.PdStack says why)
    connector_name: str = field(default="PushConnector", init=False)
    bed: NetBed | None = field(default=None, init=False)
    prefills: tuple[HostedServer, ...] = field(default=(), init=False)
    decodes: tuple[HostedServer, ...] = field(default=(), init=False)
    router: RouterProcess = field(init=False)
    start_duration_s: float | None = field(default=None, init=False)
    _stack: Stack | None = field(default=None, init=False, repr=False)

    @property
    def servers(self) -> tuple[HostedServer, ...]:
        return (*self.prefills, *self.decodes)

    @property
    def url(self) -> str:
        """The router: where clients send requests."""
        return self.router.url

    def host_of(self, server: HostedServer) -> Host:
        if server.where is None:
            raise ValueError(f"{server.url} runs on this host, not on a bed's")
        return server.where

    def _server(
        self, role: str, index: int, inst: Instance, where: Host | None, port: int
    ) -> HostedServer:
        engine_id = f"{role}-{index}"
        addr = where.addr if where is not None else LOOPBACK
        extra = {"side_channel_host": addr, **inst.extra_config}
        parse_config(extra)  # a bad knob fails here, not in four servers' workers
        kv_role = "kv_producer" if role == "prefill" else "kv_consumer"
        env = {
            "VLLM_CPU_OMP_THREADS_BIND": inst.cpus,
            **trace_env(self.run_dir, self.tracing),
            **self.server_env,
        }
        if where is not None:
            env |= where.ucx_env()
        tp = ["--tensor-parallel-size", str(inst.tp)] if inst.tp > 1 else []
        if inst.pp > 1:
            tp += ["--pipeline-parallel-size", str(inst.pp)]
        return HostedServer(
            self.model,
            port,
            kv_transfer_config=kv_transfer_config(
                self.connector_name, kv_role, engine_id, extra, self.kv_load_failure_policy
            ),
            env=env,
            extra_args=[*tp, *self.server_args, *inst.args],
            eager=inst.eager,
            log_path=self.run_dir / f"{engine_id}.log",
            host=addr,
            cpu_affinity=server_affinity(inst.cpus) if self.pin_servers else None,
            where=where,
        )

    def _build(self) -> Stack:
        n_p, n_d = len(self.prefill_instances), len(self.decode_instances)
        hosts: list[Host | None] = [None] * (n_p + n_d)
        if self.on_hosts:
            self.bed = NetBed(n_p + n_d)
            self.bed.__enter__()  # Unavailable (not root, no `ip`) propagates
            hosts = list(self.bed.hosts)
        *ports, router_port = distinct_free_ports(n_p + n_d + 1)
        self.prefills = tuple(
            self._server("prefill", i, inst, hosts[i], ports[i])
            for i, inst in enumerate(self.prefill_instances)
        )
        self.decodes = tuple(
            self._server("decode", i, inst, hosts[n_p + i], ports[n_p + i])
            for i, inst in enumerate(self.decode_instances)
        )
        self.router = RouterProcess(
            [s.url for s in self.prefills],
            [s.url for s in self.decodes],
            router_port,
            extra_args=["--health-timeout", str(ROUTER_HEALTH_TIMEOUT_S), *self.router_args],
            log_path=self.run_dir / "router.log",
            env=trace_env(self.run_dir, self.tracing),
        )
        return Stack([*self.servers, self.router])

    def start(self, timeout_s: float = 300.0) -> float:
        """Make the hosts, start every server and the router, wait until all are healthy
        (the router: every P probed); returns (and records) the seconds it took."""
        if self._stack is not None:
            raise ServerError("this HostStack is already started")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        try:
            self._stack = self._build()
            self._stack.start(timeout_s)
        except BaseException:
            self.stop()
            raise
        self.start_duration_s = time.monotonic() - t0
        return self.start_duration_s

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop the router and every server (by process group), then remove the hosts."""
        stack, self._stack = self._stack, None
        try:
            if stack is not None:
                stack.stop(timeout_s)
        finally:
            if self.bed is not None:
                self.bed.close()

    def log_errors(self, per_log: int = 20) -> str:
        """The last lines naming an error in each server's log: a server that failed to
        start says why there, above the traceback its API server ends with."""
        out = []
        for s in self.servers:
            lines = tail_lines(s.log, 2000).splitlines()
            hits = [ln for ln in lines if "Error" in ln or "error" in ln][-per_log:]
            out.append(f"--- {s.log}\n" + "\n".join(hits))
        return "\n".join(out)

    def describe(self) -> str:
        """URLs, PIDs (each leads its process group) and logs, one line each."""
        rows = [("router", self.router.url, self.router.pid, self.router.log_path)]
        rows += [(s.log.stem, s.url, s.pid, s.log) for s in self.servers]
        return "\n".join(f"{name:9} {url:26} pid {pid}  log {log}" for name, url, pid, log in rows)

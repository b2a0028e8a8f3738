"""The benchmark's configurations and their P/D/router stacks, plus machine etiquette.

Owns: ``BenchConfig`` and ``CONFIGS`` (every connector configuration the push-vs-pull
benchmark knows; ``DEFAULT_CONFIGS`` are the five it runs by default, in run order),
``BenchStack`` (a ``connector.tools.pdstack.PdStack`` that can load a connector class from another
module and pass extra config, which ``PdStack`` alone cannot: it takes the module path from
``CONNECTORS`` by class name; and that can put ``vllm-router`` in front of P and D instead of
pushkv's router, the ``*-vr`` configurations), the port and process-group checks around each
stack, and ``wait_for_quiet_machine`` (wait until no other vLLM server runs before measuring).

Every configuration gets the same P/D command lines (``PdStack``'s flags, model, seed, KV
size, ``kv_buffer_device: cpu``, engine ids ``prefill``/``decode``) and the same CPU binding
(P ``VLLM_CPU_OMP_THREADS_BIND=0``, D ``=1``, and unless ``--no-pin-servers`` each server's
whole process tree confined to that CPU, as if on a host of its own, pushkv's transfer
thread included; the router and the ``vllm bench serve`` client are not pinned); only the
connector, the router mode and the ``bench.*`` switches in ``kv_connector_extra_config``
differ. Note that vLLM's own NIXL worker re-pins its model runner to the last core unless
``connector.tools.bench.vllm_keepcpu``'s switch is on.

Must not import vLLM, NIXL or torch (servers are child processes). Needs httpx via pdstack.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

from connector.tools.pdstack import CONNECTORS, ConnectorSpec, PdStack
from connector.tools.stack import (
    ChildProcess,
    ServerError,
    Stack,
    free_port,
    group_pids,
    port_is_free,
)
from connector.tools.vllm_router import VllmRouterProcess, require_vllm_router

NOPROG_MODULE = "connector.tools.bench.vllm_noprog"
# The line vllm_noprog logs once its patch is active; must equal its PATCHED_MARKER (not
# imported here: it imports vLLM).
NOPROG_MARKER = "NIXL agents default to enable_prog_thread=False"
KEEPCPU_MODULE = "connector.tools.bench.vllm_keepcpu"
# connector.tools.bench.vllm_keepcpu.KEEP_CPU_BINDING_KEY: undo vLLM's pin of P's and D's model
# runners to the same core (without it the progress-thread-off stacks livelock on 2 cores).
KEEP_CPU_EXTRA_CONFIG: Mapping[str, Any] = {"bench_keep_cpu_binding": True}
# What other engineers' servers look like (API server command line, EngineCore's proctitle).
VLLM_PROCESS_PATTERN = "vllm.entrypoints|VLLM::"
# Which router takes the clients' requests: pushkv's own (in the connector's router mode), or
# vLLM's Rust router in its NIXL P/D mode (connector.tools.vllm_router; docs/routers.md).
PUSHKV_ROUTER, VLLM_ROUTER = "pushkv", "vllm-router"


@dataclass(frozen=True)
class BenchConfig:
    """One column of the comparison: which connector class, loaded from where."""

    name: str
    connector_name: str  # a key of connector.tools.pdstack.CONNECTORS: router mode, side channel
    module_path: str | None = None  # overrides CONNECTORS' kv_connector_module_path
    description: str = ""
    # kv_connector_extra_config of both servers (e.g. connector.tools.bench.vllm_noprog's switches)
    extra_config: Mapping[str, Any] = field(default_factory=dict)
    tracing: bool = True  # spans of every process to the run folder (PdStack.tracing)
    # P, D and the router share a secret (docs/security.md): sealed messages, coordinates
    # signed by the router and checked by D. The secret goes to a file, never an argv.
    sealed: bool = False
    router_args: tuple[str, ...] = ()  # more flags for the router (pushkv's)
    front: str = PUSHKV_ROUTER  # PUSHKV_ROUTER or VLLM_ROUTER

    @property
    def router_mode(self) -> str:
        return CONNECTORS[self.connector_name].router_mode

    @property
    def progress_thread_off(self) -> bool:
        return self.module_path == NOPROG_MODULE

    @property
    def keeps_cpu_binding(self) -> bool:
        return bool(self.extra_config.get("bench_keep_cpu_binding"))


CONFIGS: dict[str, BenchConfig] = {
    c.name: c
    for c in (
        BenchConfig(
            "push",
            "PushConnector",
            description="pushkv PushConnector (router --mode push), tracing on: every "
            "span of every request to the run folder",
        ),
        # The cost of tracing: the same stack with OTEL_SDK_DISABLED=true in all processes.
        BenchConfig(
            "push-notrace",
            "PushConnector",
            description="pushkv PushConnector, tracing off (OTEL_SDK_DISABLED)",
            tracing=False,
        ),
        BenchConfig(
            "push-ft-notrace",
            "PushConnector",
            description="pushkv PushConnector, first token from P, tracing off (OTEL_SDK_DISABLED)",
            tracing=False,
            router_args=("--first-token", "prefill"),
        ),
        # The cost of authentication: every P/D message sealed, every D leg signed.
        BenchConfig(
            "push-sealed",
            "PushConnector",
            description="pushkv PushConnector with a shared secret: sealed messages, "
            "router-signed coordinates (docs/security.md)",
            sealed=True,
        ),
        # The client's first token straight from P; D continues from it (one step fewer).
        BenchConfig(
            "push-ft",
            "PushConnector",
            description="pushkv PushConnector, first token from P (router --first-token "
            "prefill), tracing on",
            router_args=("--first-token", "prefill"),
        ),
        # The cost of the connector's metrics: the same stack with metrics: false.
        BenchConfig(
            "push-nometrics",
            "PushConnector",
            description="pushkv PushConnector, its metrics off (metrics: false)",
            extra_config={"metrics": False},
        ),
        BenchConfig(
            "vllm-push",
            "NixlPushConnector",
            description="vLLM NixlPushConnector, default (router --mode vllm-push)",
        ),
        BenchConfig(
            "vllm-pull",
            "NixlConnector",
            description="vLLM NixlConnector, default (router --mode pull)",
        ),
        # Behind the router P/D deployments already run (issue 32): the same P and D, with
        # vllm-router in its NIXL P/D mode where pushkv's router was.
        BenchConfig(
            "push-vr",
            "PushConnector",
            description="pushkv PushConnector behind vllm-router (--vllm-pd-disaggregation "
            "--kv-connector nixl), tracing on: P's and D's spans (no router span)",
            front=VLLM_ROUTER,
        ),
        # No pushkv process in it: nothing to trace.
        BenchConfig(
            "vllm-push-vr",
            "NixlPushConnector",
            description="vLLM NixlPushConnector behind vllm-router (--vllm-pd-disaggregation "
            "--kv-connector nixl)",
            tracing=False,
            front=VLLM_ROUTER,
        ),
        BenchConfig(
            "vllm-push-noprog",
            "NixlPushConnector",
            NOPROG_MODULE,
            description="NixlPushConnector, NIXL progress thread off, CPU pin undone "
            "(connector.tools.bench.vllm_noprog)",
            extra_config=KEEP_CPU_EXTRA_CONFIG,
        ),
        BenchConfig(
            "vllm-pull-noprog",
            "NixlConnector",
            NOPROG_MODULE,
            description="NixlConnector, NIXL progress thread off, CPU pin undone "
            "(connector.tools.bench.vllm_noprog)",
            extra_config=KEEP_CPU_EXTRA_CONFIG,
        ),
        # Not in the default set: isolate the CPU pin from the progress thread (--configs).
        BenchConfig(
            "vllm-push-keepcpu",
            "NixlPushConnector",
            KEEPCPU_MODULE,
            description="NixlPushConnector, progress thread on, CPU pin undone "
            "(connector.tools.bench.vllm_keepcpu)",
            extra_config=KEEP_CPU_EXTRA_CONFIG,
        ),
        BenchConfig(
            "vllm-pull-keepcpu",
            "NixlConnector",
            KEEPCPU_MODULE,
            description="NixlConnector, progress thread on, CPU pin undone "
            "(connector.tools.bench.vllm_keepcpu)",
            extra_config=KEEP_CPU_EXTRA_CONFIG,
        ),
    )
}
DEFAULT_CONFIGS = ("push", "vllm-push", "vllm-pull", "vllm-push-noprog", "vllm-pull-noprog")
QUICK_CONFIGS = ("push", "vllm-push")


@dataclass
class BenchStack(PdStack):
    """``PdStack`` plus ``module_path_override``: when set, both servers load
    ``kv_connector`` from that module (``kv_connector_module_path``), an installed one; and
    ``front``: with ``VLLM_ROUTER``, ``vllm-router`` takes the clients' requests and
    ``PdStack``'s router is never started."""

    module_path_override: str | None = None
    front: str = PUSHKV_ROUTER
    vllm_router: VllmRouterProcess | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.front == PUSHKV_ROUTER:
            return
        if self.front != VLLM_ROUTER:
            raise ValueError(f"unknown front {self.front!r}: {PUSHKV_ROUTER} or {VLLM_ROUTER}")
        # On the port picked for pushkv's router (never started), its metrics on one apart
        # from every other port of the stack. Started with P and D: it checks them every
        # second until both are up.
        taken = set(self.ports().values())
        metrics_port = next(p for p in iter(free_port, None) if p not in taken)
        self.vllm_router = VllmRouterProcess(
            self.prefill.url,
            self.decode.url,
            self.router.port,
            metrics_port,
            log_path=self.run_dir / "vllm-router.log",
        )
        self._stack = Stack([self.prefill, self.decode, self.vllm_router])

    @property
    def entry(self) -> ChildProcess:
        """The router clients send requests to."""
        return self.router if self.vllm_router is None else self.vllm_router

    @property
    def url(self) -> str:
        return self.entry.url

    def _connector(self) -> ConnectorSpec:
        spec = super()._connector()
        if self.module_path_override is None:
            return spec
        return dataclasses.replace(spec, module_path=self.module_path_override)

    def ports(self) -> dict[str, int]:
        """Every TCP port the stack listens on, by role (HTTP ports and, for vLLM's
        connectors, the NIXL side-channel ports)."""
        ports = {
            "prefill": self.prefill.port,
            "decode": self.decode.port,
            "router": self.entry.port,
        }
        if self.vllm_router is not None:
            ports["router-metrics"] = self.vllm_router.prometheus_port
        for name, server in (("prefill", self.prefill), ("decode", self.decode)):
            side = server.env.get("VLLM_NIXL_SIDE_CHANNEL_PORT")
            if side is not None:
                ports[f"{name}-side-channel"] = int(side)
        return ports

    def group_leaders(self) -> list[int]:
        """The PIDs leading the three process groups (None for a service not started)."""
        return [
            pid for pid in (self.prefill.pid, self.decode.pid, self.entry.pid) if pid is not None
        ]

    def describe(self) -> str:
        if self.vllm_router is None:
            return super().describe()
        r = self.vllm_router
        return "\n".join(
            [
                f"{'vllm-router':8} {r.url:24} pid {r.pid}  log {r.log_path}",
                *super().describe().splitlines()[1:],  # P and D
            ]
        )


def make_stack(
    config: BenchConfig,
    model: Path,
    run_dir: Path,
    pin_servers: bool = True,
    server_args: Sequence[str] = (),
    gpus: tuple[str, str] | None = None,
) -> BenchStack:
    """The stack for ``config``: logs go to ``run_dir`` (one file per process);
    ``pin_servers``: P's and D's whole process trees on their own CPU (``PdStack``);
    ``server_args``: appended to both vLLM command lines (e.g. a longer context);
    ``gpus``: P's and D's CUDA_VISIBLE_DEVICES on a GPU host (None: both see every GPU),
    where vLLM's connectors then keep their KV buffers on the GPU."""
    if config.front == VLLM_ROUTER:
        require_vllm_router(f"configuration {config.name}")
    extra, router_args = dict(config.extra_config), list(config.router_args)
    if config.sealed:
        secret = write_secret(run_dir / f"{config.name}.secret")
        extra["auth_secret_file"] = str(secret)
        router_args += ["--auth-secret-file", str(secret)]
    return BenchStack(
        model,
        run_dir,
        connector_name=config.connector_name,
        prefill_extra_config=extra,
        decode_extra_config=extra,
        router_args=router_args,
        module_path_override=config.module_path,
        front=config.front,
        tracing=config.tracing,
        pin_servers=pin_servers,
        server_args=tuple(server_args),
        prefill_gpus=None if gpus is None else gpus[0],
        decode_gpus=None if gpus is None else gpus[1],
        kv_buffer_device="cpu" if gpus is None else "cuda",
    )


def require_fronts(names: Sequence[str]) -> None:
    """``SystemExit`` before anything starts when a configuration of ``names`` (names not in
    ``CONFIGS`` are ignored: ``single``) needs ``vllm-router`` and it is not installed."""
    for name in names:
        config = CONFIGS.get(name)
        if config is not None and config.front == VLLM_ROUTER:
            try:
                require_vllm_router(f"configuration {name}")
            except ServerError as exc:
                raise SystemExit(str(exc)) from None


def write_secret(path: Path) -> Path:
    """A fresh 32-byte secret in ``path``, readable by its owner only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    return path


def busy_ports(ports: Mapping[str, int]) -> dict[str, int]:
    """The subset of ``ports`` that something listens on (or holds bound)."""
    return {name: port for name, port in ports.items() if not port_is_free(port)}


@dataclass
class StopCheck:
    """What was left after a stack was stopped: live processes of its groups, busy ports."""

    live_pids: list[int] = field(default_factory=list)
    busy: dict[str, int] = field(default_factory=dict)

    @property
    def clean(self) -> bool:
        return not self.live_pids and not self.busy


def check_stopped(
    leaders: list[int], ports: Mapping[str, int], timeout_s: float = 15.0
) -> StopCheck:
    """Wait up to ``timeout_s`` for every process of the groups led by ``leaders`` to be gone
    and every port to be free again; return what is still there at the end."""
    deadline = time.monotonic() + timeout_s
    while True:
        check = StopCheck(
            [pid for leader in leaders for pid in group_pids(leader)], busy_ports(ports)
        )
        if check.clean or time.monotonic() >= deadline:
            return check
        time.sleep(0.5)


def other_vllm_pids() -> list[int]:
    """PIDs of vLLM servers and engines running on this machine (``pgrep -f``)."""
    out = subprocess.run(
        ["pgrep", "-f", VLLM_PROCESS_PATTERN], capture_output=True, text=True, check=False
    ).stdout
    return [int(tok) for tok in out.split()]


def wait_for_quiet_machine(
    timeout_s: float, poll_s: float = 10.0, log: Callable[[str], None] = print
) -> bool:
    """Poll every ``poll_s`` until no vLLM process runs; False if still busy at ``timeout_s``.
    Logs when it starts waiting and every minute while it waits."""
    start = time.monotonic()
    last_log = -60.0
    while True:
        pids = other_vllm_pids()
        waited = time.monotonic() - start
        if not pids:
            if waited > 0.5:
                log(f"machine quiet after {waited:.0f} s of waiting")
            return True
        if waited >= timeout_s:
            log(f"still {len(pids)} vLLM process(es) after {waited:.0f} s: {pids}; giving up")
            return False
        if waited - last_log >= 60.0:
            log(
                f"waiting for other vLLM servers to finish (pids {pids}); "
                f"{waited:.0f} s of {timeout_s:.0f} s so far, polling every {poll_s:.0f} s"
            )
            last_log = waited
        time.sleep(poll_s)


class StoppableStack(Protocol):
    """What ``on_free_ports`` and ``stop_and_check`` need of a stack (``BenchStack``, and the
    sweep's ``connector.tools.bench.single.SingleStack``)."""

    def stop(self, timeout_s: float = ...) -> None: ...
    def ports(self) -> dict[str, int]: ...
    def group_leaders(self) -> list[int]: ...


S = TypeVar("S", bound=StoppableStack)


def on_free_ports(make: Callable[[], S], log: Callable[[str], None], name: str) -> S:
    """A stack from ``make()`` whose ports are all free right now (three tries: another
    process may take a port between picking and binding), or ``ServerError``."""
    for _ in range(3):
        stack = make()
        busy = busy_ports(stack.ports())
        if not busy:
            return stack
        log(f"[{name}] ports taken before start: {busy}; picking new ones")
    raise ServerError(f"no free ports after 3 tries (last busy: {busy})")


def stop_and_check(name: str, stack: StoppableStack, log: Callable[[str], None]) -> None:
    """Stop ``stack`` and log whether its process groups are gone and its ports free."""
    leaders, ports = stack.group_leaders(), stack.ports()
    try:
        stack.stop()
    except ServerError as exc:
        log(f"[{name}] stop reported: {exc}")
    check = check_stopped(leaders, ports)
    if check.clean:
        log(f"[{name}] stopped: process groups {leaders} gone, ports free")
    else:
        log(f"[{name}] WARNING after stop: live pids {check.live_pids}, busy ports {check.busy}")

"""P and D ranks as real processes with synthetic KV caches in DRAM, on loopback NIXL.

Owns: the synthetic KV cache (numpy buffers laid out like vLLM's CPU cache), the child
process that runs one rank (transport + endpoint + transfer thread) and the parent-side
handle that drives it over a pipe. Used by ``pushkv demo``, the transport benchmark and the
integration tests. No vLLM. Children are started with ``spawn`` and stopped by PID.
"""

from __future__ import annotations

import logging
import os
import resource
import time
from dataclasses import dataclass, field
from multiprocessing import get_context
from multiprocessing.connection import Connection
from typing import Any, Literal, NamedTuple

import numpy as np

from connector.config import PushkvConfig
from connector.core import events as ev
from connector.core.heads import head_range
from connector.core.layout import KVLayout, Region
from connector.core.messages import PeerAddr
from connector.core.state import ReceiverPolicy, SenderPolicy
from telemetry.counts import Counts
from telemetry.schema import Count

logger = logging.getLogger(__name__)

Role = Literal["P", "D"]


@dataclass(frozen=True)
class RankSpec:
    """One rank of a synthetic engine."""

    role: Role
    engine_id: str
    rank: int
    tp_size: int
    port: int
    num_layers: int = 2
    num_blocks: int = 64
    block_size: int = 16
    num_kv_heads: int = 4  # of the model, across all ranks
    token_bytes: int = 64
    order: Literal["HND", "NHD"] = "HND"
    p_tp: int = 1  # for D: the P engine's TP size (to know who writes to us)
    seed: int = 0
    device: str = "cpu"  # "cpu" (numpy, DRAM) or "cuda:N" (torch, VRAM)
    send_policy: SenderPolicy = field(default_factory=SenderPolicy)
    recv_policy: ReceiverPolicy = field(default_factory=ReceiverPolicy)
    dial_timeout_s: float = 5.0
    doorbell: bool = True  # UDP wake-ups on the listen port number (connector.transfer.doorbell)
    # A vLLM KVCacheLayout name ("LBHNC", "BLHNC", ...): the KV as vLLM's views lay it out
    # (connector.tools.kv_caches, token_bytes = K|V of one head), described as the worker
    # does; None: the synthetic buffer above. Needs torch.
    kv_layout: str | None = None
    dtype: str = "bfloat16"  # of the vLLM-shaped KV (bfloat16, float8_e4m3fn)
    xfer_paths: str = "auto"  # GPU: PushkvConfig.xfer_paths
    secret: bytes | None = None  # the P/D plane's shared secret (docs/security.md)
    # The address the side channel and doorbell bind and peers dial: a netbed host's
    # (connector.tools.netbed) when the rank runs in a namespace of its own.
    host: str = "127.0.0.1"

    @property
    def agent(self) -> str:
        return f"{self.engine_id}-{self.rank}"

    @property
    def addr(self) -> PeerAddr:
        return PeerAddr(agent=self.agent, host=self.host, port=self.port)

    @property
    def heads(self) -> tuple[int, int]:
        return head_range(self.rank, self.tp_size, self.num_kv_heads)

    def shape(self) -> tuple[int, ...]:
        h = self.heads[1] - self.heads[0]
        inner = (h, self.block_size) if self.order == "HND" else (self.block_size, h)
        return (self.num_layers, self.num_blocks, *inner, self.token_bytes)

    def allocate(self) -> Any:
        """P: seeded random bytes (so a misplaced byte shows); D: zeros. On CUDA a torch
        tensor, created before the transport so CUDA is up when UCX starts."""
        if self.device != "cpu":
            import torch

            dev = torch.device(self.device)
            torch.cuda.set_device(dev)
            if self.role == "P":
                g = torch.Generator(device=dev).manual_seed(self.seed * 1000 + self.rank)
                return torch.randint(
                    1, 256, self.shape(), dtype=torch.uint8, device=dev, generator=g
                )
            return torch.zeros(self.shape(), dtype=torch.uint8, device=dev)
        if self.role == "P":
            rng = np.random.default_rng(self.seed * 1000 + self.rank)
            return rng.integers(1, 256, size=self.shape(), dtype=np.uint8)
        return np.zeros(self.shape(), dtype=np.uint8)

    def layout(self, buf: Any) -> KVLayout:
        block_stride = int(np.prod(buf.shape[2:]))
        cuda = self.device != "cpu"
        addr = (lambda i: int(buf[i].data_ptr())) if cuda else (lambda i: int(buf[i].ctypes.data))
        regions = tuple(
            Region(layer=i, group=0, part=0, base_addr=addr(i), block_stride=block_stride)
            for i in range(self.num_layers)
        )
        return KVLayout(
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            heads=self.heads,
            token_bytes=self.token_bytes,
            order=self.order,
            regions=regions,
            mem_type="VRAM" if cuda else "DRAM",
            device_id=int(buf.device.index or 0) if cuda else 0,
        )


class VllmKV:
    """A rank's KV as vLLM hands it to the worker (``connector.tools.kv_caches``)."""

    def __init__(self, spec: RankSpec) -> None:
        import torch

        from connector.kv_tensors import describe_kv_caches
        from connector.tools.kv_caches import vllm_kv_caches

        self.spec, dev = spec, torch.device(spec.device)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        dtype = getattr(torch, spec.dtype)
        elt = torch.empty(0, dtype=dtype).element_size()
        h = spec.heads[1] - spec.heads[0]
        self.raw, self.views = vllm_kv_caches(
            spec.num_layers,
            spec.num_blocks,
            h,
            spec.block_size,
            spec.token_bytes // (2 * elt),
            dtype=dtype,
            layout=spec.kv_layout or "LBHNC",
            device=dev,
        )
        if spec.role == "P":
            self.fill(list(range(spec.num_blocks)), spec.seed * 1000 + spec.rank)
        self.layout = describe_kv_caches(self.views, {}, spec.heads)

    def fill(self, block_ids: list[int], seed: int) -> None:
        """Seeded random bytes into these blocks of every layer, on the current stream."""
        import torch

        g = torch.Generator(device=self.raw.device).manual_seed(seed)
        for t in self.views.values():
            rows = t.view(torch.uint8)[block_ids]
            t.view(torch.uint8)[block_ids] = torch.randint(
                1, 256, rows.shape, dtype=torch.uint8, device=rows.device, generator=g
            )

    def block_sums(self, block_ids: list[int]) -> np.ndarray:
        """(layers, blocks) checksums."""
        import torch

        sums = [
            t.view(torch.uint8)[block_ids].reshape(len(block_ids), -1).to(torch.int64).sum(-1)
            for t in self.views.values()
        ]
        return torch.stack(sums).cpu().numpy()  # type: ignore[no-any-return]


class RankCounters(NamedTuple):
    """One rank's counters, as its ``counters`` command returns them."""

    thread: dict[str, int]  # the transfer thread's, its doorbell's prefixed ``bell_``, and
    #                         its guard's (``auth_<reason>``: refused notifications and rings)
    endpoint: dict[str, int]  # the Sender's or Receiver's
    dropped: dict[str, int]  # messages its table dropped, by kind
    transfers: int  # transfers in its table
    transport: dict[str, int]  # NixlTransport's metadata loads, by outcome; its side
    #                            channel's counters prefixed ``side_``


def torch_int64() -> Any:
    import torch

    return torch.int64


def _cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def rank_main(conn: Connection, spec: RankSpec) -> None:
    """Child process: one rank, commanded over ``conn`` until ("stop",)."""
    from connector.transfer.doorbell import Doorbell
    from connector.transfer.guard import Guard
    from connector.transfer.peers import Peers
    from connector.transfer.polling import Backoff
    from connector.transfer.receiver import Receiver
    from connector.transfer.sender import Sender
    from connector.transfer.thread import TransferThread
    from connector.transfer.topology import RankInfo, Topology
    from connector.transport.nixl import NixlTransport

    kv = VllmKV(spec) if spec.kv_layout else None
    buf = spec.allocate() if kv is None else kv.raw
    layout = spec.layout(buf) if kv is None else kv.layout
    transport = NixlTransport(
        spec.agent, listen_host=spec.host, listen_port=spec.port, secret=spec.secret
    )
    transport.register_memory(layout.memory_extents(), layout.mem_type, layout.device_id)
    guard = Guard(spec.secret)
    paths: Any = None
    offer: Any = None
    if kv is not None and layout.mem_type == "VRAM":  # as WorkerSide._gpu_paths
        from connector.kv_tensors import block_row_views
        from connector.transfer.gpu.paths import paths_for

        paths, offer = paths_for(
            transport,
            layout,
            block_row_views(kv.views),
            spec.addr,
            spec.rank,
            producer=spec.role == "P",
            consumer=spec.role == "D",
            mode=spec.xfer_paths,  # type: ignore[arg-type]
        )
    bell = Doorbell.open(spec.host, spec.port, guard) if spec.doorbell else None
    peers = Peers(transport, int(spec.dial_timeout_s * 1e9), bell=bell)
    me = RankInfo(spec.engine_id, spec.rank, spec.tp_size, spec.addr)
    reports: list[Any] = []
    # as the plugin's threads poll
    backoff = Backoff.from_config(PushkvConfig(), doorbell=bell is not None)
    if spec.role == "P":
        sender = Sender(
            transport,
            me,
            layout,
            Topology(spec.num_kv_heads, spec.tp_size),
            peers,
            spec.send_policy,
            on_write_finished=reports.append,
            paths=paths,
            guard=guard,
        )
        thread = TransferThread(
            transport,
            peers,
            sender=sender,
            name=f"pushkv-{spec.agent}",
            bell=bell,
            backoff=backoff,
            guard=guard,
        )
    else:
        receiver = Receiver(me, layout, peers, spec.recv_policy, offer=offer, guard=guard)
        thread = TransferThread(
            transport,
            peers,
            receiver=receiver,
            name=f"pushkv-{spec.agent}",
            bell=bell,
            backoff=backoff,
            guard=guard,
        )
    thread.start()
    conn.send(("ready", os.getpid()))
    try:
        while True:
            cmd, *args = conn.recv()
            if cmd == "stop":
                break
            if cmd == "submit":
                thread.submit(args[0])
                conn.send(("ok",))
            elif cmd == "prefill":  # (PrefillDone, seed, sleep_cycles): a GPU "forward"
                done, seed, cycles = args
                assert kv is not None, "prefill needs kv_layout"
                ready = _forward(kv, list(done.block_ids[0]), seed, cycles)
                thread.submit(done, ready=ready)
                conn.send(("ok",))
            elif cmd == "take":
                conn.send(
                    (
                        "ok",
                        thread.take_finished_sending(),
                        thread.take_finished_recving(),
                        list(reports),
                    )
                )
            elif cmd == "read":
                conn.send(("ok", buf.cpu().numpy() if spec.device != "cpu" else buf.copy()))
            elif cmd == "block_sums":  # (layers, blocks) checksums, cheap to ship back
                ids = list(args[0])
                if kv is not None:
                    conn.send(("ok", kv.block_sums(ids)))
                elif spec.device != "cpu":
                    sums = (
                        buf[:, ids]
                        .reshape(spec.num_layers, len(ids), -1)
                        .to(dtype=torch_int64())
                        .sum(-1)
                    )
                    conn.send(("ok", sums.cpu().numpy()))
                else:
                    conn.send(
                        (
                            "ok",
                            buf[:, ids]
                            .reshape(spec.num_layers, len(ids), -1)
                            .astype(np.int64)
                            .sum(-1),
                        )
                    )
            elif cmd == "cpu":
                conn.send(("ok", _cpu_seconds()))
            elif cmd == "counters":
                endpoint = thread.sender or thread.receiver
                assert endpoint is not None  # every rank runs one of the two
                merged = Counts(thread.counters)
                merged.merge(bell.counters if bell else {}, prefix=Count.BELL)
                merged.merge(guard.counters)
                counters = RankCounters(
                    thread=dict(merged),
                    endpoint=dict(endpoint.counters),
                    dropped=dict(endpoint.table.dropped),
                    transfers=len(endpoint.table),
                    transport=_with_side_channel(transport),
                )
                conn.send(("ok", counters))
            else:
                conn.send(("error", f"unknown command {cmd!r}"))
    finally:
        thread.stop()
        transport.close()
        conn.send(("stopped",))


def _forward(kv: VllmKV, block_ids: list[int], seed: int, cycles: int) -> Any:
    """Write new KV into ``block_ids`` as a forward would: on CUDA after ``cycles`` of device
    sleep, on the current stream, and return the step's "done?" check (the worker's
    ``_step_done_check``). A WRITE that read the blocks before this check said yes would
    carry the old bytes, which the checksums catch."""
    import torch

    if kv.raw.device.type != "cuda":
        kv.fill(block_ids, seed)
        return None
    torch.cuda._sleep(cycles)
    kv.fill(block_ids, seed)
    event = torch.cuda.Event()
    event.record()
    return event.query


class RankProcess:
    """Parent-side handle of one rank's process."""

    def __init__(self, spec: RankSpec, start_timeout_s: float = 120.0, target: Any = None) -> None:
        """``target``: the child's main (``rank_main``; ``pushkv_testing.worker_ranks`` runs
        the worker role instead). Its "ready" reply's extra fields land in ``hello``."""
        ctx = get_context("spawn")
        self.spec = spec
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=target or rank_main, args=(child, spec), name=spec.agent, daemon=True
        )
        self.proc.start()
        child.close()
        self.hello = self._reply("ready", start_timeout_s)[2:]
        self.sent: list[str] = []
        self.received: list[Any] = []
        self.reports: list[Any] = []

    @property
    def pid(self) -> int:
        assert self.proc.pid is not None
        return self.proc.pid

    def _reply(self, want: str, timeout_s: float) -> tuple:
        if not self._conn.poll(timeout_s):
            raise TimeoutError(
                f"{self.spec.agent}: no {want!r} reply within {timeout_s}s "
                f"(alive={self.proc.is_alive()}, exitcode={self.proc.exitcode})"
            )
        msg = self._conn.recv()
        if msg[0] != want:
            raise RuntimeError(f"{self.spec.agent}: expected {want!r}, got {msg!r}")
        return msg

    def call(self, *cmd: Any, timeout_s: float = 10.0) -> tuple:
        self._conn.send(cmd)
        return self._reply("ok", timeout_s)[1:]

    def submit(self, event: Any) -> None:
        self.call("submit", event)

    def take(self) -> None:
        sent, received, reports = self.call("take")
        self.sent += sent
        self.received += received
        self.reports = reports

    def wait(self, what: str, pred: Any, timeout_s: float) -> None:
        """Poll until ``pred(self)`` holds; TimeoutError naming ``what`` otherwise."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.take()
            if pred(self):
                return
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"{self.spec.agent}: {what} not seen within {timeout_s}s; "
                    f"sent={self.sent} received={self.received}"
                )
            time.sleep(0.005)  # pacing of the poll loop, not synchronisation

    def prefill(self, done: ev.PrefillDone, seed: int, sleep_cycles: int = 0) -> None:
        """P with ``kv_layout``: write fresh KV into the blocks (on the GPU, after a device
        sleep), then submit ``done`` with the step's CUDA event as its ready check."""
        self.call("prefill", done, seed, sleep_cycles)

    def read(self) -> np.ndarray:
        return self.call("read")[0]

    def block_sums(self, block_ids: list[int]) -> np.ndarray:
        return self.call("block_sums", block_ids, timeout_s=120)[0]

    def cpu_seconds(self) -> float:
        return self.call("cpu")[0]

    def counters(self) -> RankCounters:
        return self.call("counters")[0]

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop cleanly if possible; kill by PID otherwise. Idempotent."""
        if self.proc.is_alive():
            try:
                self._conn.send(("stop",))
                self._reply("stopped", timeout_s)
            except (OSError, EOFError, TimeoutError, RuntimeError) as exc:
                # Stuck, dead or confused: kill() below ends it either way.
                logger.debug("%s did not stop cleanly (%r); killing it", self.spec.agent, exc)
        self.kill()

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)


def expected_event(
    tid: str,
    p_specs: list[RankSpec],
    d_spec: RankSpec,
    d_blocks: tuple[int, ...],
    num_tokens: int,
    first_token: int = 0,
) -> ev.Expected:
    """D's Expected for a transfer from the P engine ``p_specs`` into ``d_spec``."""
    from connector.transfer.topology import Topology

    topo = Topology(d_spec.num_kv_heads, len(p_specs))
    sources = tuple(
        ev.Source(p, p_specs[p].addr) for p in topo.sources(d_spec.rank, d_spec.tp_size)
    )
    return ev.Expected(tid, f"dreq-{tid}", sources, (d_blocks,), first_token, num_tokens)


def _with_side_channel(transport: Any) -> dict[str, int]:
    """A NIXL transport's counters and its side channel's (under ``side_``)."""
    out = Counts(transport.counters)
    out.merge(transport.side_channel_counters, prefix=Count.SIDE_CHANNEL)
    return dict(out)

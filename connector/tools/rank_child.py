"""The child process that runs one synthetic rank: its transport, endpoint (Sender on P,
Receiver on D) and transfer thread, commanded over a pipe by ``loopback.RankProcess``
until ("stop",). Imports NIXL and the transfer layer only inside the child."""

from __future__ import annotations

import os
import resource
from multiprocessing.connection import Connection
from typing import Any, NamedTuple

import numpy as np

from connector.config import PushkvConfig
from connector.tools.rank_spec import RankSpec, VllmKV
from telemetry.counts import Counts
from telemetry.schema import Count


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


def _with_side_channel(transport: Any) -> dict[str, int]:
    """A NIXL transport's counters and its side channel's (under ``side_``)."""
    out = Counts(transport.counters)
    out.merge(transport.side_channel_counters, prefix=Count.SIDE_CHANNEL)
    return dict(out)

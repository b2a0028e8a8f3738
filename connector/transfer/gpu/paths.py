"""The GPU path driver: maps a D's KV through its IPC offer and copies scattered blocks
straight into it when the cost model says that beats direct descriptors.

Owns: ``GpuPaths`` (the Sender's ``connector.transfer.paths.Paths`` on GPU: taking D's
offers, choosing per target, starting the copy a ``connector.core.ipc_plan`` plan says),
``IpcWrite`` (one target's IPC copy as a ``PathWrite``), ``make_offer`` (D: its ``IpcOffer``)
and ``node_identity``. On one H200 the IPC copy moves a 16k-token request with scattered blocks
at ~99 % of its contiguous rate where direct descriptors run at ~1 %
(``python -m bench.gpu_paths``, ``bench/results/h200_gpu_paths.txt``). Where IPC cannot
apply (another node, the same process, another block geometry, a GPU this process does not
see) the transfer stays direct, with the reason on the ``write`` span. The staged path's
driver (``staged.py``) is not chosen here yet: it needs D to land chunks on its side.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import msgspec
import numpy as np
import torch

from connector.core import messages as m
from connector.core.errors import LayoutError
from connector.core.events import BlockTable
from connector.core.heads import HeadRange
from connector.core.ipc_plan import IpcPlan, Rows, plan_ipc
from connector.core.layout import KVLayout
from connector.core.xfer_path import Locality, PathChoice, PathModel, XferPath, choose_path
from connector.transfer.gpu.ipc import IpcExport, IpcPush, export_rows, import_rows
from connector.transfer.gpu.lanes import Lane, Mark
from connector.transfer.gpu.rows import Backend, RowTable, copy_rows
from connector.transport.base import Transport

logger = logging.getLogger(__name__)

Mode = Literal["auto", "direct", "ipc"]
MAX_MAPPED = 16  # D processes whose KV one P rank keeps mapped at once


def node_identity() -> str:
    """This host's identity: the kernel's boot id (the same in every container of the host),
    and the host name where there is none."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


def device_uuid(device: torch.device) -> str:
    if device.type != "cuda":
        return ""
    return str(torch.cuda.get_device_properties(device).uuid)


def _local_index(uuid: str) -> int | None:
    """This process's index of the GPU ``uuid`` (CUDA_VISIBLE_DEVICES may renumber)."""
    for i in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(i).uuid) == uuid:
            return i
    return None


def pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: alive
    return True


def make_offer(rows: RowTable, me: m.PeerAddr, rank: int) -> m.IpcOffer:
    """D: the offer its Receiver sends each P rank before the first registration."""
    return m.IpcOffer(
        transfer_id="offer",
        d_rank=rank,
        d_addr=me,
        node=node_identity(),
        pid=os.getpid(),
        device_uuid=device_uuid(rows.device),
        export=msgspec.msgpack.encode(export_rows(rows)),
        pid_ns=pid_namespace(),
    )


def paths_for(
    transport: Transport,
    layout: KVLayout,
    row_views: list[torch.Tensor],
    me: m.PeerAddr,
    rank: int,
    *,
    producer: bool,
    consumer: bool,
    mode: Mode = "auto",
) -> tuple[GpuPaths | None, m.IpcOffer | None]:
    """A rank's path driver (P) and IPC offer (D) for its KV ``row_views``
    (``connector.kv_tensors.block_row_views``); (None, None) with ``mode`` direct."""
    if mode == "direct":
        return None, None
    rows = RowTable.of(row_views)
    offer = make_offer(rows, me, rank) if consumer else None  # first: CPU sharing moves storage
    paths = GpuPaths(transport, layout, rows, mode=mode) if producer else None
    return paths, offer


def _columns(rows: RowTable, cols: tuple[int, int]) -> RowTable:
    """``rows`` narrowed to bytes [a, b) of each row (the same table when that is all)."""
    a, b = cols
    if (a, b) == (0, rows.row_bytes):
        return rows
    key = f"cols{a}:{b}"
    if key not in rows._tables:  # one narrowed table per slice: its address tables are cached
        rows._tables[key] = RowTable.of([t[:, a:b] for t in rows.tensors])
    return rows._tables[key]  # type: ignore[no-any-return]


@dataclass
class _Mapped:
    rows: RowTable
    locality: Locality
    pid: int | None  # D's process, where P can see it (the same pid namespace)


class IpcWrite:
    """One target's IPC copy, as the Sender pumps it."""

    path = XferPath.IPC

    def __init__(self, push: IpcPush) -> None:
        self._push, self.peer = push, push.peer

    def pump(self) -> bool:
        return self._push.pump()

    def stage_ms(self) -> dict[str, float]:
        return {"copy": self._push.device_ms()}

    def withhold(self) -> None:
        self._push.quiet = True


class GpuPaths:
    """P's path driver. ``rows``: this rank's KV as block rows, in ``layout.regions`` order."""

    def __init__(
        self,
        transport: Transport,
        layout: KVLayout,
        rows: RowTable,
        *,
        mode: Mode = "auto",
        model: PathModel | None = None,
        backend: Backend = "auto",
    ) -> None:
        if rows.num_regions != len(layout.regions):
            raise LayoutError("GpuPaths: one row table region per layout region")
        self._t, self.layout, self.rows, self.mode = transport, layout, rows, mode
        self.model, self.backend = model or PathModel(), backend
        self._node, self._pid, self._pid_ns = node_identity(), os.getpid(), pid_namespace()
        self._next_check_ns = 0
        self._uuid = device_uuid(rows.device)
        self._lane = Lane(rows.device)
        self._mapped: dict[str, _Mapped] = {}
        self._waiter = _Waiter()
        regions, extent = sorted(layout.regions, key=lambda r: r.base_addr), layout.block_extent
        self._layers_adjacent = all(
            r.block_stride == len(regions) * extent
            and r.base_addr == regions[0].base_addr + i * extent
            for i, r in enumerate(regions)
        )
        self.refused: dict[str, str] = {}  # agent -> why its offer was not taken (logs, tests)
        self._warm_up()

    def _warm_up(self) -> None:
        """Compile the copy kernel now, not on the first request's WRITE: on a fresh GPU
        machine Triton's compile made P's first IPC WRITEs take 270-560 ms instead of ~2
        (bench/results/gpu-20261206-h100/README.md). Block 0 onto itself: the same bytes,
        the same kernel variant as a WRITE into a D of this geometry."""
        if self.mode == "direct":
            return
        zero = torch.zeros(1, dtype=torch.int64, device=self.rows.device)
        with self._lane.active():
            copy_rows(self.rows, zero, self.rows, zero, backend=self.backend)
        self._lane.synchronize()

    # ------------------------------------------------------------------ offers
    def offered(self, agent: str, offer: m.IpcOffer) -> None:
        why = self._take(agent, offer)
        if why:
            self.refused[agent] = why
            logger.info("IPC offer of %s not taken: %s; its transfers go direct", agent, why)

    def _take(self, agent: str, offer: m.IpcOffer) -> str:
        if self.mode == "direct":
            return "xfer_paths is direct"
        if offer.node != self._node:
            return "another node"
        if offer.pid == self._pid and self.rows.device.type == "cuda":
            return "same process"  # CUDA cannot open its own IPC handles
        if self.rows.device.type == "cuda":
            index = _local_index(offer.device_uuid)
            if index is None:
                return f"GPU {offer.device_uuid} not visible here"
        else:
            index = None
        try:
            export = msgspec.msgpack.decode(offer.export, type=IpcExport)
            rows = import_rows(export, device=index)
        except (msgspec.DecodeError, msgspec.ValidationError, LayoutError, RuntimeError) as exc:
            return f"cannot map: {exc}"
        same = offer.device_uuid == self._uuid
        pid = offer.pid if offer.pid_ns and offer.pid_ns == self._pid_ns else None
        self._mapped.pop(agent, None)
        self._mapped[agent] = _Mapped(rows, Locality.SAME_GPU if same else Locality.SAME_NODE, pid)
        while len(self._mapped) > MAX_MAPPED:  # D engines come and go: drop the oldest
            self.forget(next(iter(self._mapped)))
        self.refused.pop(agent, None)
        return ""

    def bind_waker(self, wake: Callable[[], None]) -> None:
        self._waiter.wake = wake

    def forget(self, agent: str) -> None:
        self._mapped.pop(agent, None)

    def due_ns(self) -> int | None:
        """The next check for dead D processes, while any D is mapped (``poll``)."""
        return self._next_check_ns if self._mapped else None

    def poll(self, now_ns: int) -> None:
        """Drop the mapping of a D whose process has died: an open IPC mapping keeps its KV
        memory allocated on the GPU, which a restarted D would need. Checked every second,
        where P sees D's process; elsewhere the next failed send to D drops it."""
        if now_ns < self._next_check_ns:
            return
        self._next_check_ns = now_ns + 1_000_000_000
        for agent, mapped in list(self._mapped.items()):
            if mapped.pid is not None and not _alive(mapped.pid):
                logger.info("D %s (pid %d) is gone: its KV mapping is released", agent, mapped.pid)
                self.forget(agent)

    # ------------------------------------------------------------------ per target
    def _plan(
        self, reg: m.Register, src_blocks: BlockTable, heads: HeadRange, mapped: _Mapped
    ) -> IpcPlan | str:
        """What an IPC copy to ``reg`` moves (``connector.core.ipc_plan``), or why not."""
        return plan_ipc(
            self.layout,
            Rows(self.rows.num_regions, self.rows.row_bytes),
            reg.layout,
            Rows(mapped.rows.num_regions, mapped.rows.row_bytes),
            src_blocks,
            reg.block_ids,
            reg.first_token,
            reg.num_tokens,
            heads,
        )

    def choose(self, reg: m.Register, src_blocks: BlockTable, heads: HeadRange) -> PathChoice:
        mapped = self._mapped.get(reg.d_addr.agent)
        if mapped is None:
            return PathChoice(XferPath.DIRECT, "direct: no IPC offer taken", ())
        plan = self._plan(reg, src_blocks, heads, mapped)
        if isinstance(plan, str):
            return PathChoice(XferPath.DIRECT, f"direct: {plan}", ())
        if not plan.units:
            return PathChoice(XferPath.DIRECT, "empty", ())
        nbytes = plan.nbytes_per_region * self.rows.num_regions
        if self.mode == "ipc":
            return PathChoice(XferPath.IPC, "xfer_paths is ipc", (), nbytes)
        seg = plan.segments[0]
        descriptors = (
            self._direct_descriptors(seg.src, seg.dst)
            if plan.whole
            else plan.units * len(self.layout.regions) * len(plan.segments)  # no run merges
        )
        return choose_path(
            descriptors,
            nbytes,
            src_mem=self.layout.mem_type,
            dst_mem=reg.layout.mem_type,
            locality=mapped.locality,
            staging_ok=False,
            model=self.model,
        )

    def _direct_descriptors(self, src: list[int], dst: list[int]) -> int:
        """What the direct plan would post for whole rows, without planning it: one
        descriptor per run of blocks consecutive on both sides, times the regions unless a
        block of all layers is one page on both (block-outermost, the same geometry)."""
        a, b = np.asarray(src), np.asarray(dst)
        runs = 1 + int(np.count_nonzero((np.diff(a) != 1) | (np.diff(b) != 1)))
        return runs * (1 if self._layers_adjacent else len(self.layout.regions))

    def start(
        self,
        choice: PathChoice,
        reg: m.Register,
        src_blocks: BlockTable,
        heads: HeadRange,
        notif: bytes,
    ) -> IpcWrite:
        mapped = self._mapped.get(reg.d_addr.agent)
        if choice.path is not XferPath.IPC or mapped is None:
            raise LayoutError(f"GpuPaths cannot start a {choice.path.value} write here")
        plan = self._plan(reg, src_blocks, heads, mapped)
        if isinstance(plan, str):
            raise LayoutError(f"IPC write to {reg.d_addr.agent}: {plan}")
        copies = []
        with self._lane.active():  # the ids' upload is ordered before the copy on its stream
            for seg in plan.segments:
                src = torch.tensor(seg.src, dtype=torch.int64, device=self.rows.device)
                dst = torch.tensor(seg.dst, dtype=torch.int64, device=mapped.rows.device)
                copies.append(
                    (_columns(self.rows, seg.p_cols), src, _columns(mapped.rows, seg.d_cols), dst)
                )
        (s_rows, s_ids, d_rows, d_ids), *more = copies
        push = IpcPush(
            self._t,
            reg.d_addr.agent,
            s_rows,
            s_ids,
            d_rows,
            d_ids,
            self._lane,
            notif,
            backend=self.backend,
            more=more,
        )
        self._waiter.watch(push.end)
        return IpcWrite(push)


class _Waiter:
    """Wakes the transfer thread the moment a copy's event has fired, instead of leaving it
    to the thread's polling backoff (up to ``poll_hot_max_s`` late). Waits in its own
    thread, since the transfer thread must never block; touches no transport."""

    def __init__(self) -> None:
        self.wake: Callable[[], None] | None = None
        self._queue: queue.SimpleQueue[Mark] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def watch(self, mark: Mark) -> None:
        if self.wake is None or mark.event is None:
            return  # no thread to wake, or host work that is already done
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="pushkv-ipc-wait", daemon=True)
            self._thread.start()
        self._queue.put(mark)

    def _run(self) -> None:
        while True:
            mark = self._queue.get()
            mark.wait()  # one stream: events fire in the order they were queued
            if self.wake is not None:
                self.wake()

"""The staged path's driver: P gathers into its staging slots and WRITEs each chunk into a
D slot; D scatters each chunk on its own lane and credits the slot back.

Owns: ``StagingBuffer`` (a pool's memory, registered once with the transport),
``RemoteStaging`` (where a peer's staging buffer is), ``StagedPush`` (P, one transfer)
and ``StagedLand`` (D, one transfer). Both are polled by the thread that owns the
transport (``pump``) and fed the staging notifications that concern them; neither blocks.
Schedules come from ``connector.transfer.staging``; copies from ``rows.py``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from connector.core.errors import LocalProtocolError
from connector.transfer.gpu.lanes import Lane, Mark
from connector.transfer.gpu.rows import Backend, RowTable, gather, scatter
from connector.transfer.staging import (
    ChunkWritten,
    SlotFreed,
    SlotPool,
    StagedRecv,
    StagedSend,
    encode_notif,
)
from connector.transport.base import Transport, WriteHandle


class StagingBuffer:
    """The memory behind a ``SlotPool``: one allocation, made once, registered once."""

    def __init__(self, pool: SlotPool, device: torch.device | str) -> None:
        self.pool = pool
        self.device = torch.device(device)
        self.tensor = torch.empty(pool.capacity_bytes, dtype=torch.uint8, device=self.device)

    @property
    def mem(self) -> str:
        return "VRAM" if self.device.type == "cuda" else "DRAM"

    @property
    def device_id(self) -> int:
        return int(self.device.index or 0) if self.device.type == "cuda" else 0

    @property
    def base_addr(self) -> int:
        return int(self.tensor.data_ptr())

    def slot(self, slot: int, nbytes: int) -> torch.Tensor:
        off = self.pool.offset(slot)
        return self.tensor[off : off + nbytes]

    def addr(self, slot: int) -> int:
        return self.base_addr + self.pool.offset(slot)

    def register(self, transport: Transport) -> None:
        transport.register_memory(
            [(self.base_addr, self.pool.capacity_bytes)], self.mem, self.device_id
        )

    def remote(self) -> RemoteStaging:
        """What a peer needs to WRITE into this buffer."""
        return RemoteStaging(self.base_addr, self.pool.slot_bytes, self.mem, self.device_id)


@dataclass(frozen=True)
class RemoteStaging:
    base_addr: int
    slot_bytes: int
    mem: str
    device_id: int

    def addr(self, slot: int) -> int:
        return self.base_addr + slot * self.slot_bytes


def _desc(addr: int, nbytes: int, device_id: int) -> np.ndarray:
    return np.array([[addr, nbytes, device_id]], dtype=np.uint64)


@dataclass
class StageTimes:
    """Marks and wall clocks of one staged transfer, for its span (ms and ns)."""

    first_post_ns: int = 0
    last_done_ns: int = 0
    marks: list[tuple[Mark, Mark]] = field(default_factory=list)  # (start, end) per chunk

    def device_ms(self) -> float:
        """From the first chunk's start to the last chunk's end on the lane."""
        if not self.marks:
            return 0.0
        return self.marks[0][0].elapsed_ms(self.marks[-1][1])


class StagedPush:
    """P's side of one staged transfer. Call ``pump`` until it returns True (every WRITE
    done); hand it the ``SlotFreed`` notifications for this transfer."""

    def __init__(
        self,
        transport: Transport,
        peer: str,
        transfer_id: str,
        src: RowTable,
        src_ids: torch.Tensor,
        plan: StagedSend,
        local: StagingBuffer,
        remote: RemoteStaging,
        lane: Lane,
        *,
        after: Any | None = None,
        backend: Backend = "auto",
    ) -> None:
        self._t, self.peer, self.transfer_id = transport, peer, transfer_id
        self.src, self.src_ids, self.plan = src, src_ids, plan
        self.local, self.remote, self.lane, self.backend = local, remote, lane, backend
        self.lane.wait_for(after)  # the forward's event: never read KV before it is written
        self._gathering: list[tuple[int, Mark]] = []
        self._writes: list[tuple[int, WriteHandle]] = []
        self.gather_times = StageTimes()
        self.write_times = StageTimes()
        self.writes_posted = 0

    def pump(self) -> bool:
        for chunk, slot in self.plan.gathers_to_start():
            begin = self.lane.record()
            with self.lane.active():
                ids = self.src_ids[chunk.block_start : chunk.block_end]
                out = self.local.slot(slot, chunk.nbytes)
                gather(self.src, ids, out, chunk.regions, backend=self.backend)
            end = self.lane.record()
            self.gather_times.marks.append((begin, end))
            self._gathering.append((chunk.index, end))
        while self._gathering and self._gathering[0][1].done():
            self.plan.gathered(self._gathering.pop(0)[0])
        for chunk, slot, rslot in self.plan.writes_to_post():
            notif = encode_notif(ChunkWritten(self.transfer_id, chunk.index, rslot))
            self.write_times.first_post_ns = self.write_times.first_post_ns or _now_ns()
            handle = self._t.write(
                self.peer,
                _desc(self.local.addr(slot), chunk.nbytes, self.local.device_id),
                _desc(self.remote.addr(rslot), chunk.nbytes, self.remote.device_id),
                notif,
                src_mem=self.local.mem,
                dst_mem=self.remote.mem,
            )
            self.writes_posted += 1
            self._writes.append((chunk.index, handle))
        still = []
        for index, handle in self._writes:
            if self._t.poll_write(handle):
                self._t.release(handle)
                self.plan.written(index)
                self.write_times.last_done_ns = _now_ns()
            else:
                still.append((index, handle))
        self._writes = still
        return self.plan.done

    def on_notif(self, msg: SlotFreed) -> None:
        if msg.transfer_id != self.transfer_id:
            raise LocalProtocolError("StagedPush: a notification of another transfer")
        self.plan.credited(msg.slot)


class StagedLand:
    """D's side of one staged transfer: ``on_notif`` enqueues a chunk's scatter on D's own
    lane; ``pump`` credits finished slots back and returns True once every scatter's event
    has fired (only then may the engine learn that the KV is ready)."""

    def __init__(
        self,
        transport: Transport,
        peer: str,
        transfer_id: str,
        dst: RowTable,
        dst_ids: torch.Tensor,
        plan: StagedRecv,
        local: StagingBuffer,
        lane: Lane,
        *,
        backend: Backend = "auto",
    ) -> None:
        self._t, self.peer, self.transfer_id = transport, peer, transfer_id
        self.dst, self.dst_ids, self.plan = dst, dst_ids, plan
        self.local, self.lane, self.backend = local, lane, backend
        self._scattering: list[tuple[int, Mark]] = []
        self._arrived = 0
        self.scatter_times = StageTimes()
        self.ready_ns = 0

    def on_notif(self, msg: ChunkWritten) -> None:
        if msg.transfer_id != self.transfer_id:
            raise LocalProtocolError("StagedLand: a notification of another transfer")
        chunk = self.plan.arrived(msg.index, msg.slot)
        self._arrived += 1
        begin = self.lane.record()
        with self.lane.active():
            ids = self.dst_ids[chunk.block_start : chunk.block_end]
            scatter(
                self.local.slot(msg.slot, chunk.nbytes), self.dst, ids, chunk.regions, self.backend
            )
        end = self.lane.record()
        self.scatter_times.marks.append((begin, end))
        self._scattering.append((chunk.index, end))

    def pump(self) -> bool:
        still = []
        for index, mark in self._scattering:
            if mark.done():
                slot = self.plan.scattered(index)
                if self._arrived < len(self.plan.chunks):  # P still has chunks to send
                    self._t.send_notif(self.peer, encode_notif(SlotFreed(self.transfer_id, slot)))
            else:
                still.append((index, mark))
        self._scattering = still
        if self.plan.ready and not self.ready_ns:
            self.ready_ns = _now_ns()
        return self.plan.ready


def _now_ns() -> int:
    return time.monotonic_ns()

"""The IPC path: D's KV cache mapped into P's process, one kernel from P's blocks into D's.

Owns: ``IpcExport`` (what D publishes so a P on the same node can map its KV rows: the
CUDA IPC handle of each allocation, from torch's ``_share_cuda_``, and each region's place
in it; plain msgspec, no pickle crosses processes), ``export_rows``/``import_rows`` and
``IpcPush`` (P, one transfer: the copy on P's lane after the forward's event, then the
notification once the copy's event has fired, so D never hears "ready" early). NIXL still
carries the notification; no descriptors, no staging, each byte read and written once.

On CPU the same calls share POSIX shared memory (``_share_filename_cpu_``), which moves the
storage: export before anything takes its addresses (NIXL registration, ``RowTable``
tables). That is how CI checks the path bytewise without a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import torch

from connector.core.errors import LayoutError, LocalProtocolError
from connector.transfer.gpu.lanes import Lane
from connector.transfer.gpu.rows import Backend, RowTable, copy_rows
from connector.transport.base import Transport


class CudaStorage(msgspec.Struct, frozen=True, tag="cuda"):
    """torch's ``UntypedStorage._share_cuda_()`` fields, in its order."""

    device: int
    handle: bytes
    size_bytes: int
    offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes | None
    event_sync_required: bool


class HostStorage(msgspec.Struct, frozen=True, tag="host"):
    """``UntypedStorage._share_filename_cpu_()``: shared memory of this host."""

    manager: bytes
    handle: bytes
    size_bytes: int


class IpcRegion(msgspec.Struct, frozen=True):
    storage: int  # index into IpcExport.storages
    offset_bytes: int  # of block 0 from the storage's start
    num_blocks: int
    row_bytes: int
    block_stride: int


class IpcExport(msgspec.Struct, frozen=True, tag="ipc_export"):
    storages: tuple[CudaStorage | HostStorage, ...]
    regions: tuple[IpcRegion, ...]
    version: int = 1


def export_rows(rows: RowTable) -> IpcExport:
    """D: what a P process needs to map every region of ``rows`` (one entry per storage)."""
    index: dict[int, int] = {}
    storages: list[CudaStorage | HostStorage] = []
    regions = []
    for t in rows.tensors:
        st = t.untyped_storage()
        key = st._cdata  # one entry per allocation, however many views
        if key not in index:
            index[key] = len(storages)
            storages.append(_share(st))
        regions.append(
            IpcRegion(index[key], t.storage_offset(), t.shape[0], t.shape[1], t.stride(0))
        )
    return IpcExport(tuple(storages), tuple(regions))


def _share(st: Any) -> CudaStorage | HostStorage:
    if st.device.type == "cuda":
        return CudaStorage(*st._share_cuda_())
    if st.device.type == "cpu":
        manager, handle, size = st._share_filename_cpu_()
        return HostStorage(manager, handle, size)
    raise LayoutError(f"cannot share a {st.device.type} storage")


def import_rows(export: IpcExport, device: int | None = None) -> RowTable:
    """P: map D's regions (same node). ``device``: the GPU's index in this process, where
    it differs from D's (CUDA_VISIBLE_DEVICES). The returned tensors keep the mappings open."""
    if export.version != 1:
        raise LayoutError(f"IpcExport version {export.version}")
    mapped = []
    for s in export.storages:
        if isinstance(s, CudaStorage):
            torch.cuda._lazy_init()
            mapped.append(
                torch.UntypedStorage._new_shared_cuda(
                    s.device if device is None else device,
                    s.handle,
                    s.size_bytes,
                    s.offset_bytes,
                    s.ref_counter_handle,
                    s.ref_counter_offset,
                    s.event_handle,
                    s.event_sync_required,
                )
            )
        else:
            mapped.append(
                torch.UntypedStorage._new_shared_filename_cpu(s.manager, s.handle, s.size_bytes)
            )
    tensors = []
    for r in export.regions:
        st = mapped[r.storage]
        if r.offset_bytes + (r.num_blocks - 1) * r.block_stride + r.row_bytes > st.nbytes():
            raise LayoutError("IpcExport: a region runs past its storage")
        t = torch.empty(0, dtype=torch.uint8, device=st.device)
        t.set_(st, r.offset_bytes, (r.num_blocks, r.row_bytes), (r.block_stride, 1))
        tensors.append(t)
    return RowTable.of(tensors)


class IpcPush:
    """P's side of one IPC transfer. ``pump`` returns True once the copy's event has fired
    and ``notif`` has been sent to D."""

    def __init__(
        self,
        transport: Transport,
        peer: str,
        src: RowTable,
        src_ids: torch.Tensor,
        dst: RowTable,
        dst_ids: torch.Tensor,
        lane: Lane,
        notif: bytes,
        *,
        after: Any | None = None,
        backend: Backend = "auto",
        more: Sequence[tuple[RowTable, torch.Tensor, RowTable, torch.Tensor]] = (),
    ) -> None:
        """``more``: further (src, src_ids, dst, dst_ids) copies of the same transfer (other
        columns of the rows, when P's and D's blocks differ in size), one launch each."""
        copies = [(src, src_ids, dst, dst_ids), *more]
        if any(d.device.type != s.device.type for s, _, d, _ in copies):
            raise LocalProtocolError("IpcPush: source and destination on different kinds")
        self._t, self.peer, self.notif = transport, peer, notif
        lane.wait_for(after)  # the forward's event: never read KV before it is written
        self.begin = lane.record()
        with lane.active():
            for s_rows, s_ids, d_rows, d_ids in copies:
                copy_rows(s_rows, s_ids, d_rows, d_ids, backend=backend)
        self.end = lane.record()
        self.sent = False
        self.quiet = False  # aborted: finish the copy, send nothing

    def pump(self) -> bool:
        if not self.sent and self.end.done():
            if not self.quiet:
                self._t.send_notif(self.peer, self.notif)
            self.sent = True
        return self.sent

    def device_ms(self) -> float:
        return self.begin.elapsed_ms(self.end)

"""Step-event ordering on a real GPU (skipped without CUDA; run on the device machine):
P's copy never reads KV before the forward's event has fired, and D hears "ready" only
after its scatter's event has fired."""

from __future__ import annotations

import pytest
import torch

from connector.transfer.gpu.ipc import IpcPush
from connector.transfer.gpu.lanes import Lane
from connector.transfer.gpu.rows import RowTable, copy_rows, scatter
from connector.transfer.gpu.staged import StagedLand, StagingBuffer
from connector.transfer.staging import ChunkWritten, SlotPool, StagedRecv, plan_chunks
from connector.transport.fake import FakeFabric

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
SLEEP_CYCLES = 200_000_000  # ~0.1 s at 2 GHz: long enough to look before it ends
ROWS, NB, ROW = 4, 32, 4096


def rows(fill: int) -> RowTable:
    t = torch.full((ROWS, NB, ROW), fill, dtype=torch.uint8, device="cuda")
    return RowTable.of(list(t.unbind(0)))


def test_ipc_copy_waits_for_the_forward_event_and_notifies_after_it() -> None:
    fabric = FakeFabric()
    p, d = fabric.transport("prefill"), fabric.transport("decode")
    p.connect("decode", *d.listen_address, timeout_s=0)
    src, dst = rows(1), rows(0)
    ids, flipped = torch.arange(NB, device="cuda"), torch.arange(NB - 1, -1, -1, device="cuda")
    copy_rows(src, ids, dst, flipped)  # compile first: a first launch outlasts the sleep
    for t in dst.tensors:
        t.zero_()
    torch.cuda.synchronize()  # (work on the default stream after this point would wait)
    forward = torch.cuda.Stream()
    with torch.cuda.stream(forward):  # the "forward": slow, then writes the KV
        torch.cuda._sleep(SLEEP_CYCLES)
        for t in src.tensors:
            t.fill_(7)
    done = torch.cuda.Event()
    done.record(forward)
    push = IpcPush(p, "decode", src, ids, dst, flipped, Lane("cuda"), b"ready", after=done)
    assert not push.pump() and d.get_notifs() == []  # the forward is still running
    while not push.pump():
        pass
    assert d.get_notifs() == [("prefill", b"ready")]
    assert all(bool((t == 7).all()) for t in dst.tensors)  # never the values before it


def test_staged_land_is_ready_only_after_its_scatter_event() -> None:
    fabric = FakeFabric()
    d = fabric.transport("decode")
    dst = rows(0)
    chunks = plan_chunks(ROWS, NB, ROW, ROWS * NB * ROW)
    assert len(chunks) == 1  # one chunk: no credit to send back
    pool = SlotPool(1, ROWS * NB * ROW)
    staging = StagingBuffer(pool, "cuda")
    staging.tensor.fill_(5)
    ids = torch.arange(NB, device="cuda")
    scatter(staging.tensor, dst, ids)  # compile first, then start from zeros again
    for t in dst.tensors:
        t.zero_()
    torch.cuda.synchronize()
    lane = Lane("cuda")
    land = StagedLand(
        d,
        "prefill",
        "t",
        dst,
        torch.arange(NB, device="cuda"),
        StagedRecv(chunks, [0]),
        staging,
        lane,
    )
    with lane.active():
        torch.cuda._sleep(SLEEP_CYCLES)  # D's lane busy: the scatter runs after this
    land.on_notif(ChunkWritten("t", 0, 0))
    assert not land.pump()
    while not land.pump():
        pass
    assert all(bool((t == 5).all()) for t in dst.tensors)

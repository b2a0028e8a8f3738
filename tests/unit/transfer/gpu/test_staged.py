"""The staged path end to end on CPU tensors over the fake transport: P gathers, WRITEs
chunks into D's slots, D scatters and credits slots back; every byte checked."""

from __future__ import annotations

import pytest
import torch

from connector.transfer.gpu.lanes import Lane
from connector.transfer.gpu.rows import RowTable
from connector.transfer.gpu.staged import StagedLand, StagedPush, StagingBuffer
from connector.transfer.staging import (
    ChunkWritten,
    SlotFreed,
    SlotPool,
    StagedRecv,
    StagedSend,
    decode_notif,
    plan_chunks,
)
from connector.transport.fake import FakeFabric

LAYERS, NB, ROW = 8, 40, 256


def kv(seed: int | None) -> RowTable:
    if seed is None:
        return RowTable.of([torch.zeros(NB, ROW, dtype=torch.uint8) for _ in range(LAYERS)])
    g = torch.Generator().manual_seed(seed)
    return RowTable.of(
        [torch.randint(1, 256, (NB, ROW), dtype=torch.uint8, generator=g) for _ in range(LAYERS)]
    )


@pytest.mark.parametrize(
    ("p_slots", "d_slots", "slot_rows"), [(1, 1, 10), (2, 3, 24), (4, 4, 64), (3, 2, 7)]
)
def test_staged_transfer_moves_every_byte_through_bounded_slots(
    p_slots: int, d_slots: int, slot_rows: int
) -> None:
    fabric = FakeFabric()
    p, d = fabric.transport("prefill"), fabric.transport("decode")
    src, dst = kv(1), kv(None)
    p_pool, d_pool = SlotPool(p_slots, slot_rows * ROW), SlotPool(d_slots, slot_rows * ROW)
    p_buf, d_buf = StagingBuffer(p_pool, "cpu"), StagingBuffer(d_pool, "cpu")
    p_buf.register(p)
    d_buf.register(d)
    p.connect("decode", *d.listen_address, timeout_s=0)
    d.connect("prefill", *p.listen_address, timeout_s=0)
    s_ids = torch.tensor([3, 17, 2, 39, 0, 8, 9, 10, 25, 31, 5, 6], dtype=torch.int64)
    d_ids = torch.tensor([30, 1, 2, 3, 12, 11, 10, 38, 20, 21, 22, 4], dtype=torch.int64)
    chunks = plan_chunks(LAYERS, len(s_ids), ROW, p_pool.slot_bytes, min_chunks=4)
    reserved = d_pool.acquire_many(d_slots)
    assert reserved is not None
    push = StagedPush(
        p,
        "decode",
        "t1",
        src,
        s_ids,
        StagedSend(chunks, p_pool, reserved),
        p_buf,
        d_buf.remote(),
        Lane("cpu"),
    )
    land = StagedLand(
        d, "prefill", "t1", dst, d_ids, StagedRecv(chunks, reserved), d_buf, Lane("cpu")
    )
    pushed = ready = False
    for _ in range(10_000):
        pushed = push.pump() or pushed
        for _, raw in d.get_notifs():
            msg = decode_notif(raw)
            assert isinstance(msg, ChunkWritten)
            land.on_notif(msg)
        ready = land.pump()
        for _, raw in p.get_notifs():
            msg = decode_notif(raw)
            assert isinstance(msg, SlotFreed)
            push.on_notif(msg)
        if pushed and ready:
            break
    assert pushed and ready
    assert push.writes_posted == len(chunks)  # one WRITE, one descriptor, per chunk
    assert all(pw.descs_total == 1 for pw in fabric.posted)
    for r in range(LAYERS):
        assert torch.equal(dst.tensors[r][d_ids], src.tensors[r][s_ids])
        rest = [b for b in range(NB) if b not in d_ids.tolist()]
        assert int(dst.tensors[r][rest].sum()) == 0
    assert p_pool.free_count == p_slots  # P's slots all back; D's are the caller's to release
    assert len(land.scatter_times.marks) == len(chunks)

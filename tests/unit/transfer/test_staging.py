"""The staged path's pure bookkeeping: chunk plans, the bounded pool, both schedules."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from connector.core.errors import LocalProtocolError, RemoteProtocolError
from connector.transfer.staging import (
    ChunkWritten,
    SlotFreed,
    SlotPool,
    StagedRecv,
    StagedSend,
    decode_notif,
    encode_notif,
    is_staging_notif,
    plan_chunks,
)


@given(
    regions=st.integers(0, 200),
    blocks=st.integers(0, 300),
    row=st.sampled_from([8, 64, 4096, 65536]),
    slots_rows=st.integers(1, 5000),
    min_chunks=st.integers(1, 8),
)
def test_chunks_cover_every_row_once_and_fit_the_slot(
    regions: int, blocks: int, row: int, slots_rows: int, min_chunks: int
) -> None:
    slot = slots_rows * row
    chunks = plan_chunks(regions, blocks, row, slot, min_chunks)
    seen = [
        (r, b) for c in chunks for r in range(*c.regions) for b in range(c.block_start, c.block_end)
    ]
    assert sorted(seen) == [(r, b) for r in range(regions) for b in range(blocks)]
    assert len(seen) == len(set(seen))
    assert all(0 < c.nbytes <= slot for c in chunks)
    assert [c.index for c in chunks] == list(range(len(chunks)))
    if regions and blocks and blocks * row <= slot:
        assert len(chunks) >= min(min_chunks, regions)  # enough chunks to overlap stages


def test_row_bigger_than_slot_is_refused() -> None:
    with pytest.raises(LocalProtocolError):
        plan_chunks(2, 2, 4096, 1024)


def test_pool_is_bounded_and_signals_back_pressure() -> None:
    pool = SlotPool(2, 1024)
    a, b = pool.acquire(), pool.acquire()
    assert {a, b} == {0, 1} and pool.acquire() is None and pool.waits == 1
    assert pool.acquire_many(1) is None
    pool.release(a)  # type: ignore[arg-type]
    with pytest.raises(LocalProtocolError):
        pool.release(a)  # type: ignore[arg-type]
    with pytest.raises(LocalProtocolError):
        pool.release(7)
    assert pool.acquire_many(1) == [a] and pool.capacity_bytes == 2048
    assert pool.offset(1) == 1024


def run_schedule(n_chunks: int, local_slots: int, remote_slots: int, seed: int) -> list[str]:
    """Drive both schedules with a random interleaving; return the order of events."""
    rng = random.Random(seed)
    chunks = plan_chunks(n_chunks, 1, 8, 8)
    pool = SlotPool(local_slots, 8)
    d_pool = SlotPool(remote_slots, 8)
    d_slots = d_pool.acquire_many(remote_slots)
    assert d_slots is not None
    send = StagedSend(chunks, pool, d_slots)
    recv = StagedRecv(chunks, d_slots)
    gathering: list[int] = []
    writing: list[tuple[int, int]] = []
    scattering: list[int] = []
    credits: list[int] = []
    log: list[str] = []
    while not (send.done and recv.ready):
        moves = []
        gathering += [c.index for c, _ in send.gathers_to_start()]
        if gathering:
            moves.append("gather")
        for c, _, rs in send.writes_to_post():
            writing.append((c.index, rs))
        if writing:
            moves.append("write")
        if scattering:
            moves.append("scatter")
        if credits:
            moves.append("credit")
        move = rng.choice(moves)
        if move == "gather":
            send.gathered(gathering.pop(0))
        elif move == "write":
            idx, rs = writing.pop(rng.randrange(len(writing)))
            send.written(idx)
            recv.arrived(idx, rs)
            scattering.append(idx)
        elif move == "scatter":
            idx = scattering.pop(rng.randrange(len(scattering)))
            credits.append(recv.scattered(idx))
            log.append(f"ready{idx}")
        else:
            send.credited(credits.pop(0))
        assert pool.free_count + len(send._local) == local_slots  # nothing leaks
    return log


@given(n=st.integers(1, 20), local=st.integers(1, 4), remote=st.integers(1, 4), seed=st.integers())
def test_schedules_finish_every_chunk_with_bounded_slots(
    n: int, local: int, remote: int, seed: int
) -> None:
    log = run_schedule(n, local, remote, seed)
    assert sorted(log) == sorted(f"ready{i}" for i in range(n))


def test_writes_wait_for_credits_and_gathers_for_slots() -> None:
    chunks = plan_chunks(4, 1, 8, 8)
    pool = SlotPool(2, 8)
    send = StagedSend(chunks, pool, [5])
    assert [c.index for c, _ in send.gathers_to_start()] == [0, 1]  # pool of 2
    send.gathered(1)
    assert send.writes_to_post() == []  # in order: chunk 0 first
    send.gathered(0)
    assert [(c.index, rs) for c, _, rs in send.writes_to_post()] == [(0, 5)]
    assert send.writes_to_post() == []  # one credit only
    send.written(0)
    assert [c.index for c, _ in send.gathers_to_start()] == [2]
    send.credited(5)
    assert [(c.index, rs) for c, _, rs in send.writes_to_post()] == [(1, 5)]
    with pytest.raises(RemoteProtocolError):
        send.credited(6)  # never ours
    with pytest.raises(LocalProtocolError):
        send.written(3)
    send.abort()
    assert pool.free_count == 2 - 0  # chunk 1's and 2's slots back


def test_recv_rejects_duplicates_and_unknown_slots() -> None:
    chunks = plan_chunks(2, 1, 8, 8)
    recv = StagedRecv(chunks, [3, 4])
    recv.arrived(0, 3)
    for idx, slot in ((0, 4), (1, 3), (1, 9), (5, 4)):
        with pytest.raises(RemoteProtocolError):
            recv.arrived(idx, slot)
    with pytest.raises(LocalProtocolError):
        recv.scattered(1)
    assert recv.scattered(0) == 3 and not recv.ready
    recv.arrived(1, 3)
    recv.scattered(1)
    assert recv.ready


def test_notifications_round_trip_and_reject_garbage() -> None:
    for msg in (ChunkWritten("t", 3, 1), SlotFreed("t", 2)):
        raw = encode_notif(msg)
        assert is_staging_notif(raw) and decode_notif(raw) == msg
    assert not is_staging_notif(b"KV_DONE:1")
    for bad in (b"pkvst\x00", b"other", encode_notif(SlotFreed("t", 1, version=2))):
        with pytest.raises(RemoteProtocolError):
            decode_notif(bad)

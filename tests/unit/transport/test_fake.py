"""Unit tests of the fake transport and of the shared contract in transport/base.py."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from connector.core.errors import (
    LocalProtocolError,
    PeerDisconnected,
    PeerUnknown,
    PeerUnreachable,
    TransportError,
)
from connector.transport.base import Transport, WriteHandle
from connector.transport.fake import FakeFabric, FakeTransport

BLOCK = 256


class Clock:
    """A fake clock; ``sleep`` advances it and runs scheduled callbacks."""

    def __init__(self) -> None:
        self.now = 0.0
        self.at: list[tuple[float, object]] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, dt: float) -> None:
        self.now += max(dt, 1e-3)
        for when, fn in list(self.at):
            if self.now >= when:
                self.at.remove((when, fn))
                fn()  # type: ignore[operator]


@dataclass
class Pair:
    fabric: FakeFabric
    p: FakeTransport
    d: FakeTransport
    src: np.ndarray
    dst: np.ndarray


def rows(buf: np.ndarray, blocks: list[int], size: int = BLOCK) -> np.ndarray:
    base = buf.ctypes.data
    return np.array([[base + b * size, size, 0] for b in blocks], dtype=np.uint64)


def make_pair(fabric: FakeFabric | None = None, nblocks: int = 16) -> Pair:
    fabric = fabric or FakeFabric()
    p, d = fabric.transport("prefill"), fabric.transport("decode")
    src = np.arange(nblocks * BLOCK, dtype=np.uint32).astype(np.uint8)
    src[src == 0] = 7  # no zero bytes, so "untouched" is unambiguous
    dst = np.zeros(nblocks * BLOCK, dtype=np.uint8)
    p.register_memory([(src.ctypes.data, src.nbytes)])
    d.register_memory([(dst.ctypes.data, dst.nbytes)])
    p.connect("decode", *d.listen_address, timeout_s=0)
    return Pair(fabric, p, d, src, dst)


def blocks_of(buf: np.ndarray, b: int) -> np.ndarray:
    return buf[b * BLOCK : (b + 1) * BLOCK]


def test_fake_transport_satisfies_the_protocol() -> None:
    assert isinstance(FakeFabric().transport("x"), Transport)


def test_scattered_write_lands_then_notifies_and_leaves_the_rest_zero() -> None:
    pr = make_pair()
    src_b, dst_b = [0, 3, 4, 5, 9, 2], [7, 1, 2, 3, 0, 11]
    h = pr.p.write("decode", rows(pr.src, src_b), rows(pr.dst, dst_b), b"KV_DONE:1")
    assert isinstance(h, WriteHandle) and (h.bytes_total, h.descs_total) == (6 * BLOCK, 6)
    assert pr.p.poll_write(h)
    assert pr.d.get_notifs() == [("prefill", b"KV_DONE:1")]
    for s, d in zip(src_b, dst_b, strict=True):
        assert np.array_equal(blocks_of(pr.dst, d), blocks_of(pr.src, s))
    untouched = set(range(16)) - set(dst_b)
    assert all(not blocks_of(pr.dst, b).any() for b in untouched)
    pr.p.release(h)
    pr.p.release(h)  # twice is fine
    assert pr.fabric.posted[-1].notif == b"KV_DONE:1"


def test_delayed_write_lands_only_when_polled_done() -> None:
    pr = make_pair()
    pr.fabric.delay_writes(3)
    h = pr.p.write("decode", rows(pr.src, [1]), rows(pr.dst, [2]), b"n")
    for _ in range(3):
        assert pr.p.poll_write(h) is False
        assert pr.d.get_notifs() == [] and not pr.dst.any()
    assert pr.p.poll_write(h) is True
    assert pr.d.get_notifs() == [("prefill", b"n")]
    assert np.array_equal(blocks_of(pr.dst, 2), blocks_of(pr.src, 1))


@pytest.mark.parametrize("at", ["post", "poll"])
def test_injected_write_failure_lands_nothing(at: str) -> None:
    pr = make_pair()
    pr.fabric.fail_writes(at, error=PeerDisconnected)  # type: ignore[arg-type]
    with pytest.raises(PeerDisconnected):
        h = pr.p.write("decode", rows(pr.src, [1]), rows(pr.dst, [2]), b"n")
        pr.p.poll_write(h)
    if at == "poll":
        with pytest.raises(PeerDisconnected):  # the failure sticks to the handle
            pr.p.poll_write(h)
    assert not pr.dst.any() and pr.d.get_notifs() == []
    h2 = pr.p.write("decode", rows(pr.src, [1]), rows(pr.dst, [2]), b"ok")  # count=1: next ok
    assert pr.p.poll_write(h2) and pr.d.get_notifs() == [("prefill", b"ok")]


def test_release_of_an_unfinished_write_cancels_it() -> None:
    pr = make_pair()
    pr.fabric.delay_writes(5)
    h = pr.p.write("decode", rows(pr.src, [1]), rows(pr.dst, [2]), b"n")
    pr.p.release(h)
    with pytest.raises(LocalProtocolError):
        pr.p.poll_write(h)
    assert not pr.dst.any() and pr.d.get_notifs() == []


def test_notification_drop_duplicate_reorder() -> None:
    pr = make_pair()
    pr.fabric.drop_notifs(1, prefix=b"HB")
    pr.fabric.duplicate_notifs(1, prefix=b"REG")
    for msg in (b"HB:1", b"HB:2", b"REG:1"):
        pr.p.send_notif("decode", msg)
    assert pr.d.get_notifs() == [("prefill", b"HB:2"), ("prefill", b"REG:1"), ("prefill", b"REG:1")]
    assert (pr.fabric.notifs_dropped, pr.fabric.notifs_duplicated) == (1, 1)
    pr.fabric.reorder_notifs("decode")
    for i in range(3):
        pr.p.send_notif("decode", b"%d" % i)
    assert [m for _, m in pr.d.get_notifs()] == [b"2", b"1", b"0"]
    pr.fabric.reorder_notifs("decode", seed=1)
    msgs = [b"%d" % i for i in range(20)]
    for m in msgs:
        pr.p.send_notif("decode", m)
    got = [m for _, m in pr.d.get_notifs()]
    assert sorted(got) == sorted(msgs) and got != msgs


def test_notifications_flow_both_ways() -> None:
    pr = make_pair()
    pr.d.send_notif("prefill", b"REG")  # connect() sent our metadata to the peer too
    pr.p.send_notif("decode", b"ACK")
    assert pr.p.get_notifs() == [("decode", b"REG")]
    assert pr.d.get_notifs() == [("prefill", b"ACK")]
    assert pr.d.get_notifs() == []  # only new ones


def test_disconnected_peer_raises_on_every_call_towards_it() -> None:
    pr = make_pair()
    pr.fabric.delay_writes(2)
    inflight = pr.p.write("decode", rows(pr.src, [1]), rows(pr.dst, [2]), b"n")
    pr.fabric.disconnect("decode")
    with pytest.raises(PeerDisconnected):
        pr.p.poll_write(inflight)
    with pytest.raises(PeerDisconnected):
        pr.p.write("decode", rows(pr.src, [1]), rows(pr.dst, [2]), b"n")
    with pytest.raises(PeerDisconnected):
        pr.p.send_notif("decode", b"x")
    with pytest.raises(TransportError):
        pr.d.get_notifs()  # the dead side is closed
    pr.p.remove_peer("decode")
    with pytest.raises(PeerUnreachable):
        pr.p.connect("decode", *pr.d.listen_address, timeout_s=0)


def test_unknown_peer_and_misuse() -> None:
    pr = make_pair()
    with pytest.raises(PeerUnknown):
        pr.p.write("nobody", rows(pr.src, [1]), rows(pr.dst, [2]), b"n")
    with pytest.raises(PeerUnknown):
        pr.p.send_notif("nobody", b"x")
    with pytest.raises(LocalProtocolError):
        pr.p.poll_peer("nobody", 0.0)
    pr.p.remove_peer("nobody")  # idempotent


@pytest.mark.parametrize(
    "src_shape,dst_shape,lens",
    [
        ((2, 3), (3, 3), None),
        ((2, 2), (2, 2), None),
        ((0, 3), (0, 3), None),
        ((2, 3), (2, 3), (BLOCK, BLOCK // 2)),
    ],
)
def test_bad_descriptors_are_our_bug(
    src_shape: tuple[int, int], dst_shape: tuple[int, int], lens: tuple[int, int] | None
) -> None:
    pr = make_pair()
    src = np.zeros(src_shape, dtype=np.uint64)
    dst = np.zeros(dst_shape, dtype=np.uint64)
    if lens:
        src[:] = rows(pr.src, [0, 1])
        dst[:] = rows(pr.dst, [0, 1])
        dst[1, 1] = lens[1]
    with pytest.raises(LocalProtocolError):
        pr.p.write("decode", src, dst, b"n")


def test_descriptors_outside_registered_memory_fail_the_write() -> None:
    pr = make_pair()
    with pytest.raises(TransportError):
        pr.p.write("decode", rows(pr.src, [1]), rows(pr.dst, [16]), b"n")  # past the end
    other = np.zeros(BLOCK, dtype=np.uint8)
    with pytest.raises(TransportError):
        pr.p.write("decode", rows(other, [0]), rows(pr.dst, [0]), b"n")
    assert pr.d.get_notifs() == []


def test_poll_peer_re_requests_every_interval_until_the_listener_is_up() -> None:
    clock = Clock()
    fabric = FakeFabric(clock=clock, sleep=clock.sleep)
    p = fabric.transport("prefill")
    p.request_peer("decode", "127.0.0.1", 31000, retry_interval_s=0.5)
    assert p.poll_peer("decode", 0.1) is False
    fabric.transport("decode", port=31000)  # late listener
    assert p.poll_peer("decode", 0.2) is False  # the next request is not due yet
    assert p.poll_peer("decode", 0.6) is False  # re-requested now; answered at once
    assert p.poll_peer("decode", 0.61) is True


def test_connect_retries_until_a_late_listener_appears_or_times_out() -> None:
    clock = Clock()
    fabric = FakeFabric(clock=clock, sleep=clock.sleep)
    p = fabric.transport("prefill")
    clock.at.append((1.0, lambda: fabric.transport("decode", port=31001)))
    p.connect("decode", "127.0.0.1", 31001, timeout_s=5.0)
    assert 1.0 <= clock.now < 1.2 and p.peer_ready("decode")
    fabric.set_unreachable("decode")
    p.remove_peer("decode")
    start = clock.now
    with pytest.raises(PeerUnreachable):
        p.connect("decode", "127.0.0.1", 31001, timeout_s=2.0)
    assert clock.now - start == pytest.approx(2.0, abs=0.01)


def test_close_is_idempotent_and_frees_the_address() -> None:
    pr = make_pair()
    pr.fabric.delay_writes(5)
    pr.p.write("decode", rows(pr.src, [1]), rows(pr.dst, [2]), b"n")
    addr = pr.d.listen_address
    pr.d.close()
    pr.d.close()
    with pytest.raises(TransportError):
        pr.d.send_notif("prefill", b"x")
    pr.p.close()
    assert not pr.dst.any()
    again = pr.fabric.transport("decode", port=addr[1])
    assert again.listen_address == addr


class _Dev:
    def __init__(self, kind: str, index: int | None) -> None:
        self.type, self.index = kind, index


class _Tensor:
    """Duck-typed stand-in for a torch tensor (importing torch costs seconds)."""

    def __init__(self, buf: np.ndarray, kind: str = "cpu") -> None:
        self.buf, self.device = buf, _Dev(kind, 0 if kind == "cuda" else None)

    def is_contiguous(self) -> bool:
        return True

    def data_ptr(self) -> int:
        return int(self.buf.ctypes.data)

    def numel(self) -> int:
        return int(self.buf.size)

    def element_size(self) -> int:
        return int(self.buf.itemsize)


def test_register_tensors_maps_cpu_to_dram_and_rejects_vram_in_the_fake() -> None:
    fabric = FakeFabric()
    p, d = fabric.transport("prefill"), fabric.transport("decode")
    a = np.full(64, 3, dtype=np.uint16)
    b = np.zeros(64, dtype=np.uint16)
    p.register_tensors([_Tensor(a)])
    d.register_tensors([_Tensor(b)])
    p.connect("decode", *d.listen_address, timeout_s=0)
    h = p.write(
        "decode",
        np.array([[a.ctypes.data, a.nbytes, 0]], dtype=np.uint64),
        np.array([[b.ctypes.data, b.nbytes, 0]], dtype=np.uint64),
        b"t",
    )
    assert p.poll_write(h) and np.array_equal(a, b)
    with pytest.raises(TransportError):
        p.register_tensors([_Tensor(a, "cuda")])


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_any_scatter_lands_exactly_where_asked(data: st.DataObject) -> None:
    n = 32
    pr = make_pair(nblocks=n)
    dst_b = data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=n, unique=True))
    src_b = data.draw(st.lists(st.integers(0, n - 1), min_size=len(dst_b), max_size=len(dst_b)))
    delay = data.draw(st.integers(0, 3))
    pr.fabric.delay_writes(delay)
    h = pr.p.write("decode", rows(pr.src, src_b), rows(pr.dst, dst_b), b"x")
    polls = 1
    while not pr.p.poll_write(h):
        polls += 1
    assert polls == delay + 1
    for s, d in zip(src_b, dst_b, strict=True):
        assert np.array_equal(blocks_of(pr.dst, d), blocks_of(pr.src, s))
    for b in set(range(n)) - set(dst_b):
        assert not blocks_of(pr.dst, b).any()
    assert pr.d.get_notifs() == [("prefill", b"x")]

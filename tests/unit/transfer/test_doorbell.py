"""Doorbells (connector.transfer.doorbell) on real UDP sockets, who rings them (Peers, Sender), and
the transfer thread's sleep policy (``Backoff``, pure)."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from connector.core import events as ev
from connector.transfer.doorbell import (
    DONE,
    MESSAGE,
    WRITE,
    Doorbell,
    IncomingWrites,
    Rings,
    write_key,
)
from connector.transfer.polling import Backoff
from telemetry.schema import Count
from tests.unit.test_endpoints import Pair

BOUND_S = 5.0  # a datagram on loopback takes microseconds; this only bounds a failure


def _free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def bells():
    a = Doorbell("127.0.0.1", _free_udp_port())
    b = Doorbell("127.0.0.1", _free_udp_port())
    yield a, b
    a.close()
    b.close()


def test_a_ring_wakes_the_peer_and_one_wait_drains_every_ring(bells) -> None:
    a, b = bells
    a.ring(*b.address)
    a.ring(*b.address, WRITE + write_key(1, "t-9"))
    a.ring(*b.address, MESSAGE)
    a.ring(*b.address, DONE + write_key(1, "t-9"))
    # One wait may return before the last datagram is in: collect until all four are.
    heard = Rings(True)
    deadline = time.monotonic() + BOUND_S
    while heard.rings < 4 and time.monotonic() < deadline:
        got = b.wait(BOUND_S)
        assert got.woken, f"no wake-up within {BOUND_S} s"
        heard.messages += got.messages
        heard.writes += got.writes
        heard.dones += got.dones
    assert (heard.messages, heard.writes, heard.dones) == (2, [b"1:t-9"], [b"1:t-9"]), heard
    assert b.counters["heard"] == 4 and b.counters["heard_write"] == 1
    assert b.counters["heard_done"] == 1 and a.counters["rung"] == 4
    t0 = time.monotonic()
    assert b.wait(0.02) == Rings(False), "every ring was drained"
    assert time.monotonic() - t0 >= 0.015, "an empty wait returned before its timeout"


def test_a_local_wake_from_another_thread_is_not_a_ring(bells) -> None:
    _, b = bells
    threading.Thread(target=b.wake).start()
    assert b.wait(BOUND_S) == Rings(True)
    assert b.counters["heard"] == 0


def test_ringing_nobody_or_a_closed_bell_never_raises(bells) -> None:
    a, b = bells
    host, port = b.address
    b.close()
    a.ring(host, port)  # ICMP port unreachable may come back to a's socket
    a.ring("127.0.0.1", _free_udp_port())
    a.wait(0.01)
    assert a.counters["heard"] == 0


def test_a_taken_port_gives_no_doorbell_instead_of_failing(bells) -> None:
    a, _ = bells
    assert Doorbell.open(*a.address) is None


class RecordingBell:
    def __init__(self) -> None:
        self.rings: list[tuple[str, int, bytes]] = []

    def ring(self, host: str, port: int, what: bytes = MESSAGE) -> None:
        self.rings.append((host, port, what))


def test_d_rings_p_with_its_registration_and_p_rings_d_when_it_posts_the_write() -> None:
    pair = Pair()
    p_bell, d_bell = RecordingBell(), RecordingBell()
    pair.sender.peers._bell = p_bell  # type: ignore[assignment]
    pair.receiver.peers._bell = d_bell  # type: ignore[assignment]
    p_at, d_at = (
        (pair.p_spec.addr.host, pair.p_spec.port),
        (pair.d_spec.addr.host, pair.d_spec.port),
    )
    pair.expect("t", 40, (9, 3, 5))
    pair.pump()
    assert d_bell.rings == [(*p_at, MESSAGE)], "D's registration went out without a ring"
    pair.sender.on_event(ev.PrefillDone("t", "preq", ((1, 2, 3),), 40), pair.now)
    pair.pump()
    assert [(r.transfer_id, r.ok) for r in pair.receiver.finished] == [("t", True)]
    assert p_bell.rings == [
        (*d_at, WRITE + write_key(0, "t")),
        (*d_at, DONE + write_key(0, "t")),
    ], "P rings D when it posts the WRITE and again when it is DONE (the completion sent)"


def test_an_announced_write_is_awaited_until_its_completion_and_a_late_bell_is_ignored() -> None:
    w = IncomingWrites(max_wait_s=0.05)
    w.announced([b"0:a", b"1:a"], now_s=1.0)
    w.landed(b"0:a", now_s=1.001)
    assert w.pending(1.001), "rank 1's WRITE of a is still in flight"
    w.landed(b"1:a", now_s=1.002)
    assert not w.pending(1.002)
    assert not w.done_rung(b"0:a"), "a DONE bell after its completion is no news"
    assert w.done_rung(b"0:z"), "a DONE bell before its completion is"
    w.landed(b"0:b", now_s=1.003)  # the completion beat its bell
    w.announced([b"0:b"], now_s=1.004)
    assert not w.pending(1.004), "a late bell must not start a wait for a WRITE already in"
    assert not w.done_rung(b"0:b")
    w.announced([b"0:c"], now_s=2.0)  # a WRITE whose completion never comes
    assert w.pending(2.0) and not w.pending(2.05)
    assert w.counters.of(Count.INCOMING_EXPIRED) == 1


def test_a_flood_of_announced_writes_is_capped() -> None:
    w = IncomingWrites(max_tracked=3)
    w.announced([b"0:%d" % i for i in range(5)], now_s=0.0)
    assert w.counters.of(Count.INCOMING_DROPPED) == 2 and w.pending(0.0)


# ---------------------------------------------------------------- Backoff (pure)
HOT_MIN, HOT_MAX, IDLE, FALLBACK, BELL_HOT = 20e-6, 1e-3, 0.05, 0.005, 0.001
INCOMING, TRUSTED = 0.0005, 0.04  # TRUSTED apart from IDLE, to tell them apart


def _backoff(bell: bool) -> Backoff:
    return Backoff(
        hot_min_s=HOT_MIN,
        hot_max_s=HOT_MAX,
        idle_s=IDLE,
        fallback_s=FALLBACK if bell else None,
        bell_hot_s=BELL_HOT,
        incoming_s=INCOMING,
        trusted_s=TRUSTED,
    )


def _quiet(b: Backoff, now: float, **busy: bool) -> float:
    return b.next(now, active=False, woken=False, rung=False, **busy)


def test_without_a_bell_a_wait_on_the_peer_is_polled_fast() -> None:
    b = _backoff(bell=False)
    assert b.next(0.0, active=True, woken=False, rung=False, local=False, remote=True) == HOT_MIN
    delays = [_quiet(b, 0.0, local=False, remote=True) for _ in range(10)]
    assert delays[0] == 2 * HOT_MIN and delays[-1] == HOT_MAX
    assert _quiet(b, 0.0, local=False, remote=True, trusted=True) == HOT_MAX, (
        "without a bell nobody is trusted to ring"
    )
    assert _quiet(b, 0.0, local=False, remote=False) == IDLE


def test_with_a_bell_a_wait_on_the_peer_sleeps_until_a_ring_then_polls_fast_briefly() -> None:
    b = _backoff(bell=True)
    assert b.next(0.0, active=True, woken=False, rung=False, local=False, remote=True) == FALLBACK
    assert b.next(1.0, active=False, woken=True, rung=True, local=False, remote=True) == HOT_MIN
    assert _quiet(b, 1.0 + BELL_HOT / 2, local=False, remote=True) == 2 * HOT_MIN
    assert _quiet(b, 1.0 + BELL_HOT, local=False, remote=True) == FALLBACK
    # A ring also wakes a thread with nothing pending for a short look (it may be news).
    assert b.next(2.0, active=False, woken=True, rung=True, local=False, remote=False) == HOT_MIN
    assert _quiet(b, 2.0 + BELL_HOT, local=False, remote=False) == IDLE
    # A ring whose news was in at once needs no second look.
    assert b.next(3.0, active=True, woken=True, rung=True, local=False, remote=True) == FALLBACK
    assert b.next(4.0, active=True, woken=True, rung=True, local=False, remote=False) == IDLE


def test_peers_that_rang_before_are_trusted_to_ring_and_polled_rarely() -> None:
    b = _backoff(bell=True)
    assert _quiet(b, 0.0, local=False, remote=True, trusted=True) == TRUSTED
    assert _quiet(b, 0.0, local=False, remote=True, trusted=False) == FALLBACK
    # ...but a ring that brought nothing is still followed by fast polls.
    assert (
        b.next(1.0, active=False, woken=True, rung=True, local=False, remote=True, trusted=True)
        == HOT_MIN
    )
    assert _quiet(b, 1.0 + BELL_HOT, local=False, remote=True, trusted=True) == TRUSTED


def test_local_work_is_polled_fast_with_or_without_a_bell() -> None:
    for bell in (False, True):
        b = _backoff(bell)
        assert b.next(0.0, active=True, woken=False, rung=False, local=True, remote=True) == HOT_MIN
        assert max(_quiet(b, 5.0, local=True, remote=True) for _ in range(20)) == HOT_MAX


def test_an_incoming_write_is_polled_steadily_not_from_twenty_microseconds_up() -> None:
    b = _backoff(bell=True)
    # The WRITE bell woke the thread: no burst of 20 µs polls, the steady cadence at once.
    assert (
        b.next(0.0, active=False, woken=True, rung=False, local=False, remote=True, incoming=True)
        == INCOMING
    )
    assert {
        _quiet(b, 0.001 * i, local=False, remote=True, incoming=True, trusted=True)
        for i in range(10)
    } == {INCOMING}
    # Local work of our own still polls fast meanwhile.
    assert (
        b.next(0.02, active=True, woken=False, rung=False, local=True, remote=True, incoming=True)
        == HOT_MIN
    )


steps = st.lists(
    st.tuples(
        st.floats(0, 0.01),
        st.booleans(),
        st.booleans(),
        st.booleans(),
        st.booleans(),
        st.booleans(),
        st.booleans(),
        st.booleans(),
    ),
    max_size=60,
)


@given(steps, st.booleans())
def test_backoff_delays_stay_in_their_bands(seq, bell: bool) -> None:
    b, now = _backoff(bell), 0.0
    for dt, active, woken, rung, local, remote, incoming, trusted in seq:
        now += dt
        rung = rung and bell  # only a doorbell rings
        incoming = incoming and bell
        d = b.next(
            now,
            active=active,
            woken=woken or rung,
            rung=rung,
            local=local,
            remote=remote,
            incoming=incoming,
            trusted=trusted,
        )
        if local:
            assert HOT_MIN <= d <= HOT_MAX, "local work must be polled fast"
        elif remote and not bell:
            assert HOT_MIN <= d <= HOT_MAX, "no bell: the peer is polled fast"
        elif rung and not active:
            assert d == HOT_MIN, "a ring that brought nothing is answered by fast polls"
        elif incoming:
            assert d <= INCOMING, "a WRITE into us is polled at least every incoming_s"
        elif remote and not trusted:
            assert d <= FALLBACK, "an untrusted peer is polled at least every fallback_s"
        assert d in (IDLE, FALLBACK, TRUSTED, INCOMING) or HOT_MIN <= d <= HOT_MAX
        assert bell or d not in (FALLBACK, TRUSTED, INCOMING)


def test_a_ringer_is_remembered_by_its_doorbell_address(bells) -> None:
    a, b = bells
    assert not b.heard_from(*a.address)
    a.ring(*b.address)
    deadline = time.monotonic() + BOUND_S
    while not b.heard_from(*a.address) and time.monotonic() < deadline:
        b.wait(BOUND_S)
    assert b.heard_from(*a.address), "a ring from a's doorbell did not mark a as ringing"
    assert not a.heard_from(*b.address), "ringing someone does not make them a ringer"


class HeardBell:
    """A doorbell stand-in for a thread that is never started: who has rung it."""

    def __init__(self) -> None:
        self.heard: set[tuple[str, int]] = set()

    def heard_from(self, host: str, port: int) -> bool:
        return (host, port) in self.heard

    def wake(self) -> None:
        pass


def test_d_trusts_its_peers_to_ring_only_once_every_p_rank_it_waits_on_has_rung() -> None:
    from connector.tools.loopback import RankSpec, expected_event
    from connector.transfer.thread import TransferThread

    pair = Pair()
    bell = HeardBell()
    thread = TransferThread(pair.td, pair.receiver.peers, receiver=pair.receiver, bell=bell)  # type: ignore[arg-type]  # not started
    p0 = pair.p_spec
    p1 = RankSpec("P", "prefill", 1, 2, p0.port + 1)
    pair.receiver.on_event(expected_event("t", [p0], pair.d_spec, (1,), 16), pair.now)
    assert not thread._peers_ring(), "P rank 0 never rang: keep the short fallback poll"
    bell.heard.add((p0.addr.host, p0.port))
    assert thread._peers_ring()
    pair.receiver.on_event(expected_event("u", [p0, p1], pair.d_spec, (2,), 16), pair.now)
    assert not thread._peers_ring(), "u also waits on P rank 1, which never rang"
    bell.heard.add((p1.addr.host, p1.port))
    assert thread._peers_ring()


# ---------------------------------------------------------------- idle sleep vs deadlines
def test_an_idle_thread_sleeps_long_yet_wakes_for_a_deadline_on_time() -> None:
    """With a doorbell an idle thread sleeps ``poll_idle_bell_s`` (here 5 s), but a deadline
    its tables keep (here: a registration that came before its prefill, ttl 300 ms) still
    fires on time, not at the next idle poll."""
    import msgspec

    from connector.config import PushkvConfig
    from connector.core import messages as m
    from connector.core.state import SendState
    from connector.transfer.thread import TransferThread

    pair = Pair()
    bell = Doorbell("127.0.0.1", 0)
    backoff = Backoff.from_config(PushkvConfig(poll_idle_bell_s=5.0), doorbell=True)
    thread = TransferThread(
        pair.tp, pair.sender.peers, sender=pair.sender, bell=bell, backoff=backoff
    )
    reg = msgspec.structs.replace(pair.register("t"), ttl_ms=300)
    pair.sender.on_message(pair.d_spec.agent, reg, time.monotonic_ns())  # before start: no race
    t0 = time.monotonic()
    thread.start()
    try:
        expired = (SendState.EXPIRED, m.FailReason.REGISTRATION_EXPIRED)
        deadline = t0 + BOUND_S
        while not pair.sender.table.ended[expired] and time.monotonic() < deadline:
            time.sleep(0.01)  # polling an outcome with a bound, not synchronising on time
        took = time.monotonic() - t0
        assert pair.sender.table.ended[expired] == 1, "the registration never expired"
        # Under the 5 s idle sleep with room for a loaded box: 300 ms when idle.
        assert took < 4.0, f"expired after {took:.2f} s: the idle sleep overran its deadline"
        # Nothing left to wait for: the thread sleeps (at most a tombstone's wake-up).
        polls = thread.counters["polls"]
        time.sleep(1.5)  # an observation window: three of the old (0.5 s) idle polls
        assert thread.counters["polls"] - polls <= 1, "an idle thread must not poll"
    finally:
        thread.stop()

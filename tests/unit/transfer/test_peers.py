"""Peers on the fake transport: one peer's silence or death never delays another's work,
a refused connection is an answer, and a failed peer backs off.

The fake's dial is immediate, so time is the test's own (``now``); what is checked is when
each callback runs relative to the dial deadline and the backoff, not wall-clock speed.
The same behaviours over real NIXL processes: tests/integration/test_dead_peers.py.
"""

from __future__ import annotations

import pytest

from connector.core import messages as m
from connector.core.errors import (
    PeerDisconnected,
    PeerGone,
    PeerUnreachable,
    TransportError,
)
from connector.core.messages import PeerAddr
from connector.core.state import ReceiverPolicy
from connector.tools.loopback import RankSpec, expected_event
from connector.transfer.peers import BACKOFF_MAX_NS, BACKOFF_MIN_NS, Peers
from connector.transfer.receiver import Receiver
from connector.transfer.topology import RankInfo
from connector.transport.fake import FakeFabric, FakeTransport

MS = 1_000_000
DIAL_NS = 10_000 * MS  # the default dial timeout: nothing below may wait for it


class Log:
    """What each callback saw, in order."""

    def __init__(self) -> None:
        self.ready: list[str] = []
        self.failed: list[tuple[str, TransportError]] = []

    def ok(self, tag: str):  # type: ignore[no-untyped-def]
        return lambda: self.ready.append(tag)

    def fail(self, tag: str):  # type: ignore[no-untyped-def]
        return lambda exc: self.failed.append((tag, exc))


@pytest.fixture
def fabric() -> FakeFabric:
    return FakeFabric()


def _me(fabric: FakeFabric) -> tuple[FakeTransport, Peers]:
    t = fabric.transport("me", port=15000)
    return t, Peers(t, DIAL_NS)


def _addr(t: FakeTransport) -> PeerAddr:
    host, port = t.listen_address
    return PeerAddr(agent=t.name, host=host, port=port)


def test_a_refused_dial_fails_its_waiters_at_the_next_poll_not_the_deadline(
    fabric: FakeFabric,
) -> None:
    _, peers = _me(fabric)
    gone = PeerAddr(agent="p-dead", host="127.0.0.1", port=16000)  # nothing listens there
    log = Log()
    peers.when_ready(gone, 0, log.ok("a"), log.fail("a"))
    peers.when_ready(gone, 1 * MS, log.ok("b"), log.fail("b"))
    peers.poll(2 * MS)
    assert [tag for tag, _ in log.failed] == ["a", "b"] and not log.ready
    assert all(isinstance(exc, PeerGone) for _, exc in log.failed)
    assert isinstance(log.failed[0][1], PeerDisconnected)  # so the transfer says peer_lost
    assert "refused" in str(log.failed[0][1])
    assert not peers.dialing and peers.counters["peer_gone"] == 1


def test_a_silent_peer_never_delays_another_peers_work(fabric: FakeFabric) -> None:
    _, peers = _me(fabric)
    silent, live = fabric.transport("p-silent"), fabric.transport("p-live")
    fabric.set_unreachable("p-silent")  # listening, but its answers never come
    log = Log()
    peers.send(_addr(silent), b"to the silent one", 0, log.fail("silent"), log.ok("silent"))
    peers.send(_addr(live), b"to the live one", 0, log.fail("live"), log.ok("live"))
    peers.poll(1 * MS)
    assert log.ready == ["live"] and not log.failed  # sent while the other still dials
    assert live.get_notifs() == [("me", b"to the live one")]
    peers.poll(DIAL_NS - 1)
    assert not log.failed
    peers.poll(DIAL_NS)
    ((tag, exc),) = log.failed
    assert tag == "silent" and isinstance(exc, PeerUnreachable)
    assert not isinstance(exc, PeerDisconnected)  # no answer is not "gone": handshake


def test_a_failed_peer_backs_off_then_is_dialed_again_and_the_backoff_doubles(
    fabric: FakeFabric,
) -> None:
    t, peers = _me(fabric)
    gone = PeerAddr(agent="p-dead", host="127.0.0.1", port=16000)
    log = Log()
    peers.when_ready(gone, 0, log.ok("1"), log.fail("1"))
    peers.poll(0)
    # Within the backoff: fails at once, before any poll, and nothing is dialed.
    peers.when_ready(gone, BACKOFF_MIN_NS - 1, log.ok("2"), log.fail("2"))
    assert [tag for tag, _ in log.failed] == ["1", "2"]
    assert not peers.dialing and peers.backing_off("p-dead")
    assert peers.counters["peer_backoff_failed"] == 1
    # After it: dialed again (refused again), and the next backoff is twice as long.
    peers.when_ready(gone, BACKOFF_MIN_NS, log.ok("3"), log.fail("3"))
    assert peers.dialing
    peers.poll(BACKOFF_MIN_NS)
    assert [tag for tag, _ in log.failed] == ["1", "2", "3"]
    peers.when_ready(gone, 3 * BACKOFF_MIN_NS - 1, log.ok("4"), log.fail("4"))
    assert len(log.failed) == 4 and not peers.dialing
    # The peer is back (same name, same address): it is used, and its backoff forgotten.
    back = fabric.transport("p-dead", port=16000)
    peers.when_ready(gone, 3 * BACKOFF_MIN_NS, log.ok("5"), log.fail("5"))
    assert peers.dialing
    peers.poll(3 * BACKOFF_MIN_NS + 1)
    assert log.ready == ["5"] and not peers.backing_off("p-dead")
    assert t.peer_ready("p-dead") and back.peer_ready("me")


def test_backoff_is_capped(fabric: FakeFabric) -> None:
    _, peers = _me(fabric)
    gone = PeerAddr(agent="p-dead", host="127.0.0.1", port=16000)
    now, log = 0, Log()
    for _ in range(12):
        peers.when_ready(gone, now, log.ok("x"), log.fail("x"))
        peers.poll(now)
        while peers.backing_off("p-dead"):
            now += MS
            peers.poll(now)
    delays = []
    for _ in range(2):
        start = now
        peers.when_ready(gone, now, log.ok("x"), log.fail("x"))
        peers.poll(now)
        while peers.backing_off("p-dead"):
            now += 10 * MS
            peers.poll(now)
        delays.append(now - start)
    assert all(BACKOFF_MAX_NS <= d <= BACKOFF_MAX_NS + 10 * MS for d in delays), delays


def test_a_peer_that_disconnects_is_forgotten_and_backs_off(fabric: FakeFabric) -> None:
    t, peers = _me(fabric)
    p = fabric.transport("p-1")
    log = Log()
    peers.send(_addr(p), b"hello", 0, log.fail("first"), log.ok("first"))
    peers.poll(0)
    assert log.ready == ["first"]
    fabric.disconnect("p-1")  # the process dies, its metadata still loaded here
    peers.send(_addr(p), b"are you there", MS, log.fail("second"), log.ok("second"))
    ((tag, exc),) = log.failed
    assert tag == "second" and isinstance(exc, PeerDisconnected)
    assert not t.peer_ready("p-1"), "its metadata is removed"
    # What follows within the backoff fails at once with the same answer, no dial.
    peers.send(_addr(p), b"again", 2 * MS, log.fail("third"), log.ok("third"))
    assert [tag for tag, _ in log.failed] == ["second", "third"] and not peers.dialing
    # After the backoff a dial finds nothing listening: gone.
    peers.send(_addr(p), b"later", BACKOFF_MIN_NS + MS, log.fail("fourth"), log.ok("fourth"))
    peers.poll(BACKOFF_MIN_NS + 2 * MS)
    assert isinstance(log.failed[-1][1], PeerGone)


def test_a_peer_that_dialed_us_during_its_backoff_is_used_at_once(fabric: FakeFabric) -> None:
    t, peers = _me(fabric)
    gone = PeerAddr(agent="p-1", host="127.0.0.1", port=16000)
    log = Log()
    peers.when_ready(gone, 0, log.ok("a"), log.fail("a"))
    peers.poll(0)
    assert peers.backing_off("p-1")
    back = fabric.transport("p-1", port=16000)
    back.request_peer("me", *t.listen_address)  # it restarted and dialed us first
    peers.when_ready(gone, MS, log.ok("b"), log.fail("b"))
    assert log.ready == ["b"] and not peers.backing_off("p-1")


# -------------------------------------------------------------------- D's transfers


class TwoP:
    """D waiting on two P engines over the fake fabric; P's side answers nothing (only
    its transport is there), so every outcome is D's own."""

    def __init__(self, heartbeat_ms: int = 1_000) -> None:
        self.fabric = FakeFabric()
        self.now = 0
        self.p1 = RankSpec("P", "p1", 0, 1, 16000)
        self.p2 = RankSpec("P", "p2", 0, 1, 16100)
        self.d = RankSpec("D", "decode", 0, 1, 17000)
        self.tp1 = self.fabric.transport(self.p1.agent, port=self.p1.port)
        self.tp2 = self.fabric.transport(self.p2.agent, port=self.p2.port)
        td = self.fabric.transport(self.d.agent, port=self.d.port)
        buf = self.d.allocate()
        layout = self.d.layout(buf)
        td.register_memory(layout.memory_extents())
        self.policy = ReceiverPolicy(
            timeout_ns=120_000 * MS, heartbeat_interval_ns=heartbeat_ms * MS
        )
        self.receiver = Receiver(
            RankInfo("decode", 0, 1, self.d.addr),
            layout,
            Peers(td, DIAL_NS),
            self.policy,
            clock=lambda: self.now,
        )

    def expect(self, tid: str, p: RankSpec) -> None:
        self.receiver.on_event(expected_event(tid, [p], self.d, (1,), 16), self.now)

    def step(self, dt_ns: int = MS) -> None:
        self.now += dt_ns
        self.receiver.peers.poll(self.now)
        self.receiver.poll(self.now)

    def done(self) -> dict[str, m.FailReason | None]:
        return {r.transfer_id: r.reason for r in self.receiver.finished}


def test_a_dead_p_is_known_as_gone_at_ds_next_heartbeat_and_only_its_transfers_end() -> None:
    d = TwoP(heartbeat_ms=1_000)
    d.expect("from-p1", d.p1)
    d.expect("from-p2", d.p2)
    d.step()
    assert d.tp1.get_notifs() and d.tp2.get_notifs()  # both registrations out
    d.fabric.disconnect(d.p1.agent)  # kill -9 of P1
    while d.now + 10 * MS < 1_000 * MS:
        d.step(10 * MS)
    assert not d.done(), "nothing tells D before its heartbeat"
    d.step(10 * MS)  # the heartbeat: P1's send fails, P2's goes out
    assert d.done() == {"from-p1": m.FailReason.PEER_LOST}
    # P2 still serves: its transfer completes as usual.
    done = m.Completion(transfer_id="from-p2", p_rank=0, p_tp_size=1)
    d.receiver.on_message(d.p2.agent, done, d.now)
    assert d.done() == {"from-p1": m.FailReason.PEER_LOST, "from-p2": None}
    # A new transfer from the dead P fails at once (backing off): no dial, no wait.
    d.expect("late", d.p1)
    assert d.done()["late"] is m.FailReason.PEER_LOST


def test_a_transfer_from_a_p_that_died_before_d_dialed_it_fails_at_the_first_poll() -> None:
    d = TwoP()
    d.fabric.disconnect(d.p1.agent)
    d.expect("t", d.p1)
    assert not d.done()
    d.step()
    assert d.done() == {"t": m.FailReason.PEER_LOST}
    assert d.receiver.counters["send_failed"] == 1


def test_a_p_that_never_answers_fails_only_its_own_transfers_at_the_dial_deadline() -> None:
    d = TwoP(heartbeat_ms=60_000)
    d.fabric.set_unreachable(d.p1.agent)
    d.expect("silent", d.p1)
    d.expect("fine", d.p2)
    d.step()
    assert d.tp2.get_notifs(), "P2's registration went out beside the dial to P1"
    d.receiver.on_message(
        d.p2.agent, m.Completion(transfer_id="fine", p_rank=0, p_tp_size=1), d.now
    )
    assert d.done() == {"fine": None}
    while d.now < DIAL_NS:
        d.step(100 * MS)
    assert d.done() == {"fine": None, "silent": m.FailReason.HANDSHAKE}

"""A dead or silent peer costs only its own transfers, and a dead one is known at once
over real sockets and real NIXL processes on loopback.

The pure logic (backoff, which callback runs when) is tests/unit/transfer/test_peers.py;
here: the side channel's dials run beside each other and a refused connection is seen before
any timeout, and a D rank waiting on two P engines loses only the killed one's transfers,
at its next heartbeat, while the other's complete as usual.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator

import pytest

from connector.core import events as ev
from connector.core import messages as m
from connector.core.state import ReceiverPolicy
from connector.tools.loopback import RankProcess, RankSpec, expected_event
from connector.tools.stack import free_port
from connector.transport.sidechannel import SideChannel

pytestmark = [pytest.mark.nixl]

MS = 1_000_000
# Each time bound below is an order of magnitude above what an idle box takes (a heartbeat:
# 200 ms) and far below the timeout that would end the same wait without the behaviour under
# test (D's 30 s deadline).


def _wait_for(what: str, pred: Callable[[], object], timeout_s: float) -> float:
    """Seconds until ``pred()`` holds; fails naming ``what`` after ``timeout_s``."""
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout_s:
            pytest.fail(f"{what} not seen within {timeout_s} s")
        time.sleep(0.001)  # pacing of the poll loop, not synchronisation
    return time.monotonic() - t0


@pytest.fixture
def channels() -> Iterator[Callable[..., SideChannel]]:
    made: list[SideChannel] = []

    def make(name: str, **kw: object) -> SideChannel:
        sc = SideChannel(name, **kw)  # type: ignore[arg-type]
        sc.set_local_metadata(f"md-of-{name}".encode())
        made.append(sc)
        return sc

    yield make
    for sc in made:
        sc.close()


def test_a_dial_to_a_silent_peer_does_not_hold_up_a_dial_to_a_live_one(
    channels: Callable[..., SideChannel],
) -> None:
    # Silent dials end only at timeouts far past the waits below (or when the silent
    # listener closes): behind one of them, the live peer's answer could not come in time.
    me = channels("me", connect_timeout_s=60.0, io_timeout_s=60.0)
    live = channels("live")
    # Accepts connections (the kernel's backlog) but never reads or answers: a hung peer.
    with socket.create_server(("127.0.0.1", 0)) as silent:
        for i in range(3):  # more silent peers than one worker could take in turn
            me.request(f"silent-{i}", "127.0.0.1", silent.getsockname()[1])
        me.request("live", *live.address)
        got: list[str] = []

        def live_in() -> bool:
            got.extend(p.peer for p in me.drain())
            return "live" in got

        _wait_for("the live peer's metadata", live_in, timeout_s=5.0)
        assert not [k for k in me.counters if k.startswith("dials_failed")], me.counters
        for i in range(3):
            assert me.last_error(f"silent-{i}") == "a dial is in flight, no answer yet"
            assert me.refused(f"silent-{i}") is None, "a peer that accepted is not gone"


def test_a_refused_dial_is_known_at_once_and_a_new_dial_clears_it(
    channels: Callable[..., SideChannel],
) -> None:
    me = channels("me", connect_timeout_s=60.0)  # the refusal, not a timeout, ends the dial
    dead_port = free_port()
    me.request("dead", "127.0.0.1", dead_port)
    _wait_for("the refusal", lambda: me.refused("dead"), timeout_s=5.0)
    assert "refused" in (me.refused("dead") or "").lower()
    back = channels("dead", port=dead_port)  # it comes back at the same address
    me.request("dead", *back.address)
    assert me.refused("dead") is None  # this dial's own answer decides
    _wait_for("its metadata", lambda: any(p.peer == "dead" for p in me.drain()), 5.0)
    assert me.refused("dead") is None


@pytest.fixture
def cluster() -> Iterator[Callable[..., RankProcess]]:
    started: list[RankProcess] = []

    def start(role: str, engine: str, **kw: object) -> RankProcess:
        proc = RankProcess(RankSpec(role, engine, 0, 1, free_port(), **kw))  # type: ignore[arg-type]
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.stop()
    assert not any(p.proc.is_alive() for p in started)


HEARTBEAT_MS = 200


def test_killing_one_p_ends_only_its_transfers_at_ds_next_heartbeat(
    cluster: Callable[..., RankProcess],
) -> None:
    p1, p2 = cluster("P", "p1"), cluster("P", "p2")
    d = cluster(
        "D",
        "decode",
        recv_policy=ReceiverPolicy(
            timeout_ns=30_000 * MS, grace_ns=1_000 * MS, heartbeat_interval_ns=HEARTBEAT_MS * MS
        ),
    )
    # D registers with both; neither has prefilled yet.
    d.submit(expected_event("from-p1", [p1.spec], d.spec, (1, 2), 32))
    d.submit(expected_event("from-p2", [p2.spec], d.spec, (3, 4), 32))
    for p in (p1, p2):
        p.wait("registration", lambda r: r.counters().transfers >= 1, timeout_s=10)
    p1.kill()
    killed = time.monotonic()
    # P2 prefills after P1 died: its WRITE and D's report are not held up by the dead peer.
    p2.submit(ev.PrefillDone("from-p2", "preq-from-p2", ((5, 6),), 32))
    took = _wait_for(
        "P2's transfer and P1's end",
        lambda: (d.take(), {x.transfer_id for x in d.received} >= {"from-p1", "from-p2"})[1],
        timeout_s=10.0,
    )
    outcome = {x.transfer_id: (x.ok, x.reason) for x in d.received}
    assert outcome["from-p2"] == (True, None), outcome
    assert outcome["from-p1"] == (False, m.FailReason.PEER_LOST), outcome
    # Known as gone at D's next heartbeat (plus a loaded box's scheduling: up to 3 s on a
    # busy 2-core host), not at a dial deadline (5 s, peers.Peers) or D's 30 s deadline.
    assert took < HEARTBEAT_MS / 1000 + 3.0, f"P1's death known after {took:.2f} s"
    print(f"\n[dead peers] P1's transfer ended {time.monotonic() - killed:.3f} s after its kill")
    # A new transfer from the dead P ends at once: refused, then backing off.
    t0 = time.monotonic()
    d.submit(expected_event("late", [p1.spec], d.spec, (7,), 16))
    d.wait("the late transfer's end", lambda r: any(x.transfer_id == "late" for x in r.received), 5)
    (late,) = [x for x in d.received if x.transfer_id == "late"]
    assert (late.ok, late.reason) == (False, m.FailReason.PEER_LOST)
    # At once, from the backoff: well under half the 5 s dial deadline a new dial would take.
    late_s = time.monotonic() - t0
    assert late_s < 2.5, f"the late transfer ended after {late_s:.2f} s"

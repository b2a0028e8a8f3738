"""A D that dies with several WRITEs of one P rank in flight: the first poll that sees it
gone removes the peer, which releases the other WRITEs' handles too. Each of them must then
fail with ``peer_lost`` at its own poll, and P's transfer thread go on: a released handle
that raised LocalProtocolError at every poll once stopped P's pushes for good (e2e, a D
killed under load: every later request waited D's whole deadline).
"""

from __future__ import annotations

from connector.core import events as ev
from connector.core import messages as m
from tests.unit.test_endpoints import MS, Pair


def test_every_write_in_flight_to_a_dead_d_fails_and_p_pushes_on() -> None:
    pair = Pair()
    pair.fabric.delay_writes(50, dst=pair.d_spec.agent)  # in flight until D dies
    for tid, block in (("t1", 1), ("t2", 2)):
        pair.expect(tid, 16, (block,))
        pair.sender.on_event(ev.PrefillDone(tid, f"p{tid}", ((block,),), 16), pair.now)
    pair.pump(rounds=5)
    assert pair.sender.writes_in_flight() == 2
    pair.fabric.disconnect(pair.d_spec.agent)
    for _ in range(5):  # P alone: D is gone
        pair.now += MS
        pair.sender.poll(pair.now)
    assert pair.sender.writes_in_flight() == 0
    assert sorted(pair.sender.finished) == ["pt1", "pt2"]
    assert [
        (r.transfer_id, r.ok, r.reason) for r in sorted(pair.reports, key=lambda r: r.transfer_id)
    ] == [
        ("t1", False, m.FailReason.PEER_LOST),
        ("t2", False, m.FailReason.PEER_LOST),
    ]


def test_a_handle_in_an_impossible_state_fails_its_write_only() -> None:
    """A bug that leaves one handle released but unfinished (poll_write raises
    LocalProtocolError) fails that WRITE; the other transfer's WRITE still completes."""
    pair = Pair()
    pair.fabric.delay_writes(3, dst=pair.d_spec.agent)
    for tid, block in (("t1", 1), ("t2", 2)):
        pair.expect(tid, 16, (block,))
        pair.sender.on_event(ev.PrefillDone(tid, f"p{tid}", ((block,),), 16), pair.now)
    pair.pump(rounds=2)
    assert pair.sender.writes_in_flight() == 2
    rec = pair.sender._transfers.get("t1")
    assert rec is not None and rec.write is not None
    for h in rec.write.handles:
        pair.tp.release(h)  # the stray release
    pair.pump(rounds=20)
    assert pair.sender.writes_in_flight() == 0
    outcome = {r.transfer_id: (r.ok, r.reason) for r in pair.reports}
    assert outcome == {"t1": (False, m.FailReason.WRITE_ERROR), "t2": (True, None)}

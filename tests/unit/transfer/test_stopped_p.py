"""A P rank whose process was stopped (SIGSTOP) while D's registration waited unread: once
it runs again it posts no WRITE for it, as D may have given the transfer up and freed its
blocks meanwhile (docs/protocol.md, "No late WRITE"). The transfer thread counts the
registration's ttl from its previous read of the transport, not from the late one.
"""

from __future__ import annotations

from connector.core import events as ev
from connector.core import messages as m
from connector.core.recv_state import ReceiverPolicy
from connector.transfer.thread import TransferThread
from tests.unit.test_endpoints import MS, Pair

POLICY = ReceiverPolicy(
    timeout_ns=100 * MS, write_timeout_ns=50 * MS, grace_ns=20 * MS, heartbeat_interval_ns=MS
)
GIVEN_UP_MS = 170  # D's last resort: receive timeout + write timeout + grace


def _p_thread(pair: Pair, clock: dict[str, int]) -> TransferThread:
    # Not started: its loop is driven by hand, on a clock the test moves.
    return TransferThread(pair.tp, pair.sender.peers, sender=pair.sender, clock=lambda: clock["ns"])


def _d_registers(pair: Pair) -> None:
    """D expects the transfer and sends its registration (into P's unread inbox)."""
    pair.expect("t", 16, (1,))
    for _ in range(5):  # D's dial on the fake fabric, then the registration
        pair.receiver.peers.poll(pair.now)
        pair.receiver.poll(pair.now)
    assert pair.tp._inbox, "D's registration never left"


def _p_runs(pair: Pair, p: TransferThread, clock: dict[str, int], at_ms: int) -> None:
    clock["ns"] = pair.now = at_ms * MS
    p.submit(ev.PrefillDone("t", "preq", ((1,),), 16))
    p._step()


def _d_gets(pair: Pair) -> list[m.FailReason | None]:
    for _ in range(GIVEN_UP_MS + 10):  # D runs on until it must have an answer
        pair.now += MS
        for agent, frame in pair.td.get_notifs():
            if (msg := pair.d_guard.decode(frame, agent)) is not None:
                pair.receiver.on_message(agent, msg, pair.now)
        pair.receiver.poll(pair.now)
        if pair.receiver.finished:
            break
    return [None if r.ok else r.reason for r in pair.receiver.finished]


def test_a_p_stopped_past_the_registrations_ttl_writes_nothing_and_tells_d() -> None:
    pair, clock = Pair(recv_policy=POLICY), {"ns": 0}
    p = _p_thread(pair, clock)
    p._step()  # P's last read before it was stopped
    _d_registers(pair)
    _p_runs(pair, p, clock, at_ms=GIVEN_UP_MS + 30)  # continued after D gave up
    assert pair.sender.writes_in_flight() == 0 and not pair.d_buf.any(), "a late WRITE"
    assert p.take_finished_sending() == ["preq"]  # P's blocks back at once
    assert _d_gets(pair) == [m.FailReason.REGISTRATION_EXPIRED]


def test_a_p_that_ran_reads_the_registration_in_time_and_writes() -> None:
    # The same story with no stop: P read just before the registration came.
    pair, clock = Pair(recv_policy=POLICY), {"ns": 0}
    p = _p_thread(pair, clock)
    _d_registers(pair)
    clock["ns"] = 1 * MS
    p._step()
    _p_runs(pair, p, clock, at_ms=2)
    assert _d_gets(pair) == [None]
    assert pair.d_buf[:, 1].any()

"""A lost answer costs D one heartbeat, not its receive deadline (a lost
notification: D learns within 1 s).

P answers a heartbeat for a transfer it has already ended as it answers a cancel: the
WRITE's `done` again (DONE) or its `fail` (any other end). D heartbeats every transfer it
still waits for, so once P's answer is lost, D learns the outcome at its next heartbeat.
Both tables are driven a millisecond at a time; the network loses exactly the answer.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from connector.core import events as ev
from connector.core.messages import FailReason
from connector.core.receiver_table import ReceiverTable
from connector.core.sender_table import SenderTable
from connector.core.state import ReceiverPolicy, SenderPolicy, SendState
from tests.unit.core.factories import d_addr, p_addr, register

MS = 1_000_000
HEARTBEAT_MS = 50
RECV = ReceiverPolicy(
    timeout_ns=1_000 * MS,
    grace_ns=100 * MS,
    heartbeat_interval_ns=HEARTBEAT_MS * MS,
    write_timeout_ns=400 * MS,
)
SOURCE = ev.Source(0, p_addr(0))


def _story(end_ms: int, ok: bool, lose_answer: bool) -> tuple[int | None, list[ev.ReportReceived]]:
    """D expects t0 at 0 and P's WRITE ends at ``end_ms``; its answer reaches D unless
    ``lose_answer``. Returns when D reported (ms) and every report."""
    d = ReceiverTable(RECV)
    p = SenderTable(lambda _tp: frozenset({0}), SenderPolicy(write_timeout_ns=900 * MS))
    d.handle(ev.Expected("t0", "dreq", (SOURCE,), ((1, 2),), 0, 32), 0)
    p.handle(ev.Registered(register("t0", ttl_ms=1_000, blocks=(1, 2))), 0)
    p.handle(ev.PrefillDone("t0", "preq", ((3, 4),), 32), 0)
    reports: list[ev.ReportReceived] = []
    reported_ms = None

    def to_d(actions: list[ev.SendAction], now: int) -> None:
        for a in actions:
            if isinstance(a, ev.ResendCompletion):
                got = d.handle(ev.CompletionSeen("t0", 0), now)
            elif isinstance(a, ev.SendFail):
                got = d.handle(ev.FailSeen("t0", 0, a.reason), now)
            else:
                continue
            reports.extend(r for r in got if isinstance(r, ev.ReportReceived))

    for now_ms in range(1_500):
        now = now_ms * MS
        if now_ms == end_ms:
            end = ev.WriteDone("t0") if ok else ev.WriteFailed("t0", FailReason.WRITE_ERROR)
            answer = p.handle(end, now)
            if not lose_answer:
                if ok:  # the WRITE's own notification
                    got = d.handle(ev.CompletionSeen("t0", 0), now)
                    reports.extend(r for r in got if isinstance(r, ev.ReportReceived))
                else:
                    to_d(answer, now)
        for a in d.tick(now):
            if isinstance(a, ev.SendHeartbeat):
                for tid in a.transfer_ids:
                    to_d(p.handle(ev.HeartbeatSeen(tid, d_addr(0)), now), now)
            elif isinstance(a, ev.SendCancel):
                to_d(p.handle(ev.Cancelled("t0", 0, d_addr(0), a.reason), now), now)
            elif isinstance(a, ev.ReportReceived):
                reports.append(a)
        p.tick(now)
        if reports and reported_ms is None:
            reported_ms = now_ms
    return reported_ms, reports


def test_a_lost_done_is_answered_at_the_next_heartbeat() -> None:
    reported, reports = _story(end_ms=10, ok=True, lose_answer=True)
    assert [(r.ok, r.reason) for r in reports] == [(True, None)]
    assert reported == HEARTBEAT_MS  # not at the 1 s deadline


def test_a_lost_fail_is_answered_at_the_next_heartbeat() -> None:
    reported, reports = _story(end_ms=10, ok=False, lose_answer=True)
    assert [(r.ok, r.reason) for r in reports] == [(False, FailReason.WRITE_ERROR)]
    assert reported == HEARTBEAT_MS


def test_an_answer_that_crosses_a_heartbeat_reports_once() -> None:
    d = ReceiverTable(RECV)
    p = SenderTable(lambda _tp: frozenset({0}), SenderPolicy())
    d.handle(ev.Expected("t0", "dreq", (SOURCE,), ((1, 2),), 0, 32), 0)
    p.handle(ev.Registered(register("t0", ttl_ms=1_000, blocks=(1, 2))), 0)
    p.handle(ev.PrefillDone("t0", "preq", ((3, 4),), 32), 0)
    (beat,) = d.tick(HEARTBEAT_MS * MS)  # sent while the done is on its way
    assert isinstance(beat, ev.SendHeartbeat)
    p.handle(ev.WriteDone("t0"), HEARTBEAT_MS * MS)
    first = d.handle(ev.CompletionSeen("t0", 0), HEARTBEAT_MS * MS)
    assert [type(a) for a in first] == [ev.ReportReceived]
    answer = p.handle(ev.HeartbeatSeen("t0", d_addr(0)), HEARTBEAT_MS * MS)
    assert [type(a) for a in answer] == [ev.ResendCompletion]
    assert d.handle(ev.CompletionSeen("t0", 0), HEARTBEAT_MS * MS) == []  # dropped, counted
    assert sum(d.dropped.values()) == 1


def test_no_heartbeat_before_one_interval_of_waiting() -> None:
    d = ReceiverTable(RECV)
    d.handle(ev.Expected("t0", "dreq", (SOURCE,), ((1, 2),), 0, 32), 0)
    assert d.next_deadline_ns() == HEARTBEAT_MS * MS
    assert d.tick(HEARTBEAT_MS * MS - 1) == []
    d.handle(ev.CompletionSeen("t0", 0), 10 * MS)  # answered sooner: no heartbeat at all
    assert d.tick(HEARTBEAT_MS * MS) == []


def test_a_write_still_running_is_not_answered() -> None:
    p = SenderTable(lambda _tp: frozenset({0}), SenderPolicy())
    p.handle(ev.Registered(register("t0")), 0)
    p.handle(ev.PrefillDone("t0", "preq", ((3, 4, 5),), 48), 0)
    rec = p.get("t0")
    assert rec is not None and rec.state is SendState.WRITING
    assert p.handle(ev.HeartbeatSeen("t0", d_addr(0)), MS) == []


def test_a_forgotten_transfer_is_not_answered() -> None:
    p = SenderTable(lambda _tp: frozenset({0}), SenderPolicy())
    assert p.handle(ev.HeartbeatSeen("t0", d_addr(0)), MS) == []
    assert p.dropped  # counted like any message out of turn


@settings(max_examples=200, deadline=None)
@given(end_ms=st.integers(0, 900), ok=st.booleans())
def test_d_learns_within_one_heartbeat_of_the_lost_answer(end_ms: int, ok: bool) -> None:
    reported, reports = _story(end_ms, ok, lose_answer=True)
    assert reported is not None and len(reports) == 1
    assert reports[0].ok is ok
    assert end_ms <= reported <= end_ms + HEARTBEAT_MS, f"ended {end_ms} ms, learned {reported}"

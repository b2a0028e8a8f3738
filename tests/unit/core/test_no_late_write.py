"""No late WRITE by construction (docs/protocol.md, "Deadlines"): D frees its blocks only
once P answered, or once the latest moment P's WRITE could end, in D's own clock, passed.

P posts no WRITE after a registration's ttl_ms (what was left of D's wait when it sent it)
and ends every WRITE within the shorter of its own write timeout and D's bound. These
tests drive both tables through the orderings where a late WRITE used to be possible; a
hypothesis test runs random timings of the same story against the rule.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from connector.core import events as ev
from connector.core.messages import FailReason, Register
from connector.core.receiver_table import ReceiverTable
from connector.core.sender_table import SenderTable
from connector.core.state import ReceiverPolicy, RecvState, SenderPolicy, SendState
from tests.unit.core.factories import d_addr, p_addr, register

MS = 1_000_000
RECV = ReceiverPolicy(
    timeout_ns=200 * MS, grace_ns=20 * MS, heartbeat_interval_ns=50 * MS, write_timeout_ns=40 * MS
)
SEND = SenderPolicy(lease_ns=500 * MS, write_timeout_ns=300 * MS)
SOURCE = ev.Source(0, p_addr(0))


def _register(d_rank: int, ttl_ms: int, write_ms: int | None, d_tp: int = 1) -> Register:
    return register("t0", d_rank, d_tp, ttl_ms, blocks=(1, 2), write_timeout_ms=write_ms)


def _sender(d_tp: int = 1) -> SenderTable:
    return SenderTable(lambda _tp: frozenset(range(d_tp)), SEND)


def _expect(d: ReceiverTable, now: int) -> Register:
    """D expects t0 at ``now``; returns the registration it sends at once."""
    out = d.handle(ev.Expected("t0", "dreq", (SOURCE,), ((1, 2),), 0, 32), now)
    assert [type(a) for a in out] == [ev.SendRegister]
    rec = d.get("t0")
    assert rec is not None
    return _register(0, (rec.expires_ns - now) // MS, RECV.write_timeout_ns // MS)


def _kinds(actions: list) -> list[type]:
    return [type(a) for a in actions]


def test_p_honours_ds_shorter_write_bound() -> None:
    p = _sender()
    p.handle(ev.Registered(_register(0, 1_000, write_ms=40)), 0)
    out = p.handle(ev.PrefillDone("t0", "req", ((3, 4),), 32), 10 * MS)
    assert _kinds(out) == [ev.IssueWrite]
    rec = p.get("t0")
    assert rec is not None and rec.deadline_ns == 50 * MS  # 10 ms + D's 40, not P's 300
    assert _kinds(p.tick(50 * MS)) == [ev.AbortWrite]


def test_p_keeps_its_own_bound_when_shorter_or_d_names_none() -> None:
    for write_ms in (None, 10_000):
        p = _sender()
        p.handle(ev.Registered(_register(0, 1_000, write_ms=write_ms)), 0)
        p.handle(ev.PrefillDone("t0", "req", ((3, 4),), 32), 0)
        rec = p.get("t0")
        assert rec is not None and rec.deadline_ns == 300 * MS


def test_no_write_starts_after_the_registrations_ttl_even_before_the_tick() -> None:
    p = _sender()
    p.handle(ev.Registered(_register(0, ttl_ms=100, write_ms=40)), 0)
    out = p.handle(ev.PrefillDone("t0", "req", ((3, 4),), 32), 101 * MS)  # no tick since
    assert _kinds(out) == [ev.FreeBlocks, ev.SendFail]
    assert out[1].reason is FailReason.REGISTRATION_EXPIRED
    rec = p.get("t0")
    assert rec is not None and rec.state is SendState.EXPIRED and not rec.write_issued


def test_a_registration_read_late_counts_its_ttl_from_ps_previous_read() -> None:
    # P read its transport at 0, then did not run (stopped) until 150 ms: the registration D
    # sent meanwhile with 100 ms left is read at 150 ms, when D may have freed its blocks.
    p = _sender()
    p.handle(ev.PrefillDone("t0", "req", ((3, 4),), 32), 0)
    out = p.handle(ev.Registered(_register(0, ttl_ms=100, write_ms=40), since_ns=0), 150 * MS)
    assert _kinds(out) == [ev.FreeBlocks, ev.SendFail]
    assert out[1].reason is FailReason.REGISTRATION_EXPIRED
    # Read soon after P's previous read, the same registration is written.
    p = _sender()
    p.handle(ev.PrefillDone("t0", "req", ((3, 4),), 32), 0)
    out = p.handle(
        ev.Registered(_register(0, ttl_ms=100, write_ms=40), since_ns=149 * MS), 150 * MS
    )
    assert _kinds(out) == [ev.IssueWrite]


def test_heartbeats_renew_a_registration_but_never_past_its_ttl() -> None:
    p = SenderTable(lambda _tp: frozenset({0}), SenderPolicy(max_registration_ttl_ns=30 * MS))
    p.handle(ev.Registered(_register(0, ttl_ms=100, write_ms=40)), 0)
    rec = p.get("t0")
    assert rec is not None and rec.deadline_ns == 30 * MS  # P's own cap
    p.handle(ev.HeartbeatSeen("t0", d_addr(0)), 20 * MS)
    assert rec.deadline_ns == 50 * MS  # renewed by the cap...
    p.handle(ev.HeartbeatSeen("t0", d_addr(0)), 90 * MS)
    assert rec.deadline_ns == 100 * MS  # ...but never past D's bound
    out = p.tick(100 * MS)
    assert _kinds(out) == [ev.SendFail] and out[0].reason is FailReason.REGISTRATION_EXPIRED


def test_a_lease_waiting_for_another_d_rank_ends_at_the_first_ranks_bound() -> None:
    p = _sender(d_tp=2)
    p.handle(ev.PrefillDone("t0", "req", ((3, 4),), 32), 0)
    p.handle(ev.Registered(_register(0, ttl_ms=100, write_ms=40, d_tp=2)), 0)
    rec = p.get("t0")
    assert rec is not None and rec.state is SendState.PREFILLED
    assert rec.deadline_ns == 100 * MS  # not the 500 ms lease
    out = p.tick(100 * MS)
    assert _kinds(out) == [ev.FreeBlocks, ev.SendFail]
    assert out[1].reason is FailReason.REGISTRATION_EXPIRED
    # D rank 1's registration, later still, gets a fail at once and no WRITE.
    out = p.handle(ev.Registered(_register(1, ttl_ms=100, write_ms=40, d_tp=2)), 120 * MS)
    assert _kinds(out) == [ev.SendFail]


def test_d_waits_for_a_silent_source_until_its_write_could_not_land() -> None:
    d = ReceiverTable(RECV)
    _expect(d, 0)
    out = d.handle(ev.AbortRequested("t0"), 10 * MS)  # the client left early
    assert _kinds(out) == [ev.SendCancel]
    rec = d.get("t0")
    assert rec is not None and rec.state is RecvState.CANCELLING
    # expires 200 ms + D's write bound 40 ms + grace 20 ms; not 10 ms + grace.
    assert rec.deadline_ns == 260 * MS
    assert d.tick(259 * MS) == []
    out = d.tick(260 * MS)
    assert _kinds(out) == [ev.ReportReceived] and not out[0].ok and rec.abandoned


def test_d_stops_waiting_at_once_when_p_answers() -> None:
    d = ReceiverTable(RECV)
    _expect(d, 0)
    d.handle(ev.AbortRequested("t0"), 10 * MS)
    out = d.handle(ev.FailSeen("t0", 0, FailReason.CANCELLED), 12 * MS)
    assert _kinds(out) == [ev.ReportReceived]


def test_a_lost_cancel_and_a_write_posted_after_it_end_before_d_frees() -> None:
    """The hole this design closes: D cancels early, the cancel is lost, P (alive, slow)
    posts afterwards and its WRITE hangs. P aborts it before D gives the source up."""
    d, p = ReceiverTable(RECV), _sender()
    reg = _expect(d, 0)
    p.handle(ev.Registered(reg), 5 * MS)  # 5 ms on the wire
    d.handle(ev.AbortRequested("t0"), 10 * MS)  # its cancel never arrives
    out = p.handle(ev.PrefillDone("t0", "req", ((3, 4),), 32), 204 * MS)  # last moment
    assert _kinds(out) == [ev.IssueWrite]
    assert _kinds(p.tick(244 * MS)) == [ev.AbortWrite]  # 204 + D's 40 ms bound
    rec = d.get("t0")
    assert rec is not None and rec.deadline_ns > 244 * MS


def _story(
    wire_ms: int, abort_ms: int, prefill_ms: int, cancel_lost: bool
) -> tuple[int | None, int | None, int | None]:
    """One transfer through both tables, a millisecond at a time; a posted WRITE hangs until
    P aborts it. Returns (WRITE posted, WRITE aborted, D released its blocks), in ms."""
    d, p = ReceiverTable(RECV), _sender()
    reg = _expect(d, 0)
    posted = aborted = released = None

    def cancel_reaches_p(actions: list, now: int) -> None:
        nonlocal released
        if cancel_lost or not any(isinstance(a, ev.SendCancel) for a in actions):
            return
        answer = p.handle(ev.Cancelled("t0", 0, d_addr(0), FailReason.ABORTED), now)
        if any(isinstance(a, ev.SendFail) for a in answer):
            out = d.handle(ev.FailSeen("t0", 0, FailReason.CANCELLED), now)
            if any(isinstance(a, ev.ReportReceived) for a in out):
                released = now // MS

    for now_ms in range(600):
        now = now_ms * MS
        if now_ms == wire_ms:
            p.handle(ev.Registered(reg), now)
        if now_ms == prefill_ms:
            out = p.handle(ev.PrefillDone("t0", "req", ((3, 4),), 32), now)
            if any(isinstance(a, ev.IssueWrite) for a in out):
                posted = now_ms
        if now_ms == abort_ms:
            cancel_reaches_p(d.handle(ev.AbortRequested("t0"), now), now)
        if any(isinstance(a, ev.AbortWrite) for a in p.tick(now)):
            aborted = now_ms
        out = d.tick(now)
        cancel_reaches_p(out, now)
        if released is None and any(isinstance(a, ev.ReportReceived) for a in out):
            released = now_ms
    return posted, aborted, released


@settings(max_examples=300, deadline=None)
@given(
    wire_ms=st.integers(0, 19),  # below D's grace (20 ms): the one assumption
    abort_ms=st.integers(1, 300),
    prefill_ms=st.integers(0, 300),
    cancel_lost=st.booleans(),
)
def test_random_timings_never_release_under_a_live_write(
    wire_ms: int, abort_ms: int, prefill_ms: int, cancel_lost: bool
) -> None:
    posted, aborted, released = _story(wire_ms, abort_ms, prefill_ms, cancel_lost)
    assert released is not None, "D never released its blocks"
    if posted is not None:
        assert aborted is not None and released > aborted, (
            f"WRITE posted at {posted} ms ran to {aborted} ms; D freed at {released} ms"
        )

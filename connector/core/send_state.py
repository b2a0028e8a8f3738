"""Every state transition of a transfer on the sending side (P), as one table.

Owns P's state enum, its per-transfer record, its policy and the table
``(state, event type) -> transition``. Rule 1 (h11): everything that changes a sending
transfer's state lives in this file (D's side: recv_state.py). Rule 2: it does not know
where it runs; sender_table.py wraps the table and owns the dict of records, the deadlines
and the counters.

A transition is ``fn(record, event, ctx) -> list[SendAction]``, with the time in ``ctx``; a
pair missing from the table raises (``transition.raise_out_of_turn``).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from connector.core import events as ev
from connector.core.errors import LocalProtocolError, RemoteProtocolError
from connector.core.messages import FailReason, PeerAddr, Register
from connector.core.transition import DeadlinePassed, raise_out_of_turn


class SendState(enum.Enum):
    REGISTERED = "registered"  # registration(s) in, prefill still running
    PREFILLED = "prefilled"  # blocks held under a lease, registration(s) missing
    WRITING = "writing"  # WRITE(s) in flight: source blocks must stay
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"

    @property
    def terminal(self) -> bool:
        return self in _SEND_TERMINAL


_SEND_TERMINAL = frozenset(
    {SendState.DONE, SendState.FAILED, SendState.CANCELLED, SendState.EXPIRED}
)


@dataclass(frozen=True)
class SenderPolicy:
    """P's timing. Its defaults are the product's (``PushkvConfig`` only converts them)."""

    lease_ns: int = 30_000_000_000  # P holds finished blocks this long without news from D
    max_registration_ttl_ns: int = 600_000_000_000
    write_timeout_ns: int = 30_000_000_000
    tombstone_ns: int = 120_000_000_000  # how long a finished transfer's id is remembered


@dataclass
class SendRecord:
    transfer_id: str
    state: SendState
    deadline_ns: int
    expected_d_ranks: frozenset[int] | None = None  # known from the first registration
    registrations: dict[int, Register] = field(default_factory=dict)
    request_id: str | None = None  # set once prefill is done (or aborted)
    block_ids: ev.BlockTable = ()
    num_tokens: int = 0
    blocks_held: bool = False  # we owe the scheduler a FreeBlocks
    write_issued: bool = False
    cancel_pending: bool = False
    aborting: bool = False
    reason: FailReason | None = None
    extra_fail_to: tuple[PeerAddr, ...] = ()
    # The bounds D set in its registrations (the earliest of each): P posts no WRITE after
    # post_by_ns, and a WRITE it posts ends (done or aborted) within write_bound_ns. D
    # knows both in its own clock, so it never frees blocks a WRITE may still reach.
    post_by_ns: int | None = None
    write_bound_ns: int | None = None

    def peers(self) -> tuple[PeerAddr, ...]:
        return tuple(r.d_addr for _, r in sorted(self.registrations.items()))


@dataclass(frozen=True)
class SendCtx:
    now_ns: int
    policy: SenderPolicy
    targets_for: Callable[[int], frozenset[int]]  # d_tp_size -> D ranks this P rank writes
    # False: this P rank writes no D rank, whatever its TP size (Topology.writes_any), so
    # no D rank registers with it and its blocks go back as soon as the prefill is done.
    writes: bool = True


def _reg_ttl(reg: Register, ctx: SendCtx) -> int:
    return min(reg.ttl_ms * 1_000_000, ctx.policy.max_registration_ttl_ns)


def _capped(rec: SendRecord, deadline_ns: int) -> int:
    """A waiting state's deadline never runs past D's post-by bound."""
    return deadline_ns if rec.post_by_ns is None else min(deadline_ns, rec.post_by_ns)


def _write_timeout(rec: SendRecord, ctx: SendCtx) -> int:
    """Our own WRITE timeout, or the shorter one every registering D rank asked for."""
    own = ctx.policy.write_timeout_ns
    return own if rec.write_bound_ns is None else min(own, rec.write_bound_ns)


def _add_registration(rec: SendRecord, e: ev.Registered, ctx: SendCtx) -> None:
    reg = e.reg
    targets = ctx.targets_for(reg.d_tp_size)
    if rec.expected_d_ranks is None:
        rec.expected_d_ranks = targets
    elif targets != rec.expected_d_ranks:
        raise RemoteProtocolError(f"{reg.transfer_id}: D ranks disagree on d_tp_size")
    if reg.d_rank not in rec.expected_d_ranks:
        raise RemoteProtocolError(f"{reg.transfer_id}: D rank {reg.d_rank} is not written by us")
    if reg.d_rank in rec.registrations:
        raise RemoteProtocolError(
            f"{reg.transfer_id}: duplicate registration of D rank {reg.d_rank}"
        )
    rec.registrations[reg.d_rank] = reg
    # ttl_ms is what remained of D's wait when it sent this: counted from the earliest it
    # can have arrived, it ends later than D's own deadline only by the message's delay on
    # the wire, not by time we spent stopped with it unread (earlier by at most one poll).
    since = ctx.now_ns if e.since_ns is None else min(ctx.now_ns, e.since_ns)
    post_by = since + reg.ttl_ms * 1_000_000
    rec.post_by_ns = post_by if rec.post_by_ns is None else min(rec.post_by_ns, post_by)
    if reg.write_timeout_ms is not None:
        bound = reg.write_timeout_ms * 1_000_000
        rec.write_bound_ns = bound if rec.write_bound_ns is None else min(rec.write_bound_ns, bound)


def _all_registered(rec: SendRecord) -> bool:
    return rec.expected_d_ranks is not None and set(rec.registrations) == rec.expected_d_ranks


def _issue(rec: SendRecord, ctx: SendCtx) -> list[ev.SendAction]:
    if rec.write_issued:
        raise LocalProtocolError(f"{rec.transfer_id}: second WRITE for one transfer id")
    if rec.post_by_ns is not None and ctx.now_ns > rec.post_by_ns:
        # Past D's bound (its deadline had not been ticked yet): D may free its blocks
        # from now on, so a WRITE must not start.
        return _end(rec, SendState.EXPIRED, ctx, FailReason.REGISTRATION_EXPIRED)
    rec.state, rec.write_issued = SendState.WRITING, True
    rec.deadline_ns = ctx.now_ns + _write_timeout(rec, ctx)
    assert rec.request_id is not None
    return [
        ev.IssueWrite(
            rec.transfer_id,
            rec.request_id,
            rec.block_ids,
            rec.num_tokens,
            tuple(r for _, r in sorted(rec.registrations.items())),
        )
    ]


def _end(
    rec: SendRecord, state: SendState, ctx: SendCtx, reason: FailReason | None
) -> list[ev.SendAction]:
    """Enter a terminal state: free what we hold, tell every known D rank unless DONE."""
    rec.state, rec.reason = state, reason
    rec.deadline_ns = ctx.now_ns + ctx.policy.tombstone_ns
    out: list[ev.SendAction] = []
    if rec.blocks_held:
        rec.blocks_held = False
        assert rec.request_id is not None
        out.append(ev.FreeBlocks(rec.transfer_id, rec.request_id))
    if state is not SendState.DONE:
        to = tuple(dict.fromkeys((*rec.peers(), *rec.extra_fail_to)))
        if to:
            out.append(ev.SendFail(rec.transfer_id, to, reason or FailReason.CANCELLED))
    return out


def _prefill_into(rec: SendRecord, e: ev.PrefillDone) -> None:
    if rec.request_id is not None:
        raise LocalProtocolError(f"{e.transfer_id}: prefill reported twice")
    rec.request_id, rec.block_ids, rec.num_tokens = e.request_id, e.block_ids, e.num_tokens
    rec.blocks_held = True


# --- transitions (sending side)
def _s_registered_registered(
    rec: SendRecord, e: ev.Registered, ctx: SendCtx
) -> list[ev.SendAction]:
    _add_registration(rec, e, ctx)
    rec.deadline_ns = _capped(rec, max(rec.deadline_ns, ctx.now_ns + _reg_ttl(e.reg, ctx)))
    return []


def _s_registered_prefill(rec: SendRecord, e: ev.PrefillDone, ctx: SendCtx) -> list[ev.SendAction]:
    _prefill_into(rec, e)
    if _all_registered(rec):
        return _issue(rec, ctx)
    rec.state, rec.deadline_ns = SendState.PREFILLED, _capped(rec, ctx.now_ns + ctx.policy.lease_ns)
    return []


def _s_any_prefill_aborted(
    rec: SendRecord, e: ev.PrefillAborted, ctx: SendCtx
) -> list[ev.SendAction]:
    if rec.request_id is not None:
        raise LocalProtocolError(f"{e.transfer_id}: prefill aborted after it finished")
    rec.request_id = e.request_id
    return _end(rec, SendState.FAILED, ctx, FailReason.PREFILL_ABORTED)


def _s_waiting_cancelled(rec: SendRecord, e: ev.Cancelled, ctx: SendCtx) -> list[ev.SendAction]:
    # Every cancel is answered, so D knows no WRITE will come; except "not needed",
    # where D never waited.
    rec.extra_fail_to = () if e.reason is FailReason.NOT_NEEDED else (e.d_addr,)
    return _end(rec, SendState.CANCELLED, ctx, FailReason.CANCELLED)


def _s_waiting_heartbeat(rec: SendRecord, e: ev.HeartbeatSeen, ctx: SendCtx) -> list[ev.SendAction]:
    if rec.state is SendState.PREFILLED:
        rec.deadline_ns = _capped(rec, ctx.now_ns + ctx.policy.lease_ns)
    else:
        ttl = max((_reg_ttl(r, ctx) for r in rec.registrations.values()), default=0)
        rec.deadline_ns = _capped(rec, max(rec.deadline_ns, ctx.now_ns + ttl))
    return []


def _s_prefilled_reclaimed(
    rec: SendRecord, e: ev.SourceReclaimed, ctx: SendCtx
) -> list[ev.SendAction]:
    # vLLM freed the blocks itself: nothing is owed back, and D must not wait for us.
    rec.blocks_held = False
    return _end(rec, SendState.FAILED, ctx, e.reason)


def _s_writing_reclaimed(
    rec: SendRecord, e: ev.SourceReclaimed, ctx: SendCtx
) -> list[ev.SendAction]:
    # The caller holds the next forward until this WRITE ends, so what it reads is still
    # the prompt's KV; the WRITE's outcome ends the transfer as usual.
    return []


def _s_registered_deadline(rec: SendRecord, e: DeadlinePassed, ctx: SendCtx) -> list[ev.SendAction]:
    return _end(rec, SendState.EXPIRED, ctx, FailReason.REGISTRATION_EXPIRED)


def _s_prefilled_registered(rec: SendRecord, e: ev.Registered, ctx: SendCtx) -> list[ev.SendAction]:
    _add_registration(rec, e, ctx)
    if _all_registered(rec):
        return _issue(rec, ctx)
    rec.deadline_ns = _capped(rec, rec.deadline_ns)
    return []


def _s_prefilled_deadline(rec: SendRecord, e: DeadlinePassed, ctx: SendCtx) -> list[ev.SendAction]:
    if rec.post_by_ns is not None and ctx.now_ns >= rec.post_by_ns:
        return _end(rec, SendState.EXPIRED, ctx, FailReason.REGISTRATION_EXPIRED)
    return _end(rec, SendState.EXPIRED, ctx, FailReason.LEASE_EXPIRED)


def _s_writing_done(rec: SendRecord, e: ev.WriteDone, ctx: SendCtx) -> list[ev.SendAction]:
    return _end(rec, SendState.DONE, ctx, None)


def _s_writing_failed(rec: SendRecord, e: ev.WriteFailed, ctx: SendCtx) -> list[ev.SendAction]:
    return _end(rec, SendState.FAILED, ctx, e.reason)


def _s_writing_cancelled(rec: SendRecord, e: ev.Cancelled, ctx: SendCtx) -> list[ev.SendAction]:
    # The WRITE may be landing right now: its completion or failure answers D.
    rec.cancel_pending = True
    return []


def _s_writing_deadline(rec: SendRecord, e: DeadlinePassed, ctx: SendCtx) -> list[ev.SendAction]:
    # Never free blocks under a live WRITE: ask for an abort and wait for WriteFailed.
    if rec.aborting:
        rec.deadline_ns = ctx.now_ns + _write_timeout(rec, ctx)
        return []
    rec.aborting, rec.deadline_ns = True, ctx.now_ns + _write_timeout(rec, ctx)
    return [ev.AbortWrite(rec.transfer_id)]


def _s_terminal_registered(rec: SendRecord, e: ev.Registered, ctx: SendCtx) -> list[ev.SendAction]:
    if rec.state is SendState.DONE or e.reg.d_rank in rec.registrations:
        raise RemoteProtocolError(f"{e.reg.transfer_id}: registration for a finished transfer")
    rec.registrations[e.reg.d_rank] = e.reg
    return [ev.SendFail(rec.transfer_id, (e.reg.d_addr,), rec.reason or FailReason.CANCELLED)]


def _s_terminal_prefill(rec: SendRecord, e: ev.PrefillDone, ctx: SendCtx) -> list[ev.SendAction]:
    # D gave up (cancel, expiry) before P finished: hand the blocks straight back.
    _prefill_into(rec, e)
    rec.blocks_held = False
    return [ev.FreeBlocks(rec.transfer_id, e.request_id)]


def _s_terminal_prefill_aborted(
    rec: SendRecord, e: ev.PrefillAborted, ctx: SendCtx
) -> list[ev.SendAction]:
    if rec.request_id is not None:
        raise LocalProtocolError(f"{e.transfer_id}: prefill aborted after it finished")
    rec.request_id = e.request_id
    return []


def _s_terminal_answer(
    rec: SendRecord, e: ev.Cancelled | ev.HeartbeatSeen, ctx: SendCtx
) -> list[ev.SendAction]:
    # D still asks about a transfer we ended: our answer was lost or crossed its message.
    # Tell it again, so a lost `done` or `fail` costs D one heartbeat, not its deadline.
    if rec.state is SendState.DONE:
        # The bytes are in D's blocks: an answer ends D's wait sooner than its grace.
        return [ev.ResendCompletion(rec.transfer_id, (e.d_addr,))]
    return [ev.SendFail(rec.transfer_id, (e.d_addr,), rec.reason or FailReason.CANCELLED)]


def _s_waiting_shutdown(rec: SendRecord, e: ev.ShutdownDue, ctx: SendCtx) -> list[ev.SendAction]:
    # Shutting down: a transfer not writing yet never will; its blocks go back and every
    # D rank that registered learns it at once (not at its receive deadline).
    return _end(rec, SendState.FAILED, ctx, FailReason.SHUTDOWN)


def _s_stale(rec: SendRecord, e: ev.Registered, ctx: SendCtx) -> list[ev.SendAction]:
    raise RemoteProtocolError(f"{type(e).__name__} for a transfer in no state to take it")


def _s_ignore(rec: SendRecord, e: object, ctx: SendCtx) -> list[ev.SendAction]:
    return []


# The event parameter is Any: each entry takes exactly the event type of its key, which a
# Callable type over the union cannot say (parameters are contravariant).
SendTransition = Callable[[SendRecord, Any, SendCtx], list[ev.SendAction]]

_S = SendState
SEND_TABLE: dict[tuple[SendState, type], SendTransition] = {
    (_S.REGISTERED, ev.Registered): _s_registered_registered,
    (_S.REGISTERED, ev.PrefillDone): _s_registered_prefill,
    (_S.REGISTERED, ev.PrefillAborted): _s_any_prefill_aborted,
    (_S.REGISTERED, ev.Cancelled): _s_waiting_cancelled,
    (_S.REGISTERED, ev.HeartbeatSeen): _s_waiting_heartbeat,
    (_S.REGISTERED, DeadlinePassed): _s_registered_deadline,
    (_S.PREFILLED, ev.Registered): _s_prefilled_registered,
    (_S.PREFILLED, ev.Cancelled): _s_waiting_cancelled,
    (_S.PREFILLED, ev.HeartbeatSeen): _s_waiting_heartbeat,
    (_S.PREFILLED, DeadlinePassed): _s_prefilled_deadline,
    (_S.PREFILLED, ev.SourceReclaimed): _s_prefilled_reclaimed,
    (_S.WRITING, ev.SourceReclaimed): _s_writing_reclaimed,
    (_S.WRITING, ev.WriteDone): _s_writing_done,
    (_S.WRITING, ev.WriteFailed): _s_writing_failed,
    (_S.WRITING, ev.Cancelled): _s_writing_cancelled,
    (_S.WRITING, ev.HeartbeatSeen): _s_ignore,
    (_S.WRITING, ev.Registered): _s_stale,
    (_S.WRITING, DeadlinePassed): _s_writing_deadline,
    (_S.REGISTERED, ev.ShutdownDue): _s_waiting_shutdown,
    (_S.PREFILLED, ev.ShutdownDue): _s_waiting_shutdown,
    (_S.WRITING, ev.ShutdownDue): _s_ignore,  # runs to its end (or its own deadline)
    **{(t, ev.Registered): _s_terminal_registered for t in _SEND_TERMINAL},
    **{(t, ev.PrefillDone): _s_terminal_prefill for t in _SEND_TERMINAL if t is not _S.DONE},
    **{
        (t, ev.PrefillAborted): _s_terminal_prefill_aborted
        for t in _SEND_TERMINAL
        if t is not _S.DONE
    },
    **{(t, ev.Cancelled): _s_terminal_answer for t in _SEND_TERMINAL},
    **{(t, ev.HeartbeatSeen): _s_terminal_answer for t in _SEND_TERMINAL},
    **{(t, ev.SourceReclaimed): _s_ignore for t in _SEND_TERMINAL},
    **{(t, ev.ShutdownDue): _s_ignore for t in _SEND_TERMINAL},
}

# What a first event makes of a transfer id never seen before (or forgotten).
SEND_NEW: dict[type, Callable[[Any, SendCtx], tuple[SendRecord, list[ev.SendAction]]]] = {}


def _new_registered(e: ev.Registered, ctx: SendCtx) -> tuple[SendRecord, list[ev.SendAction]]:
    rec = SendRecord(e.reg.transfer_id, SendState.REGISTERED, ctx.now_ns + _reg_ttl(e.reg, ctx))
    _add_registration(rec, e, ctx)
    rec.deadline_ns = _capped(rec, rec.deadline_ns)
    return rec, []


def _new_prefill(e: ev.PrefillDone, ctx: SendCtx) -> tuple[SendRecord, list[ev.SendAction]]:
    rec = SendRecord(e.transfer_id, SendState.PREFILLED, ctx.now_ns + ctx.policy.lease_ns)
    _prefill_into(rec, e)
    if not ctx.writes:  # held, they would wait out the lease for a registration never sent
        return rec, _end(rec, SendState.DONE, ctx, FailReason.NOT_NEEDED)
    return rec, []


def _new_prefill_aborted(
    e: ev.PrefillAborted, ctx: SendCtx
) -> tuple[SendRecord, list[ev.SendAction]]:
    # Remember the id so a registration arriving later is answered with Fail at once.
    rec = SendRecord(
        e.transfer_id,
        SendState.FAILED,
        ctx.now_ns + ctx.policy.tombstone_ns,
        request_id=e.request_id,
        reason=FailReason.PREFILL_ABORTED,
    )
    return rec, []


def _new_cancelled(e: ev.Cancelled, ctx: SendCtx) -> tuple[SendRecord, list[ev.SendAction]]:
    # D cancels something we never saw (its registration was lost): answer so D stops
    # waiting for us, and remember the id so a late registration or prefill is handled.
    rec = SendRecord(
        e.transfer_id,
        SendState.CANCELLED,
        ctx.now_ns + ctx.policy.tombstone_ns,
        reason=FailReason.UNKNOWN_TRANSFER,
    )
    if e.reason is FailReason.NOT_NEEDED:
        return rec, []
    return rec, [ev.SendFail(e.transfer_id, (e.d_addr,), FailReason.UNKNOWN_TRANSFER)]


SEND_NEW.update(
    {
        ev.Registered: _new_registered,
        ev.PrefillDone: _new_prefill,
        ev.PrefillAborted: _new_prefill_aborted,
        ev.Cancelled: _new_cancelled,
    }
)


def send_transition(
    rec: SendRecord | None, event: ev.SendEvent | DeadlinePassed, ctx: SendCtx
) -> tuple[SendRecord, list[ev.SendAction]]:
    """Apply one event to one transfer's record (None if the id is unknown)."""
    if rec is None:
        new = SEND_NEW.get(type(event))
        if new is None:
            raise_out_of_turn(event, None)
        return new(event, ctx)
    fn = SEND_TABLE.get((rec.state, type(event)))
    if fn is None:
        raise_out_of_turn(event, rec.state)
    return rec, fn(rec, event, ctx)

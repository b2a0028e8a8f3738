"""Every state transition of a transfer on the receiving side (D), as one table.

Owns D's state enums (the transfer's and each source's), its per-transfer record, its
policy and the table ``(state, event type) -> transition``. Rule 1 (h11): everything that
changes a receiving transfer's state lives in this file (P's side: send_state.py). Rule 2:
it does not know where it runs; receiver_table.py wraps the table and owns the dict of
records, the deadlines and the counters.

A transition is ``fn(record, event, ctx) -> list[RecvAction]``, with the time in ``ctx``; a
pair missing from the table raises (``transition.raise_out_of_turn``).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from connector.core import events as ev
from connector.core.errors import LocalProtocolError, RemoteProtocolError
from connector.core.messages import FailReason
from connector.core.send_state import SenderPolicy
from connector.core.transition import DeadlinePassed, raise_out_of_turn


class RecvState(enum.Enum):
    AWAITING = "awaiting"  # registrations sent, waiting for every source's completion
    CANCELLING = "cancelling"  # we gave up; waiting for each pending source to answer
    RECEIVED = "received"
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        return self in (RecvState.RECEIVED, RecvState.FAILED)


class SourceState(enum.Enum):
    PENDING = "pending"  # may still write into our blocks
    DONE = "done"
    FAILED = "failed"  # said it will not write, or is gone


@dataclass(frozen=True)
class ReceiverPolicy:
    """D's timing. Its defaults are the product's (``PushkvConfig`` only converts them)."""

    timeout_ns: int = 120_000_000_000  # registration sent → last completion
    # A source that never answers a cancel is given up only this long after the latest
    # moment its WRITE could end (the receive deadline + write_timeout_ns): a message's
    # one-way delay and an aborted WRITE's wind-down must fit in it.
    grace_ns: int = 10_000_000_000
    # Sent in every registration: a WRITE P posts into our blocks ends (done or aborted)
    # within this long, and P posts none after our receive deadline.
    write_timeout_ns: int = SenderPolicy.write_timeout_ns
    heartbeat_interval_ns: int = 1_000_000_000
    tombstone_ns: int = SenderPolicy.tombstone_ns


@dataclass
class RecvRecord:
    transfer_id: str
    request_id: str
    state: RecvState
    deadline_ns: int
    sources: dict[int, ev.Source]
    status: dict[int, SourceState]
    reason: FailReason | None = None
    abandoned: bool = False  # reported although a source never answered (last resort)
    # The receive deadline as first set: no source posts a WRITE after it (each
    # registration's ttl_ms is the time left until it), so none lands after
    # expires_ns + policy.write_timeout_ns.
    expires_ns: int = 0

    def safe_ns(self, policy: ReceiverPolicy) -> int:
        """When no WRITE of a silent source can still reach our blocks, with the margin."""
        return self.expires_ns + policy.write_timeout_ns + policy.grace_ns

    def pending(self) -> tuple[ev.Source, ...]:
        return tuple(
            self.sources[p] for p, s in sorted(self.status.items()) if s is SourceState.PENDING
        )


@dataclass(frozen=True)
class RecvCtx:
    now_ns: int
    policy: ReceiverPolicy


def _settle(rec: RecvRecord, ctx: RecvCtx) -> list[ev.RecvAction]:
    """Report once no source can still write; never earlier (D's blocks stay ours)."""
    if any(s is SourceState.PENDING for s in rec.status.values()):
        return []
    ok = all(s is SourceState.DONE for s in rec.status.values())
    rec.state = RecvState.RECEIVED if ok else RecvState.FAILED
    rec.deadline_ns = ctx.now_ns + ctx.policy.tombstone_ns
    return [ev.ReportReceived(rec.transfer_id, rec.request_id, ok, None if ok else rec.reason)]


def _mark(rec: RecvRecord, p_rank: int, to: SourceState) -> None:
    if p_rank not in rec.status:
        raise RemoteProtocolError(f"{rec.transfer_id}: P rank {p_rank} is not a source")
    if rec.status[p_rank] is not SourceState.PENDING:
        raise RemoteProtocolError(f"{rec.transfer_id}: P rank {p_rank} answered twice")
    rec.status[p_rank] = to


def _cancel(rec: RecvRecord, reason: FailReason, ctx: RecvCtx) -> list[ev.RecvAction]:
    rec.state, rec.reason = RecvState.CANCELLING, rec.reason or reason
    # A silent source is given up only once its WRITE could not land any more; an answer
    # (fail, or the WRITE's completion) ends the wait at once.
    rec.deadline_ns = max(ctx.now_ns + ctx.policy.grace_ns, rec.safe_ns(ctx.policy))
    pending = rec.pending()
    return [ev.SendCancel(rec.transfer_id, pending, reason)] if pending else _settle(rec, ctx)


# --- transitions (receiving side)
def _r_completion(rec: RecvRecord, e: ev.CompletionSeen, ctx: RecvCtx) -> list[ev.RecvAction]:
    _mark(rec, e.p_rank, SourceState.DONE)
    return _settle(rec, ctx)


def _r_awaiting_fail(
    rec: RecvRecord, e: ev.FailSeen | ev.SendFailed, ctx: RecvCtx
) -> list[ev.RecvAction]:
    _mark(rec, e.p_rank, SourceState.FAILED)
    rec.reason = rec.reason or e.reason
    # The KV cannot be whole any more: make the other sources answer promptly.
    return _cancel(rec, e.reason, ctx) if rec.pending() else _settle(rec, ctx)


def _r_cancelling_fail(
    rec: RecvRecord, e: ev.FailSeen | ev.SendFailed, ctx: RecvCtx
) -> list[ev.RecvAction]:
    _mark(rec, e.p_rank, SourceState.FAILED)
    rec.reason = rec.reason or e.reason
    return _settle(rec, ctx)


def _r_awaiting_abort(rec: RecvRecord, e: ev.AbortRequested, ctx: RecvCtx) -> list[ev.RecvAction]:
    return _cancel(rec, FailReason.ABORTED, ctx)


def _r_awaiting_shutdown(rec: RecvRecord, e: ev.ShutdownDue, ctx: RecvCtx) -> list[ev.RecvAction]:
    return _cancel(rec, FailReason.SHUTDOWN, ctx)


def _r_awaiting_deadline(rec: RecvRecord, e: DeadlinePassed, ctx: RecvCtx) -> list[ev.RecvAction]:
    return _cancel(rec, FailReason.DEADLINE, ctx)


def _r_cancelling_deadline(rec: RecvRecord, e: DeadlinePassed, ctx: RecvCtx) -> list[ev.RecvAction]:
    # Last resort so the engine never waits forever: a source neither answered nor was
    # seen to die, and its WRITE deadline (known to us) has passed. Counted and logged by
    # the caller.
    rec.abandoned = True
    for p in list(rec.status):
        if rec.status[p] is SourceState.PENDING:
            rec.status[p] = SourceState.FAILED
    rec.reason = rec.reason or FailReason.DEADLINE
    return _settle(rec, ctx)


def _r_terminal_send_failed(rec: RecvRecord, e: ev.SendFailed, ctx: RecvCtx) -> list[ev.RecvAction]:
    return []  # a late heartbeat or cancel to a peer that went away: nothing is owed


def _r_ignore(rec: RecvRecord, e: object, ctx: RecvCtx) -> list[ev.RecvAction]:
    return []


RecvTransition = Callable[[RecvRecord, Any, RecvCtx], list[ev.RecvAction]]

_R = RecvState
RECV_TABLE: dict[tuple[RecvState, type], RecvTransition] = {
    (_R.AWAITING, ev.CompletionSeen): _r_completion,
    (_R.AWAITING, ev.FailSeen): _r_awaiting_fail,
    (_R.AWAITING, ev.SendFailed): _r_awaiting_fail,
    (_R.AWAITING, ev.AbortRequested): _r_awaiting_abort,
    (_R.AWAITING, DeadlinePassed): _r_awaiting_deadline,
    (_R.AWAITING, ev.ShutdownDue): _r_awaiting_shutdown,
    (_R.CANCELLING, ev.CompletionSeen): _r_completion,
    (_R.CANCELLING, ev.FailSeen): _r_cancelling_fail,
    (_R.CANCELLING, ev.SendFailed): _r_cancelling_fail,
    (_R.CANCELLING, ev.AbortRequested): _r_ignore,
    (_R.CANCELLING, DeadlinePassed): _r_cancelling_deadline,
    (_R.CANCELLING, ev.ShutdownDue): _r_ignore,
    (_R.RECEIVED, ev.ShutdownDue): _r_ignore,
    (_R.FAILED, ev.ShutdownDue): _r_ignore,
    (_R.RECEIVED, ev.AbortRequested): _r_ignore,
    (_R.FAILED, ev.AbortRequested): _r_ignore,
    (_R.RECEIVED, ev.SendFailed): _r_terminal_send_failed,
    (_R.FAILED, ev.SendFailed): _r_terminal_send_failed,
}


def _new_expected(e: ev.Expected, ctx: RecvCtx) -> tuple[RecvRecord, list[ev.RecvAction]]:
    if not e.sources:
        raise LocalProtocolError(f"{e.transfer_id}: expected a transfer with no source")
    sources = {s.p_rank: s for s in e.sources}
    if len(sources) != len(e.sources):
        raise LocalProtocolError(f"{e.transfer_id}: a source rank is listed twice")
    rec = RecvRecord(
        e.transfer_id,
        e.request_id,
        RecvState.AWAITING,
        ctx.now_ns + ctx.policy.timeout_ns,
        sources,
        {p: SourceState.PENDING for p in sources},
        expires_ns=ctx.now_ns + ctx.policy.timeout_ns,
    )
    return rec, [ev.SendRegister(e.transfer_id, s) for s in e.sources]


def recv_transition(
    rec: RecvRecord | None, event: ev.RecvEvent | DeadlinePassed, ctx: RecvCtx
) -> tuple[RecvRecord | None, list[ev.RecvAction]]:
    """Apply one event to one transfer's record (None if the id is unknown)."""
    if rec is None:
        if isinstance(event, ev.Expected):
            return _new_expected(event, ctx)
        if isinstance(event, (ev.SendFailed, ev.AbortRequested, ev.ShutdownDue)):
            return None, []  # about a transfer already forgotten: nothing is owed
        raise_out_of_turn(event, None)
    if isinstance(event, ev.Expected):
        raise LocalProtocolError(f"{event.transfer_id}: expected twice")
    fn = RECV_TABLE.get((rec.state, type(event)))
    if fn is None:
        raise_out_of_turn(event, rec.state)
    return rec, fn(rec, event, ctx)

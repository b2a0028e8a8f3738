"""h2-style exhaustive check: every (state, event) pair of both tables either moves the
record to a valid state with well-formed actions, or raises a protocol error."""

from __future__ import annotations

import itertools

import pytest

from connector.core import events as ev
from connector.core.errors import LocalProtocolError, RemoteProtocolError
from connector.core.messages import FailReason
from connector.core.state import (
    DeadlinePassed,
    ReceiverPolicy,
    RecvCtx,
    RecvRecord,
    RecvState,
    SendCtx,
    SenderPolicy,
    SendRecord,
    SendState,
    SourceState,
    recv_transition,
    send_transition,
)
from tests.unit.core.factories import d_addr, p_addr, register

NOW = 1_000_000_000
SEND_CTX = SendCtx(NOW, SenderPolicy(), lambda d_tp: frozenset(range(d_tp)))
RECV_CTX = RecvCtx(NOW, ReceiverPolicy())

SEND_EVENTS = [
    ev.Registered(register("t0", d_rank=0)),
    ev.Registered(register("t0", d_rank=1, d_tp_size=2)),
    ev.PrefillDone("t0", "req-0", ((1, 2, 3),), 48),
    ev.PrefillAborted("t0", "req-0"),
    ev.WriteDone("t0"),
    ev.WriteFailed("t0", FailReason.WRITE_ERROR),
    ev.Cancelled("t0", 0, d_addr(0), FailReason.ABORTED),
    ev.HeartbeatSeen("t0", d_addr(0)),
    ev.SourceReclaimed("t0"),
    ev.Cancelled("t0", 0, d_addr(0), FailReason.NOT_NEEDED),
    ev.ShutdownDue("t0"),
    DeadlinePassed("t0"),
]


def send_record(state: SendState, prefilled: bool) -> SendRecord:
    rec = SendRecord("t0", state, NOW + 5)
    if state in (SendState.REGISTERED, SendState.WRITING) or (state.terminal and not prefilled):
        rec.registrations[0] = register("t0")
        rec.expected_d_ranks = frozenset({0})
    if prefilled or state in (SendState.PREFILLED, SendState.WRITING):
        rec.request_id, rec.block_ids, rec.num_tokens = "req-0", ((1, 2, 3),), 48
        rec.blocks_held = not state.terminal
    rec.write_issued = state in (SendState.WRITING, SendState.DONE)
    if state.terminal and state is not SendState.DONE:
        rec.reason = FailReason.CANCELLED
    return rec


def _check_send_actions(rec: SendRecord, actions: list) -> None:
    for a in actions:
        assert isinstance(
            a, (ev.IssueWrite, ev.AbortWrite, ev.FreeBlocks, ev.SendFail, ev.ResendCompletion)
        ), a
        if isinstance(a, ev.FreeBlocks):
            assert rec.state is not SendState.WRITING, "freed blocks under a live WRITE"
        if isinstance(a, ev.SendFail):
            assert a.to, "SendFail to nobody"


@pytest.mark.parametrize(
    "state, prefilled, event",
    [(s, p, e) for s, p, e in itertools.product(SendState, (False, True), SEND_EVENTS)],
    ids=str,
)
def test_every_send_pair(state: SendState, prefilled: bool, event: object) -> None:
    rec = send_record(state, prefilled)
    held_before = rec.blocks_held
    try:
        out_rec, actions = send_transition(rec, event, SEND_CTX)
    except (LocalProtocolError, RemoteProtocolError):
        return
    assert out_rec is rec and isinstance(rec.state, SendState)
    _check_send_actions(rec, actions)
    frees = [a for a in actions if isinstance(a, ev.FreeBlocks)]
    if isinstance(event, ev.PrefillDone) and rec.state.terminal:
        assert len(frees) == 1, "blocks handed over for a dead transfer must come back at once"
    elif isinstance(event, ev.SourceReclaimed):
        assert not frees and not any(isinstance(a, ev.IssueWrite) for a in actions)
    else:
        assert len(frees) == int(held_before and not rec.blocks_held)


@pytest.mark.parametrize("event", SEND_EVENTS, ids=str)
def test_every_send_event_on_an_unknown_transfer(event: object) -> None:
    try:
        rec, actions = send_transition(None, event, SEND_CTX)
    except (LocalProtocolError, RemoteProtocolError):
        assert isinstance(
            event,
            (
                ev.WriteDone,
                ev.WriteFailed,
                ev.HeartbeatSeen,
                DeadlinePassed,
                ev.SourceReclaimed,
                ev.ShutdownDue,  # the tables shut down only the records they have
            ),
        )
        return
    assert rec is not None
    _check_send_actions(rec, actions)


RECV_EVENTS = [
    ev.CompletionSeen("t0", 0),
    ev.CompletionSeen("t0", 7),
    ev.FailSeen("t0", 0, FailReason.LEASE_EXPIRED),
    ev.SendFailed("t0", 1, FailReason.PEER_LOST),
    ev.AbortRequested("t0"),
    ev.ShutdownDue("t0"),
    DeadlinePassed("t0"),
    ev.Expected("t0", "req", (ev.Source(0, p_addr(0)),), ((1,),), 0, 16),
]


def recv_record(state: RecvState, statuses: tuple[SourceState, SourceState]) -> RecvRecord:
    sources = {p: ev.Source(p, p_addr(p)) for p in (0, 1)}
    return RecvRecord("t0", "req", state, NOW + 5, sources, dict(enumerate(statuses)))


@pytest.mark.parametrize(
    "state, statuses, event",
    [
        (s, st, e)
        for s, st, e in itertools.product(
            RecvState, itertools.product(SourceState, repeat=2), RECV_EVENTS
        )
        if s.terminal or SourceState.PENDING in st
    ],
    ids=str,
)
def test_every_recv_pair(state: RecvState, statuses: tuple, event: object) -> None:
    rec = recv_record(state, statuses)
    try:
        out_rec, actions = recv_transition(rec, event, RECV_CTX)
    except (LocalProtocolError, RemoteProtocolError):
        return
    assert out_rec is rec and isinstance(rec.state, RecvState)
    reports = [a for a in actions if isinstance(a, ev.ReportReceived)]
    assert len(reports) <= 1
    if reports:
        assert not state.terminal, "reported twice"
        assert rec.state.terminal
        assert rec.abandoned or SourceState.PENDING not in rec.status.values(), (
            "reported while a source may still write"
        )
        assert reports[0].ok == all(s is SourceState.DONE for s in rec.status.values())
    if not rec.state.terminal:
        assert SourceState.PENDING in rec.status.values()

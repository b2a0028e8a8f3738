"""The scheduler role's request lifecycle (connector/core/lifecycle.py).

h2-style: every (state, event) pair is a transition of the table or LocalProtocolError. Then a
stateful test per role drives one request through what vLLM can do to it (chunked prefill,
preemption, abort, worker reports in any order) and checks each effect against a model of
what the engine holds: vLLM never frees blocks a push may still read, every push is staged
once, and every request is released once nothing is owed.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from connector.core import lifecycle as lc
from connector.core.errors import LocalProtocolError
from connector.core.lifecycle import LIFECYCLE, Effect, ReqState

S = ReqState
P_STATES = frozenset({S.PREFILLING, S.PUSHING, S.PUSHED_EARLY, S.HANDED_OVER, S.SPENT})
D_STATES = frozenset({S.AWAITING_ALLOC, S.RECEIVING, S.ABORTING, S.DONE, S.REFUSED, S.LOAD_FAILED})
LIVE = P_STATES | D_STATES
P_EVENTS = (lc.PrefillScheduled, lc.PrefillStopped, lc.PushReported)
D_EVENTS = (lc.BlocksAllocated, lc.PromptCached, lc.RecvReported, lc.LoadHookFailed)
EVENTS = [
    lc.BlocksAllocated("r"),
    lc.PromptCached("r"),
    lc.PrefillScheduled("r"),
    lc.Preempted("r"),
    lc.RequestFinished("r"),
    lc.PrefillStopped("r"),
    lc.PushReported("r"),
    lc.RecvReported("r"),
    lc.HookFailed("r"),
    lc.LoadHookFailed("r"),
]
# Where each effect may fire: the caller stages work only from these pairs.
EFFECT_AT = {
    Effect.STAGE_REGISTRATION: {(S.AWAITING_ALLOC, lc.BlocksAllocated)},
    Effect.STAGE_NOT_NEEDED: {
        (S.AWAITING_ALLOC, lc.PromptCached),
        (S.AWAITING_ALLOC, lc.HookFailed),
    },
    Effect.STAGE_PREFILL: {(S.PREFILLING, lc.PrefillScheduled)},
    Effect.RECLAIM: {
        (S.PUSHING, lc.Preempted),
        (S.PUSHING, lc.HookFailed),
        (S.PUSHING, lc.PrefillStopped),
    },
    Effect.DELAY_FREE: {(S.PUSHING, lc.RequestFinished)},
    Effect.STAGE_PREFILL_ABORT: {
        (S.PREFILLING, lc.RequestFinished),
        (S.PREFILLING, lc.PrefillStopped),
        (S.PREFILLING, lc.HookFailed),
    },
    Effect.STAGE_ABORT: {
        (S.RECEIVING, lc.RequestFinished),
        (S.RECEIVING, lc.HookFailed),
        (S.RECEIVING, lc.LoadHookFailed),
    },
    Effect.FREE_BLOCKS: {(S.HANDED_OVER, lc.PushReported)},
    Effect.TIME_FIRST_TOKEN: {(S.RECEIVING, lc.RecvReported)},
    Effect.STAGE_LOAD_FAILED: {(S.AWAITING_ALLOC, lc.LoadHookFailed)},
    Effect.FAIL_LOAD: {(S.REFUSED, lc.BlocksAllocated), (S.REFUSED, lc.LoadHookFailed)},
}


def test_a_raising_hook_lets_go_of_every_live_request_definitely() -> None:
    """Our own failure never leaves a request waiting: in every live state the table has
    an entry, and a D request vLLM waits on always gets a report staged or coming."""
    for state in LIVE:
        assert (state, lc.HookFailed) in LIFECYCLE, state
    for state in (S.AWAITING_ALLOC, S.RECEIVING, S.ABORTING, S.REFUSED, S.LOAD_FAILED):
        t = LIFECYCLE[(state, lc.LoadHookFailed)]
        # Staged now (load failed, abort) or already coming (ABORTING waits for its report,
        # LOAD_FAILED's failure is staged already).
        assert t.effect in (
            Effect.STAGE_LOAD_FAILED,
            Effect.STAGE_ABORT,
            Effect.FAIL_LOAD,
        ) or state in (S.ABORTING, S.LOAD_FAILED)


def test_every_event_type_is_in_the_pair_list() -> None:
    assert {type(e) for e in EVENTS} == set(lc.ReqEvent.__args__)
    assert set(EFFECT_AT) == set(Effect) - {Effect.NONE}


@pytest.mark.parametrize(
    "state, event", list(itertools.product(ReqState, EVENTS)), ids=lambda x: str(x)
)
def test_every_pair(state: ReqState, event: lc.ReqEvent) -> None:
    key = (state, type(event))
    if key not in LIFECYCLE:
        with pytest.raises(LocalProtocolError, match=type(event).__name__):
            lc.advance(state, event)
        return
    t = lc.advance(state, event)
    assert t is LIFECYCLE[key]
    assert state is not S.RELEASED, "a released request has no record to take events"
    assert (
        t.to is None or t.to is S.RELEASED or t.to in (P_STATES if state in P_STATES else D_STATES)
    )
    assert t.to is not state, "an unchanged state is written as an ignore"
    if t.effect is not Effect.NONE:
        assert key in EFFECT_AT[t.effect]
    if t.to is None:
        assert t == lc.IGNORE


@pytest.mark.parametrize("state", sorted(LIVE, key=lambda s: s.value))
def test_every_live_request_can_finish_and_be_released(state: ReqState) -> None:
    # vLLM may finish (abort) a request in any state, so request_finished is never out of turn.
    assert (state, lc.RequestFinished) in LIFECYCLE
    seen, frontier = {state}, [state]
    while frontier:
        here = frontier.pop()
        for (s, _), t in LIFECYCLE.items():
            if s is here and t.to is not None and t.to not in seen:
                seen.add(t.to)
                frontier.append(t.to)
    assert S.RELEASED in seen


def test_p_and_d_events_never_cross() -> None:
    for state, event in LIFECYCLE:
        if event in P_EVENTS:
            assert state in P_STATES, (state, event)
        if event in D_EVENTS:
            assert state in D_STATES, (state, event)


def test_new_requests_start_where_the_table_begins() -> None:
    assert lc.start(lc.PrefillLegAdded("r")) is S.PREFILLING
    assert lc.start(lc.DecodeLegAdded("r")) is S.AWAITING_ALLOC
    assert lc.start(lc.LegRejected("r")) is S.DONE
    assert lc.start(lc.LegRefused("r")) is S.REFUSED
    assert set(lc.NEW) == set(lc.NewReqEvent.__args__)


def test_push_pending_is_a_staged_push_not_yet_reported() -> None:
    assert {s for s in ReqState if s.push_pending} == {S.PUSHING, S.HANDED_OVER}


def test_rows_render_the_whole_table() -> None:
    rows = lc.rows()
    assert len(rows) == len(lc.NEW) + len(LIFECYCLE)
    assert ("(new)", "PrefillLegAdded", "PREFILLING", "none") in rows
    assert ("PUSHING", "RequestFinished", "HANDED_OVER", "delay_free") in rows
    assert ("SPENT", "PrefillScheduled", "-", "none") in rows
    assert all(len(r) == 4 and all(isinstance(c, str) and c for c in r) for r in rows)


# ---------------------------------------------------------------- request paths
class _Request(RuleBasedStateMachine):
    """One request; each rule is something vLLM may do next. ``fire`` applies the table as
    scheduler_side.py does and returns the effect; it fails on a pair the table lacks."""

    state: ReqState

    def fire(self, event: lc.ReqEvent) -> Effect:
        before = self.state
        t = lc.advance(before, event)  # raises on a pair vLLM's contract can produce
        if t.to is not None:
            self.state = t.to
        note(f"{before.name} --{type(event).__name__}--> {self.state.name} ({t.effect.value})")
        return t.effect

    @property
    def released(self) -> bool:
        return self.state is S.RELEASED

    @rule()
    def engine_step(self) -> None:
        """A step that changes nothing for this request (a finished one sees only these)."""


class PRequestPath(_Request):
    """P: the prompt runs in chunks (maybe preempted and recomputed), the push is staged by
    the step that completes it, the workers report it done before or after vLLM finishes
    the request, or the request is aborted at any point."""

    def __init__(self) -> None:
        super().__init__()
        self.state = lc.start(lc.PrefillLegAdded("r"))
        self.prompt_done = False  # this run of the prompt completed (vLLM's counters)
        self.running = True
        self.finished = False
        self.staged = 0  # pushes staged
        self.reported = False  # the staged push's finished_sending came in
        self.reclaimed = False
        self.report_may_come = False  # a staged push's end is still to be reported
        self.delay_free = False
        self.freed = 0

    @precondition(lambda self: self.running and not self.finished)
    @rule(completes=st.booleans())
    def schedule(self, completes: bool) -> None:
        if not (completes or self.prompt_done):
            return  # a chunk of the prompt: the caller sends no event
        first = not self.prompt_done
        self.prompt_done = True
        effect = self.fire(lc.PrefillScheduled("r"))
        # Only the first completion of the prompt, and never after a reclaim, pushes.
        should = first and self.staged == 0
        assert (effect is Effect.STAGE_PREFILL) == should
        if should:
            self.staged += 1
            self.report_may_come = True

    @precondition(lambda self: self.running and not self.finished)
    @rule()
    def preempt(self) -> None:
        effect = self.fire(lc.Preempted("r"))
        in_flight = self.staged and not self.reported and not self.reclaimed
        assert (effect is Effect.RECLAIM) == bool(in_flight)
        if self.staged:
            self.reclaimed = True
        self.running, self.prompt_done = False, False

    @precondition(lambda self: not self.running and not self.finished)
    @rule()
    def resume(self) -> None:
        self.running = True  # allocation for a P request sends no event

    @precondition(lambda self: not self.finished)
    @rule()
    def finish(self) -> None:
        effect = self.fire(lc.RequestFinished("r"))
        self.finished = True
        in_flight = self.staged and not self.reported and not self.reclaimed
        # vLLM keeps the blocks exactly while a WRITE may read them.
        assert (effect is Effect.DELAY_FREE) == bool(in_flight)
        self.delay_free = effect is Effect.DELAY_FREE
        assert (effect is Effect.STAGE_PREFILL_ABORT) == (self.staged == 0)

    @precondition(lambda self: self.running and self.prompt_done and not self.finished)
    @rule()
    def stop(self) -> None:
        """The first token ends the request and its leg says no D follows
        (``release_on_stop``): vLLM frees the blocks now, a WRITE that may read them is
        reclaimed (the next forward waits for it), nothing is owed back."""
        effect = self.fire(lc.PrefillStopped("r"))
        self.finished = True
        in_flight = self.staged and not self.reported and not self.reclaimed
        assert (effect is Effect.RECLAIM) == bool(in_flight)
        assert effect is not Effect.DELAY_FREE
        if in_flight:
            self.reclaimed = True
        assert self.released

    @precondition(lambda self: self.report_may_come and not self.released)
    @rule()
    def push_reported(self) -> None:
        self.report_may_come = False
        effect = self.fire(lc.PushReported("r"))
        if not self.reclaimed:
            self.reported = True
        if effect is Effect.FREE_BLOCKS:
            self.freed += 1
        assert (effect is Effect.FREE_BLOCKS) == self.delay_free

    @invariant()
    def blocks_are_owed_exactly_while_a_push_may_read_them(self) -> None:
        in_flight = self.staged and not self.reported and not self.reclaimed
        assert self.state.push_pending == (bool(in_flight) and not self.released)
        assert self.staged <= 1 and self.freed <= 1
        assert self.released == (self.finished and (not self.delay_free or self.freed == 1))


class DRequestPath(_Request):
    """D: blocks are allocated (or the prefix cache holds the prompt), the KV is reported in
    or failed, and the request runs, is preempted or is aborted, in any order vLLM allows."""

    def __init__(self) -> None:
        super().__init__()
        self.state = lc.start(lc.DecodeLegAdded("r"))
        self.allocated = False
        self.registered = False
        self.not_needed = False
        self.loading = False  # registered, finished_recving not in yet (WAITING_FOR_REMOTE_KVS)
        self.running = False
        self.finished = False
        self.aborted_load = False

    @precondition(lambda self: not self.running and not self.loading and not self.finished)
    @rule(prompt_cached=st.booleans())
    def allocate(self, prompt_cached: bool) -> None:
        # get_num_new_matched_tokens asks for a load only before the first allocation.
        wants_load = self.state is S.AWAITING_ALLOC and not prompt_cached
        event = lc.BlocksAllocated("r") if wants_load else lc.PromptCached("r")
        effect = self.fire(event)
        first = not self.allocated
        self.allocated = True
        assert (effect is Effect.STAGE_REGISTRATION) == (first and wants_load)
        assert (effect is Effect.STAGE_NOT_NEEDED) == (first and not wants_load)
        if wants_load:
            self.registered = self.loading = True
        else:
            self.not_needed |= first
            self.running = True

    @precondition(lambda self: self.loading)
    @rule()
    def recv_reported(self) -> None:
        self.loading = False
        effect = self.fire(lc.RecvReported("r"))
        assert (effect is Effect.TIME_FIRST_TOKEN) == (not self.finished)

    @precondition(lambda self: self.running and not self.finished)
    @rule()
    def preempt(self) -> None:
        assert self.fire(lc.Preempted("r")) is Effect.NONE
        self.running = False

    @precondition(lambda self: not self.finished)
    @rule()
    def finish(self) -> None:
        effect = self.fire(lc.RequestFinished("r"))
        self.finished = True
        # A request aborted while its KV is awaited tells P to stand down, once.
        assert (effect is Effect.STAGE_ABORT) == self.loading
        self.aborted_load = self.loading

    @invariant()
    def released_once_nothing_is_awaited(self) -> None:
        assert not (self.registered and self.not_needed)
        assert self.released == (self.finished and not self.loading)
        assert not self.state.push_pending


def test_a_refused_leg_fails_its_load_and_never_tells_p() -> None:
    """untrusted_leg: refuse. vLLM's "fail" policy ends the request (RequestFinished) before
    it passes the failed report on; no entry on the way stages anything that reaches P
    (a registration, not_needed, an abort): its coordinates are not trusted."""
    towards_p = {Effect.STAGE_REGISTRATION, Effect.STAGE_NOT_NEEDED, Effect.STAGE_ABORT}
    towards_p.add(Effect.STAGE_LOAD_FAILED)  # it frees P's blocks: tells P
    state = lc.start(lc.LegRefused("r"))
    t = lc.advance(state, lc.BlocksAllocated("r"))
    assert (t.to, t.effect) == (S.LOAD_FAILED, Effect.FAIL_LOAD)
    assert lc.advance(S.LOAD_FAILED, lc.RequestFinished("r")).to is S.RELEASED
    for (state, _), t in LIFECYCLE.items():
        if state in (S.REFUSED, S.LOAD_FAILED):
            assert t.effect not in towards_p, (state, t)
    # A prompt vLLM loads nothing for is computed here, as under "recompute".
    assert lc.advance(S.REFUSED, lc.PromptCached("r")).to is S.DONE


TestPRequestPath = PRequestPath.TestCase
TestDRequestPath = DRequestPath.TestCase

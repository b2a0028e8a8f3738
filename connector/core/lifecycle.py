"""The scheduler role's per-request lifecycle: its states, the events that move them, one table.

Owns: ``ReqState``, the request events, ``Effect`` and ``LIFECYCLE``. h11's rules: every change
of a request's state is an entry of the table, and a pair missing from it raises
LocalProtocolError (scheduler_side.py logs it and the request keeps its state; a vLLM hook
never raises into the engine's step). scheduler_side.py turns vLLM's hooks into these events
and carries out each entry's ``Effect`` with the vLLM objects it holds.

Pure: no vLLM, no clocks, no logging.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from connector.core.errors import LocalProtocolError


class ReqState(enum.Enum):
    PREFILLING = "prefilling"  # P: prompt not complete yet
    PUSHING = "pushing"  # P: workers were told to push; request still running
    PUSHED_EARLY = "pushed_early"  # P: every worker finished before request_finished
    HANDED_OVER = "handed_over"  # P: request finished, blocks ours until finished_sending
    SPENT = "spent"  # P: preempted after its push began; never pushed again
    AWAITING_ALLOC = "awaiting_alloc"  # D: no blocks yet
    RECEIVING = "receiving"  # D: registration staged, WAITING_FOR_REMOTE_KVS
    ABORTING = "aborting"  # D: finished while receiving; blocks held until finished_recving
    DONE = "done"  # D: KV in or not needed; also a request whose leg was rejected
    REFUSED = "refused"  # D: an untrusted leg refused; no blocks yet, nothing dialed
    LOAD_FAILED = "load_failed"  # D: a refused leg's load reported failed; vLLM ends it
    RELEASED = "released"  # nothing left to track: the record is dropped

    @property
    def push_pending(self) -> bool:
        """A push may still be running: the engine must keep stepping (has_pending_push_work)."""
        return self in _PUSH_PENDING

    @property
    def transfer_pending(self) -> bool:
        """A transfer of this request may still run on some rank: P pushing, D receiving."""
        return self in _TRANSFER_PENDING


_PUSH_PENDING = frozenset({ReqState.PUSHING, ReqState.HANDED_OVER})
_TRANSFER_PENDING = _PUSH_PENDING | {ReqState.RECEIVING, ReqState.ABORTING}


# ---------------------------------------------------------------- events: a request arrives
@dataclass(frozen=True)
class PrefillLegAdded:
    """P: a new request asks for its prompt's KV to be pushed to D."""

    request_id: str


@dataclass(frozen=True)
class DecodeLegAdded:
    """D: a new request expects its prompt's KV to be pushed from P."""

    request_id: str


@dataclass(frozen=True)
class LegRejected:
    """A new request's kv_transfer_params are malformed, or (D, ``untrusted_leg:
    recompute``) name P coordinates D may not dial: it is computed locally."""

    request_id: str


@dataclass(frozen=True)
class LegRefused:
    """D, ``untrusted_leg: refuse``: the leg names P coordinates D may not dial. D asks vLLM
    to wait for a load and reports it failed at once (vLLM's kv_load_failure_policy "fail"
    ends the request with an error); nothing is dialed, P is never told."""

    request_id: str


# ---------------------------------------------------------------- events: vLLM's hooks
@dataclass(frozen=True)
class BlocksAllocated:
    """D: blocks were allocated for the tokens P will write (update_state_after_alloc)."""

    request_id: str


@dataclass(frozen=True)
class PromptCached:
    """D: blocks were allocated and nothing is to be loaded (the prefix cache holds the
    prompt, or the KV is already in)."""

    request_id: str


@dataclass(frozen=True)
class PrefillScheduled:
    """P: the scheduled step completes the prompt's KV (or runs after it did)."""

    request_id: str


@dataclass(frozen=True)
class Preempted:
    """vLLM preempted the request: its blocks are free again and it will be recomputed."""

    request_id: str


@dataclass(frozen=True)
class RequestFinished:
    """vLLM finished the request (stop, length, abort, error): request_finished."""

    request_id: str


@dataclass(frozen=True)
class PrefillStopped:
    """P: vLLM finished the request with a stop (EOS, a stop token) and its leg says no D
    leg follows then (``release_on_stop``: the router streams P's token and ends the
    request). Its blocks are not held for a registration that will not come."""

    request_id: str


@dataclass(frozen=True)
class PushReported:
    """P: every worker reported the request in finished_sending."""

    request_id: str


@dataclass(frozen=True)
class RecvReported:
    """D: every worker reported the request in finished_recving: its KV is in, or failed,
    and no WRITE can reach its blocks any more."""

    request_id: str


# ---------------------------------------------------------------- events: our own failure
@dataclass(frozen=True)
class HookFailed:
    """A hook of ours raised for this request (plugin.py's guard) and vLLM is not waiting
    for a load of it: pushkv lets go of the request, definitely. P: D is told at once, and
    a push that may read the blocks is reclaimed; D: P frees its blocks (not needed) and D
    computes the prompt, or, once registered, the load is aborted and reported failed."""

    request_id: str


@dataclass(frozen=True)
class LoadHookFailed:
    """D: a hook raised after vLLM was told to wait for the load (update_state_after_alloc
    with tokens to load): the load is reported failed, so vLLM applies
    kv_load_failure_policy."""

    request_id: str


NewReqEvent = PrefillLegAdded | DecodeLegAdded | LegRejected | LegRefused
ReqEvent = (
    BlocksAllocated
    | PromptCached
    | PrefillScheduled
    | Preempted
    | RequestFinished
    | PrefillStopped
    | PushReported
    | RecvReported
    | HookFailed
    | LoadHookFailed
)


class Effect(enum.Enum):
    """What scheduler_side.py does with vLLM's objects when a transition fires."""

    NONE = "none"
    STAGE_REGISTRATION = "stage_registration"  # D: register the blocks with P this step
    STAGE_NOT_NEEDED = "stage_not_needed"  # D: tell P to free its blocks at once
    STAGE_PREFILL = "stage_prefill"  # P: push right after this step's forward
    RECLAIM = "reclaim"  # P: vLLM takes the blocks back while a WRITE may read them
    DELAY_FREE = "delay_free"  # P: request_finished keeps the blocks for the push
    STAGE_PREFILL_ABORT = "stage_prefill_abort"  # P: the prompt never ran; D must not wait
    STAGE_ABORT = "stage_abort"  # D: stop waiting; vLLM holds the blocks until reported
    FREE_BLOCKS = "free_blocks"  # P: pass finished_sending on; vLLM frees the blocks
    TIME_FIRST_TOKEN = "time_first_token"  # D: the KV is in; watch for the first token
    # D: report the load failed now (nothing was registered) and free P's blocks
    STAGE_LOAD_FAILED = "stage_load_failed"
    # D: report the load failed now; P is not told (its coordinates are not trusted)
    FAIL_LOAD = "fail_load"


@dataclass(frozen=True)
class Transition:
    """One entry of the table: the state entered (None: the request keeps its state) and
    what the caller must do."""

    to: ReqState | None
    effect: Effect = Effect.NONE


IGNORE = Transition(None)
"""An explicit ignore: the event is expected here and changes nothing."""

NEW: dict[type[NewReqEvent], ReqState] = {
    PrefillLegAdded: ReqState.PREFILLING,
    DecodeLegAdded: ReqState.AWAITING_ALLOC,
    LegRejected: ReqState.DONE,  # tracked only to answer request_finished with the reason
    LegRefused: ReqState.REFUSED,
}

_S = ReqState
LIFECYCLE: dict[tuple[ReqState, type[ReqEvent]], Transition] = {
    # P: the prompt runs, in chunks, possibly preempted and recomputed.
    (_S.PREFILLING, PrefillScheduled): Transition(_S.PUSHING, Effect.STAGE_PREFILL),
    (_S.PREFILLING, Preempted): IGNORE,  # nothing staged yet: recomputed, pushed later
    (_S.PREFILLING, RequestFinished): Transition(_S.RELEASED, Effect.STAGE_PREFILL_ABORT),
    (_S.PREFILLING, PrefillStopped): Transition(_S.RELEASED, Effect.STAGE_PREFILL_ABORT),
    # P: the push is staged and the request still runs (its decode steps).
    (_S.PUSHING, PrefillScheduled): IGNORE,
    (_S.PUSHING, Preempted): Transition(_S.SPENT, Effect.RECLAIM),
    (_S.PUSHING, RequestFinished): Transition(_S.HANDED_OVER, Effect.DELAY_FREE),
    # No D will register: vLLM frees the blocks now, the next forward waits for any WRITE
    # that still reads them, and P's transfer ends "not needed".
    (_S.PUSHING, PrefillStopped): Transition(_S.RELEASED, Effect.RECLAIM),
    # Held back: vLLM may only free finished requests.
    (_S.PUSHING, PushReported): Transition(_S.PUSHED_EARLY),
    (_S.PUSHED_EARLY, PrefillScheduled): IGNORE,
    (_S.PUSHED_EARLY, Preempted): Transition(_S.SPENT),  # no WRITE reads the blocks any more
    (_S.PUSHED_EARLY, RequestFinished): Transition(_S.RELEASED),  # vLLM frees the blocks now
    (_S.PUSHED_EARLY, PrefillStopped): Transition(_S.RELEASED),
    # P: the request finished; its blocks are ours until the push ends.
    (_S.HANDED_OVER, PushReported): Transition(_S.RELEASED, Effect.FREE_BLOCKS),
    (_S.HANDED_OVER, RequestFinished): Transition(_S.RELEASED),  # a repeat: let vLLM free
    (_S.HANDED_OVER, PrefillStopped): Transition(_S.RELEASED),
    # P: preempted after the push began; recomputed, never pushed again.
    (_S.SPENT, PrefillScheduled): IGNORE,
    (_S.SPENT, Preempted): IGNORE,
    (_S.SPENT, PushReported): IGNORE,  # the reclaimed push's end: vLLM owns the blocks
    (_S.SPENT, RequestFinished): Transition(_S.RELEASED),
    (_S.SPENT, PrefillStopped): Transition(_S.RELEASED),
    # D: waiting for blocks.
    (_S.AWAITING_ALLOC, BlocksAllocated): Transition(_S.RECEIVING, Effect.STAGE_REGISTRATION),
    (_S.AWAITING_ALLOC, PromptCached): Transition(_S.DONE, Effect.STAGE_NOT_NEEDED),
    (_S.AWAITING_ALLOC, RequestFinished): Transition(_S.RELEASED),
    # D: registered; vLLM keeps the request in WAITING_FOR_REMOTE_KVS.
    (_S.RECEIVING, PromptCached): IGNORE,  # allocated again once the KV is in
    (_S.RECEIVING, RequestFinished): Transition(_S.ABORTING, Effect.STAGE_ABORT),
    (_S.RECEIVING, RecvReported): Transition(_S.DONE, Effect.TIME_FIRST_TOKEN),
    # D: finished while receiving; vLLM frees the blocks with finished_recving.
    (_S.ABORTING, RecvReported): Transition(_S.RELEASED),
    (_S.ABORTING, RequestFinished): Transition(_S.RELEASED),  # a repeat: let vLLM free
    # D: the KV is in (or was not needed), or the leg was rejected: a local request now.
    (_S.DONE, PromptCached): IGNORE,  # allocated again after the load or a preemption
    (_S.DONE, Preempted): IGNORE,
    (_S.DONE, RequestFinished): Transition(_S.RELEASED),
    # D: a refused leg. Its load is reported failed at once, and vLLM's "fail" policy ends
    # the request with an error (before it passes the report on); a prompt vLLM loads
    # nothing for (one that skips the prefix cache) is computed here with the reason.
    (_S.REFUSED, BlocksAllocated): Transition(_S.LOAD_FAILED, Effect.FAIL_LOAD),
    (_S.REFUSED, PromptCached): Transition(_S.DONE),
    (_S.REFUSED, RequestFinished): Transition(_S.RELEASED),
    (_S.LOAD_FAILED, RequestFinished): Transition(_S.RELEASED),
    (_S.LOAD_FAILED, RecvReported): Transition(_S.DONE),  # still running: computed here
    # A hook of ours raised: pushkv lets go of the request, and every side learns it now.
    (_S.PREFILLING, HookFailed): Transition(_S.RELEASED, Effect.STAGE_PREFILL_ABORT),
    (_S.PUSHING, HookFailed): Transition(_S.SPENT, Effect.RECLAIM),
    (_S.PUSHED_EARLY, HookFailed): Transition(_S.SPENT),  # no WRITE reads the blocks
    (_S.HANDED_OVER, HookFailed): IGNORE,  # vLLM keeps the blocks until the push reports
    (_S.SPENT, HookFailed): IGNORE,
    (_S.AWAITING_ALLOC, HookFailed): Transition(_S.DONE, Effect.STAGE_NOT_NEEDED),
    (_S.AWAITING_ALLOC, LoadHookFailed): Transition(_S.RELEASED, Effect.STAGE_LOAD_FAILED),
    (_S.RECEIVING, HookFailed): Transition(_S.ABORTING, Effect.STAGE_ABORT),
    (_S.RECEIVING, LoadHookFailed): Transition(_S.ABORTING, Effect.STAGE_ABORT),
    (_S.ABORTING, HookFailed): IGNORE,
    (_S.ABORTING, LoadHookFailed): IGNORE,
    (_S.DONE, HookFailed): IGNORE,
    (_S.REFUSED, HookFailed): IGNORE,  # nothing staged towards P
    (_S.REFUSED, LoadHookFailed): Transition(_S.LOAD_FAILED, Effect.FAIL_LOAD),
    (_S.LOAD_FAILED, HookFailed): IGNORE,  # the failed load is reported already
    (_S.LOAD_FAILED, LoadHookFailed): IGNORE,
}
"""Every (state, event) pair a request can meet. Missing pairs are events vLLM cannot send in
that state: only running requests are scheduled or preempted (not finished ones, nor ones
waiting for blocks or KV); workers report a staged push or receive once; our
get_num_new_matched_tokens asks for a load only in AWAITING_ALLOC; P's and D's events never
cross; a RELEASED request has no record."""


def start(event: NewReqEvent) -> ReqState:
    """The state a new request starts in."""
    return NEW[type(event)]


def advance(state: ReqState, event: ReqEvent) -> Transition:
    """The table's entry for ``event`` in ``state``; LocalProtocolError if it has none."""
    transition = LIFECYCLE.get((state, type(event)))
    if transition is None:
        raise LocalProtocolError(
            f"{type(event).__name__} for request {event.request_id} in {state.name}"
        )
    return transition


def rows() -> list[tuple[str, str, str, str]]:
    """The table for the docs: (state, event, next state, effect), new requests first; a
    state left unchanged shows as "-"."""
    out = [("(new)", e.__name__, s.name, Effect.NONE.value) for e, s in NEW.items()]
    for (state, event), t in LIFECYCLE.items():
        to = t.to.name if t.to is not None else "-"
        out.append((state.name, event.__name__, to, t.effect.value))
    return out

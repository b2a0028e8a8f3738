"""The connector's scheduler role: the vLLM adapter that runs inside EngineCore.

Owns: one record per request that carries a pushkv leg, the per-step metadata sent to the
workers, and the filtering of worker results before vLLM acts on them. Touches vLLM
objects (Request, KVCacheBlocks, SchedulerOutput, KVConnectorOutput) but never NIXL. A
request's state changes only through core/lifecycle.py's table: each hook turns what vLLM
says into one of its events and carries out the effect of the transition it returns.
A new request's leg becomes its record in leg_intake.py; D's first_token span is timed in
first_token.py.

P (producer): the step that completes a prompt's KV is known when it is *scheduled*, so
that step's metadata tells the workers to hand the blocks to the transfer thread right
after its forward; the WRITE then starts before the request has even finished, one
engine step earlier than vLLM's push connector. ``request_finished`` keeps the blocks
(delay_free) until every worker reports the transfer done; a report that arrives before
``request_finished`` is held back, since vLLM may only free finished requests.

D (consumer): when blocks are allocated for a D leg, the registration is staged in this
step's metadata, so the workers send it within the same engine step.

vLLM 0.26 (connector/vllm_compat.py) binds no cache manager, so P's block ids come from
the steps' SchedulerOutputs (block_tracker.py), and reports a failed load only as block
ids (``failures_as_blocks``), which D maps back through each load's first block.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any

import msgspec

from connector.block_tracker import BlockTracker
from connector.core import lifecycle as lc
from connector.core import pairing
from connector.core.errors import LocalProtocolError
from connector.core.events import BlockTable
from connector.core.lifecycle import Effect, ReqState
from connector.engine_spans import emit_hook_failed, engine_tracer
from connector.first_token import FirstTokenWatch
from connector.kv_params import Coordinates, KvParamsError, LegTrust, is_probe
from connector.leg_intake import LegIntake, ReqRecord
from connector.metadata import Handshake, StagedAbort, StagedPrefill, StagedRegistration, StepPlan
from connector.shutdown import ShutdownWatch
from telemetry.counts import Counts
from telemetry.schema import Count, Recomputed

logger = logging.getLogger(__name__)


class SchedulerSide:
    def __init__(
        self,
        engine_id: str,
        is_producer: bool,
        is_consumer: bool,
        trust: LegTrust | None = None,
        refuse_untrusted: bool = False,
        host: str = "",
        failures_as_blocks: bool = False,
        shutdown: ShutdownWatch | None = None,
        pp_size: int = 1,
    ) -> None:
        """``pp_size``: this engine's pipeline stages (P's coordinates name every worker
        of every stage)."""
        self.engine_id = engine_id
        self._pp_size = pp_size
        self._shutdown = shutdown  # armed on the first step; its grace goes in each plan
        # vLLM 0.26: a failed load comes back as its block ids, not its request id.
        self._failures_as_blocks = failures_as_blocks
        self._tracker = BlockTracker()  # P's block ids where no cache manager is bound
        self.is_producer, self.is_consumer = is_producer, is_consumer
        self._reqs: dict[str, ReqRecord] = {}
        self._step = StepPlan()
        self._handshakes: dict[int, Handshake] = {}
        self._kv_cache_manager: Any = None
        tracer = engine_tracer(engine_id, producer=False, host=host) if is_consumer else None
        self._intake = LegIntake(
            engine_id, is_producer, is_consumer, trust or LegTrust(), refuse_untrusted, tracer
        )
        self._first = FirstTokenWatch(engine_id, tracer)  # D: the first_token spans
        # Requests computed locally, by why (metrics: connector/plugin.py drains it).
        self.recomputed: Counter[str] = Counter()
        self._fault_tracer = tracer or engine_tracer(engine_id, producer=is_producer, host=host)
        # Faults seen here, under telemetry.schema's Count names.
        self.counters: Counts = Counts()

    # ------------------------------------------------------------------ set-up
    def bind_kv_cache_manager(self, manager: Any) -> None:
        self._kv_cache_manager = manager

    def set_handshakes(self, by_rank: dict[int, Any]) -> None:
        """Each worker's handshake, by its source rank (the TP rank at PP 1;
        ``connector.core.stages.source_rank``)."""
        for rank, hs in by_rank.items():
            if isinstance(hs, Handshake):
                self._handshakes[rank] = hs

    def coordinates(self) -> dict[str, Any] | None:
        if not self._handshakes:
            return None
        ranks = sorted(self._handshakes)
        hs = [self._handshakes[r] for r in ranks]
        coords: dict[str, Any] = msgspec.to_builtins(
            Coordinates(
                engine_id=self.engine_id,
                host=hs[0].host,
                port=hs[0].port,
                tp_size=max(1, len(hs) // self._pp_size),
                ports=tuple(h.port for h in hs),
                agents=tuple(h.agent for h in hs),
                pp_size=self._pp_size,
            )
        )
        return coords

    # ------------------------------------------------------------------ requests
    def on_new_request(self, request: Any) -> None:
        params = request.kv_transfer_params
        if not isinstance(params, dict) or is_probe(params):
            return
        rid = request.request_id
        try:
            # vLLM's API server resubmits a D leg that ended in an error pre-aborted
            # (notify_kv_transfer_request_rejected), for cleanup: not a second leg.
            report = not getattr(request, "abort_immediately", False)
            rec = self._intake.record(request, report=report)
        except (KvParamsError, pairing.ForeignLegError) as exc:
            # The request is served locally; the reason goes back in the response.
            logger.warning("Request %s: %s; computing it locally", rid, exc)
            self.recomputed[Recomputed.BAD_PARAMS.value] += 1
            rec = ReqRecord(request, lc.start(lc.LegRejected(rid)), error=str(exc))
        if rec is not None:
            self._reqs[rid] = rec

    @property
    def untrusted_legs(self) -> int:
        """D legs never dialed since start-up (their P coordinates were not trusted)."""
        return self._intake.untrusted_legs

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        rec = self._reqs.get(request.request_id)
        if rec is None or rec.decode is None:
            return 0, False
        covered = rec.decode.covered(request.num_prompt_tokens)
        missing = covered - num_computed_tokens
        if rec.state is ReqState.REFUSED:
            # A load to fail (update_state_after_alloc), so that vLLM ends the request.
            return (missing, True) if missing > 0 else (0, False)
        if rec.state is not ReqState.AWAITING_ALLOC:
            return 0, False
        # vLLM recomputes the last prompt token after a load of the whole prompt anyway, so
        # a hit that leaves at most that token to fetch means nothing needs to move. P
        # covering less than the prompt (first token from P): D computes the rest itself.
        recomputed = 1 if covered == request.num_prompt_tokens else 0
        return (missing, True) if missing > recomputed else (0, False)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        rec = self._reqs.get(request.request_id)
        if rec is not None and rec.prefill is not None and not rec.scheduled_ns:
            rec.scheduled_ns = time.time_ns()  # P: first scheduled (ends P's queue time)
        if rec is None or rec.decode is None:
            return
        rid, leg = request.request_id, rec.decode
        if num_external_tokens:
            self._note_load_block(rec, blocks)
        if num_external_tokens == 0:
            move = self._next(rid, rec, lc.PromptCached(rid))
            if move.effect is Effect.STAGE_NOT_NEEDED:
                # A prefix-cache hit covers the prompt: release P's blocks at once.
                self._step.aborts.append(StagedAbort(leg.transfer_id, rid, "not_needed", leg))
            self._enter(rid, rec, move)
            return
        move = self._next(rid, rec, lc.BlocksAllocated(rid))
        if move.effect is Effect.FAIL_LOAD:
            self._step.failed_loads.append(rid)  # nothing registered, nothing dialed
        elif move.effect is Effect.STAGE_REGISTRATION:
            groups = blocks.get_unhashed_block_ids_all_groups()
            block_ids: BlockTable = tuple(tuple(g) for g in groups)
            covered = leg.covered(request.num_prompt_tokens)
            self._step.registrations.append(
                StagedRegistration(
                    leg.transfer_id,
                    rid,
                    block_ids,
                    first_token=covered - num_external_tokens,
                    num_tokens=covered,
                    leg=leg,
                    alloc_ns=time.time_ns(),
                )
            )
            rec.local_tokens = request.num_prompt_tokens - num_external_tokens
        self._enter(rid, rec, move)

    def build_connector_meta(self, scheduler_output: Any) -> StepPlan:
        """Called before vLLM advances num_computed_tokens for this step."""
        if self._shutdown is not None and self._shutdown.arm():
            self._step.shutdown_grace_s = self._shutdown.grace_left_s()
        for rid in scheduler_output.preempted_req_ids or ():
            rec = self._reqs.get(rid)
            if rec is None:
                continue
            move = self._next(rid, rec, lc.Preempted(rid))
            if move.effect is Effect.RECLAIM:
                assert rec.prefill is not None
                self._step.reclaimed.append(rec.prefill.transfer_id)
            self._enter(rid, rec, move)
        scheduled = scheduler_output.num_scheduled_tokens
        if self._kv_cache_manager is None and self.is_producer:  # vLLM 0.26: P's blocks
            wanted = {rid for rid, rec in self._reqs.items() if rec.prefill is not None}
            self._tracker.update(scheduler_output, wanted)
        manager = self._kv_cache_manager or self._tracker
        if self._first:
            self._first.poll(scheduled, time.time_ns())
        for rid, rec in list(self._reqs.items()):
            if rec.prefill is None or rid not in scheduled:
                continue
            request = rec.request
            if request.num_computed_tokens + scheduled[rid] < request.num_prompt_tokens:
                continue  # a chunk of the prompt
            move = self._next(rid, rec, lc.PrefillScheduled(rid))
            if move.effect is Effect.STAGE_PREFILL:
                blocks = manager.get_block_ids(rid)
                now = time.time_ns()
                self._step.prefills.append(
                    StagedPrefill(
                        rec.prefill.transfer_id,
                        rid,
                        tuple(tuple(g) for g in blocks),
                        request.num_prompt_tokens,
                        rec.prefill,
                        arrival_ns=_wall_ns(getattr(request, "arrival_time", None)) or now,
                        scheduled_ns=rec.scheduled_ns or now,
                    )
                )
            self._enter(rid, rec, move)
        step, self._step = self._step, StepPlan()
        step.idle = not getattr(scheduler_output, "total_num_scheduled_tokens", 1)
        step.transfers_pending = any(r.state.transfer_pending for r in self._reqs.values())
        return step

    def request_finished(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        if is_probe(request.kv_transfer_params):
            return False, {"pushkv": self.coordinates()}
        if rid in self._first:
            self._first.out(rid, time.time_ns())
        rec = self._reqs.get(rid)
        if rec is None:
            return False, None
        out = None
        if rec.prefill is not None:
            coords, tid = self.coordinates(), rec.prefill.transfer_id
            out = {"pushkv": coords, "transfer_id": tid}
            if rec.foreign and coords is not None:
                out |= pairing.answer_params(coords, tid)
        stopped = rec.prefill is not None and rec.prefill.release_on_stop and _stopped(request)
        event = lc.PrefillStopped(rid) if stopped else lc.RequestFinished(rid)
        move = self._next(rid, rec, event)
        if move.effect is Effect.RECLAIM:  # stopped: no D leg follows, vLLM frees the blocks
            assert rec.prefill is not None
            self._step.stopped.append(rec.prefill.transfer_id)
        elif move.effect is Effect.STAGE_PREFILL_ABORT:  # aborted or failed before the prompt ran
            assert rec.prefill is not None
            self._step.aborts.append(
                StagedAbort(rec.prefill.transfer_id, rid, "prefill_aborted", None)
            )
        elif move.effect is Effect.STAGE_ABORT:
            # vLLM itself holds the blocks of a request aborted in WAITING_FOR_REMOTE_KVS
            # until finished_recving; make sure that report comes.
            assert rec.decode is not None
            self._step.aborts.append(
                StagedAbort(rec.decode.transfer_id, rid, "aborted", rec.decode)
            )
        self._enter(rid, rec, move)
        if rec.error:
            return False, {"pushkv_error": rec.error}
        # DELAY_FREE: a WRITE may be in flight, so vLLM keeps the blocks until finished_sending.
        return move.effect is Effect.DELAY_FREE, out

    # ------------------------------------------------------------------ results
    def update_connector_output(self, output: Any) -> None:
        if self._first:
            self._first.poll({}, time.time_ns())
        sending = output.finished_sending or set()
        for rid in list(sending):
            rec = self._reqs.get(rid)
            if rec is None:
                sending.discard(rid)
                logger.warning("Dropping finished_sending for unknown request %s", rid)
                continue
            move = self._next(rid, rec, lc.PushReported(rid))
            if move.effect is not Effect.FREE_BLOCKS:
                # Only finished requests may be freed: an early completion waits for
                # request_finished, which then frees the blocks itself.
                sending.discard(rid)
            self._enter(rid, rec, move)
        failed = self._failed_recving(output)
        for rid in output.finished_recving or ():
            rec = self._reqs.get(rid)
            if rec is None:
                continue
            if rid in failed and rec.state is not ReqState.LOAD_FAILED:
                # or failed: kv_load_failure_policy
                self.recomputed[Recomputed.TRANSFER_FAILED.value] += 1
            move = self._next(rid, rec, lc.RecvReported(rid))
            if move.effect is Effect.TIME_FIRST_TOKEN and self._intake.tracer is not None:
                self._first.watch(rid, rec, time.time_ns())
            self._enter(rid, rec, move)

    def _failed_recving(self, output: Any) -> set[str]:
        """The loads that failed this step: by request (0.32: ``failed_recving``), or by the
        first block each load writes (0.26: ``invalid_block_ids``)."""
        if not self._failures_as_blocks:
            return set(getattr(output, "failed_recving", None) or ())
        invalid = getattr(output, "invalid_block_ids", None) or set()
        return {
            rid
            for rid in output.finished_recving or ()
            if (rec := self._reqs.get(rid)) is not None and rec.load_block in invalid
        }

    def _note_load_block(self, rec: ReqRecord, blocks: Any) -> None:
        """D: remember, and tell the workers, the first block a load writes (vLLM 0.26
        takes a failed load only as block ids: this one makes it compute from there)."""
        if rec.load_block is None and blocks is not None:
            groups = blocks.get_unhashed_block_ids_all_groups()
            if groups and groups[0]:
                rec.load_block = int(groups[0][0])
        if rec.load_block is not None:
            self._step.load_blocks[rec.request.request_id] = rec.load_block

    # ------------------------------------------------------------------ our own failure
    def count_hook_error(self) -> None:
        """A hook of ours raised with no request to let go of (plugin.py's guard)."""
        self.counters.add(Count.HOOK_ERRORS)

    def hook_failed(
        self, hook: str, request: Any, num_external_tokens: int = 0, blocks: Any = None
    ) -> None:
        """A hook of ours raised for ``request`` (plugin.py's guard): let go of the request
        definitely, so nothing waits on it. P: D is told now and a push that may read the
        blocks is reclaimed. D: if vLLM now waits for a load (``update_state_after_alloc``
        with tokens to load), the load is reported failed, so vLLM applies
        kv_load_failure_policy; otherwise P frees its blocks and D computes the prompt."""
        rid = request.request_id
        self.count_hook_error()
        rec = self._reqs.get(rid)
        if rec is None and hook == "on_new_request":
            rec = self._adopt(request)
        if rec is None:
            return  # released already, or no pushkv leg we can read: nothing waits on us
        waiting = hook == "update_state_after_alloc" and num_external_tokens > 0
        if waiting:
            try:
                self._note_load_block(rec, blocks)
            except Exception:  # the blocks may be what failed: report the load all the same
                logger.exception("pushkv: no first block for request %s's failed load", rid)
        event: lc.ReqEvent = lc.LoadHookFailed(rid) if waiting else lc.HookFailed(rid)
        leg, pleg = rec.decode, rec.prefill
        if waiting and leg is not None and rec.state is ReqState.AWAITING_ALLOC:
            # Staged in this step but not sent yet: it never will be, so no WRITE can come.
            self._step.registrations = [
                r for r in self._step.registrations if r.transfer_id != leg.transfer_id
            ]
        move = self._next(rid, rec, event)
        tid = leg.transfer_id if leg is not None else pleg.transfer_id if pleg else None
        if move.effect is Effect.STAGE_PREFILL_ABORT and pleg is not None:
            self._stage_abort(StagedAbort(pleg.transfer_id, rid, "prefill_aborted", None))
        elif move.effect is Effect.RECLAIM and pleg is not None:
            self._step.reclaimed.append(pleg.transfer_id)
        elif move.effect is Effect.STAGE_NOT_NEEDED and leg is not None:
            self._stage_abort(StagedAbort(leg.transfer_id, rid, "not_needed", leg))
            rec.error = f"pushkv: {hook} failed; the prompt was computed here"
        elif move.effect is Effect.STAGE_ABORT and leg is not None:
            self._stage_abort(StagedAbort(leg.transfer_id, rid, "aborted", leg))
        elif move.effect is Effect.STAGE_LOAD_FAILED and leg is not None:
            self._stage_abort(StagedAbort(leg.transfer_id, rid, "not_needed", leg))
            self._step.failed_loads.append(rid)
        elif move.effect is Effect.FAIL_LOAD and rid not in self._step.failed_loads:
            self._step.failed_loads.append(rid)  # a refused leg: P is not told
        self.counters.add(Count.HOOK_EFFECT, move.effect.value)
        self._enter(rid, rec, move)
        trace = leg.trace() if leg is not None else pleg.trace() if pleg else None
        emit_hook_failed(
            self._fault_tracer,
            trace,
            hook=hook,
            transfer_id=tid,
            request_id=rid,
            engine_id=self.engine_id,
            at_ns=time.time_ns(),
        )

    def _stage_abort(self, abort: StagedAbort) -> None:
        """Stage ``abort`` unless the hook that raised had staged it already."""
        if not any(a.transfer_id == abort.transfer_id for a in self._step.aborts):
            self._step.aborts.append(abort)

    def keeps_blocks(self, request: Any) -> bool:
        """request_finished's answer when it raised: keep the blocks exactly while a push
        handed over may still read them (it reports, and frees them, later)."""
        rec = self._reqs.get(request.request_id)
        return rec is not None and rec.state is ReqState.HANDED_OVER

    def _adopt(self, request: Any) -> ReqRecord | None:
        """A record for a request whose ``on_new_request`` raised, if its leg parses."""
        try:
            rec = self._intake.record(request, report=False)  # an untrusted leg stays undialed
        except (KvParamsError, pairing.ForeignLegError):
            return None
        if rec is not None:
            self._reqs[request.request_id] = rec
        return rec

    # ------------------------------------------------------------------ the lifecycle table
    def _next(self, rid: str, rec: ReqRecord, event: lc.ReqEvent) -> lc.Transition:
        """The table's transition for ``event``. One out of turn is our bug: logged, and the
        request keeps its state, since a hook must not raise into vLLM's step."""
        try:
            return lc.advance(rec.state, event)
        except LocalProtocolError as exc:
            logger.error("Request %s: %s; ignored", rid, exc)
            return lc.IGNORE

    def _enter(self, rid: str, rec: ReqRecord, move: lc.Transition) -> None:
        """Apply a transition once its effect is carried out (so a failing vLLM call leaves
        the request where it was)."""
        if move.to is ReqState.RELEASED:
            del self._reqs[rid]
        elif move.to is not None:
            rec.state = move.to

    def has_pending_push_work(self) -> bool:
        return not self._step.empty() or any(r.state.push_pending for r in self._reqs.values())


def _stopped(request: Any) -> bool:
    """vLLM's RequestStatus.FINISHED_STOPPED: EOS or a stop token ended the request."""
    return getattr(getattr(request, "status", None), "name", None) == "FINISHED_STOPPED"


def _wall_ns(seconds: float | None) -> int:
    """vLLM's ``Request.arrival_time`` (time.time() seconds) as nanoseconds; 0 if unknown."""
    return int(seconds * 1e9) if seconds else 0

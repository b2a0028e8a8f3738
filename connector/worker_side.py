"""The connector's worker role: the vLLM adapter that runs in each TP worker.

Owns: describing vLLM's KV cache tensors as a ``KVLayout``, creating this rank's
transport agent and transfer thread, turning each step's ``StepPlan`` into events for
the thread, and reporting the thread's outcomes back to vLLM. Touches vLLM objects and
torch, never NIXL directly (that is transport/nixl.py), never the core's state.

Nothing here runs a transfer on the engine's loop: every hook only queues work for the
transfer thread or takes its results.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

from connector.config import PushkvConfig, load_secret
from connector.core import events as ev
from connector.core.errors import ConfigError, LayoutError
from connector.core.geometry import KVGeometry, kv_geometry
from connector.core.heads import head_range
from connector.core.layout import KVLayout
from connector.core.messages import FailReason, PeerAddr
from connector.core.stages import PipelineStage, source_rank, source_ranks
from connector.engine_spans import engine_tracer
from connector.kv_params import agent_name
from connector.kv_tensors import (
    block_row_views,
    check_stage_layers,
    describe_kv_caches,
    physical_order,
)
from connector.metadata import Handshake, StagedAbort, StepPlan
from connector.transfer.doorbell import Doorbell
from connector.transfer.guard import Guard
from connector.transfer.metrics import RankMetrics, Tee
from connector.transfer.peers import Peers
from connector.transfer.polling import Backoff
from connector.transfer.receiver import Receiver
from connector.transfer.sender import Sender
from connector.transfer.spans import (
    NO_SPANS,
    PrefillNote,
    RegisterNote,
    TransferSpans,
    geometry_attributes,
)
from connector.transfer.thread import TransferThread
from connector.transfer.topology import RankInfo, Topology
from connector.transport.ports import free_port
from telemetry.schema import Attr

logger = logging.getLogger(__name__)


class WorkerSide:
    def __init__(
        self,
        cfg: PushkvConfig,
        engine_id: str,
        is_producer: bool,
        is_consumer: bool,
        tp_rank: int,
        tp_size: int,
        num_kv_heads: int,
        logical_block_size: int,
        group_of: dict[str, int],
        cache_dtype: str = "auto",
        latent: bool = False,
        stage: PipelineStage | None = None,
    ) -> None:
        """``latent``: the model's KV is MLA's latent (``model_support.is_latent_kv``).
        ``stage``: P's pipeline stage of this worker (``vllm_compat.pipeline_stage``)."""
        self.cfg, self.engine_id = cfg, engine_id
        self.is_producer, self.is_consumer = is_producer, is_consumer
        self.tp_rank, self.tp_size, self.num_kv_heads = tp_rank, tp_size, num_kv_heads
        self.stage = stage = stage or PipelineStage()
        # Among the engine's workers (ports, agent names, completions): the TP rank at PP 1.
        self.rank = source_rank(stage.stage, tp_rank, tp_size)
        self._logical_block_size = logical_block_size
        self._group_of = group_of
        self._cache_dtype = cache_dtype  # vLLM's --kv-cache-dtype
        self._latent = latent
        self._ratio = 1
        self.thread: TransferThread | None = None
        self._transport: Any = None
        self._handshake: Handshake | None = None
        self._plan: StepPlan | None = None
        self._metrics = RankMetrics(self.rank) if cfg.metrics else None
        self._failed_loads: set[str] = set()  # reported failed with the next results
        # D: the first block each load writes, by request (vLLM 0.26 reports failed loads
        # as block ids: failed_blocks).
        self._load_blocks: dict[str, int] = {}
        self._failed_blocks: set[int] = set()
        self._closing = False  # the engine is shutting down: the thread was told

    # ------------------------------------------------------------------ start-up
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        from connector.transport.nixl import NixlTransport

        heads = head_range(self.tp_rank, self.tp_size, self.num_kv_heads)
        first = 0
        if self.stage.size > 1:
            check_stage_layers(kv_caches, self.stage.first_layer, self.stage.end_layer)
            first = self.stage.first_layer
        layout = describe_kv_caches(
            kv_caches, self._group_of, heads, cache_dtype=self._cache_dtype, first_layer=first
        )
        if self._logical_block_size % layout.block_size:
            raise LayoutError(
                f"scheduler block size {self._logical_block_size} is not a multiple "
                f"of the kernel block size {layout.block_size}"
            )
        self._ratio = self._logical_block_size // layout.block_size
        host = self.cfg.side_channel_host
        port = (
            self.cfg.side_channel_port + self.rank
            if self.cfg.side_channel_port
            else free_port(host)
        )
        name = agent_name(self.engine_id, self.rank, uuid.uuid4().hex[:8])
        secret = load_secret(self.cfg)
        guard = Guard(secret, self.cfg.auth_window_s)
        self._transport = NixlTransport(
            name,
            listen_host=host,
            listen_port=port,
            secret=secret,
            auth_window_s=self.cfg.auth_window_s,
        )
        freed = None
        if self.cfg.faults is not None:  # test-only fault injection
            self._transport, freed = self._with_faults(layout)
        self._transport.register_memory(layout.memory_extents(), layout.mem_type, layout.device_id)
        bell = (
            Doorbell.open(host, self._transport.listen_address[1], guard)
            if self.cfg.doorbells
            else None
        )
        peers = Peers(self._transport, int(self.cfg.dial_timeout_s * 1e9), bell=bell)
        me = RankInfo(
            self.engine_id,
            self.tp_rank,
            self.tp_size,
            PeerAddr(agent=name, host=host, port=port),
            pp_stage=self.stage.stage,
            pp_size=self.stage.size,
        )
        listeners = [x for x in (self._metrics, freed) if x is not None]
        traced = self._spans(geometry_attributes(self.geometry(layout)))
        spans = Tee(traced, *listeners) if listeners else traced
        paths, offer = self._gpu_paths(kv_caches, layout, me)
        sender = receiver = None
        if self.is_producer:
            sender = Sender(
                self._transport,
                me,
                layout,
                Topology(self.num_kv_heads, self.tp_size),
                peers,
                self.cfg.sender_policy(),
                spans=spans,
                paths=paths,
                guard=guard,
                checksum_every=self.cfg.kv_checksum_every,
                model_layers=self.stage.model_layers,
            )
        if self.is_consumer:
            receiver = Receiver(
                me,
                layout,
                peers,
                self.cfg.receiver_policy(),
                spans=spans,
                offer=offer,
                guard=guard,
                verify_checksums=self.cfg.kv_checksum_every > 0,
            )
        self.thread = TransferThread(
            self._transport,
            peers,
            sender=sender,
            receiver=receiver,
            name=f"pushkv-{name}",
            bell=bell,
            backoff=Backoff.from_config(self.cfg, doorbell=bell is not None),
            guard=guard,
            metrics=self._metrics,
        )
        self.thread.start()
        self._handshake = Handshake(name, host, port)
        logger.info(
            "pushkv worker %s: %d regions%s, %d blocks of %d tokens, KV %s %s in %s (heads "
            "[%d, %d) of %d B per token), listening on %s:%d, "
            + ("P/D plane authenticated" if secret else "P/D plane UNAUTHENTICATED"),
            name,
            len(layout.regions),
            (
                f" (pipeline stage {self.stage.stage} of {self.stage.size}: layers "
                f"[{self.stage.first_layer}, {self.stage.end_layer}) of {self.stage.model_layers})"
                if self.stage.size > 1
                else ""
            ),
            layout.num_blocks,
            layout.block_size,
            layout.dtype,
            physical_order(kv_caches),
            layout.mem_type,
            *layout.heads,
            layout.token_bytes,
            host,
            port,
        )

    def _gpu_paths(self, kv_caches: dict[str, Any], layout: Any, me: RankInfo) -> tuple[Any, Any]:
        """GPU: P's path driver and D's IPC offer (connector/transfer/gpu/paths.py); neither
        on CPU, where every transfer goes direct."""
        if layout.mem_type != "VRAM":
            return None, None
        if self.stage.size > 1:
            # The IPC and staged paths copy whole block rows of every layer; a stage writes
            # only its layers: direct (NIXL) is the path it has.
            logger.info("pushkv: pipeline stage %d writes direct", self.stage.stage)
            return None, None
        from connector.transfer.gpu.paths import paths_for

        try:
            views = block_row_views(kv_caches)
        except LayoutError as exc:
            logger.warning("KV blocks are not contiguous rows (%s): transfers go direct", exc)
            return None, None
        return paths_for(
            self._transport,
            layout,
            views,
            me.addr,
            me.rank,
            producer=self.is_producer,
            consumer=self.is_consumer,
            mode=self.cfg.xfer_paths,
        )

    def _with_faults(self, layout: Any) -> tuple[Any, Any]:
        """Test-only: the transport wrapped by ``pushkv_testing.faults`` (not in the wheel;
        a source checkout on ``PYTHONPATH``), and D's freed-block check or None."""
        try:
            from pushkv_testing.faults import wrap_transport
        except ImportError as exc:
            raise ConfigError(
                "_faults is test-only: it needs pushkv_testing/ from a source checkout "
                "on PYTHONPATH"
            ) from exc
        return wrap_transport(
            self._transport,
            self.cfg,
            layout,
            engine_id=self.engine_id,
            consumer=self.is_consumer,
        )

    def geometry(self, layout: KVLayout) -> KVGeometry:
        """This rank's KV geometry, as P's transfer spans name it."""
        return kv_geometry(layout, self._latent)

    def _spans(self, kv: dict[Attr, Any]) -> Any:
        tracer = engine_tracer(
            self.engine_id, producer=self.is_producer, host=self.cfg.side_channel_host
        )
        if tracer is None:
            return NO_SPANS
        stage = self.stage.stage if self.stage.size > 1 else None
        return TransferSpans(tracer, self.engine_id, self.tp_rank, kv=kv, pp_stage=stage)

    def handshake(self) -> Handshake | None:
        return self._handshake

    # ------------------------------------------------------------------ per step
    def _blocks(self, table: ev.BlockTable) -> ev.BlockTable:
        """Scheduler (logical) block ids -> kernel block ids of the tensors."""
        r = self._ratio
        if r == 1:
            return table
        return tuple(tuple(b * r + i for b in group for i in range(r)) for group in table)

    def _sources(self, leg: Any) -> tuple[ev.Source, ...]:
        """One per P TP rank that writes our heads, in each of P's pipeline stages."""
        topo = Topology(self.num_kv_heads, leg.remote_tp_size)
        ranks = source_ranks(
            topo.sources(self.tp_rank, self.tp_size), leg.remote_tp_size, leg.p_stages
        )
        return tuple(
            ev.Source(r, PeerAddr(agent=leg.agent_of(r), host=leg.remote_host, port=leg.port_of(r)))
            for r in ranks
        )

    def before_forward(self, plan: StepPlan) -> None:
        """vLLM's handle_preemptions: runs before this step's forward may reuse blocks."""
        if self.thread is None:
            return
        for ids, reason in (
            (plan.reclaimed, FailReason.PREFILL_ABORTED),
            (plan.stopped, FailReason.NOT_NEEDED),
        ):
            if ids and not self.thread.reclaim(ids, self.cfg.write_timeout_s, reason):
                logger.error(
                    "WRITEs of reclaimed transfers %s still running after %.0fs; "
                    "this forward may overwrite blocks they read",
                    ids,
                    self.cfg.write_timeout_s,
                )

    def bind(self, plan: StepPlan) -> None:
        """Before the forward: registrations and aborts go out at once."""
        self._plan = plan
        self._failed_loads.update(plan.failed_loads)
        self._load_blocks.update(plan.load_blocks)
        thread = self.thread
        if thread is None:
            return
        if plan.shutdown_grace_s is not None and not self._closing:
            self._closing = True
            thread.begin_shutdown(plan.shutdown_grace_s)
        for reg in plan.registrations:
            trace = reg.leg.trace()
            thread.submit(
                ev.Expected(
                    reg.transfer_id,
                    reg.request_id,
                    self._sources(reg.leg),
                    self._blocks(reg.block_ids),
                    reg.first_token,
                    reg.num_tokens,
                    trace,
                    reg.leg.p_stages,
                ),
                note=RegisterNote(trace, reg.alloc_ns),
            )
        for ab in plan.aborts:
            thread.submit(self._abort_event(ab))

    def _abort_event(self, ab: StagedAbort) -> Any:
        if ab.kind == "prefill_aborted":
            return ev.PrefillAborted(ab.transfer_id, ab.request_id)
        if ab.kind == "not_needed":
            assert ab.leg is not None
            return ev.NotNeeded(ab.transfer_id, self._sources(ab.leg))
        return ev.AbortRequested(ab.transfer_id)

    def after_forward(self) -> None:
        """After the forward: the prompts this step completed are ready to push."""
        plan, thread = self._plan, self.thread
        if plan is None or thread is None or not plan.prefills:
            return
        ready = _step_done_check()
        done_ns = time.time_ns()
        for p in plan.prefills:
            note = PrefillNote(p.leg.trace(), p.arrival_ns, p.scheduled_ns, done_ns, p.num_tokens)
            thread.submit(
                ev.PrefillDone(
                    p.transfer_id, p.request_id, self._blocks(p.block_ids), p.num_tokens
                ),
                ready=ready,
                note=note,
            )

    def clear(self) -> None:
        self._plan = None

    def take_results(self) -> tuple[set[str], set[str], set[str]]:
        failed_now, self._failed_loads = self._failed_loads, set()
        if self.thread is None:
            return self._results(set(), failed_now, set(failed_now))
        plan, wait_s = self._plan, self.cfg.idle_step_wait_s
        if (
            plan is not None
            and plan.idle
            and wait_s > 0
            and (self.thread.transfers_pending or plan.transfers_pending)
        ):
            # Nothing to compute this step: wait (briefly) for the transfer instead of
            # letting vLLM spin the next empty step at once. A rank with no transfer of its
            # own (MLA: P ranks past 0) waits too: returning at once, it would spin in vLLM's
            # message queue for the next step, a whole core, while the others wait.
            self.thread.wait_for_results(wait_s)  # counted by the thread
        sent = set(self.thread.take_finished_sending())
        received = self.thread.take_finished_recving()
        return self._results(
            sent,
            {r.request_id for r in received} | failed_now,
            {r.request_id for r in received if not r.ok} | failed_now,
        )

    def _results(
        self, sent: set[str], received: set[str], failed: set[str]
    ) -> tuple[set[str], set[str], set[str]]:
        """Forget the first blocks of the loads that ended; keep the failed ones' for
        ``failed_blocks``."""
        blocks = {r: self._load_blocks.pop(r) for r in received if r in self._load_blocks}
        self._failed_blocks = {b for r, b in blocks.items() if r in failed}
        return sent, received, failed

    def failed_blocks(self) -> set[int]:
        """vLLM 0.26: the loads the last ``take_results`` reported failed, as the block ids
        vLLM takes (each load's first block). vLLM 0.32 names requests (failed_recving)."""
        return self._failed_blocks

    def stats(self) -> dict[str, Any] | None:
        """This rank's metrics since the last call (``connector.transfer.metrics``)."""
        if self._metrics is None or self.thread is None:
            return None
        return self._metrics.drain()

    def shutdown(self) -> None:
        if self.thread is not None:
            # Finish WRITEs in flight and tell every peer about what will not happen, before
            # the transport goes (connector.transfer.thread.TransferThread.drain).
            if not self.thread.drain(self.cfg.shutdown_drain_s):
                logger.warning(
                    "pushkv worker rank %d: transfers still in flight after %.1f s at shutdown",
                    self.rank,
                    self.cfg.shutdown_drain_s,
                )
            self.thread.stop()  # first: it merges its components' counters, transport's too
            logger.info("pushkv worker rank %d counters: %s", self.rank, dict(self.thread.counters))
        if self._transport is not None:
            self._transport.close()
        self.thread = self._transport = None


def _step_done_check() -> Any:
    """On GPU the forward was only launched: the WRITE must wait for the KV. Record an event
    on the current stream; the transfer thread polls it. On CPU the forward is done."""
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    event = torch.cuda.Event()
    event.record()
    return event.query

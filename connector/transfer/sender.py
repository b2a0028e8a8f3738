"""P's side of the push protocol, run on the transfer thread.

Owns: turning the rendezvous table's actions into transport work (WRITE posts,
notifications) and transport outcomes back into table events, moving each transfer's
record (``connector.transfer.send_records``) as its WRITE goes: the table decides when a
WRITE starts and ends; the record holds how far its transport work has got. Planning is
``write_plan``'s, the notices' frames ``notices``'. Touches the transport only through the
Transport protocol; never vLLM. One thread calls it.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any

from connector.core import events as ev
from connector.core import messages as m
from connector.core.errors import (
    LayoutError,
    LocalProtocolError,
    PeerDisconnected,
    TransportError,
)
from connector.core.heads import HeadRange
from connector.core.layout import KVLayout
from connector.core.sender_table import SenderTable
from connector.core.stages import layer_span
from connector.core.state import SenderPolicy
from connector.transfer.doorbell import DONE, WRITE, write_key
from connector.transfer.guard import Guard
from connector.transfer.notices import Notices
from connector.transfer.paths import Paths, PathWrite
from connector.transfer.peers import Peers
from connector.transfer.send_records import Phase, ReadyCheck, Transfers, Write, WriteReport
from connector.transfer.spans import NO_SPANS, PrefillNote
from connector.transfer.topology import RankInfo, Topology
from connector.transfer.write_plan import (
    LayoutCheck,
    TargetPlan,
    account,
    new_report,
    plan_writes,
)
from connector.transport.base import Transport, WriteHandle
from telemetry.counts import Counts
from telemetry.schema import Count

logger = logging.getLogger(__name__)


class Sender:
    """Matches registrations with finished prefills and pushes the KV to D."""

    def __init__(
        self,
        transport: Transport,
        me: RankInfo,
        layout: KVLayout,
        topology: Topology,
        peers: Peers,
        policy: SenderPolicy = SenderPolicy(),
        on_write_finished: Callable[[WriteReport], None] | None = None,
        spans: Any = NO_SPANS,
        paths: Paths | None = None,
        guard: Guard | None = None,
        checksum_every: int = 0,
        model_layers: int = 0,
    ) -> None:
        """``paths``: the path driver (GPU); None sends every transfer direct.
        ``checksum_every``: send a digest of the KV with one transfer in this many (0: none;
        ``connector.transfer.integrity``). ``model_layers``: with pipeline stages on P
        (``me.pp_size`` > 1), the model's layers, every stage's (``layout`` holds this
        stage's, numbered as the model numbers them)."""
        layout.validate()
        if me.pp_size > 1:
            layer_span(layout)  # a stage holds one contiguous run of the model's layers
            if model_layers < 1:
                raise LayoutError("a P pipeline stage needs the model's layer count")
        self._model_layers = model_layers
        self.counters: Counts = Counts()
        codec = guard if guard is not None else Guard()  # seals when a secret is set
        self.notices = Notices(me, codec, self.counters, checksum_every)
        self._t, self.me, self.layout, self.topology, self.peers = (
            transport,
            me,
            layout,
            topology,
            peers,
        )
        self.table = SenderTable(
            lambda d_tp: topology.targets(me.rank, d_tp),
            policy,
            writes=topology.writes_any(me.rank),
        )
        self._transfers = Transfers()
        self._check_layout = LayoutCheck()
        self._on_write_finished = on_write_finished
        self.spans = spans  # connector.transfer.spans.TransferSpans, or NO_SPANS
        self.paths = paths
        self.finished: list[str] = []  # request ids whose blocks go back (finished_sending)

    # ------------------------------------------------------------------ inputs
    def on_event(
        self,
        event: ev.SendEvent,
        now_ns: int,
        ready: ReadyCheck | None = None,
        note: PrefillNote | None = None,
    ) -> None:
        if isinstance(event, ev.SourceReclaimed):
            tid = event.transfer_id
            rec = self._transfers.get(tid)
            if rec is not None and rec.phase is Phase.DEFERRED:
                # Not posted yet (the compute step had not finished): it never will be.
                self._transfers.end(tid, rec)
                event = ev.WriteFailed(tid, m.FailReason.PREFILL_ABORTED, "preempted")
        if isinstance(event, ev.PrefillDone):
            if ready is not None:
                self._transfers.record(event.transfer_id).ready = ready
            self.spans.prefill_submitted(event, note, deferred=ready is not None)
        self._run(self.table.handle(event, now_ns), now_ns)

    def on_message(
        self, agent: str, msg: m.Message, now_ns: int, since_ns: int | None = None
    ) -> None:
        """``since_ns``: the earliest ``msg`` can have arrived (``ev.Registered``)."""
        if (
            isinstance(msg, (m.Register, m.Cancel, m.Heartbeat, m.IpcOffer))
            and msg.d_addr.agent != agent
        ):
            self.counters.add(Count.SENDER_MISMATCH)
            logger.warning(
                "Dropped %s for %s: sent by %s, claims %s",
                type(msg).__name__,
                msg.transfer_id,
                agent,
                getattr(msg, "d_addr", None),
            )
            return
        if isinstance(msg, m.Register):
            # Fetch D's metadata and check its layout now, while P may still be computing:
            # off the critical path (validation is costly for many regions, docs/benchmarks.md).
            self.peers.when_ready(msg.d_addr, now_ns, _noop, _noop_fail)
            try:
                self._check_layout(self.layout, msg.layout)
            except LayoutError:
                pass  # the transfer fails with LAYOUT_MISMATCH when it is posted
            self.spans.registration(msg.transfer_id, msg.trace, time.time_ns())
            self._run(self.table.handle(ev.Registered(msg, since_ns), now_ns), now_ns)
        elif isinstance(msg, m.Cancel):
            self._run(
                self.table.handle(
                    ev.Cancelled(msg.transfer_id, msg.d_rank, msg.d_addr, msg.reason), now_ns
                ),
                now_ns,
            )
        elif isinstance(msg, m.Heartbeat):
            self.counters.add(Count.HEARTBEATS)
            for tid in msg.transfer_ids():
                self._run(self.table.handle(ev.HeartbeatSeen(tid, msg.d_addr), now_ns), now_ns)
        elif isinstance(msg, m.IpcOffer):
            if self.paths is None:
                self.counters.add(Count.IPC_OFFERS_IGNORED)
            else:
                self.paths.offered(agent, msg)
        else:
            self.counters.add(Count.UNEXPECTED, type(msg).__name__)

    def poll(self, now_ns: int) -> None:
        # GPU: note when the step's event fires (the end of P's prefill span), even while
        # no registration has come yet.
        for tid in self._transfers.newly_ready():
            self.spans.prefill_ready(tid, time.time_ns())
        for rec in self._transfers.due():
            if rec.issue is not None:  # still deferred: posting another may have ended it
                issue, rec.issue = rec.issue, None
                self._post(issue, now_ns)
        for tid in self._transfers.in_phase(Phase.WRITING):
            self._poll_write(tid, now_ns)
        if self.paths is not None:
            self.paths.poll(now_ns)
        nxt = self.table.next_deadline_ns()
        if nxt is not None and nxt <= now_ns:
            self._run(self.table.tick(now_ns), now_ns)

    def shut_down(self, now_ns: int) -> None:
        """Shutting down: transfers not writing yet end now (blocks back, D told
        ``shutdown``); WRITEs already posted or waiting for their KV run to their end."""
        self._run(self.table.shut_down(now_ns), now_ns)

    def quiescent(self, transfer_ids: list[str]) -> bool:
        """No WRITE of these transfers is posted, waiting to be posted, or in flight."""
        return self._transfers.quiescent(transfer_ids)

    def writing(self) -> bool:
        """A WRITE is in flight or waits for its KV (GPU): only our polling moves it on."""
        return self._transfers.active > 0

    def writes_in_flight(self) -> int:
        """Transfers with a WRITE posted or waiting for its KV (metrics)."""
        return self._transfers.active

    def awaiting_network(self) -> bool:
        """Blocks held for a registration (or a peer's answer) that has not come yet."""
        return self.table.awaiting_network()

    # ------------------------------------------------------------------ actions
    def _run(self, actions: list[ev.SendAction], now_ns: int) -> None:
        for a in actions:
            if isinstance(a, ev.IssueWrite):
                rec = self._transfers.get(a.transfer_id)
                if rec is not None and rec.ready is not None and not rec.ready():
                    rec.issue = a  # GPU: the step's event has not fired
                    self._transfers.move(a.transfer_id, rec, Phase.DEFERRED)
                else:
                    self._post(a, now_ns)
            elif isinstance(a, ev.FreeBlocks):
                self._transfers.release(a.transfer_id)
                sent = self.table.get(a.transfer_id)
                self.spans.released(a.transfer_id, sent.reason if sent is not None else None)
                self.finished.append(a.request_id)
            elif isinstance(a, ev.AbortWrite):
                self._abort(a.transfer_id, now_ns)
            elif isinstance(a, ev.SendFail):
                self.counters.add(Count.FAIL_SENT, a.reason.value)
                frame = self.notices.fail(a.transfer_id, a.reason)
                for addr in a.to:
                    self.peers.send(addr, frame, now_ns, self._count_send_failure)
            elif isinstance(a, ev.ResendCompletion):
                self.counters.add(Count.COMPLETION_RESENT)
                frame = self.notices.completion(a.transfer_id, 0, 0)
                for addr in a.to:
                    self.peers.send(addr, frame, now_ns, self._count_send_failure)
            else:
                raise TypeError(f"unknown sender action {a!r}")

    def _count_send_failure(self, exc: TransportError) -> None:
        self.counters.add(Count.SEND_FAILED)
        logger.warning("Sending a notification from %s failed: %s", self.me.addr.agent, exc)

    def _post(self, a: ev.IssueWrite, now_ns: int) -> None:
        report = new_report(a, self.layout)
        try:
            plans = plan_writes(
                a,
                self.layout,
                self._check_layout,
                self._heads,
                self.paths,
                self.me.pp_size,
                self._model_layers,
            )
        except LayoutError as exc:
            logger.warning("Transfer %s cannot be mapped: %s", a.transfer_id, exc)
            if (rec := self._transfers.get(a.transfer_id)) is not None:
                self._transfers.end(a.transfer_id, rec)
            self._run(
                self.table.handle(
                    ev.WriteFailed(a.transfer_id, m.FailReason.LAYOUT_MISMATCH, str(exc)), now_ns
                ),
                now_ns,
            )
            return
        report.prepared_ns = time.time_ns()
        account(report, plans)
        w = Write(report, unposted=len(plans))
        rec = self._transfers.record(a.transfer_id)
        rec.write = w
        self._transfers.move(a.transfer_id, rec, Phase.WRITING)
        for p in plans:
            self.peers.when_ready(
                p.reg.d_addr,
                now_ns,
                functools.partial(self._post_one, w, p, a.block_ids),
                lambda exc: self._unposted_failed(w, _unreached(exc), exc),
            )
        self._poll_write(a.transfer_id, now_ns)

    def _heads(self, reg: m.Register) -> HeadRange:
        return self.topology.heads(self.me.rank, reg.d_rank, reg.d_tp_size)

    def _post_one(self, w: Write, plan: TargetPlan, src_blocks: ev.BlockTable) -> None:
        w.unposted -= 1
        if w.aborting:
            return
        reg, pieces, choice, heads = plan.reg, plan.pieces, plan.choice, plan.heads
        if pieces is None:  # another path than direct: no descriptors were planned
            assert self.paths is not None and choice is not None
            digest = self.notices.path_digest(
                w.report.transfer_id, self.layout, reg, src_blocks, heads
            )
            notif = self.notices.completion(w.report.transfer_id, choice.bytes_total, 0, digest)
            try:
                w.report.posted_ns = w.report.posted_ns or time.time_ns()
                w.others.append(self.paths.start(choice, reg, src_blocks, heads, notif))
            except Exception as exc:  # a device error (CUDA, Triton) too: fail now, not at
                # the WRITE deadline
                self._note_failure(w, m.FailReason.POST_ERROR, TransportError(str(exc)))
            return
        tid = w.report.transfer_id
        digest = self.notices.digest(tid, self.layout, pieces, heads, reg.layout.mem_type)
        notif = self.notices.completion(tid, pieces.bytes_total, pieces.count, digest)
        try:
            if pieces.count == 0:  # D already holds every token: nothing to move, say so
                self._t.send_notif(reg.d_addr.agent, notif)
                self.peers.ring(reg.d_addr.agent)
                return
            src, dst = pieces.as_descs(self.layout.device_id, reg.layout.device_id)
            handle = self._t.write(
                reg.d_addr.agent,
                src,
                dst,
                notif,
                src_mem=self.layout.mem_type,
                dst_mem=reg.layout.mem_type,
            )
        except TransportError as exc:
            self._lost(reg.d_addr.agent, exc)
            self._note_failure(w, m.FailReason.POST_ERROR, exc)
            return
        w.report.posted_ns = w.report.posted_ns or handle.posted_ns
        w.handles.append(handle)
        # D polls (steadily, connector.transfer.polling) until this WRITE's completion is in: over
        # TCP it needs D's UCX progress.
        self.peers.ring(
            reg.d_addr.agent, WRITE + write_key(self.me.source_rank, w.report.transfer_id)
        )

    def _unposted_failed(self, w: Write, reason: m.FailReason, exc: TransportError) -> None:
        w.unposted -= 1
        self._note_failure(w, reason, exc)

    def _note_failure(self, w: Write, reason: m.FailReason, exc: Exception) -> None:
        self.counters.add(Count.WRITE_FAILED, reason.value)
        if w.failure is None:
            w.failure, w.detail = reason, str(exc)
            logger.warning(
                "WRITE of transfer %s failed (%s): %s", w.report.transfer_id, reason.value, exc
            )

    def _poll_write(self, tid: str, now_ns: int) -> None:
        rec = self._transfers.get(tid)
        if rec is None or rec.write is None:
            return
        w = rec.write
        live = []
        for h in w.handles:
            try:
                if not self._t.poll_write(h):
                    live.append(h)
                    continue
                # DONE: NIXL has just sent the completion; D polls slowly until it comes.
                self.peers.ring(h.peer, DONE + write_key(self.me.source_rank, w.report.transfer_id))
            except TransportError as exc:
                self._lost(h.peer, exc)
                reason = (
                    m.FailReason.PEER_LOST
                    if isinstance(exc, PeerDisconnected)
                    else m.FailReason.WRITE_ERROR
                )
                self._note_failure(w, reason, exc)
            except LocalProtocolError as exc:
                # A handle in a state it should never reach (a bug): this WRITE fails, and the
                # loop, with every other transfer, goes on (it raised at each poll once).
                logger.error("WRITE %s to %s: %s", w.report.transfer_id, h.peer, exc)
                self._note_failure(w, m.FailReason.WRITE_ERROR, exc)
            self._release(h)
        w.handles = live
        w.others = [pw for pw in w.others if not self._pump(w, pw)]
        if live or w.others or w.unposted:
            return
        self._transfers.end(tid, rec)
        w.report.done_ns = time.time_ns()
        w.report.ok, w.report.reason = w.failure is None, w.failure
        self.counters.add(Count.PATH, w.report.path)
        if self._on_write_finished is not None:
            self._on_write_finished(w.report)
        self.spans.write_finished(w.report)
        event = ev.WriteDone(tid) if w.failure is None else ev.WriteFailed(tid, w.failure, w.detail)
        self._run(self.table.handle(event, now_ns), now_ns)

    def _lost(self, agent: str, exc: TransportError) -> None:
        self.peers.lost(agent, exc)
        if self.paths is not None and isinstance(exc, PeerDisconnected):
            self.paths.forget(agent)  # it may come back under the same name, remapped

    def _pump(self, w: Write, pw: PathWrite) -> bool:
        """Move a non-direct write on; True once it has ended (well or not)."""
        try:
            if not pw.pump():
                return False
        except TransportError as exc:
            self._lost(pw.peer, exc)
            self._note_failure(w, m.FailReason.WRITE_ERROR, exc)
            return True
        except Exception as exc:  # a device error on the copy's event: fail it now
            self._note_failure(w, m.FailReason.WRITE_ERROR, TransportError(str(exc)))
            return True
        w.report.stage_ms.update(pw.stage_ms())
        if not w.aborting:
            self.peers.ring(pw.peer)  # its completion went out as a message
        return True

    def _release(self, h: WriteHandle) -> None:
        try:
            self._t.release(h)
        except TransportError as exc:
            logger.warning("Releasing a WRITE to %s failed: %s", h.peer, exc)

    def _abort(self, tid: str, now_ns: int) -> None:
        rec = self._transfers.get(tid)
        if rec is None:
            return
        if rec.phase is Phase.DEFERRED:
            # Never posted (its KV was not computed yet): it must not start past its deadline.
            self._transfers.end(tid, rec)
            self.counters.add(Count.WRITE_FAILED, m.FailReason.WRITE_TIMEOUT.value)
            event = ev.WriteFailed(tid, m.FailReason.WRITE_TIMEOUT, "KV not ready in time")
            self._run(self.table.handle(event, now_ns), now_ns)
            return
        w = rec.write
        if w is None:
            return
        w.aborting = True
        self._note_failure(
            w, m.FailReason.WRITE_TIMEOUT, TransportError("WRITE ran past its deadline")
        )
        still = []
        for h in w.handles:
            try:
                self._t.release(h)  # NIXL cancels an unfinished WRITE on release
            except TransportError as exc:
                logger.warning("Cannot cancel WRITE of %s yet: %s", tid, exc)
                still.append(h)  # keep polling: the blocks stay held until it ends
        w.handles = still
        for pw in w.others:
            pw.withhold()  # a device copy cannot be recalled: wait for it, say nothing
        self._poll_write(tid, now_ns)


def _noop() -> None:
    pass


def _noop_fail(exc: TransportError) -> None:
    pass


def _unreached(exc: TransportError) -> m.FailReason:
    """Why a WRITE to a D we could not reach failed: its process is gone, or no answer."""
    return m.FailReason.PEER_LOST if isinstance(exc, PeerDisconnected) else m.FailReason.HANDSHAKE

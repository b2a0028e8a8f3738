"""The push protocol's spans, built from times observed on the transfer thread and the
scheduler.

Owns: the notes the engine hands the transfer thread with each event (``PrefillNote``,
``RegisterNote``: the trace context and the engine's own timestamps), ``TransferSpans``
(P: ``prefill``, ``rendezvous_wait``, ``prepare_descriptors``, ``write``; D: ``register``,
``await_kv``), ``geometry_attributes`` (P's KV geometry on its transfer spans) and
``NO_SPANS`` (tracing off: every hook is a no-op); the engine's own
spans are ``connector.engine_spans``. Names and keys come from ``telemetry.schema``;
nothing here touches vLLM or NIXL.
``TransferSpans`` is called only from the transfer thread, after the fact: a span is one
``emit`` call, so no span stays open across threads.

Wall-clock nanoseconds (``time.time_ns``) throughout: span times, and the same clock in
every process of the host, so P's and D's spans line up in one trace.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from connector.core import events as ev
from connector.core.geometry import KVGeometry
from connector.core.messages import FailReason, TraceContext
from telemetry.emit import emit, parent_of
from telemetry.schema import Attr, Event, Span

# A transfer whose end is never seen (an orphan registration that expired) must not keep
# its record forever.
MAX_OPEN = 8192
_NOT_ERRORS = frozenset({FailReason.NOT_NEEDED.value})


@dataclass(frozen=True)
class PrefillNote:
    """P's scheduler and worker: when the request arrived, was first scheduled, and when
    the step that completed its prompt returned (on GPU: was launched)."""

    trace: TraceContext | None
    arrival_ns: int
    scheduled_ns: int
    done_ns: int
    prompt_tokens: int


@dataclass(frozen=True)
class RegisterNote:
    """D's scheduler: when the blocks were allocated."""

    trace: TraceContext | None
    alloc_ns: int


def geometry_attributes(g: KVGeometry) -> dict[Attr, Any]:
    """The ``pushkv.kv.*`` attributes of P's ``prepare_descriptors`` and ``write``."""
    return {
        Attr.KV_LAYERS: g.layers,
        Attr.KV_FORM: g.form,
        Attr.KV_HEADS: g.heads,
        Attr.KV_HEAD_SIZE: g.head_size,
        Attr.KV_DTYPE: g.dtype or None,
        Attr.KV_BYTES_PER_TOKEN: g.bytes_per_token,
        Attr.KV_BLOCK_TOKENS: g.block_tokens,
    }


def _error(reason: FailReason | str | None) -> str | None:
    if reason is None:
        return None
    value = reason.value if isinstance(reason, FailReason) else reason
    return None if value in _NOT_ERRORS else value


@dataclass
class _Push:
    """P: what is known of one transfer so far."""

    request_id: str = ""
    note: PrefillNote | None = None
    reg_trace: TraceContext | None = None
    prefill_ns: int = 0  # prompt KV complete on this rank
    reg_first_ns: int = 0


@dataclass
class _Receive:
    """D: one transfer being received."""

    note: RegisterNote
    request_id: str
    p_ranks: int
    sent_ns: int = 0  # the last registration went out
    sends: int = 0
    kv_check: str | None = None  # integrity: the worst verdict on a P rank's digest


@dataclass
class TransferSpans:
    """Span emitter of one rank's transfer thread."""

    tracer: Any
    engine_id: str
    tp_rank: int
    # P's KV geometry as span attributes, once per layout (``geometry_attributes``)
    kv: dict[Attr, Any] = field(default_factory=dict)
    pp_stage: int | None = None  # P's pipeline stage, where P runs several
    _push: OrderedDict[str, _Push] = field(default_factory=OrderedDict)
    _recv: OrderedDict[str, _Receive] = field(default_factory=OrderedDict)

    def _common(self, tid: str, request_id: str) -> dict[Attr, Any]:
        out = {
            Attr.TRANSFER_ID: tid,
            Attr.REQUEST_ID: request_id or None,
            Attr.ENGINE_ID: self.engine_id,
            Attr.TP_RANK: self.tp_rank,
        }
        if self.pp_stage is not None:
            out[Attr.PP_STAGE] = self.pp_stage
        return out

    @staticmethod
    def _slot(table: OrderedDict[str, Any], tid: str, make: Any) -> Any:
        rec = table.get(tid)
        if rec is None:
            rec = table[tid] = make()
            while len(table) > MAX_OPEN:
                table.popitem(last=False)
        return rec

    # ------------------------------------------------------------------ P
    def prefill_submitted(
        self, event: ev.PrefillDone, note: PrefillNote | None, deferred: bool
    ) -> None:
        """P's prompt was handed over. ``deferred``: the KV is complete only once the
        step's GPU event fires (``prefill_ready`` then)."""
        rec = self._slot(self._push, event.transfer_id, _Push)
        rec.request_id, rec.note = event.request_id, note
        if not deferred:
            self.prefill_ready(event.transfer_id, note.done_ns if note else time.time_ns())

    def prefill_ready(self, tid: str, at_ns: int) -> None:
        rec = self._push.get(tid)
        if rec is None or rec.prefill_ns:
            return
        rec.prefill_ns = at_ns
        note = rec.note
        if note is None:
            return
        emit(
            self.tracer,
            Span.PREFILL,
            parent=parent_of(note.trace),
            start_ns=note.arrival_ns or at_ns,
            end_ns=at_ns,
            events=[(Event.SCHEDULED, note.scheduled_ns)],
            attributes={
                **self._common(tid, rec.request_id),
                Attr.PROMPT_TOKENS: note.prompt_tokens,
            },
        )

    def registration(self, tid: str, trace: TraceContext | None, at_ns: int) -> None:
        rec = self._slot(self._push, tid, _Push)
        rec.reg_trace = rec.reg_trace or trace
        rec.reg_first_ns = rec.reg_first_ns or at_ns

    def _rendezvous(self, tid: str, rec: _Push, end_ns: int, error: str | None) -> Any:
        # The transfer serves D's leg: its spans hang under the context D's registration
        # carried (the router's decode_leg, which lasts until D's answer is out), not under
        # P's leg, whose HTTP answer may come back before the WRITE ends.
        parent = parent_of(rec.reg_trace or (rec.note.trace if rec.note else None))
        known = [t for t in (rec.prefill_ns, rec.reg_first_ns) if t]
        start = min(known) if known else end_ns
        first = None
        if rec.prefill_ns and rec.reg_first_ns:
            first = "registration" if rec.reg_first_ns <= rec.prefill_ns else "prefill"
        emit(
            self.tracer,
            Span.RENDEZVOUS_WAIT,
            parent=parent,
            start_ns=start,
            end_ns=end_ns,
            events=[(Event.REGISTRATION, rec.reg_first_ns), (Event.PREFILL_DONE, rec.prefill_ns)],
            attributes={**self._common(tid, rec.request_id), Attr.FIRST_ARRIVED: first},
            error=error,
        )
        return parent

    def write_finished(self, report: Any) -> None:
        """The transfer's WRITEs ended (``sending.WriteReport``)."""
        rec = self._push.pop(report.transfer_id, None) or _Push(request_id=report.request_id)
        tid, common = report.transfer_id, self._common(report.transfer_id, report.request_id)
        parent = self._rendezvous(tid, rec, report.issued_ns, None)
        error = None if report.ok else (_error(report.reason) or "write_failed")
        prepared = report.prepared_ns or report.done_ns
        emit(
            self.tracer,
            Span.PREPARE_DESCRIPTORS,
            parent=parent,
            start_ns=report.issued_ns,
            end_ns=prepared,
            attributes={
                **common,
                Attr.BLOCKS: report.blocks,
                Attr.DESCRIPTORS: report.descriptors,
                Attr.REGIONS: report.regions,
                **self.kv,
            },
            error=None if report.prepared_ns else error,
        )
        start = report.posted_ns or prepared
        seconds = (report.done_ns - start) / 1e9
        gbps = report.bytes_total / seconds / 1e9 if report.ok and seconds > 0 else None
        emit(
            self.tracer,
            Span.WRITE,
            parent=parent,
            start_ns=start,
            end_ns=report.done_ns,
            attributes={
                **common,
                Attr.BYTES: report.bytes_total,
                Attr.DESCRIPTORS: report.descriptors,
                Attr.GBPS: gbps,
                Attr.PEER: ",".join(report.targets),
                Attr.XFER_PATH: report.path,
                Attr.XFER_REASON: report.path_reason or None,
                Attr.XFER_COPY_MS: report.stage_ms.get("copy"),
                **self.kv,
            },
            error=error,
        )

    def released(self, tid: str, reason: FailReason | None) -> None:
        """P gave the blocks back. After a WRITE ``write_finished`` already closed the
        record; otherwise the transfer ended before any WRITE: say why."""
        rec = self._push.pop(tid, None)
        if rec is None:
            return
        self._rendezvous(
            tid, rec, time.time_ns(), _error(reason) or (None if reason is not None else "released")
        )

    # ------------------------------------------------------------------ D
    def expected(self, event: ev.Expected, note: RegisterNote | None) -> None:
        note = note or RegisterNote(event.trace, time.time_ns())
        self._slot(
            self._recv,
            event.transfer_id,
            lambda: _Receive(note, event.request_id, len(event.sources)),
        )

    def register_sent(self, tid: str) -> None:
        rec = self._recv.get(tid)
        if rec is not None:
            rec.sent_ns, rec.sends = time.time_ns(), rec.sends + 1

    def kv_checked(self, tid: str, result: str) -> None:
        """D checked a P rank's digest (``connector.transfer.integrity.Check``)."""
        rec = self._recv.get(tid)
        if rec is not None and rec.kv_check != "mismatch":
            rec.kv_check = result if rec.kv_check in (None, "skipped") else rec.kv_check

    def received(self, tid: str, ok: bool, reason: FailReason | None, at_ns: int) -> None:
        rec = self._recv.pop(tid, None)
        if rec is None:
            return
        parent, common = parent_of(rec.note.trace), self._common(tid, rec.request_id)
        sent = rec.sent_ns or at_ns
        emit(
            self.tracer,
            Span.REGISTER,
            parent=parent,
            start_ns=rec.note.alloc_ns,
            end_ns=sent,
            attributes={**common, Attr.P_RANKS: rec.p_ranks},
            error=None if rec.sends == rec.p_ranks else (_error(reason) or "not_sent"),
        )
        emit(
            self.tracer,
            Span.AWAIT_KV,
            parent=parent,
            start_ns=sent,
            end_ns=at_ns,
            attributes={**common, Attr.P_RANKS: rec.p_ranks, Attr.KV_CHECK: rec.kv_check},
            error=None if ok else (_error(reason) or "failed"),
        )


class _NoSpans:
    """Tracing off: the same hooks, doing nothing."""

    def __getattr__(self, _name: str) -> Any:
        return _nothing


def _nothing(*_args: Any, **_kwargs: Any) -> None:
    return None


NO_SPANS: Any = _NoSpans()

"""One rank's transfer metrics: the transfer thread produces, the engine step drains.

Owns: ``RankMetrics``. On the transfer thread it takes the span hooks' times (``Tee`` puts
it next to ``TransferSpans``, so metrics are observed exactly where spans are) and, at
most every ``every_ns`` or when results go out, publishes the tables' census (counters
and gauges, O(1) each: ``connector.core.table``). The engine step calls ``drain`` and gets
one dict in the shape ``connector.stats.PushkvStats`` aggregates across ranks: histogram
samples, counter deltas since the last drain, and this rank's gauges when they changed.

Thread safety: samples go through a lock (a few appends per transfer); the published
census is a fresh dict swapped in by reference, never mutated after.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from connector.core.messages import FailReason
from connector.core.state import RecvState, SendState
from telemetry.schema import Count, Metric

if TYPE_CHECKING:
    from connector.transfer.thread import TransferThread

MAX_OPEN = 8192  # transfers whose end is never seen must not be remembered forever
SEP = "|"  # joins a metric name and its extra label values in the stats dict's keys

_CANCELLED = frozenset({FailReason.CANCELLED, FailReason.ABORTED, FailReason.NOT_NEEDED})
_EXPIRED = frozenset(
    {FailReason.LEASE_EXPIRED, FailReason.REGISTRATION_EXPIRED, FailReason.DEADLINE}
)


def key(metric: Metric, *labels: str) -> str:
    return SEP.join((metric.value, *labels))


def outcome(state: SendState | RecvState, reason: FailReason | None) -> str:
    """A terminal state as the ``outcome`` label: done, failed, cancelled or expired."""
    if state in (SendState.DONE, RecvState.RECEIVED):
        return "done"
    if state in (SendState.CANCELLED, SendState.EXPIRED):
        return state.value
    if reason in _CANCELLED:
        return "cancelled"
    return "expired" if reason in _EXPIRED else "failed"


def census(thread: TransferThread, now_ns: int) -> tuple[dict[str, int], dict[str, float]]:
    """Counter totals and gauges of one transfer thread; called on that thread only."""
    totals: dict[str, int] = {}

    def add(k: str, n: int) -> None:
        if n:
            totals[k] = totals.get(k, 0) + n

    gauges: dict[str, float] = {}
    add(key(Metric.DROPPED, "malformed"), thread.counters.of(Count.MALFORMED_NOTIFS))
    add(key(Metric.DROPPED, "unauthenticated"), thread.counters.of(Count.UNAUTHENTICATED_NOTIFS))
    for side, end in (("send", thread.sender), ("recv", thread.receiver)):
        if end is None:
            continue
        table: Any = end.table
        for (state, reason), n in table.ended.items():
            add(
                key(Metric.TRANSFERS, side, outcome(state, reason), reason.value if reason else ""),
                n,
            )
        for kind, n in table.dropped.items():
            add(key(Metric.DROPPED, "table_full" if kind == "table_full" else "stale"), n)
        add(key(Metric.DROPPED, "sender_mismatch"), end.counters.of(Count.SENDER_MISMATCH))
    s, r = thread.sender, thread.receiver
    if s is not None:
        add(key(Metric.HEARTBEATS, "received"), s.counters.of(Count.HEARTBEATS))
        blocks, age_ns = s.table.held(now_ns)
        gauges[Metric.REGISTRATIONS_WAITING.value] = s.table.live[SendState.REGISTERED]
        gauges[Metric.PREFILLS_WAITING.value] = s.table.live[SendState.PREFILLED]
        gauges[Metric.BLOCKS_HELD.value] = blocks
        gauges[Metric.OLDEST_HELD.value] = age_ns / 1e9
        gauges[Metric.WRITES_IN_FLIGHT.value] = s.writes_in_flight()
    if r is not None:
        add(key(Metric.HEARTBEATS, "sent"), r.counters.of(Count.HEARTBEATS_SENT))
        live = r.table.live
        gauges[Metric.AWAITING_KV.value] = live[RecvState.AWAITING] + live[RecvState.CANCELLING]
    bell = thread.bell
    if bell is not None:
        add(key(Metric.DOORBELLS, "sent"), bell.counters.of(Count.RUNG))
        add(key(Metric.DOORBELLS, "received"), bell.counters.of(Count.HEARD))
    return totals, gauges


class RankMetrics:
    """One TP rank's metrics (see the module doc for who calls what)."""

    def __init__(self, rank: int, every_ns: int = 100_000_000) -> None:
        self.rank, self._every_ns = rank, every_ns
        self._lock = threading.Lock()
        self._samples: dict[str, list[float]] = {}
        self._ready: OrderedDict[str, int] = OrderedDict()  # P: prompt KV complete
        self._registered: OrderedDict[str, int] = OrderedDict()  # P: first registration in
        self._sent: OrderedDict[str, int] = OrderedDict()  # D: last registration out
        self._next_ns = 0
        self._totals: dict[str, int] = {}  # published by the transfer thread
        self._gauges: dict[str, float] = {}
        self._drained: dict[str, int] = {}  # the engine's: totals at the last drain
        self._drained_gauges: dict[str, float] = {}

    # ------------------------------------------------------------ transfer thread
    def _sample(self, k: str, value: float) -> None:
        with self._lock:
            self._samples.setdefault(k, []).append(value)

    @staticmethod
    def _remember(table: OrderedDict[str, int], tid: str, at_ns: int) -> None:
        table.setdefault(tid, at_ns)
        while len(table) > MAX_OPEN:
            table.popitem(last=False)

    def prefill_submitted(self, event: Any, note: Any, deferred: bool) -> None:
        if not deferred:
            self._remember(self._ready, event.transfer_id, note.done_ns if note else time.time_ns())

    def prefill_ready(self, tid: str, at_ns: int) -> None:
        self._remember(self._ready, tid, at_ns)

    def registration(self, tid: str, trace: Any, at_ns: int) -> None:
        self._remember(self._registered, tid, at_ns)

    def released(self, tid: str, reason: Any) -> None:
        self._ready.pop(tid, None)
        self._registered.pop(tid, None)

    def write_finished(self, report: Any) -> None:
        """P: a transfer's WRITEs ended (``connector.transfer.send_records.WriteReport``)."""
        ready = self._ready.pop(report.transfer_id, 0)
        registered = self._registered.pop(report.transfer_id, 0)
        if not report.ok:
            return  # counted by outcome in the census
        start = report.posted_ns or report.prepared_ns
        seconds = max(report.done_ns - start, 0) / 1e9
        self._sample(key(Metric.PREPARE), max(report.prepared_ns - report.issued_ns, 0) / 1e9)
        self._sample(key(Metric.WRITE, report.path), seconds)
        if seconds > 0 and report.bytes_total:
            self._sample(key(Metric.WRITE_THROUGHPUT, report.path), report.bytes_total / seconds)
        self._sample(key(Metric.BYTES), report.bytes_total)
        self._sample(key(Metric.DESCRIPTORS), report.descriptors)
        if ready:
            self._sample(key(Metric.PUSH), max(report.done_ns - ready, 0) / 1e9)
        if ready and registered:
            first = "registration" if registered <= ready else "prefill"
            wait = max(report.issued_ns - min(ready, registered), 0) / 1e9
            self._sample(key(Metric.RENDEZVOUS_WAIT, first), wait)

    def register_sent(self, tid: str) -> None:
        self._sent[tid] = time.time_ns()
        while len(self._sent) > MAX_OPEN:
            self._sent.popitem(last=False)

    def received(self, tid: str, ok: bool, reason: Any, at_ns: int) -> None:
        sent = self._sent.pop(tid, 0)
        if ok and sent:
            self._sample(key(Metric.KV_WAIT), max(at_ns - sent, 0) / 1e9)

    def publish(self, thread: TransferThread, now_ns: int, force: bool) -> None:
        """Refresh the census every ``every_ns``, or now when ``force`` (results go out:
        the engine step that takes them then sees the gauges that go with them)."""
        if not force and now_ns < self._next_ns:
            return
        self._next_ns = now_ns + self._every_ns
        self._totals, self._gauges = census(thread, now_ns)

    # ------------------------------------------------------------ engine step
    def drain(self) -> dict[str, Any] | None:
        """What changed since the last drain, or None: ``{"samples": {key: [values]},
        "counts": {key: delta}, "gauges": {rank: {name: value}}}``."""
        with self._lock:
            samples, self._samples = self._samples, {}
        totals, gauges = self._totals, self._gauges
        counts = {k: n - self._drained.get(k, 0) for k, n in totals.items()}
        counts = {k: n for k, n in counts.items() if n > 0}
        self._drained = totals
        data: dict[str, Any] = {"samples": samples, "counts": counts, "gauges": {}}
        if gauges != self._drained_gauges:
            data["gauges"] = {str(self.rank): gauges}
            self._drained_gauges = gauges
        return data if samples or counts or data["gauges"] else None


class Tee:
    """Calls each hook on every target that has it: spans and metrics, side by side."""

    def __init__(self, *targets: Any) -> None:
        self._targets = targets

    def __getattr__(self, name: str) -> Any:
        hooks = [getattr(t, name) for t in self._targets if hasattr(t, name)]

        def call(*args: Any, **kwargs: Any) -> None:
            for hook in hooks:
                hook(*args, **kwargs)

        return call

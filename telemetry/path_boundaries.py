"""Where each critical-path model's boundaries lie in one trace.

Owns: ``Boundary`` (an instant that closes a segment) and ``Mark`` (an instant shown inside
one), the span readers the models share (a span's start, end, event, TP rank; the one span
of a name, with an anomaly when there are several), and one function per model (push,
first token from P, router only) that finds its boundaries and marks, in segment order,
and the critical TP rank (whose ``write`` ends last). critical_path.py turns them into
segments. Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from telemetry.otlp_json import SpanRecord, Trace
from telemetry.schema import Attr, Event, Span


@dataclass(frozen=True, slots=True)
class Boundary:
    """An instant that closes a segment; ``time_ns`` None when it could not be observed."""

    label: str  # e.g. "write.end"
    time_ns: int | None
    span: SpanRecord | None
    ends_span: bool = True  # the span's end (its error, if any, is the segment's); else an event


@dataclass(frozen=True, slots=True)
class Mark:
    """An instant worth showing inside a segment (not a boundary)."""

    label: str
    time_ns: int


def start_of(sp: SpanRecord | None) -> int | None:
    return sp.start_ns if sp else None


def end_of(sp: SpanRecord | None) -> int | None:
    return sp.end_ns if sp else None


def event_at(sp: SpanRecord | None, name: Event) -> int | None:
    ev = sp.event(name.value) if sp else None
    return ev.time_ns if ev else None


def rank_of(sp: SpanRecord) -> int | None:
    r = sp.attr(Attr.TP_RANK.value)
    return int(r) if r is not None else None


def of_rank(spans: Sequence[SpanRecord], rank: int | None) -> SpanRecord | None:
    """The span of ``rank`` (the last-ending one when ranks are not told apart)."""
    same = [sp for sp in spans if rank_of(sp) == rank]
    pool = same or list(spans)
    return max(pool, key=lambda sp: sp.end_ns) if pool else None


def single(trace: Trace, name: Span, anomalies: list[str], last: bool = False) -> SpanRecord | None:
    spans = trace.named(name.value)
    if len(spans) > 1:
        which = "last" if last else "first"
        anomalies.append(f"{len(spans)} {name.value} spans; the {which} one is used")
    if not spans:
        return None
    return spans[-1] if last else spans[0]


def push_boundaries(
    trace: Trace, anomalies: list[str]
) -> tuple[list[Boundary], list[Mark], int | None]:
    # a retried dispatch makes a new prefill leg; the last one is the one that served the request
    leg = single(trace, Span.PREFILL_LEG, anomalies, last=True)
    writes = trace.named(Span.WRITE.value)
    prefills = trace.named(Span.PREFILL.value)
    critical = max(writes, key=lambda sp: sp.end_ns) if writes else of_rank(prefills, None)
    rank = rank_of(critical) if critical else None
    prefill = of_rank(prefills, rank)
    rdv = of_rank(trace.named(Span.RENDEZVOUS_WAIT.value), rank)
    prep = of_rank(trace.named(Span.PREPARE_DESCRIPTORS.value), rank)
    write = of_rank(writes, rank)
    first_token = single(trace, Span.FIRST_TOKEN, anomalies)
    bounds = [
        Boundary("prefill_leg.start", start_of(leg), leg, False),
        Boundary("prefill.scheduled", event_at(prefill, Event.SCHEDULED), prefill, False),
        Boundary("prefill.end", end_of(prefill), prefill),
        Boundary("rendezvous_wait.end", end_of(rdv), rdv),
        Boundary("prepare_descriptors.end", end_of(prep), prep),
        Boundary("write.end", end_of(write), write),
        Boundary(
            "first_token.scheduled", event_at(first_token, Event.SCHEDULED), first_token, False
        ),
        Boundary("first_token.end", end_of(first_token), first_token),
    ]
    marks = [
        Mark(f"{name.value}.end", sp.end_ns)
        for name in (Span.REGISTER, Span.AWAIT_KV, Span.FIRST_BYTE)
        for sp in trace.named(name.value)[:1]
    ]
    met = [
        e.time_ns
        for e in (rdv.events if rdv else ())
        if e.name in (Event.REGISTRATION.value, Event.PREFILL_DONE.value)
    ]
    if len(met) == 2:  # both sides known: the rest of the wait is P's hand-off to its thread
        marks.append(Mark("rendezvous met", max(met)))
    if len(writes) > 1:
        marks += [
            Mark(f"write.end (tp_rank {rank_of(w)})", w.end_ns) for w in writes if w is not write
        ]
    return bounds, marks, rank


def first_token_boundaries(
    trace: Trace, anomalies: list[str]
) -> tuple[list[Boundary], list[Mark], int | None]:
    leg = single(trace, Span.PREFILL_LEG, anomalies, last=True)
    prefills = trace.named(Span.PREFILL.value)
    prefill = max(prefills, key=lambda sp: sp.end_ns) if prefills else None
    rank = rank_of(prefill) if prefill else None
    bounds = [
        Boundary("prefill_leg.start", start_of(leg), leg, False),
        Boundary("prefill.scheduled", event_at(prefill, Event.SCHEDULED), prefill, False),
        Boundary("prefill.end", end_of(prefill), prefill),
        Boundary("prefill_leg.end", end_of(leg), leg),
    ]
    marks = [  # after the first token: the push and D's first step (token 2)
        Mark(f"{name.value}.end", sp.end_ns)
        for name in (Span.WRITE, Span.FIRST_TOKEN)
        for sp in trace.named(name.value)[:1]
    ]
    return bounds, marks, rank


def router_boundaries(
    trace: Trace, anomalies: list[str]
) -> tuple[list[Boundary], list[Mark], None]:
    leg = single(trace, Span.PREFILL_LEG, anomalies, last=True)
    first_byte = single(trace, Span.FIRST_BYTE, anomalies)
    bounds = [
        Boundary("prefill_leg.start", start_of(leg), leg, False),
        Boundary("prefill_leg.end", end_of(leg), leg),
        Boundary("first_byte.end", end_of(first_byte), first_byte),
    ]
    decode = trace.first(Span.DECODE_LEG.value)
    marks = [Mark("decode_leg.start", decode.start_ns)] if decode else []
    return bounds, marks, None

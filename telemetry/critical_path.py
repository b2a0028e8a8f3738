"""The critical-path model: one trace -> consecutive segments that sum to the client's TTFT.

Owns: the segments of each model, how missing boundaries become one "unknown" segment, and
the flags for out-of-order (negative) gaps; which span edges are the boundaries is
path_boundaries.py's. Pure: takes a
``telemetry.otlp_json.Trace``, returns frozen values; no I/O, no clock.

Client-observed TTFT is the router ``request`` span's start -> its ``first_chunk`` event. All
processes stamp unix nanos of one host clock. Push mode, boundaries in order (each segment runs
from the previous boundary to its own, so the segments telescope to exactly end - start):

    request.start                         (the HTTP server's accept of the connection opened
                                          for the request, else its first bytes)
    -> connect.end                        connection (0 on a connection already open)
    -> ingress.end                        router ingress (queued on the router's loop)
    -> prefill_leg.start                  router overhead
    -> P prefill's scheduled event         P queue
    -> prefill.end                        P prefill (prompt KV complete)
    -> rendezvous_wait.end                rendezvous wait (0 unless D registered after prefill)
    -> prepare_descriptors.end            descriptor prep
    -> write.end                          WRITE (posted -> DONE)
    -> D first_token's scheduled event     notification to schedule (D); await_kv.end is a mark
    -> first_token.end                    D first step
    -> request's first_chunk event        stream back

With several P TP ranks the critical rank is the one whose ``write`` ends last; its own
prefill / rendezvous / descriptor spans give the P boundaries. First token from P
(``pushkv.router.first_token`` = "prefill" on the request span): the client's first token is
P's, so the path ends at P's answer: ... -> prefill.end (P prefill) -> prefill_leg.end (P's
answer back to the router) -> first_chunk (stream back); the push and D's first step come
after it and are marks. Router-only modes (``pull``, ``vllm-push``) have only router spans:
connection / router ingress / router overhead / prefill leg / decode leg to first byte /
stream back. A trace without ``connect`` or ``ingress`` spans (written before the router
stamped arrivals) has zero-length segments in their place. A request that never produced a
first token ends at the request span's end; ``ttft_ns`` is then None and the segments sum to
the time until it ended.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

from telemetry.otlp_json import SpanRecord, Trace, shared_span_ids
from telemetry.path_boundaries import (
    Boundary,
    Mark,
    event_at,
    first_token_boundaries,
    of_rank,
    push_boundaries,
    router_boundaries,
    single,
)
from telemetry.schema import Attr, Event, RouterMode, Span

PUSH_MODE = RouterMode.PUSH.value


class Seg(str, Enum):
    """Segment names (labels for people; the spans behind them come from the schema)."""

    CONNECT = "connection"
    INGRESS = "router ingress"
    ROUTER = "router overhead"
    P_QUEUE = "P queue"
    P_PREFILL = "P prefill"
    RENDEZVOUS = "rendezvous wait"
    DESCRIPTORS = "descriptor prep"
    WRITE = "WRITE"
    NOTIFY = "notification to schedule (D)"
    D_STEP = "D first step"
    STREAM_BACK = "stream back"
    P_ANSWER = "P answer to router"
    PREFILL_LEG = "prefill leg"
    DECODE_LEG = "decode leg to first byte"
    UNKNOWN = "unknown"


PUSH_SEGMENTS: tuple[Seg, ...] = (
    Seg.CONNECT,
    Seg.INGRESS,
    Seg.ROUTER,
    Seg.P_QUEUE,
    Seg.P_PREFILL,
    Seg.RENDEZVOUS,
    Seg.DESCRIPTORS,
    Seg.WRITE,
    Seg.NOTIFY,
    Seg.D_STEP,
    Seg.STREAM_BACK,
)
FIRST_TOKEN_SEGMENTS: tuple[Seg, ...] = (
    Seg.CONNECT,
    Seg.INGRESS,
    Seg.ROUTER,
    Seg.P_QUEUE,
    Seg.P_PREFILL,
    Seg.P_ANSWER,
    Seg.STREAM_BACK,
)
ROUTER_SEGMENTS: tuple[Seg, ...] = (
    Seg.CONNECT,
    Seg.INGRESS,
    Seg.ROUTER,
    Seg.PREFILL_LEG,
    Seg.DECODE_LEG,
    Seg.STREAM_BACK,
)


@dataclass(frozen=True, slots=True)
class Segment:
    name: Seg
    start_ns: int
    end_ns: int
    covers: tuple[Seg, ...]  # for UNKNOWN: the segments it stands for; else (name,)
    span_ids: tuple[str, ...]  # spans whose edges bound it (the critical path)
    error: str | None = None  # the bounding span ended in error: its reason
    span_keys: tuple[tuple[str, str], ...] = ()  # (span id, name): ids alone may collide

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns

    @property
    def negative(self) -> bool:
        return self.end_ns < self.start_ns


@dataclass(frozen=True, slots=True)
class CriticalPath:
    trace_id: str
    model: str  # "push" or "router"
    mode: str  # the router's mode attribute ("unknown" when absent)
    start_ns: int
    end_ns: int
    ttft_ns: int | None  # None: no first chunk reached the client
    segments: tuple[Segment, ...]
    marks: tuple[Mark, ...]
    anomalies: tuple[str, ...]  # negative gaps, duplicated spans: never silently dropped
    rendezvous_first: str | None = None
    critical_tp_rank: int | None = None

    @property
    def total_ns(self) -> int:
        return self.end_ns - self.start_ns

    @property
    def span_ids(self) -> frozenset[str]:
        return frozenset(i for seg in self.segments for i in seg.span_ids)

    def on_path(self, sp: SpanRecord) -> bool:
        """Whether ``sp`` bounds a segment (by id and name: seeded id generators collide)."""
        return any((sp.span_id, sp.name) in seg.span_keys for seg in self.segments)

    def durations_ns(self) -> dict[Seg, int]:
        """Per segment name (unknown ones added up under UNKNOWN)."""
        out: dict[Seg, int] = {}
        for seg in self.segments:
            out[seg.name] = out.get(seg.name, 0) + seg.duration_ns
        return out


def _reason(sp: SpanRecord | None) -> str | None:
    if sp is None or not sp.is_error:
        return None
    return str(sp.attr(Attr.REASON.value) or sp.status_message or "error")


_Model = Callable[[Trace, list[str]], tuple[list[Boundary], list[Mark], int | None]]
_MODELS: dict[str, tuple[tuple[Seg, ...], _Model]] = {
    "push": (PUSH_SEGMENTS, push_boundaries),
    "first_token": (FIRST_TOKEN_SEGMENTS, first_token_boundaries),
    "router": (ROUTER_SEGMENTS, router_boundaries),
}


def _segments(
    names: Sequence[Seg], start: Boundary, bounds: Sequence[Boundary], anomalies: list[str]
) -> list[Segment]:
    """Segment i ends at boundary i; a run of missing boundaries becomes one UNKNOWN segment
    reaching the next boundary that was observed (the last, the end, always is)."""
    out: list[Segment] = []
    prev = start
    pending: list[Seg] = []
    for name, b in zip(names, bounds, strict=True):
        if b.time_ns is None:
            pending.append(name)
            continue
        assert prev.time_ns is not None
        bounding = [sp for sp in (prev.span, b.span) if sp is not None]
        ids = tuple(dict.fromkeys(sp.span_id for sp in bounding))
        keys = tuple(dict.fromkeys((sp.span_id, sp.name) for sp in bounding))
        covers = (*pending, name)
        seg = Segment(
            Seg.UNKNOWN if pending else name,
            prev.time_ns,
            b.time_ns,
            covers,
            ids,
            _reason(b.span) if b.ends_span else None,
            keys,
        )
        if seg.negative:
            anomalies.append(
                f"negative gap {prev.label} -> {b.label}: "
                f"{seg.duration_ns / 1e6:.3f} ms ({' + '.join(c.value for c in covers)})"
            )
        out.append(seg)
        prev, pending = b, []
    return out


def _router_in(trace: Trace, name: Span, req: SpanRecord, anomalies: list[str]) -> Boundary:
    """The end of the router's ``connect`` or ``ingress`` span; without one, the previous
    boundary's time (a zero-length segment: a connection already open, or an old trace)."""
    sp = single(trace, name, anomalies)
    label = f"{name.value.removeprefix('pushkv.')}.end"
    if sp is not None:
        return Boundary(label, sp.end_ns, sp)
    if name is Span.INGRESS and (conn := trace.first(Span.CONNECT.value)) is not None:
        return Boundary(label, conn.end_ns, conn, False)
    return Boundary(label, req.start_ns, req, False)


def model_for(mode: str, trace: Trace) -> str:
    """Push mode (or no mode attribute, with P/D spans present) -> push, or first_token when
    the request's first token came from P; else router."""
    if mode == PUSH_MODE:
        req = trace.first(Span.REQUEST.value)
        if req is not None and req.attr(Attr.FIRST_TOKEN_FROM.value) == "prefill":
            return "first_token"
        return "push"
    if mode == "unknown" and (trace.named(Span.WRITE.value) or trace.named(Span.PREFILL.value)):
        return "push"
    return "router"


def critical_path(trace: Trace, model: str | None = None) -> CriticalPath | None:
    """The TTFT decomposition of one trace; None when the trace has no router request span."""
    anomalies: list[str] = []
    req = single(trace, Span.REQUEST, anomalies)
    if req is None:
        return None
    shared = shared_span_ids(trace)
    if shared:
        anomalies.append(
            f"{len(shared)} span id(s) shared by different spans "
            "(seeded id generators): parent links are ambiguous"
        )
    mode = str(req.attr(Attr.MODE.value) or "unknown")
    model = model or model_for(mode, trace)
    names, boundaries_of = _MODELS[model]
    bounds, marks, rank = boundaries_of(trace, anomalies)
    first_chunk = event_at(req, Event.FIRST_CHUNK)
    end_ns = first_chunk if first_chunk is not None else req.end_ns
    # a first chunk is an event: the request's error (if any) belongs on the segment only
    # when the request ended without one
    end = Boundary(
        "request.first_chunk" if first_chunk is not None else "request.end",
        end_ns,
        req,
        ends_span=first_chunk is None,
    )
    start = Boundary("request.start", req.start_ns, req, False)
    router_in = [_router_in(trace, name, req, anomalies) for name in (Span.CONNECT, Span.INGRESS)]
    segments = _segments(names, start, [*router_in, *bounds, end], anomalies)
    rdv = of_rank(trace.named(Span.RENDEZVOUS_WAIT.value), rank)  # the critical rank's
    first = rdv.attr(Attr.FIRST_ARRIVED.value) if rdv else None
    return CriticalPath(
        trace_id=trace.trace_id,
        model=model,
        mode=mode,
        start_ns=req.start_ns,
        end_ns=end_ns,
        ttft_ns=first_chunk - req.start_ns if first_chunk is not None else None,
        segments=tuple(segments),
        marks=tuple(sorted(marks, key=lambda m: m.time_ns)),
        anomalies=tuple(anomalies),
        rendezvous_first=str(first) if first else None,
        critical_tp_rank=rank,
    )

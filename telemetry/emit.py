"""Emitting spans with explicit timestamps: the one helper every emitter uses.

Owns: ``parent_context`` (W3C traceparent text -> OpenTelemetry context, through the
standard propagator), ``parent_of`` (the same from a carried trace context) and ``emit``
(one finished span: start, end, attributes, events and an error status with a reason).
Spans of the push protocol are built after the fact from times observed where they
happened (the transfer thread, the scheduler), so they are never left open across threads
and a span is one call. Imports only the OpenTelemetry API.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from typing import Protocol

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from telemetry.schema import Attr, Event, Outcome, Span

_PROPAGATOR = TraceContextTextMapPropagator()

AttrValue = str | bool | int | float
Events = Iterable[tuple[Event, int]]


def parent_context(traceparent: str | None, tracestate: str = "") -> Context | None:
    """The context a remote ``traceparent`` names; None when absent or malformed (the span
    then starts a trace of its own)."""
    if not traceparent:
        return None
    if len(traceparent) > 64 or len(tracestate) > 512:  # W3C: 55 and 512 characters
        return _parsed.__wrapped__(traceparent, tracestate)  # not cached: a forged giant
    return _parsed(traceparent, tracestate)


class Carrier(Protocol):
    """A trace context as messages carry it (``connector.core.messages.TraceContext``)."""

    @property
    def traceparent(self) -> str: ...

    @property
    def tracestate(self) -> str: ...


def parent_of(carrier: Carrier | None) -> Context | None:
    """``parent_context`` of a carried trace context; None when there is none."""
    return parent_context(carrier.traceparent, carrier.tracestate) if carrier else None


@functools.lru_cache(maxsize=1024)
def _parsed(traceparent: str, tracestate: str) -> Context | None:
    # Each transfer parents several spans on one traceparent (P four, D two), and the
    # propagator's parse is a large part of a span's cost (``python -m bench.tracing_cost``).
    # Contexts are immutable, so one parse may serve them all.
    carrier = {"traceparent": traceparent}
    if tracestate:
        carrier["tracestate"] = tracestate
    ctx = _PROPAGATOR.extract(carrier)
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


def traceparent_of(span: trace.Span) -> str | None:
    """The ``traceparent`` that makes ``span`` the parent of a remote span."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get("traceparent")


def emit(
    tracer: Tracer,
    name: Span,
    *,
    parent: Context | None,
    start_ns: int,
    end_ns: int,
    attributes: Mapping[Attr, AttrValue | None] | None = None,
    events: Events = (),
    error: str | None = None,
    kind: SpanKind = SpanKind.INTERNAL,
) -> trace.Span:
    """Record one finished span. ``end_ns`` before ``start_ns`` (clocks read in different
    threads) is clamped to a zero-length span rather than a negative one. ``error``: the
    span ends with an error status, ``pushkv.reason`` = error, ``pushkv.outcome`` kept if
    given (else the reason)."""
    attrs: dict[str, AttrValue] = {
        k.value: v for k, v in (attributes or {}).items() if v is not None
    }
    if error is not None:
        attrs[Attr.REASON.value] = error
        attrs.setdefault(Attr.OUTCOME.value, error)
    else:
        attrs.setdefault(Attr.OUTCOME.value, Outcome.OK.value)
    end_ns = max(end_ns, start_ns)
    # A tracer of telemetry.setup's provider records the finished span in one step.
    if (direct := getattr(tracer, "pushkv_emit", None)) is not None:
        at = ((e.value, max(t, start_ns)) for e, t in events if t)
        if (
            span := direct(name.value, parent, kind, start_ns, end_ns, attrs, at, error)
        ) is not None:
            return span  # type: ignore[no-any-return]
    span = tracer.start_span(
        name.value, context=parent, kind=kind, start_time=start_ns, attributes=attrs
    )
    for event, at_ns in events:
        if at_ns:
            span.add_event(event.value, timestamp=max(at_ns, start_ns))
    if error is not None:
        span.set_status(Status(StatusCode.ERROR, error))
    span.end(end_time=end_ns)
    return span


def context_of(span: trace.Span) -> Context:
    """A context whose current span is ``span`` (to parent children on it)."""
    return trace.set_span_in_context(span)

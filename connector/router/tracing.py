"""The router's spans of one request: ``request`` (root), ``route``, ``prefill_leg``,
``decode_leg`` and ``first_byte`` (telemetry/schema.py has the tree), and the trace id in
a stream's closing events (``TraceStamp``).

Owns: ``RequestTrace``, which the endpoint and ``attempt.Attempt`` call at each step of a
request (all on the event loop), and which makes the ``traceparent`` each leg carries: the
P leg's names ``prefill_leg`` as parent, the D leg's ``decode_leg``, so P's and D's spans
hang under the leg that caused them. It also watches D's answer as it is relayed: the
first token sent to the client (the client-observed TTFT, event ``first_chunk``), the
number of token events and the usage numbers, for the request's TTFT/TPOT attributes.

With tracing off (no tracer) it still makes one valid traceparent for both legs, so P's and
D's logs keep one id per request. Either way it keeps the times the router's metrics and the
client's ``Server-Timing`` header need, tells ``metrics`` (``RouterMetrics``) when each leg
ends, and names the request's trace for the client (``traceresponse``).
"""

from __future__ import annotations

import re
import time
from typing import Any

from opentelemetry.trace import SpanKind, Status, StatusCode

from connector.router import legs
from connector.router.arrival import Arrival
from telemetry.emit import context_of, emit, parent_context, traceparent_of
from telemetry.schema import Attr, Event, Outcome, Span

_FINISHED = re.compile(rb'"finish_reason":\s*"')
_USAGE_ONLY = re.compile(rb'"choices":\s*\[\]')
_PROMPT_TOKENS = re.compile(rb'"prompt_tokens":\s*(\d+)')
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens":\s*(\d+)')


class RequestTrace:
    def __init__(
        self,
        tracer: Any,
        incoming: str | None,
        *,
        mode: str,
        endpoint: str,
        metrics: Any = None,
        loop_lag: Any = None,
        arrival: Arrival | None = None,
    ) -> None:
        """``loop_lag``: the router's ``connector.router.looplag.LoopLag``; the root span
        carries the worst event-loop lag seen while the request was open. ``arrival``: the
        HTTP server's stamps (``connector.router.arrival``); the root span starts at the
        earliest, a ``connect`` span covers accept -> first bytes (a connection opened for
        this request) and an ``ingress`` span first bytes -> this handler."""
        self._tracer = tracer
        self._metrics = metrics
        self._loop_lag = loop_lag
        now_ns = time.time_ns()
        self._handler_ns = now_ns
        self._start_ns = min(arrival.start_ns, now_ns) if arrival else now_ns
        self._first_bytes_ns = min(arrival.first_bytes_ns, now_ns) if arrival else now_ns
        self._start_mono_ns = time.monotonic_ns() - (now_ns - self._start_ns)
        self._fallback = legs.new_traceparent(incoming)
        self._legs: dict[str, tuple[str, int]] = {}  # open legs: role -> (url, sent ns)
        self.first_leg_ns = 0
        self.prefill_ns: tuple[int, int] | None = None  # P leg sent, answered
        self.decode_byte_ns: tuple[int, int] | None = None  # D leg sent, first byte
        self._root: Any = None
        self._prefill: Any = None
        self._decode: Any = None
        self._decode_start_ns = 0
        self._closing = False
        self._tail = b""  # the end of what was sent, for patterns split across chunks
        self.first_chunk_ns = 0
        self.last_chunk_ns = 0
        self.token_events = 0
        self.prompt_tokens: int | None = None
        self.completion_tokens: int | None = None
        if tracer is not None:
            self._root = tracer.start_span(
                Span.REQUEST.value,
                context=parent_context(incoming),
                kind=SpanKind.SERVER,
                start_time=self._start_ns,
                attributes={
                    Attr.MODE.value: mode,
                    Attr.ENDPOINT.value: endpoint,
                    Attr.ARRIVAL.value: "server" if arrival else "handler",
                },
            )
            first_bytes = self._first_bytes_ns
            if first_bytes > self._start_ns:  # a connection opened for this request
                emit(
                    tracer,
                    Span.CONNECT,
                    parent=self._ctx(),
                    start_ns=self._start_ns,
                    end_ns=first_bytes,
                )
            emit(tracer, Span.INGRESS, parent=self._ctx(), start_ns=first_bytes, end_ns=now_ns)
        # W3C Trace Context Level 2: the trace and the router's span the client can quote.
        self.traceresponse = (
            traceparent_of(self._root) if self._root is not None else None
        ) or self._fallback

    @property
    def start_ns(self) -> int:
        return self._start_ns

    @property
    def trace_id(self) -> str:
        return self.traceresponse.split("-")[1]

    def _leg_started(self, role: str, url: str) -> None:
        now = time.time_ns()
        self.first_leg_ns = self.first_leg_ns or now
        self._legs[role] = (url, now)

    def _leg_ended(self, role: str, error: str | None) -> int:
        """The leg's start (0 if it was not open); counts it once."""
        url, start = self._legs.pop(role, ("", 0))
        if start and self._metrics is not None:
            self._metrics.leg_ended(role, url, error)
        return start

    def server_timing(self, now_ns: int) -> str:
        """``Server-Timing`` of an answer sent now: the segments the router saw (ms)."""
        parts = []
        if self._first_bytes_ns > self._start_ns:
            parts.append(("connect", self._first_bytes_ns - self._start_ns))
        parts.append(("ingress", self._handler_ns - self._first_bytes_ns))
        if self.first_leg_ns:
            parts.append(("router", self.first_leg_ns - self._handler_ns))
        if self.prefill_ns is not None:
            parts.append(("prefill", self.prefill_ns[1] - self.prefill_ns[0]))
        if self.decode_byte_ns is not None:
            parts.append(("decode", self.decode_byte_ns[1] - self.decode_byte_ns[0]))
        parts.append(("total", now_ns - self._start_ns))
        return ", ".join(f"{name};dur={max(ns, 0) / 1e6:.3f}" for name, ns in parts)

    @property
    def on(self) -> bool:
        return self._root is not None

    def _ctx(self) -> Any:
        return context_of(self._root)

    def request_parsed(self, body: dict[str, Any], request_id: str) -> None:
        if self._root is not None:
            model = body.get("model")
            self._root.set_attributes(
                {
                    Attr.REQUEST_ID.value: request_id,
                    Attr.STREAM.value: bool(body.get("stream")),
                    **({Attr.REQUEST_MODEL.value: model} if isinstance(model, str) else {}),
                }
            )

    def routed(
        self,
        start_ns: int,
        prefill_url: str | None,
        decode_url: str | None,
        outstanding: int | None,
        error: str | None = None,
        reason: str = "least outstanding among healthy",
        *,
        policy: str | None = None,
        prefill_reason: str | None = None,
        prefix_blocks: int | None = None,
    ) -> None:
        """The route span; ``reason`` is D's choice's (or the degraded one's),
        ``prefill_reason`` P's."""
        if self._root is None:
            return
        choice = {
            Attr.ROUTE_REASON: None if error else reason,
            Attr.ROUTE_POLICY: policy,
            Attr.ROUTE_PREFILL_REASON: None if error else prefill_reason,
            Attr.ROUTE_PREFIX_BLOCKS: prefix_blocks,
        }
        emit(
            self._tracer,
            Span.ROUTE,
            parent=self._ctx(),
            start_ns=start_ns,
            end_ns=time.time_ns(),
            error=error,
            attributes={
                Attr.PREFILL_URL: prefill_url,
                Attr.DECODE_URL: decode_url,
                Attr.PENDING: outstanding,
                **choice,
            },
        )
        if decode_url:
            self._root.set_attributes(
                {Attr.DECODE_URL.value: decode_url, Attr.PREFILL_URL.value: prefill_url or ""}
            )
            # the last attempt's choice wins, like the URLs
            self._root.set_attributes({k.value: v for k, v in choice.items() if v is not None})

    def attempt_failed(self, attempt: int, role: str, reason: str) -> None:
        """One attempt's leg failed before the client got a byte; another attempt follows."""
        if self._root is not None:
            self._root.add_event(
                Event.ATTEMPT_FAILED.value,
                attributes={
                    Attr.ATTEMPT.value: attempt,
                    Attr.FAILED_ROLE.value: role,
                    Attr.REASON.value: reason,
                },
            )

    def attempted(self, attempts: int, *, degraded: bool) -> None:
        """How many attempts the request took, and whether the last one was D alone."""
        if self._root is not None:
            self._root.set_attributes(
                {Attr.ATTEMPTS.value: attempts, Attr.DEGRADED.value: degraded}
            )

    def first_token(self, source: str, blocker: str | None) -> None:
        """Who sends the client's first token, and (``--first-token prefill``) why not P."""
        if self._root is not None:
            self._root.set_attribute(Attr.FIRST_TOKEN_FROM.value, source)
            if blocker is not None:
                self._root.set_attribute(Attr.FIRST_TOKEN_BLOCKER.value, blocker)

    # -- legs: each returns the traceparent its request carries --------------------------
    def prefill_started(self, url: str) -> str:
        self._leg_started("prefill", url)
        if self._root is None:
            return self._fallback
        self._prefill = self._tracer.start_span(
            Span.PREFILL_LEG.value,
            context=self._ctx(),
            kind=SpanKind.CLIENT,
            attributes={Attr.PREFILL_URL.value: url},
        )
        return traceparent_of(self._prefill) or self._fallback

    def prefill_ended(self, error: str | None = None) -> None:
        if (start := self._leg_ended("prefill", error)) and error is None:
            self.prefill_ns = (start, time.time_ns())
        _end(self._prefill, error)
        self._prefill = None
        if self._closing:
            self._close_root()

    def decode_started(self, url: str) -> str:
        self._leg_started("decode", url)
        if self._root is None:
            return self._fallback
        self._decode_start_ns = time.time_ns()
        self._decode = self._tracer.start_span(
            Span.DECODE_LEG.value,
            context=self._ctx(),
            kind=SpanKind.CLIENT,
            start_time=self._decode_start_ns,
            attributes={Attr.DECODE_URL.value: url},
        )
        return traceparent_of(self._decode) or self._fallback

    def decode_ended(self, error: str | None = None) -> None:
        self._leg_ended("decode", error)
        _end(self._decode, error)
        self._decode = None

    def decode_bytes(self) -> None:
        """D's first body bytes arrived (called for every chunk; acts on the first)."""
        if self.decode_byte_ns is None and "decode" in self._legs:
            self.decode_byte_ns = (self._legs["decode"][1], time.time_ns())
        if self._decode is not None and self._decode_start_ns:
            emit(
                self._tracer,
                Span.FIRST_BYTE,
                parent=context_of(self._decode),
                start_ns=self._decode_start_ns,
                end_ns=time.time_ns(),
            )
            self._decode_start_ns = 0

    # -- what the client got -------------------------------------------------------------
    def sent(self, chunk: bytes, *, stream: bool) -> None:
        """A piece of D's answer went to the client (its times are kept with tracing off too:
        the router's metrics need them)."""
        if not chunk:
            return
        now = time.time_ns()
        seen = self._tail + chunk
        self._tail = seen[-512:]
        if b"usage" in seen:
            if m := _PROMPT_TOKENS.search(self._tail if stream else chunk):
                self.prompt_tokens = int(m[1])
            if m := _COMPLETION_TOKENS.search(self._tail if stream else chunk):
                self.completion_tokens = int(m[1])
        if stream:
            # Count the patterns that end in this chunk (a window reaching len - 1 bytes
            # back), so one split across two chunks counts once.
            events = _ends_in(seen, chunk, b"data: {") - _ends_in(seen, chunk, b'"choices":[]')
            if events <= 0:
                return  # [DONE], a usage-only event, or a piece of an event
            self.token_events += events
        if not self.first_chunk_ns:
            self.first_chunk_ns = now
            if self._root is not None:
                self._root.add_event(Event.FIRST_CHUNK.value, timestamp=now)
        self.last_chunk_ns = now

    def end(self, status: int | None, error: str | None = None) -> None:
        """The client has its answer. A P leg still running (D finished first; P's HTTP
        answer is bookkeeping) keeps the root open until it ends, so every child lies
        inside the root."""
        root = self._root
        if root is None or self._closing:
            return
        self._closing = True
        self.decode_ended(Outcome.CANCELLED.value)  # no-op unless the relay left it open
        attrs: dict[str, Any] = {}
        if status is not None:
            attrs[Attr.HTTP_STATUS.value] = status
        if self.first_chunk_ns:
            attrs[Attr.TTFT_MS.value] = (self.first_chunk_ns - self._start_ns) / 1e6
        tokens = self.completion_tokens or self.token_events
        if tokens > 1 and self.last_chunk_ns > self.first_chunk_ns:
            attrs[Attr.TPOT_MS.value] = (
                (self.last_chunk_ns - self.first_chunk_ns) / 1e6 / (tokens - 1)
            )
        if self.prompt_tokens is not None:
            attrs[Attr.INPUT_TOKENS.value] = self.prompt_tokens
        if self._loop_lag is not None:
            attrs[Attr.LOOP_LAG_MS.value] = self._loop_lag.worst_since(self._start_mono_ns) / 1e6
        if tokens:
            attrs[Attr.OUTPUT_TOKENS.value] = tokens
        if error is None and status is not None and status >= 400:
            error = f"http_{status}"
        attrs[Attr.OUTCOME.value] = error or Outcome.OK.value
        if error is not None:
            attrs[Attr.REASON.value] = error
            root.set_status(Status(StatusCode.ERROR, error))
        root.set_attributes(attrs)
        if self._prefill is None:
            self._close_root()

    def _close_root(self) -> None:
        root, self._root = self._root, None
        if root is not None:
            root.end()


def _end(span: Any, error: str | None) -> None:
    if span is None:
        return
    if error is not None:
        span.set_attributes({Attr.OUTCOME.value: error, Attr.REASON.value: error})
        span.set_status(Status(StatusCode.ERROR, error))
    else:
        span.set_attribute(Attr.OUTCOME.value, Outcome.OK.value)
    span.end()


def _ends_in(seen: bytes, chunk: bytes, pattern: bytes) -> int:
    return seen[-(len(chunk) + len(pattern) - 1) :].count(pattern)


class TraceStamp:
    """Puts ``"pushkv_trace_id"`` into a stream's closing events (a choice's finish, the
    usage event), a field OpenAI clients ignore. It passes whole SSE events on as soon as
    they are complete (a client cannot use half an event anyway), so it delays nothing."""

    def __init__(self, trace_id: str) -> None:
        self._field = b'"pushkv_trace_id":"' + trace_id.encode() + b'",'
        self._rest = b""

    def feed(self, chunk: bytes) -> bytes:
        data = self._rest + chunk
        cut = data.rfind(b"\n\n") + 2
        if cut < 2:
            self._rest = data
            return b""
        ready, self._rest = data[:cut], data[cut:]
        if not (_FINISHED.search(ready) or _USAGE_ONLY.search(ready)):
            return ready  # the usual event: as it came
        return b"\n\n".join(self._stamp(e) for e in ready.split(b"\n\n"))

    def _stamp(self, event: bytes) -> bytes:
        if event.startswith(b"data: {") and (
            _FINISHED.search(event) or (_USAGE_ONLY.search(event) and b'"usage":{' in event)
        ):
            return b"data: {" + self._field + event[7:]
        return event

    def flush(self) -> bytes:
        rest, self._rest = self._rest, b""
        return rest

"""One parser of OTLP/JSON ``TracesData`` into typed spans and traces.

Owns: ``SpanRecord``, ``SpanEvent``, ``Trace`` and the conversion from the OTLP/JSON mapping
(hex ids, integer enums, times as decimal strings of unix nanos, ``AnyValue`` attributes).
Both sources use it: our JSON-lines files (``telemetry.traces``) and Jaeger's v3 API
(``telemetry.jaeger``), since both speak OTLP/JSON. Imports neither OpenTelemetry nor the
schema: it knows the wire format, not what pushkv's spans mean.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

_SERVICE_NAME = "service.name"  # OpenTelemetry's resource key, not one of pushkv's own


class OtlpFormatError(ValueError):
    """The document is not OTLP/JSON ``TracesData`` (says where it went wrong)."""


class StatusCode(IntEnum):
    """OTLP ``Status.code``."""

    UNSET = 0
    OK = 1
    ERROR = 2


@dataclass(frozen=True, slots=True)
class SpanEvent:
    name: str
    time_ns: int
    attributes: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class SpanRecord:
    """One finished span with its resource (the process that emitted it)."""

    trace_id: str
    span_id: str
    parent_span_id: str | None
    name: str
    kind: int
    start_ns: int
    end_ns: int
    status: StatusCode
    status_message: str
    attributes: Mapping[str, Any]
    events: tuple[SpanEvent, ...]
    resource: Mapping[str, Any]

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns

    @property
    def service(self) -> str:
        return str(self.resource.get(_SERVICE_NAME, "unknown"))

    @property
    def is_error(self) -> bool:
        return self.status is StatusCode.ERROR

    def event(self, name: str) -> SpanEvent | None:
        """The first event called ``name`` (events are instants; the first is the one meant)."""
        for ev in self.events:
            if ev.name == name:
                return ev
        return None

    def attr(self, key: str, default: Any = None) -> Any:
        """A span attribute, else the resource's (e.g. a TP rank set once per process)."""
        if key in self.attributes:
            return self.attributes[key]
        return self.resource.get(key, default)


@dataclass(frozen=True, slots=True)
class Trace:
    """The spans of one trace id, sorted by start time."""

    trace_id: str
    spans: tuple[SpanRecord, ...]
    _by_name: dict[str, list[SpanRecord]] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        for sp in self.spans:
            self._by_name.setdefault(sp.name, []).append(sp)

    @property
    def start_ns(self) -> int:
        return min(sp.start_ns for sp in self.spans)

    @property
    def end_ns(self) -> int:
        return max(sp.end_ns for sp in self.spans)

    def named(self, name: str) -> list[SpanRecord]:
        """Every span called ``name``, by start time."""
        return self._by_name.get(name, [])

    def first(self, name: str) -> SpanRecord | None:
        spans = self._by_name.get(name)
        return spans[0] if spans else None

    def span(self, span_id: str) -> SpanRecord | None:
        for sp in self.spans:
            if sp.span_id == span_id:
                return sp
        return None


def any_value(v: Mapping[str, Any]) -> Any:
    """Decode an OTLP/JSON ``AnyValue`` (64-bit ints travel as strings)."""
    if "stringValue" in v:
        return v["stringValue"]
    if "intValue" in v:
        return int(v["intValue"])
    if "doubleValue" in v:
        return float(v["doubleValue"])
    if "boolValue" in v:
        return bool(v["boolValue"])
    if "arrayValue" in v:
        return [any_value(x) for x in v["arrayValue"].get("values", ())]
    if "kvlistValue" in v:
        return attributes(v["kvlistValue"].get("values", ()))
    if "bytesValue" in v:
        return v["bytesValue"]  # base64 text; no pushkv attribute is bytes
    return None  # an empty AnyValue is legal OTLP


def attributes(kvs: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    return {kv["key"]: any_value(kv.get("value", {})) for kv in kvs}


def _hex_id(raw: Any, nbytes: int, what: str) -> str:
    """OTLP/JSON ids are lowercase hex; accept protobuf's default base64 too."""
    if not isinstance(raw, str) or not raw:
        raise OtlpFormatError(f"{what} missing or not a string: {raw!r}")
    if len(raw) == 2 * nbytes:
        try:
            bytes.fromhex(raw)
            return raw.lower()
        except ValueError:
            pass  # not hex after all: it may still be base64, tried below
    try:
        decoded = base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError):
        decoded = b""
    if len(decoded) != nbytes:
        raise OtlpFormatError(f"{what} is neither {2 * nbytes} hex digits nor base64: {raw!r}")
    return decoded.hex()


def _nanos(raw: Any, what: str) -> int:
    # proto3 JSON leaves zero values out, so an absent time is 0, not an error
    try:
        return int(raw)
    except (TypeError, ValueError):
        raise OtlpFormatError(f"{what} is not unix nanos: {raw!r}") from None


def parse_span(sp: Mapping[str, Any], resource: Mapping[str, Any]) -> SpanRecord:
    name = sp.get("name", "")
    parent = sp.get("parentSpanId") or None
    status = sp.get("status") or {}
    try:
        code = StatusCode(int(status.get("code", 0)))
    except ValueError:
        # protobuf without use_integers_for_enums writes "STATUS_CODE_ERROR"
        code = StatusCode.ERROR if "ERROR" in str(status.get("code")) else StatusCode.UNSET
    return SpanRecord(
        trace_id=_hex_id(sp.get("traceId"), 16, f"traceId of span {name!r}"),
        span_id=_hex_id(sp.get("spanId"), 8, f"spanId of span {name!r}"),
        parent_span_id=_hex_id(parent, 8, f"parentSpanId of span {name!r}") if parent else None,
        name=name,
        kind=int(sp.get("kind", 0)) if str(sp.get("kind", 0)).isdigit() else 0,
        start_ns=_nanos(sp.get("startTimeUnixNano", 0), f"startTimeUnixNano of {name!r}"),
        end_ns=_nanos(sp.get("endTimeUnixNano", 0), f"endTimeUnixNano of {name!r}"),
        status=code,
        status_message=status.get("message", ""),
        attributes=attributes(sp.get("attributes", ())),
        events=tuple(
            SpanEvent(
                ev.get("name", ""),
                _nanos(ev.get("timeUnixNano", 0), f"event of {name!r}"),
                attributes(ev.get("attributes", ())),
            )
            for ev in sp.get("events", ())
        ),
        resource=resource,
    )


def parse_traces_data(doc: Mapping[str, Any]) -> list[SpanRecord]:
    """Every span of one ``TracesData`` (``{"resourceSpans": [...]}``)."""
    if not isinstance(doc, Mapping) or not isinstance(doc.get("resourceSpans", []), list):
        raise OtlpFormatError("expected an object with a resourceSpans list")
    out: list[SpanRecord] = []
    for rs in doc.get("resourceSpans", ()):
        resource = attributes((rs.get("resource") or {}).get("attributes", ()))
        for ss in rs.get("scopeSpans", ()):
            for sp in ss.get("spans", ()):
                out.append(parse_span(sp, resource))
    return out


def _identity(sp: SpanRecord) -> tuple[str, str, int, int, str]:
    return (sp.span_id, sp.name, sp.start_ns, sp.end_ns, sp.service)


def group_traces(spans: Iterable[SpanRecord]) -> list[Trace]:
    """Spans grouped by trace id; traces in order of their first span's start. A span seen
    twice (overlapping Jaeger pages, a re-read file) is kept once; distinct spans that
    share an id (processes whose id generators were seeded alike) are all kept."""
    by_id: dict[str, dict[tuple[str, str, int, int, str], SpanRecord]] = {}
    for sp in spans:
        by_id.setdefault(sp.trace_id, {}).setdefault(_identity(sp), sp)
    traces = [
        Trace(tid, tuple(sorted(sps.values(), key=lambda s: (s.start_ns, -s.end_ns))))
        for tid, sps in by_id.items()
    ]
    traces.sort(key=lambda t: t.spans[0].start_ns)
    return traces


def shared_span_ids(trace: Trace) -> dict[str, int]:
    """Span ids that more than one distinct span of ``trace`` carries, with how many."""
    counts: dict[str, int] = {}
    for sp in trace.spans:
        counts[sp.span_id] = counts.get(sp.span_id, 0) + 1
    return {i: n for i, n in counts.items() if n > 1}

"""OTLP JSON-lines span exporter: the default sink, readable with no Docker.

Owns: ``JsonLinesSpanExporter``, one file per process, each line one OTLP ``TracesData`` in
OTLP/JSON (hex ids, integer enums), as the OTLP file-exporter spec says; ``encode_line``
builds it straight from the SDK's spans (it runs in vLLM's processes, next to the engine
loop), and is tested equal to ``encode_line_reference``: OpenTelemetry's own protobuf
encoder plus protobuf's JSON mapping, three to four times slower. Never raises into the host: an
export that fails is logged once and reported as FAILURE.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.trace import SpanKind, StatusCode

logger = logging.getLogger(__name__)

_ID_KEYS = ("traceId", "spanId", "parentSpanId")


def hex_ids(d: dict[str, Any]) -> dict[str, Any]:
    """protobuf's JSON mapping writes bytes as base64; OTLP/JSON wants lowercase hex."""
    for rs in d.get("resourceSpans", ()):
        for ss in rs.get("scopeSpans", ()):
            for sp in ss.get("spans", ()):
                for k in _ID_KEYS:
                    if sp.get(k):
                        sp[k] = base64.b64decode(sp[k]).hex()
                for link in sp.get("links", ()):
                    for k in ("traceId", "spanId"):
                        if link.get(k):
                            link[k] = base64.b64decode(link[k]).hex()
    return d


def encode_line_reference(spans: Sequence[ReadableSpan]) -> str:
    """One OTLP/JSON TracesData line through OpenTelemetry's own protobuf encoder and
    protobuf's JSON mapping: the reference ``encode_line`` is tested against (its
    ``MessageToDict`` walk is the slow part, and it runs in the engine's process)."""
    from google.protobuf.json_format import MessageToDict
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    d = MessageToDict(encode_spans(spans), use_integers_for_enums=True)
    return json.dumps(hex_ids(d), separators=(",", ":")) + "\n"


def encode_line(spans: Sequence[ReadableSpan]) -> str:
    """One OTLP/JSON TracesData line for ``spans``: the same objects as
    ``encode_line_reference`` (OTLP's proto3 JSON mapping: defaults omitted, 64-bit
    integers as strings, hex ids), built straight from the SDK's spans."""
    groups: dict[Any, dict[Any, list[dict[str, Any]]]] = {}
    for span in spans:
        groups.setdefault(span.resource, {}).setdefault(
            span.instrumentation_scope or None, []
        ).append(_span(span))
    resource_spans = []
    for resource, scopes in groups.items():
        scope_spans = []
        for scope, encoded in scopes.items():
            ss: dict[str, Any] = {"scope": _scope(scope), "spans": encoded}
            if scope is not None and scope.schema_url:
                ss["schemaUrl"] = scope.schema_url
            scope_spans.append(ss)
        rs: dict[str, Any] = {
            "resource": _attrs_obj(resource.attributes),
            "scopeSpans": scope_spans,
        }
        if resource.schema_url:
            rs["schemaUrl"] = resource.schema_url
        resource_spans.append(rs)
    return json.dumps({"resourceSpans": resource_spans}, separators=(",", ":")) + "\n"


def _value(v: Any) -> dict[str, Any]:
    if v is None:
        return {}
    if isinstance(v, bool):
        return {"boolValue": v}
    if isinstance(v, str):  # a oneof member: written even when empty or zero
        return {"stringValue": v}
    if isinstance(v, int):
        return {"intValue": str(v)}
    if isinstance(v, float):
        return {"doubleValue": v}
    if isinstance(v, bytes):
        return {"bytesValue": base64.b64encode(v).decode()}
    if isinstance(v, (list, tuple)):
        return {"arrayValue": {"values": [_value(x) for x in v]} if v else {}}
    return {"kvlistValue": {"values": [{"key": str(k), "value": _value(x)} for k, x in v.items()]}}


def _attrs(attributes: Any) -> list[dict[str, Any]]:
    return [{"key": k, "value": _value(v)} for k, v in (attributes or {}).items()]


def _attrs_obj(attributes: Any) -> dict[str, Any]:
    out = _attrs(attributes)
    return {"attributes": out} if out else {}


def _scope(scope: Any) -> dict[str, Any]:
    if scope is None:
        return {}
    out: dict[str, Any] = {}
    if scope.name:
        out["name"] = scope.name
    if scope.version:
        out["version"] = scope.version
    out.update(_attrs_obj(scope.attributes))
    return out


def _flags(parent: Any) -> int:
    return 0x300 if parent is not None and parent.is_remote else 0x100  # SpanFlags masks


# Enum.value is a descriptor call per read, on the exporter's hot path (a lookup table is
# cheaper); the SDK's INTERNAL=0..., OTLP's INTERNAL=1...
_KIND = {k: k.value + 1 for k in SpanKind}
_STATUS = {c: c.value for c in StatusCode}


def _span(span: ReadableSpan) -> dict[str, Any]:
    ctx = span.get_span_context()
    assert ctx is not None  # an ended span always has its context
    out: dict[str, Any] = {
        "traceId": format(ctx.trace_id, "032x"),
        "spanId": format(ctx.span_id, "016x"),
    }
    if ctx.trace_state:
        out["traceState"] = ",".join(f"{k}={v}" for k, v in ctx.trace_state.items())
    if span.parent is not None:
        out["parentSpanId"] = format(span.parent.span_id, "016x")
    out["name"] = span.name
    out["kind"] = _KIND[span.kind]
    out["startTimeUnixNano"] = str(span.start_time)
    out["endTimeUnixNano"] = str(span.end_time)
    if span.attributes:
        out["attributes"] = _attrs(span.attributes)
    if span.dropped_attributes:
        out["droppedAttributesCount"] = span.dropped_attributes
    if span.events:
        events = []
        for e in span.events:
            ev: dict[str, Any] = {"timeUnixNano": str(e.timestamp), "name": e.name}
            if e.attributes:
                ev["attributes"] = _attrs(e.attributes)
            if e.dropped_attributes:
                ev["droppedAttributesCount"] = e.dropped_attributes
            events.append(ev)
        out["events"] = events
    if span.dropped_events:
        out["droppedEventsCount"] = span.dropped_events
    if span.links:
        links = []
        for link in span.links:
            lk: dict[str, Any] = {
                "traceId": format(link.context.trace_id, "032x"),
                "spanId": format(link.context.span_id, "016x"),
            }
            if link.attributes:
                lk["attributes"] = _attrs(link.attributes)
            if link.dropped_attributes:
                lk["droppedAttributesCount"] = link.dropped_attributes
            lk["flags"] = _flags(link.context)
            links.append(lk)
        out["links"] = links
    if span.dropped_links:
        out["droppedLinksCount"] = span.dropped_links
    status: dict[str, Any] = {}
    if span.status is not None:
        if span.status.description:
            status["message"] = span.status.description
        if code := _STATUS[span.status.status_code]:
            status["code"] = code
    out["status"] = status
    out["flags"] = _flags(span.parent)
    return out


class JsonLinesSpanExporter(SpanExporter):
    """Append spans to ``path`` as OTLP JSON lines. One writer per file: processes never
    share a file (a long line may take several write() calls)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed in shutdown)
        self._lock = threading.Lock()
        self._failed_once = False

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if not spans:
            return SpanExportResult.SUCCESS
        try:
            line = encode_line(spans)
            with self._lock:
                self._file.write(line)
                self._file.flush()
        except Exception:  # telemetry must never break the engine
            if not self._failed_once:
                self._failed_once = True
                logger.exception("Writing spans to %s failed", self.path)
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        with self._lock:
            if not self._file.closed:
                self._file.flush()
        return True

    def shutdown(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.close()

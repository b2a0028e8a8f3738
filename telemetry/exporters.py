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
    integers as strings, hex ids), built from each span's ``SpanRecords`` record."""
    records = SpanRecords()
    rows = [records.record(span) for span in spans]
    return encode_records(records.headers, rows)


# -------------------------------------------------------------------- raw span records
# A finished span as plain tuples, dicts, strings and numbers (what ``marshal`` writes):
# taken on the thread that ends the span, encoded as JSON elsewhere (telemetry/span_pipe.py
# sends them to telemetry/sink.py, a process of its own). Field order of a record:
# trace id, span id, trace state (pairs or None), parent span id (or None), parent remote,
# name, OTLP kind, start, end, attributes (dict or None), dropped attributes, events
# ((name, time, attributes, dropped) or None), dropped events, links ((trace id, span id,
# remote, attributes, dropped) or None), dropped links, status code, status message.
Header = tuple[int, dict[str, Any], str, tuple[str, str, str, dict[str, Any]] | None]
Row = tuple[int, tuple[Any, ...]]  # (group id, record)


class SpanRecords:
    """Records of spans, and the table of their (resource, scope) groups: a group's header
    is made once (a Resource's own hash dumps its attributes as JSON), rows name it by id.
    ``record`` may run on any thread; ``headers`` only grows."""

    def __init__(self) -> None:
        self.headers: dict[int, Header] = {}
        self._groups: dict[tuple[int, int], int] = {}
        self._resources: dict[int, Any] = {}
        self._keep: list[Any] = []  # the keyed objects stay alive, so their ids stay theirs
        self._lock = threading.Lock()

    def group(self, resource: Any, scope: Any) -> int:
        """The id of the group of ``resource`` and ``scope`` (made on first use)."""
        # Equal resources and scopes share a group (tracers of one name, e.g. a scheduler's
        # and a worker's in one process, write one scopeSpans), as OpenTelemetry's encoder does.
        with self._lock:
            if (gid := self._groups.get((id(resource), id(scope)))) is not None:
                return gid
            self._keep.append((resource, scope))
            rid = next((i for i, r in self._resources.items() if r == resource), None)
            if rid is None:
                rid = len(self._resources)
                self._resources[rid] = resource
            sc = None
            if scope is not None:
                sc = (
                    scope.name,
                    scope.version or "",
                    scope.schema_url or "",
                    dict(scope.attributes or {}),
                )
            header = (rid, dict(resource.attributes), resource.schema_url or "", sc)
            gid = next((g for g, h in self.headers.items() if h == header), len(self.headers))
            self.headers[gid] = header
            self._groups[(id(resource), id(scope))] = gid
            return gid

    def record(self, span: ReadableSpan) -> Row:
        # Private fields: the public properties copy (events, links) or wrap (attributes).
        s: Any = span
        key = (id(s._resource), id(s._instrumentation_scope))
        gid = self._groups.get(key)
        if gid is None:
            gid = self.group(s._resource, s._instrumentation_scope)
        ctx, parent, attrs, status = s._context, s._parent, s._attributes, s._status
        ts = ctx.trace_state
        events = None
        if s._events:
            events = tuple(
                (
                    e.name,
                    e.timestamp,
                    dict(e.attributes) if e.attributes else None,
                    e.dropped_attributes,
                )
                for e in s._events
            )
        links = None
        if s._links:
            links = tuple(
                (
                    lk.context.trace_id,
                    lk.context.span_id,
                    lk.context.is_remote,
                    dict(lk.attributes) if lk.attributes else None,
                    lk.dropped_attributes,
                )
                for lk in s._links
            )
        return gid, (
            ctx.trace_id,
            ctx.span_id,
            tuple(ts.items()) if ts else None,
            None if parent is None else parent.span_id,
            parent is not None and parent.is_remote,
            s._name,
            _KIND[s._kind],
            s._start_time,
            s._end_time,
            dict(attrs) if attrs else None,
            span.dropped_attributes,
            events,
            span.dropped_events,
            links,
            span.dropped_links,
            0 if status is None else _STATUS[status.status_code],
            None if status is None else status.description,
        )


def encode_records(headers: dict[int, Header], rows: Sequence[Row]) -> str:
    """One OTLP/JSON TracesData line for ``rows`` (``SpanRecords.record``), grouped by
    resource and scope in the order they first appear."""
    groups: dict[int, dict[int, list[dict[str, Any]]]] = {}
    for gid, rec in rows:
        groups.setdefault(headers[gid][0], {}).setdefault(gid, []).append(_span(rec))
    resource_spans = []
    for scopes in groups.values():
        scope_spans = []
        rs: dict[str, Any] = {}
        for gid, encoded in scopes.items():
            _, res_attrs, res_schema, scope = headers[gid]
            ss: dict[str, Any] = {"scope": _scope(scope), "spans": encoded}
            if scope is not None and scope[2]:
                ss["schemaUrl"] = scope[2]
            scope_spans.append(ss)
            rs = {"resource": _attrs_obj(res_attrs), "scopeSpans": scope_spans}
            if res_schema:
                rs["schemaUrl"] = res_schema
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


def _scope(scope: tuple[str, str, str, dict[str, Any]] | None) -> dict[str, Any]:
    if scope is None:
        return {}
    name, version, _, attributes = scope
    out: dict[str, Any] = {}
    if name:
        out["name"] = name
    if version:
        out["version"] = version
    out.update(_attrs_obj(attributes))
    return out


# Enum.value is a descriptor call per read, on the recording path (a lookup table is
# cheaper); the SDK's INTERNAL=0..., OTLP's INTERNAL=1...
_KIND = {k: k.value + 1 for k in SpanKind}
_STATUS = {c: c.value for c in StatusCode}
_LOCAL, _REMOTE = 0x100, 0x300  # SpanFlags masks: context has is_remote, and it is false/true


def _span(rec: tuple[Any, ...]) -> dict[str, Any]:
    (tid, sid, ts, psid, premote, name, kind, start, end, attrs, dattrs) = rec[:11]
    (events, devents, links, dlinks, code, message) = rec[11:]
    out: dict[str, Any] = {"traceId": format(tid, "032x"), "spanId": format(sid, "016x")}
    if ts:
        out["traceState"] = ",".join(f"{k}={v}" for k, v in ts)
    if psid is not None:
        out["parentSpanId"] = format(psid, "016x")
    out["name"] = name
    out["kind"] = kind
    out["startTimeUnixNano"] = str(start)
    out["endTimeUnixNano"] = str(end)
    if attrs:
        out["attributes"] = _attrs(attrs)
    if dattrs:
        out["droppedAttributesCount"] = dattrs
    if events:
        evs = []
        for e_name, e_time, e_attrs, e_dropped in events:
            ev: dict[str, Any] = {"timeUnixNano": str(e_time), "name": e_name}
            if e_attrs:
                ev["attributes"] = _attrs(e_attrs)
            if e_dropped:
                ev["droppedAttributesCount"] = e_dropped
            evs.append(ev)
        out["events"] = evs
    if devents:
        out["droppedEventsCount"] = devents
    if links:
        lks = []
        for l_tid, l_sid, l_remote, l_attrs, l_dropped in links:
            lk: dict[str, Any] = {"traceId": format(l_tid, "032x"), "spanId": format(l_sid, "016x")}
            if l_attrs:
                lk["attributes"] = _attrs(l_attrs)
            if l_dropped:
                lk["droppedAttributesCount"] = l_dropped
            lk["flags"] = _REMOTE if l_remote else _LOCAL
            lks.append(lk)
        out["links"] = lks
    if dlinks:
        out["droppedLinksCount"] = dlinks
    status: dict[str, Any] = {}
    if message:
        status["message"] = message
    if code:
        status["code"] = code
    out["status"] = status
    out["flags"] = _REMOTE if psid is not None and premote else _LOCAL
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

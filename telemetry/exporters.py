"""OTLP JSON-lines span exporter: the default sink, readable with no Docker.

Owns: ``JsonLinesSpanExporter``, one file per process, each line one OTLP ``TracesData``
encoded with OpenTelemetry's own protobuf encoder and converted to OTLP/JSON (hex ids,
integer enums), as the OTLP file-exporter spec says. Never raises into the host: an export
that fails is logged once and reported as FAILURE.
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


def encode_line(spans: Sequence[ReadableSpan]) -> str:
    """One OTLP/JSON TracesData line for ``spans``."""
    from google.protobuf.json_format import MessageToDict
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    d = MessageToDict(encode_spans(spans), use_integers_for_enums=True)
    return json.dumps(hex_ids(d), separators=(",", ":")) + "\n"


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

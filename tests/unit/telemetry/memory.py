"""An in-memory tracer for span tests: the real SDK, spans kept in a list."""

from __future__ import annotations

from typing import Any

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from telemetry.schema import Span


class Recorder:
    def __init__(self, sampler: Any = None) -> None:
        self.exporter = InMemorySpanExporter()
        self.provider = TracerProvider(sampler=sampler)
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.tracer = self.provider.get_tracer("test")

    def spans(self) -> list[ReadableSpan]:
        return list(self.exporter.get_finished_spans())

    def named(self, name: Span) -> list[ReadableSpan]:
        return [s for s in self.spans() if s.name == name.value]

    def one(self, name: Span) -> ReadableSpan:
        found = self.named(name)
        assert len(found) == 1, (
            f"{name.value}: {len(found)} spans, want 1: {[s.name for s in self.spans()]}"
        )
        return found[0]

    def names(self) -> list[str]:
        return sorted(s.name for s in self.spans())

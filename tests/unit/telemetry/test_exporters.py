"""The JSON-lines exporter writes OTLP/JSON (hex ids, integer enums) that parses back."""

from __future__ import annotations

import json
from pathlib import Path

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import SpanKind, StatusCode

from telemetry.exporters import JsonLinesSpanExporter
from telemetry.schema import Attr, Span
from telemetry.setup import setup_tracing


def test_spans_round_trip_as_otlp_json(tmp_path: Path) -> None:
    path = tmp_path / "run" / "traces-test.jsonl"
    exporter = JsonLinesSpanExporter(path)
    provider = TracerProvider(resource=Resource.create({"service.name": "pushkv-test"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("pushkv")
    with tracer.start_as_current_span(Span.REQUEST.value, kind=SpanKind.SERVER) as root:
        child = tracer.start_span(
            Span.WRITE.value, start_time=1_000, attributes={Attr.BYTES.value: 4096}
        )
        child.set_status(StatusCode.ERROR, "lease_expired")
        child.end(end_time=2_000)
    provider.shutdown()
    lines = path.read_text().splitlines()
    spans = [
        sp
        for line in lines
        for rs in json.loads(line)["resourceSpans"]
        for ss in rs["scopeSpans"]
        for sp in ss["spans"]
    ]
    by_name = {sp["name"]: sp for sp in spans}
    write, req = by_name[Span.WRITE.value], by_name[Span.REQUEST.value]
    assert write["traceId"] == format(root.get_span_context().trace_id, "032x")
    assert write["parentSpanId"] == req["spanId"] and len(req["spanId"]) == 16
    assert req["kind"] == 2 and write["status"]["code"] == 2
    assert (int(write["startTimeUnixNano"]), int(write["endTimeUnixNano"])) == (1_000, 2_000)
    assert {"key": Attr.BYTES.value, "value": {"intValue": "4096"}} in write["attributes"]


def test_setup_defaults_to_one_file_per_process(tmp_path: Path, monkeypatch) -> None:
    for var in (
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "OTEL_SDK_DISABLED",
    ):
        monkeypatch.delenv(var, raising=False)
    provider = setup_tracing("pushkv-unit", role="router", run_dir=tmp_path, set_global=False)
    provider.get_tracer("t").start_span("x").end()
    provider.shutdown()
    (f,) = tmp_path.glob("traces-pushkv-unit-*.jsonl")
    assert "resourceSpans" in f.read_text()


def test_setup_can_be_disabled(monkeypatch) -> None:
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert setup_tracing("x", role="router", set_global=False) is None


def test_span_ids_do_not_follow_the_random_module(tmp_path) -> None:
    """vLLM seeds ``random`` identically in P's and D's processes; ids must still differ."""
    import random

    from telemetry.setup import setup_tracing

    ids = []
    for _ in range(2):
        random.seed(0)
        provider = setup_tracing("t", role="test", run_dir=tmp_path, set_global=False)
        with provider.get_tracer("t").start_as_current_span("s") as span:
            ids.append(span.get_span_context().span_id)
        provider.shutdown()
    assert ids[0] != ids[1]


def test_fast_encoder_equals_opentelemetry_encoder() -> None:
    """encode_line (ours, fast) and encode_line_reference (OpenTelemetry's protobuf encoder
    and protobuf's JSON mapping) give the same objects, for every shape of span we make."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import Link

    from telemetry.emit import emit, parent_context
    from telemetry.exporters import encode_line, encode_line_reference
    from telemetry.schema import Event

    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "enc", "n": 3}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    other = TracerProvider(resource=Resource.create({"service.name": "other"}))
    other.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("pushkv", "1.0")
    remote = parent_context("00-" + "ab" * 16 + "-" + "cd" * 8 + "-01", "k=v")
    with tracer.start_as_current_span(
        Span.REQUEST.value,
        kind=SpanKind.SERVER,
        attributes={"b": True, "f": 0.5, "i": 0, "s": "", "seq": [1, 2], "strs": ("a", "b")},
    ) as root:
        root.add_event(Event.FIRST_CHUNK.value, {"n": 1}, timestamp=5)
        root.set_status(StatusCode.ERROR, "boom")
        emit(
            tracer,
            Span.WRITE,
            parent=remote,
            start_ns=1,
            end_ns=2,
            attributes={Attr.BYTES: 4096, Attr.GBPS: 1.0},
            error="write_error",
        )
        emit(tracer, Span.PREFILL, parent=None, start_ns=3, end_ns=4, events=[(Event.SCHEDULED, 3)])
        tracer.start_span(
            "linked", links=[Link(root.get_span_context(), {"x": "y"})], kind=SpanKind.CLIENT
        ).end()
    other.get_tracer("o").start_span("o", kind=SpanKind.PRODUCER).end()
    spans = memory.get_finished_spans()
    assert len(spans) == 5
    assert json.loads(encode_line(spans)) == json.loads(encode_line_reference(spans))


def test_parent_contexts_are_parsed_once_and_bad_ones_rejected() -> None:
    from opentelemetry import trace

    from telemetry.emit import _parsed, parent_context

    tp = "00-" + "12" * 16 + "-" + "34" * 8 + "-01"
    first = parent_context(tp, "k=v")
    assert first is not None and parent_context(tp, "k=v") is first  # the cached parse
    sc = trace.get_current_span(first).get_span_context()
    assert (sc.trace_id, sc.span_id, sc.is_remote) == (int("12" * 16, 16), int("34" * 8, 16), True)
    assert parent_context("00-" + "0" * 32 + "-" + "34" * 8 + "-01") is None  # invalid trace id
    assert parent_context("garbage") is None and parent_context(None) is None
    held = _parsed.cache_info().currsize
    parent_context(tp, "k=" + "v" * 100_000)  # parsed (the propagator drops the state), not kept
    assert _parsed.cache_info().currsize == held

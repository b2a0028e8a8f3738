"""The JSON-lines sink process: what it writes equals the in-process encoder's output, emit's
direct path records the same span as the SDK, and no span is lost when the sink dies."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from telemetry.emit import emit, parent_context
from telemetry.exporters import encode_line
from telemetry.schema import Attr, Event, Span
from telemetry.setup import setup_tracing
from telemetry.span_pipe import PipeSpanProcessor

REMOTE = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"


@pytest.fixture(autouse=True)
def _json_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in (
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "OTEL_SDK_DISABLED",
        "PUSHKV_SPAN_SINK",
    ):
        monkeypatch.delenv(var, raising=False)


def _spans(path: Path) -> list[dict[str, Any]]:
    return [
        sp
        for line in path.read_text().splitlines()
        for rs in json.loads(line)["resourceSpans"]
        for ss in rs["scopeSpans"]
        for sp in ss["spans"]
    ]


def _emit_all(tracer: Any) -> None:
    remote = parent_context(REMOTE, "k=v")
    emit(
        tracer,
        Span.WRITE,
        parent=remote,
        start_ns=10,
        end_ns=5,  # clamped to a zero-length span
        attributes={Attr.BYTES: 4096, Attr.GBPS: 1.5, Attr.TRANSFER_ID: "t", Attr.REASON: None},
        events=[(Event.SCHEDULED, 3), (Event.FIRST_CHUNK, 0), (Event.FIRST_CHUNK, 12)],
        error="write_error",
    )
    emit(tracer, Span.PREFILL, parent=None, start_ns=1, end_ns=2, kind=SpanKind.SERVER)


def test_direct_path_writes_what_the_sdk_span_would(tmp_path: Path) -> None:
    provider = setup_tracing("pipe", role="test", run_dir=tmp_path, set_global=False)
    tracer = provider.get_tracer("pushkv")
    assert tracer.pushkv_emit is not None
    _emit_all(tracer)
    provider.shutdown()
    (path,) = tmp_path.glob("traces-pipe-*.jsonl")
    got = _spans(path)

    memory = InMemorySpanExporter()
    sdk = TracerProvider(resource=provider.resource)
    sdk.add_span_processor(SimpleSpanProcessor(memory))
    _emit_all(sdk.get_tracer("pushkv"))
    want = [sp for line in [encode_line(memory.get_finished_spans())] for sp in _spans_of(line)]

    assert len(got) == len(want) == 2
    for g, w in zip(got, want, strict=True):
        for k in ("spanId",) + (("traceId",) if "parentSpanId" not in w else ()):
            assert len(g.pop(k)) == len(w.pop(k))  # fresh ids, of the right size
        assert g == w


def _spans_of(line: str) -> list[dict[str, Any]]:
    return [
        sp
        for rs in json.loads(line)["resourceSpans"]
        for ss in rs["scopeSpans"]
        for sp in ss["spans"]
    ]


def test_sink_writes_the_same_line_as_the_encoder(tmp_path: Path) -> None:
    memory = InMemorySpanExporter()
    pipe = PipeSpanProcessor(tmp_path / "out.jsonl", delay_s=60)
    provider = TracerProvider(resource=Resource.create({"service.name": "s", "n": 1}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    provider.add_span_processor(pipe)  # two processors: emit takes the SDK's path
    tracer = provider.get_tracer("pushkv", "1.0")
    with tracer.start_as_current_span("root", attributes={"seq": [1, 2]}) as root:
        root.add_event("e", {"a": "b"}, timestamp=7)
        _emit_all(tracer)
    assert pipe.force_flush(10_000)
    line = (tmp_path / "out.jsonl").read_text()
    assert json.loads(line) == json.loads(encode_line(memory.get_finished_spans()))
    provider.shutdown()


def test_no_span_is_lost_when_the_sink_dies(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    pipe = PipeSpanProcessor(path, delay_s=60)
    provider = TracerProvider()
    provider.add_span_processor(pipe)
    tracer = provider.get_tracer("t")
    tracer.start_span("before").end()
    assert pipe.force_flush(10_000)
    assert pipe._proc is not None
    os.kill(pipe._proc.pid, signal.SIGKILL)
    pipe._proc.wait(timeout=10)
    for i in range(3):
        tracer.start_span(f"after-{i}").end()
    pipe.force_flush(10_000)  # the write fails: this batch is encoded here
    tracer.start_span("last").end()
    provider.shutdown()
    names = sorted(sp["name"] for sp in _spans(path))
    assert names == ["after-0", "after-1", "after-2", "before", "last"]


def test_sink_ends_with_its_writer_and_keeps_what_it_got(tmp_path: Path) -> None:
    """The engine process killed with SIGKILL: its end of the pipe closes, the sink drains."""
    path = tmp_path / "out.jsonl"
    pipe = PipeSpanProcessor(path, delay_s=60)
    provider = TracerProvider()
    provider.add_span_processor(pipe)
    provider.get_tracer("t").start_span("s").end()
    pipe._send()  # in the pipe, not yet acknowledged
    assert pipe._proc is not None and pipe._proc.stdin is not None
    pipe._proc.stdin.close()  # what a SIGKILL of this process would do
    assert pipe._proc.wait(timeout=10) == 0
    assert [sp["name"] for sp in _spans(path)] == ["s"]


def test_a_forked_child_does_not_keep_the_sink_open(tmp_path: Path) -> None:
    """vLLM forks workers: the sink must still end when its own process closes the pipe."""
    pipe = PipeSpanProcessor(tmp_path / "out.jsonl", delay_s=60)
    provider = TracerProvider()
    provider.add_span_processor(pipe)
    provider.get_tracer("t").start_span("s").end()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: waits until the parent is done, records nothing
        os.close(write_end)
        os.read(read_end, 1)
        os._exit(0)
    os.close(read_end)
    try:
        provider.shutdown()  # waits for the sink: it ends although the child still runs
        assert pipe._proc is not None and pipe._proc.returncode == 0
    finally:
        os.close(write_end)
        os.waitpid(pid, 0)
    assert [sp["name"] for sp in _spans(tmp_path / "out.jsonl")] == ["s"]


def _written(path: Path) -> int:
    """Spans in the sink's file so far (a line still being written counts none)."""
    try:
        return len(_spans(path))
    except (FileNotFoundError, json.JSONDecodeError):
        return 0


def test_spans_go_out_within_the_delay_and_an_idle_thread_never_wakes(tmp_path: Path) -> None:
    """The sending thread blocks with no timeout while nothing is queued (an idle engine pays
    no wake-ups), yet every span, spans on the direct path too, is sent within the delay."""
    path = tmp_path / "out.jsonl"
    pipe = PipeSpanProcessor(path, delay_s=0.01)
    provider = TracerProvider()
    provider.add_span_processor(pipe)
    tracer = provider.get_tracer("t")
    waits: list[float | None] = []
    real_wait = pipe._wake.wait

    def counting_wait(timeout: float | None = None) -> bool:
        waits.append(timeout)
        return real_wait(timeout)

    pipe._wake.wait = counting_wait  # type: ignore[method-assign]
    pipe._wake.set()  # let the thread's first wait return into counting_wait
    for i, name in enumerate(("sdk", "direct", "sdk-again")):
        if name == "direct":
            emit(tracer, Span.PREFILL, parent=None, start_ns=1, end_ns=2)
        else:
            tracer.start_span(name).end()
        deadline = time.monotonic() + 10.0
        while _written(path) < i + 1:
            assert time.monotonic() < deadline, f"span {name} not sent without a flush"
            time.sleep(0.005)  # polling an outcome with a bound
    assert waits and all(t is None for t in waits), f"waits with a timeout: {waits}"
    n = len(waits)
    time.sleep(0.1)  # ten delays with nothing queued
    assert len(waits) == n, "an idle sending thread must not wake"
    provider.shutdown()
    assert not pipe._thread.is_alive()

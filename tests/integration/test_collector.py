"""``pushkv collect`` as a real OTLP/HTTP endpoint: the OpenTelemetry SDK's own OTLP/HTTP
exporter (protobuf, and gzip) sends to it, and what it writes reads back as OTLP JSON
lines with the same ids; bad bodies are 400s that write nothing."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import httpx
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from tests.collector_proc import running_collector


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def spans_of(records: list[dict]) -> list[dict]:
    return [
        sp
        for r in records
        for rs in r["resourceSpans"]
        for ss in rs["scopeSpans"]
        for sp in ss["spans"]
    ]


def send_spans(url: str, compression: Compression) -> tuple[str, list[str]]:
    provider = TracerProvider(resource=Resource.create({"service.name": "collector-test"}))
    provider.add_span_processor(
        SimpleSpanProcessor(OTLPSpanExporter(endpoint=f"{url}/v1/traces", compression=compression))
    )
    tracer = provider.get_tracer("t")
    with tracer.start_as_current_span("parent") as parent:
        with tracer.start_as_current_span("child", attributes={"k": 7}):
            pass
    provider.shutdown()
    ctx = parent.get_span_context()
    return f"{ctx.trace_id:032x}", [f"{ctx.span_id:016x}"]


def test_sdk_exports_arrive_as_otlp_json_lines(tmp_path: Path) -> None:
    with running_collector(tmp_path) as c:
        trace_id, (parent_id,) = send_spans(c.url, Compression.NoCompression)
        gz_trace, _ = send_spans(c.url, Compression.Gzip)
        (f,) = c.files()
        spans = spans_of(lines(f))
        assert c.health()["spans"] == 4
    mine = {s["name"]: s for s in spans if s["traceId"] == trace_id}
    assert set(mine) == {"parent", "child"}
    assert mine["child"]["parentSpanId"] == parent_id == mine["parent"]["spanId"]
    assert mine["child"]["attributes"] == [{"key": "k", "value": {"intValue": "7"}}]
    assert {s["name"] for s in spans if s["traceId"] == gz_trace} == {"parent", "child"}


def test_bad_bodies_are_rejected_and_write_nothing(tmp_path: Path) -> None:
    with running_collector(tmp_path) as c:
        url = f"{c.url}/v1/traces"
        bad = [
            ({"content-type": "application/x-protobuf"}, b"\xff\xff\xff not protobuf"),
            ({"content-type": "application/json"}, b"{nope"),
            ({"content-type": "application/json"}, b'{"resourceSpans": 3}'),
            ({"content-type": "text/plain"}, b"hello"),
            ({"content-type": "application/json", "content-encoding": "gzip"}, b"not gz"),
        ]
        for headers, body in bad:
            r = httpx.post(url, content=body, headers=headers, trust_env=False)
            assert r.status_code == 400, (headers, body, r.text)
            assert r.json()["message"]
        ok = httpx.post(
            url,
            content=gzip.compress(b'{"resourceSpans": []}'),
            trust_env=False,
            headers={"content-type": "application/json", "content-encoding": "gzip"},
        )
        assert ok.status_code == 200
        health = c.health()
        assert health["rejected"] == len(bad) and health["exports"] == 1 and health["spans"] == 0
        (f,) = c.files()
        assert lines(f) == [{"resourceSpans": []}]

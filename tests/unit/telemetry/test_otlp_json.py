"""The OTLP JSON parser and the run-folder reader, on Jaeger's documented shape and our files."""

from __future__ import annotations

import base64
import dataclasses
import json
from pathlib import Path

import pytest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import SpanKind
from opentelemetry.trace import StatusCode as OtelStatus

from telemetry.exporters import JsonLinesSpanExporter
from telemetry.otlp_json import (
    OtlpFormatError,
    StatusCode,
    any_value,
    group_traces,
    parse_traces_data,
    shared_span_ids,
)
from telemetry.schema import Attr, Event, Span
from telemetry.traces import RunFolderError, find_runs, fingerprint, read_run
from tests.fixtures.traces import run_dirs, run_ids

# Jaeger's snapshot of GetTrace (cmd/jaeger/internal/extension/jaegerquery/internal/apiv3/snapshots)
JAEGER_SNAPSHOT = {
    "result": {
        "resourceSpans": [
            {
                "resource": {},
                "scopeSpans": [
                    {
                        "scope": {},
                        "spans": [
                            {
                                "kind": 2,
                                "name": "foobar",
                                "spanId": "0000000000000002",
                                "status": {"code": 2},
                                "traceId": "00000000000000000000000000000001",
                            }
                        ],
                    }
                ],
            }
        ]
    }
}


def test_jaeger_snapshot_parses() -> None:
    (sp,) = parse_traces_data(JAEGER_SNAPSHOT["result"])
    assert sp.trace_id == "00000000000000000000000000000001" and sp.span_id == "0000000000000002"
    assert sp.kind == 2 and sp.status is StatusCode.ERROR and sp.is_error
    assert sp.parent_span_id is None and sp.start_ns == 0 and sp.service == "unknown"


def test_any_value_kinds() -> None:
    assert any_value({"intValue": "9007199254740993"}) == 9007199254740993  # > 2**53: stays exact
    assert any_value({"doubleValue": 1.5}) == 1.5 and any_value({"boolValue": True}) is True
    assert any_value({"arrayValue": {"values": [{"stringValue": "a"}, {"intValue": "2"}]}}) == [
        "a",
        2,
    ]
    assert any_value(
        {"kvlistValue": {"values": [{"key": "k", "value": {"stringValue": "v"}}]}}
    ) == {"k": "v"}
    assert any_value({}) is None


def test_base64_ids_are_accepted_as_hex() -> None:
    doc = {
        "resourceSpans": [
            {
                "scopeSpans": [
                    {
                        "spans": [
                            {
                                "traceId": base64.b64encode(bytes(range(16))).decode(),
                                "spanId": base64.b64encode(bytes(range(8))).decode(),
                                "name": "x",
                                "startTimeUnixNano": "1",
                                "endTimeUnixNano": "2",
                            }
                        ]
                    }
                ]
            }
        ]
    }
    (sp,) = parse_traces_data(doc)
    assert sp.trace_id == bytes(range(16)).hex() and sp.span_id == bytes(range(8)).hex()


@pytest.mark.parametrize(
    "doc, words",
    [
        ([], "resourceSpans"),
        ({"resourceSpans": "nope"}, "resourceSpans"),
        (
            {
                "resourceSpans": [
                    {"scopeSpans": [{"spans": [{"traceId": "zz", "spanId": "00", "name": "w"}]}]}
                ]
            },
            "traceId of span 'w'",
        ),
        (
            {
                "resourceSpans": [
                    {
                        "scopeSpans": [
                            {
                                "spans": [
                                    {
                                        "traceId": "0" * 32,
                                        "spanId": "0" * 16,
                                        "name": "w",
                                        "startTimeUnixNano": "soon",
                                    }
                                ]
                            }
                        ]
                    }
                ]
            },
            "startTimeUnixNano",
        ),
    ],
)
def test_malformed_documents_say_what_is_wrong(doc: object, words: str) -> None:
    with pytest.raises(OtlpFormatError, match=words):
        parse_traces_data(doc)  # type: ignore[arg-type]


def test_sdk_spans_round_trip_through_our_exporter(tmp_path: Path) -> None:
    exporter = JsonLinesSpanExporter(tmp_path / "traces-pushkv-router-1.jsonl")
    provider = TracerProvider(
        resource=Resource.create({"service.name": "pushkv-router", Attr.TP_RANK.value: 3})
    )
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("t")
    root = tracer.start_span(
        Span.REQUEST.value,
        kind=SpanKind.SERVER,
        start_time=1_000,
        attributes={Attr.MODE.value: "push", Attr.INPUT_TOKENS.value: 7},
    )
    root.add_event(Event.FIRST_CHUNK.value, timestamp=1_500, attributes={"n": 1})
    from opentelemetry import trace

    child = tracer.start_span(
        Span.WRITE.value, context=trace.set_span_in_context(root), start_time=1_100
    )
    child.set_status(OtelStatus.ERROR, "write_error")
    child.end(end_time=1_400)
    root.end(end_time=2_000)
    provider.shutdown()
    run = read_run(tmp_path)
    (t,) = run.traces
    req, write = t.first(Span.REQUEST.value), t.first(Span.WRITE.value)
    assert req is not None and write is not None and not run.problems
    assert t.trace_id == format(root.get_span_context().trace_id, "032x")
    assert write.parent_span_id == req.span_id and req.kind == 2
    assert (req.start_ns, req.end_ns, write.start_ns, write.end_ns) == (1_000, 2_000, 1_100, 1_400)
    assert req.attributes == {Attr.MODE.value: "push", Attr.INPUT_TOKENS.value: 7}
    ev = req.event(Event.FIRST_CHUNK.value)
    assert ev is not None and ev.time_ns == 1_500 and ev.attributes == {"n": 1}
    assert write.is_error and write.status_message == "write_error"
    assert write.attr(Attr.TP_RANK.value) == 3  # falls back to the resource
    assert [s.name for s in t.spans] == [Span.REQUEST.value, Span.WRITE.value]  # by start


def test_partial_last_line_is_reported_not_raised(tmp_path: Path) -> None:
    src = run_dirs()[0]
    for f in src.glob("traces-*.jsonl"):
        (tmp_path / f.name).write_text(f.read_text())
    whole = read_run(tmp_path)
    victim = sorted(tmp_path.glob("traces-*.jsonl"))[0]
    with open(victim, "a") as fh:
        fh.write('{"resourceSpans": [{"scopeSp')  # a writer mid-line
    partial = read_run(tmp_path)
    assert len(partial.traces) == len(whole.traces)
    assert (
        len(partial.problems) == 1
        and "not JSON" in partial.problems[0]
        and victim.name in partial.problems[0]
    )


def test_missing_or_empty_folder_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(RunFolderError, match="does not exist"):
        read_run(tmp_path / "nope")
    with pytest.raises(RunFolderError, match="no traces-"):
        read_run(tmp_path)


def test_duplicate_spans_are_kept_once_but_colliding_ids_are_not_merged() -> None:
    (sp,) = parse_traces_data(JAEGER_SNAPSHOT["result"])
    (t,) = group_traces([sp, sp])
    assert len(t.spans) == 1 and not shared_span_ids(t)
    # two processes whose id generators were seeded alike (vLLM seeds `random`) pick one id
    other = dataclasses.replace(sp, name="other", start_ns=5, resource={"service.name": "d"})
    (t,) = group_traces([sp, other, sp])
    assert sorted(s.name for s in t.spans) == ["foobar", "other"]
    assert shared_span_ids(t) == {sp.span_id: 2}


def test_run_reports_colliding_span_ids(tmp_path: Path) -> None:
    line = json.loads(json.dumps(JAEGER_SNAPSHOT["result"]))
    twin = json.loads(json.dumps(line))
    twin["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["name"] = "twin"
    (tmp_path / "traces-a-1.jsonl").write_text(json.dumps(line) + "\n")
    (tmp_path / "traces-b-2.jsonl").write_text(json.dumps(twin) + "\n")
    run = read_run(tmp_path)
    assert len(run.traces[0].spans) == 2
    assert any("carried by different spans" in p and "seeded" in p for p in run.problems)


@pytest.mark.parametrize("run_dir", run_dirs(), ids=run_ids())
def test_every_fixture_run_reads_cleanly(run_dir: Path) -> None:
    run = read_run(run_dir)
    unreadable = [p for p in run.problems if "span id(s) are carried by different spans" not in p]
    assert run.traces and not unreadable
    raw_spans = sum(
        len(ss["spans"])
        for f in run.files
        for line in f.read_text().splitlines()
        for rs in json.loads(line)["resourceSpans"]
        for ss in rs["scopeSpans"]
    )
    assert sum(len(t.spans) for t in run.traces) == raw_spans
    for t in run.traces:
        assert all(sp.trace_id == t.trace_id for sp in t.spans)
        assert [sp.start_ns for sp in t.spans] == sorted(sp.start_ns for sp in t.spans)
    assert fingerprint(run_dir) and run_dir in find_runs(run_dir.parent)

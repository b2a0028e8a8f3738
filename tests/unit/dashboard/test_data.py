"""The dashboard's pure data layer: table columns and fallbacks, order, buckets, aggregates."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pandas as pd
import pytest

from dashboard.data import (
    CLIENT_COLUMNS,
    CLIENT_TTFTS_FILE,
    COLUMNS,
    OK,
    analyse,
    attention_order,
    decomposition,
    in_flight_at_arrival,
    load_run_folder,
    percentiles,
    pow2_bucket,
)
from telemetry.otlp_json import SpanRecord, StatusCode, Trace
from telemetry.schema import Attr, Resource, Span
from telemetry.traces import read_run
from tests.fixtures.traces import HERE, run_dirs, run_ids


@pytest.mark.parametrize("run_dir", run_dirs(), ids=run_ids())
def test_request_table_has_one_row_per_trace_failed_first(run_dir: Path) -> None:
    run = load_run_folder(run_dir)
    df = run.requests
    assert list(df.columns) == COLUMNS and len(df) == len(run.traces) - run.not_requests
    assert set(df["trace_id"]) == {
        tid for tid, t in run.traces.items() if t.first(Span.REQUEST.value)
    }
    failed = (df["outcome"] != OK).tolist()
    assert failed == sorted(failed, reverse=True)
    ok = df[df["outcome"] == OK]
    assert ok["ttft_ms"].tolist() == sorted(ok["ttft_ms"], reverse=True)
    assert (df.loc[df["outcome"] != OK, "flag"] == "failed").all()
    assert (df["load"] >= 1).all()


def test_columns_fall_back_to_spans_when_attributes_are_missing() -> None:
    traces = read_run(HERE / "gen-push").traces
    keep = {
        Attr.REQUEST_ID.value,
        Attr.MODE.value,
    }  # drop ttft/tpot/tokens/outcome from the request
    stripped = [
        Trace(
            t.trace_id,
            tuple(
                dataclasses.replace(
                    sp, attributes={k: v for k, v in sp.attributes.items() if k in keep}
                )
                if sp.name == Span.REQUEST.value
                else sp
                for sp in t.spans
            ),
        )
        for t in traces
    ]
    full, bare = analyse("a", list(traces)).requests, analyse("b", stripped).requests
    merged = full.merge(bare, on="trace_id", suffixes=("", "_fallback"))
    ok = merged[merged["outcome"] == OK]
    assert len(ok) and (ok["outcome_fallback"] == OK).all()
    assert ok["ttft_ms"].tolist() == pytest.approx(ok["ttft_ms_fallback"].tolist(), abs=1e-3)
    assert (
        merged["input_tokens"] == merged["input_tokens_fallback"]
    ).all()  # from P's prefill span
    assert set(merged.loc[merged["outcome"] != OK, "outcome_fallback"]) == {"error"}


def test_in_flight_at_arrival() -> None:
    # a: 0-10, b: 5-7, c: 8-20, d: 10-11 -> a alone; a+b; a+c (b ended); c+d (a ended at 10)
    assert in_flight_at_arrival([0, 5, 8, 10], [10, 7, 20, 11]) == [1, 2, 2, 2]


def test_attention_order_puts_failed_then_slow_first() -> None:
    df = pd.DataFrame(
        {"outcome": ["ok", "error", "ok", "cancelled"], "ttft_ms": [5.0, None, 9.0, None]}
    )
    assert attention_order(df)["outcome"].tolist() == ["error", "cancelled", "ok", "ok"]
    assert attention_order(df)["ttft_ms"].tolist()[2:] == [9.0, 5.0]


@pytest.mark.parametrize(
    "n, floor, label",
    [
        (1, 1, "1"),
        (2, 1, "2"),
        (3, 1, "3-4"),
        (64, 16, "33-64"),
        (65, 16, "65-128"),
        (10, 16, "1-16"),
        (None, 1, "unknown"),
    ],
)
def test_pow2_bucket(n: float | None, floor: int, label: str) -> None:
    assert pow2_bucket(n, floor) == label


@pytest.mark.parametrize("run_dir", run_dirs(), ids=run_ids())
@pytest.mark.parametrize("by", ["input_tokens", "load"])
def test_decomposition_stacks_add_up_to_mean_ttft(run_dir: Path, by: str) -> None:
    run = load_run_folder(run_dir)
    long = decomposition(run, by)
    if run.segments.empty:
        assert long.empty
        return
    stacked = long.groupby("bucket")["ms"].sum()
    reqs = run.requests.dropna(subset=["ttft_ms"])
    reqs = reqs.assign(
        bucket=reqs[by].map(lambda v: pow2_bucket(v, 16 if by == "input_tokens" else 1))
    )
    # router attribute ttft_ms and the trace's first-chunk TTFT agree to the microsecond
    mean_ttft = reqs.groupby("bucket")["ttft_ms"].mean()
    assert stacked.sort_index().tolist() == pytest.approx(mean_ttft.sort_index().tolist(), abs=1e-3)
    counts = long.groupby("bucket")["requests"].first()
    assert counts.sum() == len(reqs)


@pytest.mark.parametrize("run_dir", run_dirs(), ids=run_ids())
def test_percentiles_are_ordered(run_dir: Path) -> None:
    p = percentiles(load_run_folder(run_dir))
    assert "TTFT" in p.index
    assert (p["p50"] <= p["p90"] + 1e-9).all() and (p["p90"] <= p["p99"] + 1e-9).all()


def test_traces_without_a_request_span_are_counted_not_listed(tmp_path: Path) -> None:
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    from telemetry.exporters import JsonLinesSpanExporter

    for f in (HERE / "gen-push").glob("traces-*.jsonl"):
        (tmp_path / f.name).write_text(f.read_text())
    provider = TracerProvider(resource=Resource.create({"service.name": "pushkv-prefill"}))
    exporter = JsonLinesSpanExporter(tmp_path / "traces-pushkv-prefill-9.jsonl")
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    provider.get_tracer("t").start_span(
        Span.PREFILL.value
    ).end()  # e.g. the router's start-up probe
    provider.shutdown()
    run = load_run_folder(tmp_path)
    assert run.not_requests == 1 and len(run.requests) == len(run.traces) - 1
    orphan = next(tid for tid, t in run.traces.items() if t.first(Span.REQUEST.value) is None)
    assert orphan not in set(run.requests["trace_id"]) and run.paths[orphan] is None


def test_client_ttfts_beside_a_run_show_next_to_the_traces(tmp_path: Path) -> None:
    for f in (HERE / "gen-push").glob("traces-*.jsonl"):
        (tmp_path / f.name).write_bytes(f.read_bytes())
    plain = load_run_folder(tmp_path).requests
    ok = plain[plain["ttft_ms"].notna()]
    first, second = ok.iloc[0], ok.iloc[1]
    client = {first["request_id"]: first["ttft_ms"] + 7.5, second["request_id"]: 1.0}
    (tmp_path / CLIENT_TTFTS_FILE).write_text(json.dumps(client))
    df = load_run_folder(tmp_path).requests
    at = COLUMNS.index("ttft_ms") + 1
    assert list(df.columns) == [*COLUMNS[:at], *CLIENT_COLUMNS, *COLUMNS[at:]]
    by_id = df.set_index("request_id")
    assert by_id.loc[first["request_id"], "unaccounted_ms"] == pytest.approx(7.5)
    assert by_id.loc[second["request_id"], "client_ttft_ms"] == 1.0
    assert by_id["client_ttft_ms"].notna().sum() == 2, "requests the client did not time: NaN"
    (tmp_path / CLIENT_TTFTS_FILE).write_text("{not json")
    broken = load_run_folder(tmp_path)
    assert list(broken.requests.columns) == COLUMNS
    assert any(CLIENT_TTFTS_FILE in p for p in broken.problems)


def test_the_table_says_which_p_and_d_served() -> None:
    """From the router's request span; else (D alone, degraded: no P) the engines' address."""

    def span(name: str, attrs: dict[str, object], resource: dict[str, object]) -> SpanRecord:
        return SpanRecord(
            "t" * 32,
            name[:16].ljust(16, "0"),
            None,
            name,
            1,
            1,
            2,
            StatusCode.UNSET,
            "",
            attrs,
            (),
            resource,
        )

    routed = span(
        Span.REQUEST.value,
        {Attr.PREFILL_URL.value: "http://10.213.1.2:8100", Attr.DECODE_URL.value: ""},
        {},
    )
    d = span(
        Span.AWAIT_KV.value,
        {},
        {Resource.ROLE.value: "decode", Resource.HOST_ADDR.value: "10.213.1.4"},
    )
    run = analyse("t", [Trace("t" * 32, (routed, d))])
    row = run.requests.iloc[0]
    assert (row["prefill"], row["decode"]) == ("10.213.1.2:8100", "10.213.1.4")

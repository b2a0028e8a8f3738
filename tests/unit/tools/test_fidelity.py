"""The trace-fidelity check of `pushkv bench` (connector/tools/bench/fidelity.py): client
TTFTs matched to router request spans by request id, the 2 % + 2 ms criterion, pooling."""

from __future__ import annotations

from connector.tools.bench import fidelity
from connector.tools.bench.level_result import LevelResult, fidelity_lines, median_results
from telemetry.otlp_json import SpanEvent, SpanRecord, StatusCode, Trace
from telemetry.schema import Attr, Event, Span

T0 = 1_800_000_000_000_000_000


def _request(i: int, ttft_ms: float, prefix: str = "bench-x-") -> Trace:
    tid = f"{i + 1:032x}"
    span = SpanRecord(
        trace_id=tid,
        span_id=f"{i + 1:016x}",
        parent_span_id=None,
        name=Span.REQUEST.value,
        kind=2,
        start_ns=T0,
        end_ns=T0 + int(ttft_ms * 2e6),
        status=StatusCode.UNSET,
        status_message="",
        attributes={Attr.REQUEST_ID.value: f"{prefix}{i}"},
        events=(SpanEvent(Event.FIRST_CHUNK.value, T0 + int(ttft_ms * 1e6), {}),),
        resource={},
    )
    return Trace(tid, (span,))


def test_within_is_two_percent_plus_two_ms() -> None:
    assert fidelity.within(100.0, 96.0)  # 4 ms off: 2 + 2 ms allowed
    assert not fidelity.within(100.0, 95.9)
    assert fidelity.within(10.0, 11.9)  # the trace may also be longer (clocks, rounding)


def test_check_matches_by_request_id_and_counts_unmatched_against() -> None:
    bench = {
        "ttfts": [0.050, 0.100, 0.200, 0.0, 0.300],
        "errors": ["", "", "", "boom", ""],
    }
    # request 0 accounted, 1 misses 20 ms, 2 has no trace, 3 failed (not timed), 4 accounted
    traces = [_request(0, 49.5), _request(1, 80.0), _request(4, 299.0), _request(9, 1.0)]
    f = fidelity.check(bench, "bench-x-", traces)
    assert (f.requests, f.matched, f.within) == (4, 3, 2)
    assert f.share == 0.5
    assert [round(g, 1) for g in f.gaps_ms] == [0.5, 20.0, 1.0]
    assert fidelity.check(bench, "other-", traces).matched == 0


def test_rounds_pool_their_requests_and_the_report_says_so() -> None:
    def result(within: int) -> LevelResult:
        r = LevelResult("push", 8, 10, ok=True, completed=10, metrics={"median_ttft_ms": 1.0})
        r.fidelity = fidelity.Fidelity(10, 10, within, (1.0,) * 10).to_json()
        return r

    (pooled,) = median_results([[result(10)], [result(9)]])
    assert (pooled.fidelity["requests"], pooled.fidelity["within"]) == (20, 19)
    (line,) = fidelity_lines([pooled])
    assert line.startswith("push c=8: 19/20 (95%) within 2 % + 2 ms")
    bare = LevelResult("vllm-push", 8, 10, ok=True)
    assert fidelity_lines([bare]) == [], "a stack without router spans has no line"

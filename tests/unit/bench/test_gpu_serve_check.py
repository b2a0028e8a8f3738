"""bench.gpu_serve_check's gate on the deviations the H100 run measured
(bench/results/gpu-20261205-h100/check.txt): P/D within D's own two-path floor passes,
an answer that parts earlier than D's own paths or moves logprobs further does not."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from bench.gpu_serve_check import deviation, kv_checks, within_floor
from telemetry.exporters import JsonLinesSpanExporter
from telemetry.schema import Attr, Span
from telemetry.traces import read_run


def answer(tokens: list[str], lps: list[float]) -> dict[str, Any]:
    return {
        "choices": [
            {"text": "".join(tokens), "logprobs": {"tokens": tokens, "token_logprobs": lps}}
        ]
    }


def test_deviation_is_where_tokens_part_and_the_largest_logprob_gap_before() -> None:
    a = answer(["x", "y", "z"], [-1.0, -2.0, -3.0])
    b = answer(["x", "y", "w"], [-1.1, -2.3, -9.0])
    assert deviation(a, b) == {"same_tokens": 2, "max_logprob_diff": 0.3}
    assert deviation(a, a) == {"same_tokens": 3, "max_logprob_diff": 0.0}


def test_the_h100_runs_deviations_pass_within_the_floor() -> None:
    tol = 0.4029  # the run's largest cold-vs-cached difference (16k tokens)
    measured = [  # (P/D vs D cached, D cached vs cold) at 200, 4096 and 16384 tokens
        (
            {"same_tokens": 16, "max_logprob_diff": 0.165},
            {"same_tokens": 16, "max_logprob_diff": 0.1888},
        ),
        (
            {"same_tokens": 16, "max_logprob_diff": 0.1715},
            {"same_tokens": 10, "max_logprob_diff": 0.3441},
        ),
        (
            {"same_tokens": 10, "max_logprob_diff": 0.3131},
            {"same_tokens": 9, "max_logprob_diff": 0.4029},
        ),
    ]
    assert all(within_floor(pd, floor, tol) for pd, floor in measured)


def test_parting_earlier_than_ds_own_paths_or_further_logprobs_fails() -> None:
    floor = {"same_tokens": 9, "max_logprob_diff": 0.4}
    assert not within_floor({"same_tokens": 8, "max_logprob_diff": 0.1}, floor, 0.4)
    assert not within_floor({"same_tokens": 16, "max_logprob_diff": 0.41}, floor, 0.4)
    # D's own paths parting at the first token give no floor to stand on.
    assert not within_floor(
        {"same_tokens": 0, "max_logprob_diff": 0.0},
        {"same_tokens": 0, "max_logprob_diff": 0.0},
        0.4,
    )


def test_kv_checks_counts_ds_verdicts_and_unchecked_transfers(tmp_path: Path) -> None:
    """What the check gates on with kv_checksum_every 1: every await_kv of D says ok."""
    exporter = JsonLinesSpanExporter(tmp_path / "traces-pushkv-decode-1.jsonl")
    provider = TracerProvider(resource=Resource.create({"service.name": "pushkv-decode"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("t")
    for verdict in ("ok", "ok", "mismatch", None):
        attrs = {} if verdict is None else {Attr.KV_CHECK.value: verdict}
        tracer.start_span(Span.AWAIT_KV.value, attributes=attrs).end()
    tracer.start_span(Span.WRITE.value).end()  # not D's wait: not counted
    provider.shutdown()
    assert kv_checks(read_run(tmp_path)) == {"ok": 2, "mismatch": 1, "unchecked": 1}

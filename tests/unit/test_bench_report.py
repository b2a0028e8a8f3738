"""bench/report.py's verdicts: pure arithmetic on recorded results."""

from __future__ import annotations

from bench.report import LevelResult, markdown_report, tracing_verdicts


def level(config: str, ttft: float, rps: float, conc: int = 16) -> LevelResult:
    return LevelResult(config, conc, 128, True,
                       metrics={"median_ttft_ms": ttft, "request_throughput": rps})


def test_tracing_within_budget_is_met() -> None:
    (line,) = tracing_verdicts([level("push", 101.0, 19.8), level("push-notrace", 100.0, 20.0)])
    assert line.startswith("c=16: MET"), line
    assert "cost +1.0%" in line  # TTFT 1 % slower and throughput 1 % lower


def test_tracing_over_budget_is_not_met() -> None:
    (line,) = tracing_verdicts([level("push", 110.0, 20.0), level("push-notrace", 100.0, 20.0)])
    assert line.startswith("c=16: NOT MET") and "OVER" in line, line


def test_no_tracing_section_without_both_configs() -> None:
    assert tracing_verdicts([level("push", 100.0, 20.0)]) == []
    assert "Tracing cost" not in markdown_report([level("push", 100.0, 20.0)])
    assert "Tracing cost" in markdown_report([level("push", 100.0, 20.0),
                                              level("push-notrace", 100.0, 20.0)])

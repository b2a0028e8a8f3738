"""connector/tools/bench/report.py's verdicts: pure arithmetic on recorded results."""

from __future__ import annotations

from connector.tools.bench.level_result import LevelResult, median_results
from connector.tools.bench.report import (
    markdown_report,
    round_tally,
    target_verdicts,
    tracing_verdicts,
    variant_tally,
)


def level(config: str, ttft: float, rps: float, conc: int = 16, tpot: float = 8.0) -> LevelResult:
    return LevelResult(
        config,
        conc,
        128,
        True,
        metrics={"median_ttft_ms": ttft, "request_throughput": rps, "mean_tpot_ms": tpot},
    )


def failed(config: str, conc: int = 16) -> LevelResult:
    return LevelResult(config, conc, 128, False, reason="stack did not start")


def test_target_met_only_when_every_comparison_was_made() -> None:
    push = level("push", 70.0, 40.0, tpot=8.0)
    both = [
        push,
        level("vllm-push-noprog", 130.0, 38.0, tpot=8.5),
        level("vllm-pull-noprog", 110.0, 35.0, tpot=9.0),
    ]
    assert target_verdicts(both)[0].startswith("c=16: MET:")
    # One baseline failed to start: the cell is not green.
    (line,) = target_verdicts(
        [push, failed("vllm-push-noprog"), level("vllm-pull-noprog", 110.0, 35.0, tpot=9.0)]
    )
    assert line.startswith("c=16: INCOMPLETE:") and "n/a (stack did not start)" in line, line
    # A miss still reads as a miss beside the missing comparison.
    (line,) = target_verdicts(
        [push, failed("vllm-push-noprog"), level("vllm-pull-noprog", 110.0, 35.0, tpot=7.0)]
    )
    assert line.startswith("c=16: NOT MET:") and "MISSED" in line, line
    (line,) = target_verdicts([push, failed("vllm-push-noprog")])
    assert line.startswith("c=16: NOT EVALUATED:"), line


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
    assert "Tracing cost" in markdown_report(
        [level("push", 100.0, 20.0), level("push-notrace", 100.0, 20.0)]
    )


def test_medians_over_rounds_skip_failed_rounds_and_keep_all_failed_cells_failed() -> None:
    rounds = [
        [level("push", 70.0, 40.0, tpot=9.0), level("vllm-push-noprog", 130.0, 38.0)],
        [level("push", 90.0, 30.0, tpot=7.0), failed("vllm-push-noprog")],
        [level("push", 80.0, 35.0, tpot=8.0), level("vllm-push-noprog", 150.0, 30.0)],
    ]
    by = {r.config: r for r in median_results(rounds)}
    assert by["push"].metrics == {
        "median_ttft_ms": 80.0,
        "request_throughput": 35.0,
        "mean_tpot_ms": 8.0,
    }
    assert by["vllm-push-noprog"].ok and by["vllm-push-noprog"].metrics["median_ttft_ms"] == 140.0
    assert by["vllm-push-noprog"].reason == "1 of 3 rounds failed"
    assert by["push"].completed == 0 and by["push"].decode_prompt_tokens == {}
    with_tokens = [
        [
            LevelResult(
                "push",
                16,
                8,
                True,
                metrics={"mean_tpot_ms": 8.0},
                completed=8,
                decode_prompt_tokens={"external_kv_transfer": 2048.0},
            )
        ]
    ] * 2
    (both,) = median_results(with_tokens)
    assert both.completed == 16 and both.decode_prompt_tokens == {"external_kv_transfer": 4096.0}
    (gone,) = median_results([[failed("vllm-push-noprog")], [failed("vllm-push-noprog")]])
    assert not gone.ok and gone.reason == "stack did not start"


def test_round_tally_counts_rounds_where_push_held_the_target() -> None:
    rounds = [
        [level("push", 70.0, 40.0, tpot=9.0), level("vllm-push-noprog", 130.0, 38.0, tpot=8.1)],
        [level("push", 70.0, 40.0, tpot=8.0), failed("vllm-push-noprog")],
        [level("push", 70.0, 40.0, tpot=8.0), level("vllm-push-noprog", 140.0, 38.0, tpot=8.8)],
    ]
    lines = {line.split(":")[0]: line for line in round_tally(rounds)}
    tpot = lines["c=16 vs vllm-push-noprog mean_tpot"]
    assert "in 1 of 2 rounds (0.90x, n/a, 1.10x)" in tpot, tpot
    assert "in 2 of 2 rounds" in lines["c=16 vs vllm-push-noprog median_ttft"]
    assert not any("vllm-pull-noprog" in line for line in lines.values())  # never ran


def test_variant_tally_sets_each_rounds_ratio_against_pushs_own_spread() -> None:
    rounds = [
        [level("push", 50.0, 40.0), level("push-sealed", 55.0, 40.0)],
        [level("push", 65.0, 40.0), level("push-sealed", 52.0, 40.0), failed("push-nometrics")],
    ]
    lines = {line.split(":")[0]: line for line in variant_tally(rounds)}
    ttft = lines["c=16 median_ttft"]
    assert "push's spread between rounds 1.30x (50.0, 65.0)" in ttft, ttft
    assert "push vs push-sealed 1.10x, 0.80x" in ttft, ttft  # latencies: other / push
    assert "push vs push-nometrics n/a" in ttft, ttft
    assert "push-notrace" not in ttft  # never ran
    assert variant_tally([[level("push", 50.0, 40.0)]]) == []  # no variant: no line

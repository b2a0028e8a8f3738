"""Results of the push-vs-pull benchmark: the ratios of push against each vLLM
configuration, the target check, the tallies over repeated rounds (``round_tally``,
``variant_tally``), and their rendering. The record per (configuration, concurrency) and
its median over rounds are ``level_result``'s.

Owns ``ratios``, ``target_verdicts``, ``tracing_verdicts`` and the Markdown / rich
renderings. Ratios are written so that **> 1 means push is better**: other / push for
latencies (TTFT, TPOT, ITL), push / other for request throughput.

Pure: no processes, no I/O besides ``rich`` printing to the console it is given.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from connector.tools.bench.level_result import (
    LATENCY_KEYS,
    METRICS,
    LevelResult,
    fidelity_lines,
)

BASELINE = "push"
# The goal: push at least this much better than vLLM's push connector in its default
# configuration, and no worse than vLLM's connectors with the progress thread off.
TARGET_VS_DEFAULT = 1.3
TARGET_DEFAULT_CONFIG = "vllm-push"
TARGET_NO_WORSE_CONFIGS = ("vllm-push-noprog", "vllm-pull-noprog")
TARGET_KEYS = ("median_ttft_ms", "mean_tpot_ms")
# Tracing's cost: push (spans on, 100 % sampled) against the same stack with tracing off.
TRACING_OFF_CONFIG = "push-notrace"
TRACING_BUDGET = 0.03  # throughput and median TTFT within 3 %
TRACING_KEYS = ("request_throughput", "median_ttft_ms")
# push with one thing switched off or on, to measure what that thing costs: tracing,
# authentication (sealed messages and signed coordinates), the connector's metrics.
VARIANT_CONFIGS = ("push-notrace", "push-sealed", "push-nometrics")


def round_tally(rounds: Sequence[Sequence[LevelResult]]) -> list[str]:
    """Per concurrency and target comparison: in how many rounds push was at least as good,
    and the per-round ratios (the spread a median hides)."""
    lines = []
    concs = sorted({r.concurrency for rs in rounds for r in rs})
    for conc in concs:
        for other, need in (
            (TARGET_DEFAULT_CONFIG, TARGET_VS_DEFAULT),
            *((c, 1.0) for c in TARGET_NO_WORSE_CONFIGS),
        ):
            for key in TARGET_KEYS:
                xs = _round_ratios(rounds, conc, other, key)
                made = [x for x in xs if x is not None]
                if not xs:
                    continue
                lines.append(
                    f"c={conc} vs {other} {key.removesuffix('_ms')}: push >= {need:g}x "
                    f"in {sum(x >= need for x in made)} of {len(made)} rounds ("
                    + ", ".join("n/a" if x is None else f"{x:.2f}x" for x in xs)
                    + ")"
                )
    return lines + variant_tally(rounds)


def variant_tally(rounds: Sequence[Sequence[LevelResult]]) -> list[str]:
    """Per concurrency and TARGET_KEYS: push's own spread between rounds (largest / smallest
    value), then each ``VARIANT_CONFIGS`` run's ratio to push round by round (> 1: push
    better). A variant is within noise only where its ratios stay inside push's spread."""
    lines = []
    concs = sorted({r.concurrency for rs in rounds for r in rs})
    for conc in concs:
        for key in TARGET_KEYS:
            values = []
            for results in rounds:
                push = _by_key(results).get((BASELINE, conc))
                if push is not None and push.ok and key in push.metrics:
                    values.append(push.metrics[key])
            variants = []
            for other in VARIANT_CONFIGS:
                if xs := _round_ratios(rounds, conc, other, key):
                    variants.append(
                        f"push vs {other} "
                        + ", ".join("n/a" if x is None else f"{x:.2f}x" for x in xs)
                    )
            if not variants:
                continue
            name = key.removesuffix("_ms")
            spread = (
                f"{max(values) / min(values):.2f}x ({', '.join(f'{v:.1f}' for v in values)})"
                if len(values) > 1 and min(values) > 0
                else "n/a"
            )
            lines.append(
                f"c={conc} {name}: push's spread between rounds {spread}; " + "; ".join(variants)
            )
    return lines


def _round_ratios(
    rounds: Sequence[Sequence[LevelResult]], conc: int, other: str, key: str
) -> list[float | None]:
    """push against ``other`` on ``key`` at ``conc``, one per round where both ran."""
    xs = []
    for results in rounds:
        table = _by_key(results)
        push, r = table.get((BASELINE, conc)), table.get((other, conc))
        if push is not None and r is not None:
            xs.append(ratio(key, push, r))
    return xs


def _by_key(results: Sequence[LevelResult]) -> dict[tuple[str, int], LevelResult]:
    return {(r.config, r.concurrency): r for r in results}


def ratio(key: str, push: LevelResult, other: LevelResult) -> float | None:
    """How much better push is than ``other`` on ``key`` (> 1: push better); None if
    either lacks the number or a denominator is 0."""
    a, b = push.metrics.get(key), other.metrics.get(key)
    if not (push.ok and other.ok) or a is None or b is None:
        return None
    num, den = (b, a) if key in LATENCY_KEYS else (a, b)
    return num / den if den > 0 else None


def ratios(results: Sequence[LevelResult]) -> list[dict[str, Any]]:
    """One row per (concurrency, vLLM configuration): every metric's ratio against push."""
    table = _by_key(results)
    rows = []
    for conc in sorted({r.concurrency for r in results}):
        push = table.get((BASELINE, conc))
        for r in results:
            if r.concurrency != conc or r.config == BASELINE or push is None:
                continue
            rows.append(
                {
                    "concurrency": conc,
                    "versus": r.config,
                    **{k: ratio(k, push, r) for k, _ in METRICS},
                }
            )
    return rows


def target_verdicts(results: Sequence[LevelResult]) -> list[str]:
    """One line per concurrency: does push meet the target (see TARGET_*)?"""
    table, lines = _by_key(results), []
    for conc in sorted({r.concurrency for r in results}):
        push = table.get((BASELINE, conc))
        if push is None or not push.ok:
            lines.append(f"c={conc}: push has no numbers; target not evaluated")
            continue
        parts, met, evaluated, missing = [], True, 0, 0
        for other, need in (
            (TARGET_DEFAULT_CONFIG, TARGET_VS_DEFAULT),
            *((c, 1.0) for c in TARGET_NO_WORSE_CONFIGS),
        ):
            r = table.get((other, conc))
            if r is None:
                continue
            for key in TARGET_KEYS:
                x = ratio(key, push, r)
                if x is None:
                    parts.append(f"{other} {key}: n/a ({r.reason or 'no number'})")
                    missing += 1
                    continue
                ok = x >= need
                met &= ok
                evaluated += 1
                parts.append(
                    f"{other} {key.removesuffix('_ms')} {x:.2f}x "
                    f"(need >= {need:g}x) {'ok' if ok else 'MISSED'}"
                )
        if not parts:
            lines.append(
                f"c={conc}: no {TARGET_DEFAULT_CONFIG} or progress-thread-off "
                f"configuration in this run; target not evaluated"
            )
            continue
        # A comparison that could not be made never counts as met: a stack that failed
        # to start must not turn the cell green.
        verdict = (
            "NOT MET"
            if not met
            else "NOT EVALUATED"
            if not evaluated
            else "INCOMPLETE"
            if missing
            else "MET"
        )
        lines.append(f"c={conc}: {verdict}: " + "; ".join(parts))
    return lines


def tracing_verdicts(results: Sequence[LevelResult]) -> list[str]:
    """One line per concurrency where both push and push-notrace ran: tracing's cost."""
    table, lines = _by_key(results), []
    for conc in sorted({r.concurrency for r in results}):
        on, off = table.get((BASELINE, conc)), table.get((TRACING_OFF_CONFIG, conc))
        if on is None or off is None:
            continue
        if not (on.ok and off.ok):
            lines.append(f"c={conc}: not evaluated ({on.reason or off.reason})")
            continue
        parts, met = [], True
        for key in TRACING_KEYS:
            a, b = on.metrics.get(key), off.metrics.get(key)
            if a is None or b is None or b == 0:
                parts.append(f"{key}: n/a")
                met = False
                continue
            cost = (b - a) / b if key == "request_throughput" else (a - b) / b
            ok = cost <= TRACING_BUDGET
            met &= ok
            parts.append(
                f"{key} on {a:.2f} / off {b:.2f} (cost {cost:+.1%}) {'ok' if ok else 'OVER'}"
            )
        lines.append(f"c={conc}: {'MET' if met else 'NOT MET'}: " + "; ".join(parts))
    return lines


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _kv_cell(r: LevelResult) -> str:
    if not r.decode_prompt_tokens:
        return "-"
    ext = r.decode_prompt_tokens.get("external_kv_transfer", 0.0)
    local = r.decode_prompt_tokens.get("local_compute", 0.0)
    return f"{ext:.0f} / {local:.0f}"


def result_rows(results: Sequence[LevelResult]) -> tuple[list[str], list[list[str]]]:
    """Header and cells of the main table (shared by Markdown and rich)."""
    header = [
        "config",
        "conc",
        "prompts",
        *(title for _, title in METRICS),
        "completed",
        "failed",
        "D prompt tokens ext / local",
        "note",
    ]
    rows = []
    for r in sorted(results, key=lambda r: r.concurrency):
        cells = [_fmt(r.metrics.get(k), 2 if k == "request_throughput" else 1) for k, _ in METRICS]
        note = r.reason if not r.ok else ("; ".join(r.errors) if r.failed else "")
        if r.foreign_vllm_pids:
            note += f" (other vLLM processes running: {len(r.foreign_vllm_pids)})"
        rows.append(
            [
                r.config,
                str(r.concurrency),
                str(r.num_prompts),
                *cells,
                str(r.completed) if r.ok else "-",
                str(r.failed) if r.ok else "-",
                _kv_cell(r),
                ("FAILED: " if not r.ok else "") + note,
            ]
        )
    return header, rows


def ratio_rows(results: Sequence[LevelResult]) -> tuple[list[str], list[list[str]]]:
    header = ["conc", "push vs", *(title.replace(" ms", "") for _, title in METRICS)]
    rows = [
        [
            str(row["concurrency"]),
            row["versus"],
            *(("-" if row[k] is None else f"{row[k]:.2f}x") for k, _ in METRICS),
        ]
        for row in ratios(results)
    ]
    return header, rows


def _markdown(header: list[str], rows: list[list[str]]) -> str:
    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.replace("|", "/").replace("\n", " ") for c in cells) + " |"

    return "\n".join([line(header), line(["---"] * len(header)), *map(line, rows)])


def markdown_report(results: Sequence[LevelResult], preamble: str = "") -> str:
    """The whole report: the results table, the ratio table and the target verdicts."""
    parts = [preamble.rstrip(), ""] if preamble else []  # a heading after a list needs a gap
    ratio_title = (
        "## Push vs each vLLM configuration (> 1: push better; latencies "
        "other/push, throughput push/other)"
    )
    target_title = (
        f"## Target (push median TTFT and mean TPOT >= {TARGET_VS_DEFAULT:g}x "
        f"{TARGET_DEFAULT_CONFIG}, >= 1x {', '.join(TARGET_NO_WORSE_CONFIGS)})"
    )
    parts += [
        "## Results",
        _markdown(*result_rows(results)),
        "",
        ratio_title,
        _markdown(*ratio_rows(results)),
        "",
        target_title,
        *(f"- {line}" for line in target_verdicts(results)),
    ]
    if tracing := tracing_verdicts(results):
        parts += [
            "",
            f"## Tracing cost ({BASELINE}, every request traced, vs "
            f"{TRACING_OFF_CONFIG}; budget {TRACING_BUDGET:.0%} on throughput and "
            "median TTFT)",
            *(f"- {line}" for line in tracing),
        ]
    if fidelity := fidelity_lines(results):
        parts += [
            "",
            "## Trace fidelity (the trace's TTFT against the client's, per request)",
            *(f"- {line}" for line in fidelity),
        ]
    return "\n".join(parts) + "\n"


def print_rich(results: Sequence[LevelResult], console: Any = None) -> None:
    """The results and ratio tables on the console (rich)."""
    from rich.console import Console
    from rich.table import Table

    if console is None:
        console = Console()
        if not console.is_terminal:  # a log file: do not squeeze the tables into 80 columns
            console = Console(width=220)
    for title, (header, rows) in (
        ("push vs pull: vllm bench serve", result_rows(results)),
        ("push vs each vLLM configuration (> 1: push better)", ratio_rows(results)),
    ):
        table = Table(title=title)
        for col in header:
            table.add_column(col, overflow="fold")
        for row in rows:
            style = "red" if row[-1].startswith("FAILED") else None
            table.add_row(*row, style=style)
        console.print(table)
    for line in target_verdicts(results):
        console.print(line)

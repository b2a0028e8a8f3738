"""Results of the push-vs-pull benchmark: the record per (configuration, concurrency), the
ratios of push against each vLLM configuration, the target check, and their rendering;
the median over repeated rounds (``median_results``, ``round_tally``).

Owns: ``LevelResult`` (one ``vllm bench serve`` run's numbers, read from its saved JSON, or
why there are none), ``ratios``, ``target_verdicts`` and the Markdown / rich renderings.
Ratios are written so that **> 1 means push is better**: other / push for latencies (TTFT,
TPOT, ITL), push / other for request throughput.

Pure: no processes, no I/O besides ``rich`` printing to the console it is given.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from connector.tools.bench.fidelity import Fidelity, describe

# (key in vllm bench serve's JSON, column title); the first four are latencies in ms.
METRICS: tuple[tuple[str, str], ...] = (
    ("median_ttft_ms", "median TTFT ms"),
    ("p90_ttft_ms", "p90 TTFT ms"),
    ("mean_tpot_ms", "mean TPOT ms"),
    ("median_itl_ms", "median ITL ms"),
    ("median_e2el_ms", "median E2EL ms"),  # robust to streamed chunks of several tokens
    ("request_throughput", "req/s"),
)
LATENCY_KEYS = frozenset(k for k, _ in METRICS if k.endswith("_ms"))
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


@dataclass
class LevelResult:
    """One configuration at one concurrency. ``ok`` is False when no numbers could be taken
    (the stack did not start, ``vllm bench serve`` failed or hung, no request completed);
    ``reason`` then says why. Requests failing inside a run show in ``failed``."""

    config: str
    concurrency: int
    num_prompts: int
    ok: bool
    reason: str = ""
    metrics: dict[str, float] = field(default_factory=dict)
    completed: int = 0
    failed: int = 0
    duration_s: float | None = None
    # Delta of D's vllm:prompt_tokens_by_source_total over the run, by source: proves D
    # took the prompt's KV from P (external_kv_transfer) instead of recomputing it.
    decode_prompt_tokens: dict[str, float] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)  # distinct request errors, a few
    # vLLM processes not of this stack running when the run started (they share the cores).
    foreign_vllm_pids: list[int] = field(default_factory=list)
    result_file: str | None = None
    request_id_prefix: str | None = None
    # Whether the traces account for the client's TTFTs (``bench.fidelity.Fidelity.to_json``);
    # empty when the stack wrote no router spans.
    fidelity: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_bench_json(
        cls, config: str, concurrency: int, num_prompts: int, data: dict[str, Any], result_file: str
    ) -> LevelResult:
        errors = sorted({str(e) for e in data.get("errors", []) if e})[:3]
        completed, failed = int(data.get("completed", 0)), int(data.get("failed", 0))
        return cls(
            config,
            concurrency,
            num_prompts,
            ok=completed > 0,
            reason="" if completed > 0 else "no request completed",
            metrics={k: float(data[k]) for k, _ in METRICS if data.get(k) is not None},
            completed=completed,
            failed=failed,
            duration_s=data.get("duration"),
            errors=errors,
            result_file=result_file,
        )

    @classmethod
    def failure(cls, config: str, concurrency: int, num_prompts: int, reason: str) -> LevelResult:
        return cls(config, concurrency, num_prompts, ok=False, reason=reason)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def median_results(rounds: Sequence[Sequence[LevelResult]]) -> list[LevelResult]:
    """One result per (config, concurrency) over repeated rounds: each metric the median of
    the rounds that produced numbers, ``completed``, ``failed`` and D's prompt tokens by
    source summed; failed rounds leave it out (a cell where every round failed stays
    failed, with the first reason)."""
    cells: dict[tuple[str, int], list[LevelResult]] = {}
    for results in rounds:
        for r in results:
            cells.setdefault((r.config, r.concurrency), []).append(r)
    out = []
    for (config, conc), rs in cells.items():
        good = [r for r in rs if r.ok]
        if not good:
            out.append(LevelResult.failure(config, conc, rs[0].num_prompts, rs[0].reason))
            continue
        keys = {k for r in good for k in r.metrics}
        out.append(
            LevelResult(
                config,
                conc,
                good[0].num_prompts,
                True,
                reason=""
                if len(good) == len(rs)
                else f"{len(rs) - len(good)} of {len(rs)} rounds failed",
                metrics={
                    k: statistics.median(r.metrics[k] for r in good if k in r.metrics)
                    for k in sorted(keys)
                },
                completed=sum(r.completed for r in good),
                failed=sum(r.failed for r in good),
                decode_prompt_tokens=_summed(r.decode_prompt_tokens for r in good),
                fidelity=Fidelity.pooled(r.fidelity for r in good).to_json()
                if any(r.fidelity for r in good)
                else {},
            )
        )
    return out


def fidelity_lines(results: Sequence[LevelResult]) -> list[str]:
    """One line per (configuration, concurrency) whose traces were checked against the
    client's TTFTs (the criterion: >= 95 % within 2 % + 2 ms)."""
    return [
        f"{r.config} c={r.concurrency}: {describe(r.fidelity)}"
        for r in results
        if r.fidelity.get("requests")
    ]


def _summed(dicts: Iterable[dict[str, float]]) -> dict[str, float]:
    total: dict[str, float] = {}
    for d in dicts:
        for k, v in d.items():
            total[k] = total.get(k, 0.0) + v
    return total


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

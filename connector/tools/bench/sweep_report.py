"""The sweep's ``report.md``: every point's numbers against the single instance, and every
point's TTFT decomposition, so that each gap in the figures comes with its reason.

Pure: a ``sweep.json`` dict in, Markdown out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from connector.tools.bench.single import SINGLE
from telemetry.critical_path import Seg


def _ms(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(str(c).replace("|", "/").replace("\n", " ") for c in cells) + " |"

    return "\n".join([line(header), line(["---"] * len(header)), *map(line, rows)])


def _key(p: dict[str, Any]) -> tuple[int, float]:
    return int(p["input_len"]), float(p["rate"])


def results_table(points: Sequence[dict[str, Any]], configs: Sequence[str]) -> str:
    """One row per (length, rate, configuration); the gap is this TTFT p50 minus the single
    instance's at the same point."""
    single = {_key(p): p["metrics"].get("median_ttft_ms") for p in points if p["config"] == SINGLE}
    order = {c: i for i, c in enumerate(configs)}
    rows = []
    for p in sorted(points, key=lambda p: (*_key(p), order.get(p["config"], 99))):
        m = p["metrics"]
        ttft, ideal = m.get("median_ttft_ms"), single.get(_key(p))
        gap = None if ttft is None or ideal is None or p["config"] == SINGLE else ttft - ideal
        rows.append(
            [
                str(p["input_len"]),
                f"{p['rate']:g}",
                p["config"],
                f"{p['completed']}/{p['num_prompts']}",
                _ms(ttft),
                _ms(m.get("p90_ttft_ms")),
                _ms(gap),
                _ms(m.get("mean_tpot_ms"), 2),
                _ms(m.get("median_itl_ms"), 2),
                _ms(m.get("request_throughput"), 2),
                ("" if p["ok"] else "FAILED: ") + p.get("reason", ""),
            ]
        )
    header = [
        "input",
        "req/s offered",
        "config",
        "completed",
        "TTFT p50 ms",
        "TTFT p90 ms",
        "p50 - single ms",
        "mean TPOT ms",
        "ITL p50 ms",  # without the one gap push-ft adds after P's first token
        "req/s done",
        "note",
    ]
    return _table(header, rows)


def decomposition_tables(points: Sequence[dict[str, Any]], configs: Sequence[str]) -> list[str]:
    """Per input length: median ms of each critical-path segment, one row per (rate,
    configuration) with traces."""
    order = {c: i for i, c in enumerate(configs)}
    out = []
    for n in sorted({int(p["input_len"]) for p in points}):
        traced = [p for p in points if int(p["input_len"]) == n and p.get("decomposition")]
        if not traced:
            continue
        present = {s for p in traced for s in p["decomposition"]["segments_ms"]}
        segs = [s.value for s in Seg if s.value in present]
        rows = [
            [
                f"{p['rate']:g}",
                p["config"],
                str(p["decomposition"]["requests"]),
                _ms(p["decomposition"]["ttft_ms"]),
                *(_ms(p["decomposition"]["segments_ms"].get(s)) for s in segs),
            ]
            for p in sorted(traced, key=lambda p: (p["rate"], order.get(p["config"], 99)))
        ]
        out += [
            f"### {n} tokens in",
            "",
            _table(["req/s", "config", "traced", "TTFT p50 ms", *segs], rows),
            "",
        ]
    return out


NOTRACE = "-notrace"


def tracing_lines(points: Sequence[dict[str, Any]]) -> list[str]:
    """Per point where both ran: a configuration (every request traced) against its
    ``-notrace`` twin (push against push-notrace, push-ft against push-ft-notrace)."""
    metrics = {(p["config"], *_key(p)): p["metrics"] for p in points if p["ok"]}
    lines = []
    for config, *key in sorted(metrics):
        if not config.endswith(NOTRACE) or (base := config[: -len(NOTRACE)], *key) not in metrics:
            continue
        a, b = metrics[(base, *key)], metrics[(config, *key)]
        parts = []
        for metric, label, fmt in (
            ("median_ttft_ms", "TTFT p50", "{:.1f} ms"),
            ("mean_tpot_ms", "mean TPOT", "{:.1f} ms"),
            ("request_throughput", "req/s", "{:.2f}"),
        ):
            if a.get(metric) and b.get(metric):
                both = fmt.format(a[metric]).split()[0] + " / " + fmt.format(b[metric])
                parts.append(f"{label} {both} ({(a[metric] - b[metric]) / b[metric]:+.1%})")
        lines.append(f"- {base}, {key[0]} tokens, {key[1]:g} req/s: " + "; ".join(parts or ["n/a"]))
    return lines


def markdown(data: dict[str, Any]) -> str:
    plan, points = data.get("plan", {}), data.get("points", [])
    configs = data.get("configs", [])
    failed = [p for p in points if not p["ok"]]
    parts = [
        "# Sweep: input length x request rate, against one plain instance",
        "",
        f"Command `{' '.join(data.get('argv', []))}` at commit {data.get('git_commit')} on "
        f"{data.get('host')} ({data.get('cpus')} CPUs); model `{data.get('model')}`; lengths "
        f"{plan.get('lengths')}, rates {plan.get('rates')} req/s ({data.get('arrivals')}), "
        f"{plan.get('output_len')} output tokens, about {plan.get('point_s')} s of arrivals "
        f"per point; configurations {', '.join(configs)}. Figures: `sweep.html`, `sweep.png`; "
        "each point's traces in `<config>/<point>/` (a run folder for `pushkv dashboard`)."
        + (
            f" Decompositions re-rendered at commit {data['rerendered_at']} (`--rerender`)."
            if data.get("rerendered_at")
            else ""
        ),
        "",
        f"{len(points) - len(failed)} of {len(points)} points completed every request"
        + (
            f"; failed: {', '.join(p['config'] + ' ' + p['point'] for p in failed)}"
            if failed
            else ""
        )
        + ".",
        "",
        "## Results",
        "",
        results_table(points, configs),
        "",
        "## TTFT decomposition (median ms per critical-path segment)",
        "",
        "From each point's traces (the dashboard's critical-path model): push mode shows every "
        "segment from the router to D's first step; vLLM's connectors only the router's legs; "
        "the single instance has no traces. Medians of segments do not add up to the median "
        "TTFT.",
        "",
        *decomposition_tables(points, configs),
    ]
    if tracing := tracing_lines(points):
        parts += ["## Tracing's cost (every request traced, against the -notrace twin)", ""]
        parts += tracing
    return "\n".join(parts).rstrip() + "\n"

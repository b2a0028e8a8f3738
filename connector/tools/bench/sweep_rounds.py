"""Several sweeps of the same plan read as rounds (``pushkv bench --sweep --rounds DIR...``):
per point, each configuration's median and range over the rounds, each one's median TTFT
against the single instance's and each traced configuration against its ``-notrace`` twin,
both paired within each round.

Why paired: the CPU box drifts by 30 % within minutes, so two configurations are compared
point by point inside one round (``--interleave`` runs them back to back) and only then
across rounds; the spread of the per-round changes says what the rounds can resolve.

Per point too, request by request: within one sweep request i of every configuration had
the same prompt and arrival offset, so pairing requests removes the prompts' and the
arrivals' share of the spread (what a median over 6-16 requests a point cannot).

Pure: sweep folders in, Markdown out; no processes, no clock.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from connector.tools.bench.single import SINGLE
from connector.tools.bench.sweep_points import SWEEP_FILE, Point, bench_file
from connector.tools.bench.sweep_report import NOTRACE

# (key of a point's metrics, column title, digits)
METRICS: tuple[tuple[str, str, int], ...] = (
    ("median_ttft_ms", "TTFT p50 ms", 1),
    ("mean_tpot_ms", "mean TPOT ms", 2),
    ("request_throughput", "req/s done", 2),
)

Key = tuple[int, float, str]  # input length, rate, configuration


def load_rounds(dirs: Sequence[Path]) -> list[dict[str, Any]]:
    return [json.loads((d / SWEEP_FILE).read_text()) for d in dirs]


def by_point(rounds: Sequence[dict[str, Any]]) -> dict[Key, list[dict[str, float] | None]]:
    """Each (length, rate, config)'s metrics per round, None where that round's point
    failed or is missing (so round i of one configuration pairs with round i of another)."""
    out: dict[Key, list[dict[str, float] | None]] = {}
    for i, data in enumerate(rounds):
        for p in data.get("points", []):
            key = (p["input_len"], float(p["rate"]), p["config"])
            out.setdefault(key, [None] * len(rounds))[i] = p["metrics"] if p["ok"] else None
    return out


def _spread(xs: Sequence[float], digits: int, pct: bool = False) -> str:
    if not xs:
        return "n/a"
    fmt = (lambda x: f"{x:+.1%}") if pct else (lambda x: f"{x:.{digits}f}")
    return f"{fmt(statistics.median(xs))} [{fmt(min(xs))} to {fmt(max(xs))}]"


def paired(
    table: dict[Key, list[dict[str, float] | None]],
    a: Key,
    b: Key,
    metric: str,
    relative: bool = False,
) -> list[float]:
    """Per round where both completed: a - b, or (a - b) / b when ``relative``."""
    out = []
    for x, y in zip(table[a], table[b], strict=True):
        if x and y and x.get(metric) is not None and y.get(metric) is not None:
            if not relative:
                out.append(x[metric] - y[metric])
            elif y[metric]:
                out.append((x[metric] - y[metric]) / y[metric])
    return out


def per_request(bench: dict[str, Any]) -> list[tuple[float, float] | None]:
    """Each request's (TTFT, TPOT) in ms from ``vllm bench serve``'s JSON, in request order
    (None for a failed one): request i of two configurations at one point of one sweep had
    the same prompt and the same arrival offset (the point's seed)."""
    out: list[tuple[float, float] | None] = []
    for ttft, latency, n in zip(
        bench.get("ttfts", []),
        bench.get("latencies", []),
        bench.get("output_lens", []),
        strict=False,
    ):
        ok = ttft and latency and n and n > 1
        out.append((ttft * 1e3, (latency - ttft) * 1e3 / (n - 1)) if ok else None)
    return out


def request_pairs(
    dirs: Sequence[Path], a: str, b: str, point: Point
) -> list[tuple[tuple[float, float], tuple[float, float]]]:
    """Request i of ``a`` with request i of ``b``, over every round holding both."""
    pairs = []
    for d in dirs:
        fa, fb = bench_file(d, a, point), bench_file(d, b, point)
        if not (fa.is_file() and fb.is_file()):
            continue
        ra, rb = (per_request(json.loads(f.read_text())) for f in (fa, fb))
        pairs += [(x, y) for x, y in zip(ra, rb, strict=False) if x and y]
    return pairs


def _quartiles(xs: Sequence[float], fmt: str) -> str:
    if len(xs) < 4:
        return "n/a"
    q1, q2, q3 = statistics.quantiles(xs, n=4)
    return f"{format(q2, fmt)} [{format(q1, fmt)} to {format(q3, fmt)}]"


def _head(intro: str | None, columns: Sequence[str]) -> list[str]:
    """A paragraph (if any), then a table's header."""
    para = ["", intro] if intro else []
    return [*para, "", "| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]


def markdown(dirs: Sequence[Path], rounds: Sequence[dict[str, Any]]) -> str:
    table = by_point(rounds)
    points = sorted({(n, r) for n, r, _ in table})
    configs = list(dict.fromkeys(c for data in rounds for c in data.get("configs", [])))
    lines = [
        f"# {len(rounds)} rounds of one sweep plan",
        "",
        *[
            f"- `{d}`: `{' '.join(data.get('argv', []))}` at commit {data.get('git_commit')}"
            + (" (interleaved)" if data.get("interleaved") else "")
            for d, data in zip(dirs, rounds, strict=True)
        ],
        "",
        "## Each configuration: median over the rounds [min to max]",
        *_head(None, ["point", "config", *(title for _, title, _ in METRICS), "rounds"]),
    ]
    for n, r in points:
        for c in configs:
            runs = table.get((n, r, c))
            if runs is None:
                continue
            done = [m for m in runs if m]
            cells = [_spread([m[k] for m in done if m.get(k)], d) for k, _, d in METRICS]
            lines.append(f"| {n} @ {r:g} | {c} | " + " | ".join(cells) + f" | {len(done)} |")
    if SINGLE in configs:
        others = [c for c in configs if c != SINGLE]
        lines += [
            "",
            "## Median TTFT minus the single instance's, paired per round (ms)",
            *_head(None, ["point", *others]),
        ]
        for n, r in points:
            if (n, r, SINGLE) not in table:
                continue
            cells = [
                _spread(paired(table, (n, r, c), (n, r, SINGLE), "median_ttft_ms"), 1)
                if (n, r, c) in table
                else "n/a"
                for c in others
            ]
            lines.append(f"| {n} @ {r:g} | " + " | ".join(cells) + " |")
        lines += _head(
            "Per request (request i of a configuration against request i of the single "
            "instance: the same prompt, arriving at the same offset), TTFT minus the single "
            "instance's, ms: median [quartiles] (pairs).",
            ["point", *others],
        )
        for n, r in points:
            cells = []
            for c in others:
                pairs = request_pairs(dirs, c, SINGLE, Point(n, r))
                diffs = [x[0] - y[0] for x, y in pairs]
                cells.append(f"{_quartiles(diffs, '.1f')} ({len(diffs)})")
            lines.append(f"| {n} @ {r:g} | " + " | ".join(cells) + " |")
    twins = [c for c in configs if c.endswith(NOTRACE) and c[: -len(NOTRACE)] in configs]
    for twin in twins:
        base = twin[: -len(NOTRACE)]
        lines += [
            "",
            f"## Tracing's cost: {base} (every request traced) against {twin}, paired per round",
            *_head(
                "Per round (traced - untraced) / untraced at the same point; the median over "
                "the rounds [min to max]. TTFT and TPOT: above 0 is tracing slower; req/s done: "
                "below 0 is tracing slower.",
                ["point", *(title for _, title, _ in METRICS)],
            ),
        ]
        for n, r in points:
            if (n, r, base) not in table or (n, r, twin) not in table:
                continue
            cells = [
                _spread(paired(table, (n, r, base), (n, r, twin), k, relative=True), 0, pct=True)
                for k, _, _ in METRICS
            ]
            lines.append(f"| {n} @ {r:g} | " + " | ".join(cells) + " |")
        lines += _head(
            "Per request (request i traced against request i untraced: the same prompt, "
            "arriving at the same offset, in the same round), (traced - untraced) / "
            "untraced: median [quartiles] (pairs).",
            ["point", "TTFT", "TPOT"],
        )
        per_run: tuple[list[float], list[float]] = ([], [])
        for n, r in points:
            by_round = [p for d in dirs if (p := request_pairs([d], base, twin, Point(n, r)))]
            if not by_round:
                continue
            changes = [[(x[0] / y[0] - 1, x[1] / y[1] - 1) for x, y in run] for run in by_round]
            ttft = [c[0] for run in changes for c in run]
            tpot = [c[1] for run in changes for c in run]
            lines.append(
                f"| {n} @ {r:g} | {_quartiles(ttft, '+.1%')} ({len(ttft)}) | "
                f"{_quartiles(tpot, '+.1%')} ({len(tpot)}) |"
            )
            for run in changes:
                per_run[0].append(statistics.median(c[0] for c in run))
                per_run[1].append(statistics.median(c[1] for c in run))
        if per_run[0]:
            lines += [
                "",
                "Requests of one point in one round share the box's state, so the unit is a "
                "point's run: the median change of each run's pairs, over every point and "
                f"round ({len(per_run[0])} runs), median [min to max]: TTFT "
                f"{_spread(per_run[0], 0, pct=True)}, TPOT {_spread(per_run[1], 0, pct=True)}.",
            ]
    return "\n".join(lines) + "\n"


def main(dirs: Sequence[Path], out: Path | None) -> int:
    text = markdown(dirs, load_rounds(dirs))
    if out is not None:
        out.write_text(text)
    print(text, end="")
    return 0

"""A benchmark run folder's published files: ``results.json`` and ``report.md``.

Owns: writing them for one round (``publish``) or for the top of a ``--repeats`` folder
(``publish_rounds``: the medians and the per-round tally), and rebuilding them from the
saved ``vllm bench serve`` JSON files alone (``rerender``, ``pushkv bench --rerender``).
The numbers and tables themselves are ``connector.tools.bench.report``'s. No stacks, no processes.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from connector.tools.bench.level_result import LevelResult, median_results
from connector.tools.bench.report import (
    markdown_report,
    print_rich,
    ratios,
    round_tally,
    target_verdicts,
    tracing_verdicts,
)


def rerender(run_dir: Path) -> int:
    """Rebuild ``run_dir``'s report from what it saved (e.g. after a metric column was added):
    every result's metrics are re-read from its own ``vllm bench serve`` JSON file. A folder
    of ``--repeats`` rounds has each round rebuilt, then the medians."""
    data = json.loads((run_dir / "results.json").read_text())
    meta = {k: v for k, v in data.items() if k not in ("results", "ratios", "target", "duration_s")}
    if meta.get("rounds"):
        codes = [rerender(run_dir / name) for name in meta["rounds"]]
        rounds = [
            [
                LevelResult(**raw)
                for raw in json.loads((run_dir / name / "results.json").read_text())["results"]
            ]
            for name in meta["rounds"]
        ]
        publish_rounds(run_dir, meta, rounds, data["duration_s"])
        return max(codes)
    results = []
    for raw in data["results"]:
        r = LevelResult(**raw)
        if r.ok and r.result_file:
            fresh = LevelResult.from_bench_json(
                r.config,
                r.concurrency,
                r.num_prompts,
                json.loads((run_dir / r.result_file).read_text()),
                r.result_file,
            )
            r.metrics = fresh.metrics
        results.append(r)
    publish(run_dir, meta, results, data["duration_s"])
    return 0 if all(r.ok for r in results) else 1


def publish(
    run_dir: Path, meta: dict[str, Any], results: Sequence[LevelResult], duration_s: float
) -> None:
    """``results.json``, ``report.md`` and the console table of one run folder."""
    write_json(run_dir, meta, results, duration_s)
    write_report(run_dir, meta, results, duration_s)
    print_rich(results)


def publish_rounds(
    run_dir: Path, meta: dict[str, Any], rounds: Sequence[Sequence[LevelResult]], duration_s: float
) -> None:
    """The top of a ``--repeats`` folder: the medians, and the per-round tally in ``meta``."""
    meta["round_tally"] = round_tally(rounds)
    publish(run_dir, meta, median_results(rounds), duration_s)


def write_json(
    run_dir: Path, meta: dict[str, Any], results: Sequence[LevelResult], duration_s: float
) -> None:
    data = {
        **meta,
        "duration_s": round(duration_s, 1),
        "results": [r.to_json() for r in results],
        "ratios": ratios(results),
        "target": target_verdicts(results),
        "tracing": tracing_verdicts(results),
    }
    (run_dir / "results.json").write_text(json.dumps(data, indent=2) + "\n")


def arrivals(rate: float | None) -> str:
    return "closed loop" if rate is None else f"open loop, Poisson arrivals at {rate:g} req/s"


def write_report(
    run_dir: Path, meta: dict[str, Any], results: Sequence[LevelResult], duration_s: float
) -> None:
    w = meta["workload"]
    preamble = (
        f"# Push vs pull: `vllm bench serve` through the router\n\n"
        f"Run {run_dir.name} on {meta['host']} ({meta['cpus']} CPUs), commit "
        f"{meta['git_commit']}; random {w['input_len']} in / {w['output_len']} out, "
        f"levels (concurrency, prompts) {[tuple(x) for x in w['levels']]}, "
        f"{arrivals(w.get('request_rate'))}"
        f"{', P and D servers pinned to their CPU' if meta.get('pin_servers') else ''}; "
        f"took {duration_s / 60:.1f} min. Command: `{' '.join(meta['argv'])}`.\n"
    )
    if tally := meta.get("round_tally"):
        preamble += (
            f"\nEvery number below is the median over {len(meta['rounds'])} rounds "
            f"({', '.join(meta['rounds'])}/ hold each round's own report); push "
            f"against each baseline, round by round:\n\n" + "".join(f"- {line}\n" for line in tally)
        )
    (run_dir / "report.md").write_text(markdown_report(results, preamble))

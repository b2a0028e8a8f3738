"""Median of several ``pushkv bench`` runs, per configuration and concurrency.

Run: python -m bench.aggregate runs/bench-A runs/bench-B ... [--markdown]

A small host's numbers move a lot from one run to the next (see README: the engines' spinning
loops and two cores), so claims rest on the median over repeated, interleaved runs. Prints
per (config, concurrency, arrivals): the runs that had numbers, then the median over them of
median TTFT, p90 TTFT, mean TPOT, median E2EL and req/s, with the min-max range of median
TTFT. Arrivals are "closed" (the default) or the open-loop rate of ``--request-rate``: runs
of different arrivals are never mixed.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

KEYS = (
    ("median_ttft_ms", "median TTFT ms"),
    ("p90_ttft_ms", "p90 TTFT ms"),
    ("mean_tpot_ms", "mean TPOT ms"),
    ("median_e2el_ms", "median E2EL ms"),
    ("request_throughput", "req/s"),
)


def main(argv: list[str]) -> int:
    markdown = "--markdown" in argv
    runs = [Path(a) for a in argv if not a.startswith("--")]
    cells: dict[tuple[str, int, str], list[dict[str, float]]] = defaultdict(list)
    failed: dict[tuple[str, int, str], list[str]] = defaultdict(list)
    order: list[str] = []
    missing = [str(run) for run in runs if not (run / "results.json").is_file()]
    if missing:
        print(f"no results.json in: {', '.join(missing)}", file=sys.stderr)
        return 2
    for run in runs:
        data = json.loads((run / "results.json").read_text())
        rate = data.get("workload", {}).get("request_rate")
        arrivals = "closed" if rate is None else f"{rate:g}/s"
        for r in data["results"]:
            key = (r["config"], r["concurrency"], arrivals)
            if r["config"] not in order:
                order.append(r["config"])
            (cells[key].append(r["metrics"]) if r["ok"] else failed[key].append(r["reason"]))
    header = ["config", "conc", "arrivals", "runs", *(t for _, t in KEYS), "median TTFT range"]
    rows = []
    for arrivals, conc in sorted(
        {(a, c) for _, c, a in [*cells, *failed]}, key=lambda ac: (ac[0] != "closed", ac[0], ac[1])
    ):
        for cfg in order:
            ms = cells.get((cfg, conc, arrivals), [])
            n_fail = len(failed.get((cfg, conc, arrivals), []))
            if not ms and not n_fail:
                continue
            if not ms:
                rows.append(
                    [cfg, str(conc), arrivals, f"0 ({n_fail} failed)", *["-"] * (len(KEYS) + 1)]
                )
                continue
            med = [statistics.median(m[k] for m in ms if k in m) for k, _ in KEYS]
            ttfts = [m["median_ttft_ms"] for m in ms]
            rows.append(
                [
                    cfg,
                    str(conc),
                    arrivals,
                    f"{len(ms)}" + (f" (+{n_fail} failed)" if n_fail else ""),
                    *(
                        f"{v:.2f}" if k == "request_throughput" else f"{v:.1f}"
                        for v, (k, _) in zip(med, KEYS, strict=True)
                    ),
                    f"{min(ttfts):.0f}-{max(ttfts):.0f}",
                ]
            )
    if markdown:
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for row in rows:
            print("| " + " | ".join(row) + " |")
    else:
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        for row in [header, *rows]:
            print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

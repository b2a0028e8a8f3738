"""The sweep's points and their results files: what ``pushkv bench --sweep`` measures and where
each result lives.

Owns: ``SweepPlan`` (input lengths x request rates at a fixed output length, how many prompts
a point sends, its seed and its wall-clock limit), ``Point``, the run folder's layout (one
``<config>/<point>.json`` per point, ``<config>/<point>.bench.json`` from ``vllm bench serve``,
``<config>/<point>/`` with that point's traces, ``sweep.json`` with every point), the point
record (``point_record``: the numbers of ``vllm bench serve``'s JSON plus the TTFT
decomposition) and reading a folder's points back (``load_points``).

Pure: files in, files out; no processes, no clock.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

SWEEP_FILE = "sweep.json"
# (key in vllm bench serve's JSON): what a point keeps; latencies in ms.
METRIC_KEYS: tuple[str, ...] = (
    "median_ttft_ms",
    "p90_ttft_ms",
    "p99_ttft_ms",
    "mean_ttft_ms",
    "mean_tpot_ms",
    "median_tpot_ms",
    "p90_tpot_ms",
    "median_itl_ms",
    "median_e2el_ms",
    "request_throughput",
    "output_throughput",
)


@dataclass(frozen=True, order=True)
class Point:
    """One cell of the sweep: prompts of ``input_len`` tokens arriving at ``rate`` per second
    (Poisson)."""

    input_len: int
    rate: float

    @property
    def name(self) -> str:
        return f"in{self.input_len}-r{self.rate:g}"


@dataclass(frozen=True)
class SweepPlan:
    """Input lengths x request rates, every point open loop (Poisson arrivals) with the same
    output length. A point sends ``rate * point_s`` prompts (clamped to ``min_prompts`` and
    ``max_prompts``), so every point lasts about ``point_s`` seconds of arrivals; ``cap`` is
    ``vllm bench serve --max-concurrency``, a safety cap far above what an unsaturated stack
    has in flight."""

    lengths: tuple[int, ...]
    rates: tuple[float, ...]
    output_len: int = 32
    point_s: float = 8.0
    min_prompts: int = 6
    max_prompts: int = 64
    cap: int = 64
    seed: int = 0

    def points(self) -> list[Point]:
        """Every point, by length and then by rate (the run order within a stack)."""
        return [Point(n, r) for n in self.lengths for r in self.rates]

    def num_prompts(self, point: Point) -> int:
        return max(self.min_prompts, min(self.max_prompts, round(point.rate * self.point_s)))

    def seed_of(self, point: Point) -> int:
        """A seed per point, the same for every configuration (the same prompts), and
        different between points (no prefix-cache hit on the previous point's prompts)."""
        return self.seed + 1 + self.points().index(point)

    def limit_s(self, point: Point) -> float:
        """The wall-clock bound of one point: the client's start-up plus, several times over,
        the arrivals and the drain of a stack that keeps up; it bounds a saturated or hung
        stack."""
        arrivals_s = self.num_prompts(point) / point.rate
        return 60.0 + 3.0 * arrivals_s

    def max_model_len(self) -> int:
        """Room for the longest prompt, its output and the random dataset's token drift."""
        return max(self.lengths) + self.output_len + 64


def point_file(run_dir: Path, config: str, point: Point) -> Path:
    return run_dir / config / f"{point.name}.json"


def bench_file(run_dir: Path, config: str, point: Point) -> Path:
    return run_dir / config / f"{point.name}.bench.json"


def traces_dir(run_dir: Path, config: str, point: Point) -> Path:
    return run_dir / config / point.name


def is_done(run_dir: Path, config: str, point: Point) -> bool:
    """A point whose results file holds numbers: a resumed sweep skips it (a failed one
    is tried again)."""
    path = point_file(run_dir, config, point)
    try:
        return bool(json.loads(path.read_text()).get("ok"))
    except (OSError, ValueError):
        return False


def point_record(
    config: str,
    point: Point,
    plan: SweepPlan,
    bench: dict[str, Any] | None,
    reason: str = "",
    decomposition: dict[str, Any] | None = None,
    wall_s: float | None = None,
) -> dict[str, Any]:
    """One point's results: ``bench`` is ``vllm bench serve``'s saved JSON (None: the run
    gave none, ``reason`` says why). ``ok`` only when every prompt completed."""
    num = plan.num_prompts(point)
    completed = int(bench.get("completed", 0)) if bench else 0
    failed = int(bench.get("failed", 0)) if bench else 0
    if bench is not None and completed < num and not reason:
        reason = f"{completed}/{num} requests completed"
    errors = sorted({str(e) for e in (bench or {}).get("errors", []) if e})[:3]
    return {
        "config": config,
        "point": point.name,
        "input_len": point.input_len,
        "rate": point.rate,
        "output_len": plan.output_len,
        "num_prompts": num,
        "seed": plan.seed_of(point),
        "ok": bench is not None and completed == num,
        "reason": reason,
        "completed": completed,
        "failed": failed,
        "errors": errors,
        "metrics": {k: float(bench[k]) for k in METRIC_KEYS if bench and bench.get(k) is not None},
        "duration_s": bench.get("duration") if bench else None,
        "wall_s": None if wall_s is None else round(wall_s, 1),
        "decomposition": decomposition or {},
    }


def write_point(run_dir: Path, record: dict[str, Any]) -> Path:
    point = Point(int(record["input_len"]), float(record["rate"]))
    path = point_file(run_dir, record["config"], point)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


def load_points(run_dir: Path) -> list[dict[str, Any]]:
    """Every point record under ``run_dir`` (``<config>/in*-r*.json``), sorted by config,
    length and rate."""
    records = []
    for path in sorted(run_dir.glob("*/in*-r*.json")):
        if path.name.endswith(".bench.json"):
            continue
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue  # a point being written, or not a point
    return sorted(records, key=lambda r: (r["config"], r["input_len"], r["rate"]))


def write_sweep(
    run_dir: Path, meta: dict[str, Any], records: Sequence[dict[str, Any]]
) -> dict[str, Any]:
    """``sweep.json``: the run's metadata and every point (what the plots and the
    dashboard read)."""
    data = {**meta, "points": list(records)}
    (run_dir / SWEEP_FILE).write_text(json.dumps(data, indent=2) + "\n")
    return data


def plan_json(plan: SweepPlan) -> dict[str, Any]:
    return asdict(plan)

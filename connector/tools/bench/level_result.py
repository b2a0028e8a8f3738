"""One ``vllm bench serve`` run's numbers for the serving benchmark, per (configuration,
concurrency): ``LevelResult`` (read from its saved JSON, or why there are none), and the
median over repeated rounds (``median_results``). Pure: no processes, no I/O.
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

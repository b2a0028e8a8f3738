"""pushkv's metrics through vLLM's connector-stats hooks (vLLM's own /metrics).

Owns: ``PushkvStats`` (what ``get_kv_connector_stats`` returns and vLLM aggregates across
TP ranks and the scheduler, then ships to the API server) and ``PushkvPromMetrics`` (what
``build_prom_metrics`` returns: it registers the metrics of ``telemetry.schema.METRICS``
with vLLM's metric classes and labels and records each aggregated stats dict).

Duck-typed to vLLM's ``KVConnectorStats`` and ``KVConnectorPromMetrics``: nothing here
imports vLLM (``plugin.py`` wires it in), so a test can drive it with fake metric classes.
The dict is msgpack-able (vLLM sends it between processes): ``samples`` (histogram values
by key), ``counts`` (counter increments by key) and ``gauges`` (per TP rank, the latest);
a key is the metric name and its extra label values joined by ``|``
(``connector.transfer.metrics.key``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from telemetry.schema import METRICS, Metric, Recomputed

_SEP = "|"
_SECONDS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0]
BUCKETS: dict[Metric, list[float]] = {
    Metric.RENDEZVOUS_WAIT: _SECONDS,
    Metric.PREPARE: _SECONDS,
    Metric.WRITE: _SECONDS,
    Metric.PUSH: _SECONDS,
    Metric.KV_WAIT: _SECONDS,
    Metric.WRITE_THROUGHPUT: [1e8 * 2**i for i in range(12)],  # 0.1 GB/s .. 205 GB/s
    Metric.BYTES: [float(2 ** (16 + 2 * i)) for i in range(10)],  # 64 KiB .. 16 GiB
    Metric.DESCRIPTORS: [1, 10, 50, 100, 500, 1000, 5000, 10000, 50000, 100000],
}
# Gauges are per TP rank; across ranks, what each rank holds adds up, while transfer
# counts (every rank sees every transfer) and ages take the largest.
_SUMMED = frozenset({Metric.BLOCKS_HELD.value, Metric.WRITES_IN_FLIGHT.value})


def combine_gauges(ranks: dict[str, dict[str, float]]) -> dict[str, float]:
    """Each gauge over the TP ranks' latest values (summed or the largest, see _SUMMED)."""
    out: dict[str, float] = {}
    for gauges in ranks.values():
        for name, value in gauges.items():
            if name not in out:
                out[name] = value
            else:
                out[name] = out[name] + value if name in _SUMMED else max(out[name], value)
    return out


def _empty() -> dict[str, Any]:
    return {"samples": {}, "counts": {}, "gauges": {}}


@dataclass
class PushkvStats:
    """The stats of one step (or, in vLLM's logger, of an interval), all ranks together."""

    data: dict[str, Any] = field(default_factory=_empty)

    def __post_init__(self) -> None:
        for k, v in _empty().items():
            self.data.setdefault(k, v)

    def to_dict(self) -> dict[str, Any]:
        return self.data

    def reset(self) -> None:
        self.data = _empty()

    def is_empty(self) -> bool:
        return not (self.data["samples"] or self.data["counts"] or self.data["gauges"])

    def aggregate(self, other: Any) -> PushkvStats:
        """Add ``other`` (another rank, the scheduler, or a later step) into this one."""
        for k, values in other.data.get("samples", {}).items():
            self.data["samples"].setdefault(k, []).extend(values)
        counts = self.data["counts"]
        for k, n in other.data.get("counts", {}).items():
            counts[k] = counts.get(k, 0) + n
        self.data["gauges"].update(other.data.get("gauges", {}))  # later wins, per rank
        return self

    def reduce(self) -> dict[str, int | float]:
        """A line for vLLM's periodic log: transfers by outcome, mean times in ms."""
        out: dict[str, int | float] = {}
        for k, n in sorted(self.data["counts"].items()):
            name, *labels = k.split(_SEP)
            if name == Metric.TRANSFERS.value:
                label = f"{labels[0]} {labels[1]}"
                out[label] = out.get(label, 0) + n
        for k, values in sorted(self.data["samples"].items()):
            name = k.split(_SEP)[0]
            if name.endswith("_seconds") and values:
                short = name.removeprefix("vllm:pushkv_").removesuffix("_seconds")
                out[f"avg {short} ms"] = round(sum(values) / len(values) * 1e3, 3)
        for name, value in sorted(combine_gauges(self.data["gauges"]).items()):
            out[name.removeprefix("vllm:pushkv_")] = round(value, 3)
        return out


def recomputed_counts(recomputed: Any, recompute: bool) -> dict[str, Any] | None:
    """The scheduler role's counts (``SchedulerSide.recomputed``), drained; a failed
    transfer is recomputed only under ``kv_load_failure_policy: recompute``."""
    counts = {
        _SEP.join((Metric.RECOMPUTED.value, why)): n
        for why, n in recomputed.items()
        if n and (recompute or why != Recomputed.TRANSFER_FAILED.value)
    }
    recomputed.clear()
    return {"samples": {}, "counts": counts, "gauges": {}} if counts else None


class PushkvPromMetrics:
    """Registers pushkv's engine metrics and records aggregated stats into them."""

    def __init__(
        self,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        """``metric_types``: vLLM's map from prometheus_client's Gauge, Counter and
        Histogram to the classes to use (its Prometheus or Ray wrappers)."""
        from prometheus_client import Counter, Gauge, Histogram

        self.per_engine_labelvalues = per_engine_labelvalues
        self.metrics: dict[str, Any] = {}
        for metric, (kind, extra, doc) in METRICS.items():
            if not metric.value.startswith("vllm:"):
                continue  # the router's
            names = [*labelnames, *(label.value for label in extra)]
            if kind == "histogram":
                made = metric_types[Histogram](
                    name=metric.value, documentation=doc, labelnames=names, buckets=BUCKETS[metric]
                )
            elif kind == "counter":
                made = metric_types[Counter](name=metric.value, documentation=doc, labelnames=names)
            else:
                made = metric_types[Gauge](
                    name=metric.value,
                    documentation=doc,
                    labelnames=names,
                    multiprocess_mode="mostrecent",
                )
            self.metrics[metric.value] = made
        self._ranks: dict[int, dict[str, dict[str, float]]] = {}  # engine -> rank -> gauges

    def _child(self, k: str, engine_idx: int) -> Any:
        name, *labels = k.split(_SEP)
        metric = self.metrics.get(name)
        if metric is None:  # a newer worker's metric: skip rather than fail the logger
            return None
        return metric.labels(*self.per_engine_labelvalues[engine_idx], *labels)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for k, values in transfer_stats_data.get("samples", {}).items():
            if (child := self._child(k, engine_idx)) is not None:
                for v in values:
                    child.observe(v)
        for k, n in transfer_stats_data.get("counts", {}).items():
            if (child := self._child(k, engine_idx)) is not None:
                child.inc(n)
        if not transfer_stats_data.get("gauges"):
            return
        ranks = self._ranks.setdefault(engine_idx, {})
        ranks.update(transfer_stats_data["gauges"])
        for name, value in combine_gauges(ranks).items():
            if (child := self._child(name, engine_idx)) is not None:
                child.set(value)

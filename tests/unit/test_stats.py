"""connector/stats.py: vLLM's view of pushkv's metrics. The stats aggregate across ranks
and steps; the Prometheus side records them with vLLM's labels into a private registry."""

from __future__ import annotations

import functools

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from connector.config import parse_config
from connector.plugin import PushConnector
from connector.scheduler_side import SchedulerSide
from connector.stats import PushkvPromMetrics, PushkvStats, recomputed_counts
from connector.transfer.metrics import key
from connector.worker_side import WorkerSide
from telemetry.schema import METRICS, Metric


def _rank(rank: int, write_s: list[float], done: int, held: int) -> PushkvStats:
    return PushkvStats(
        {
            "samples": {key(Metric.WRITE, "direct"): write_s},
            "counts": {key(Metric.TRANSFERS, "send", "done", ""): done},
            "gauges": {
                str(rank): {Metric.BLOCKS_HELD.value: held, Metric.OLDEST_HELD.value: held / 10}
            },
        }
    )


def test_aggregate_joins_samples_adds_counts_and_keeps_each_ranks_gauges() -> None:
    agg = _rank(0, [0.001], 1, 4).aggregate(_rank(1, [0.002, 0.003], 2, 6))
    assert agg.data["samples"][key(Metric.WRITE, "direct")] == [0.001, 0.002, 0.003]
    assert agg.data["counts"] == {key(Metric.TRANSFERS, "send", "done", ""): 3}
    assert set(agg.data["gauges"]) == {"0", "1"}
    later = agg.aggregate(_rank(0, [], 0, 0))
    assert later.data["gauges"]["0"][Metric.BLOCKS_HELD.value] == 0, "a later step wins"
    assert later.reduce() == {
        "send done": 3,
        "avg write ms": 2.0,
        "blocks_held": 6,  # rank 0 now holds none, rank 1 six
        "oldest_held_seconds": 0.6,
    }
    assert not later.is_empty() and PushkvStats().is_empty()


def test_the_connector_builds_its_stats_from_the_dict_vllm_ships() -> None:
    data = _rank(0, [0.5], 1, 0).to_dict()
    built = PushConnector.build_kv_connector_stats(data)
    assert isinstance(built, PushkvStats) and built.data is data
    assert PushConnector.build_kv_connector_stats().is_empty()


def test_recomputed_counts_drain_and_follow_the_failure_policy() -> None:
    import collections

    c = collections.Counter({"bad_params": 1, "transfer_failed": 2})
    assert recomputed_counts(c, recompute=False) == {
        "samples": {},
        "counts": {key(Metric.RECOMPUTED, "bad_params"): 1},
        "gauges": {},
    }
    assert not c and recomputed_counts(c, recompute=True) is None


def _prom() -> tuple[PushkvPromMetrics, CollectorRegistry]:
    registry = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=registry) for cls in (Gauge, Counter, Histogram)}
    labels = {0: ["tiny", "0"], 1: ["tiny", "1"]}
    return PushkvPromMetrics(types, ["model_name", "engine"], labels), registry


def test_prom_metrics_register_every_engine_metric_of_the_schema() -> None:
    prom, _ = _prom()
    engine = {m.value for m in METRICS if m.value.startswith("vllm:")}
    assert set(prom.metrics) == engine
    built = PushConnector.build_prom_metrics(
        None, _prom_types(), ["model_name", "engine"], {0: ["m", "0"]}
    )
    assert isinstance(built, PushkvPromMetrics)


def _prom_types() -> dict:
    registry = CollectorRegistry()
    return {cls: functools.partial(cls, registry=registry) for cls in (Gauge, Counter, Histogram)}


def test_prom_observe_records_samples_counts_and_gauges_with_vllms_labels() -> None:
    prom, registry = _prom()
    prom.observe(_rank(0, [0.001, 0.002], 2, 4).aggregate(_rank(1, [0.003], 1, 6)).data, 1)
    get = registry.get_sample_value
    lab = {"model_name": "tiny", "engine": "1"}
    assert get("vllm:pushkv_write_seconds_count", {**lab, "path": "direct"}) == 3
    assert get("vllm:pushkv_write_seconds_sum", {**lab, "path": "direct"}) == 0.006
    done = {**lab, "side": "send", "outcome": "done", "reason": ""}
    assert get("vllm:pushkv_transfers_total", done) == 3
    assert get("vllm:pushkv_blocks_held", lab) == 10, "blocks held add up across ranks"
    assert get("vllm:pushkv_oldest_held_seconds", lab) == 0.6, "the oldest is the largest"
    # Rank 1 drains to zero in a later step; rank 0 keeps what it said last.
    prom.observe(_rank(1, [], 0, 0).data, 1)
    assert get("vllm:pushkv_blocks_held", lab) == 4
    prom.observe({"samples": {"vllm:pushkv_unknown|x": [1.0]}, "counts": {}, "gauges": {}}, 0)
    text = generate_latest(registry).decode()
    assert 'vllm:pushkv_transfers_total{engine="1"' in text


def test_every_metric_of_the_schema_is_documented() -> None:
    from pathlib import Path

    doc = (Path(__file__).parents[2] / "docs" / "operations.md").read_text()
    missing = [m.value for m in METRICS if f"`{m.value}`" not in doc]
    assert not missing, f"not in docs/operations.md#metrics: {missing}"


def _connector(extra: dict[str, object]) -> PushConnector:
    """PushConnector's scheduler role without vLLM's config: only what the stats hook reads."""
    c = PushConnector.__new__(PushConnector)
    c._cfg = parse_config(extra)
    c._worker, c._recompute = None, True
    c._sched = SchedulerSide("decode", False, True)
    c._sched.recomputed["bad_params"] += 1
    return c


def test_metrics_false_reports_nothing_from_scheduler_or_worker() -> None:
    """The ``metrics: false`` knob (what ``pushkv bench``'s push-nometrics measures)."""
    on = _connector({}).get_kv_connector_stats()
    assert on is not None and on.data["counts"]
    assert _connector({"metrics": False}).get_kv_connector_stats() is None
    worker = WorkerSide(parse_config({"metrics": False}), "decode", False, True, 0, 1, 4, 16, {})
    worker.thread = object()  # type: ignore[assignment]  # stats() only asks if it started
    assert worker._metrics is None and worker.stats() is None
    worker = WorkerSide(parse_config({}), "decode", False, True, 0, 1, 4, 16, {})
    worker.thread = object()  # type: ignore[assignment]
    assert worker._metrics is not None
    worker._metrics._sample(key(Metric.KV_WAIT), 0.01)
    assert worker.stats() == {"samples": {key(Metric.KV_WAIT): [0.01]}, "counts": {}, "gauges": {}}

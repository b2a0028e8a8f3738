"""What pushkv's metrics cost, piece by piece (CPU time per call, best of --repeats).

Prints microseconds for: the transfer thread's hooks of one transfer (P and D), the census
it publishes (with N transfers holding blocks), the engine step's drain, vLLM's aggregation
of two ranks' stats, and the API server's Prometheus ``observe`` of one step's stats.

    python -m bench.metrics_cost [--number 20000] [--repeats 5]

Read it against a transfer's own time (milliseconds) and an engine step (milliseconds): the
thread's share per transfer is the hooks plus one census when the results go out.
"""

from __future__ import annotations

import argparse
import functools
import timeit
from collections import Counter
from types import SimpleNamespace
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, Histogram
from prometheus_client import Counter as PCounter

from connector.core import events as ev
from connector.core.sender_table import SenderTable
from connector.stats import PushkvPromMetrics, PushkvStats
from connector.transfer.metrics import RankMetrics, census


def _report(done_ns: int) -> Any:
    return SimpleNamespace(
        transfer_id="t",
        request_id="r",
        ok=True,
        reason=None,
        issued_ns=done_ns - 3_000_000,
        prepared_ns=done_ns - 2_000_000,
        posted_ns=done_ns - 1_000_000,
        done_ns=done_ns,
        bytes_total=8 << 20,
        descriptors=64,
        path="direct",
    )


def _thread(held: int) -> Any:
    """A transfer thread's shape as ``census`` reads it, with ``held`` transfers holding
    blocks in a real SenderTable."""
    table = SenderTable(lambda _d_tp: frozenset({0}))
    for i in range(held):
        table.handle(ev.PrefillDone(f"t{i}", f"r{i}", ((1, 2, 3, 4),), 64), i)
    sender = SimpleNamespace(table=table, counters=Counter(), writes_in_flight=lambda: 0)
    return SimpleNamespace(counters=Counter(), sender=sender, receiver=None, bell=None)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--number", type=int, default=20000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)

    def us(fn: Any) -> float:
        best = min(timeit.repeat(fn, number=args.number, repeat=args.repeats))
        return best / args.number * 1e6

    m = RankMetrics(0)
    report = _report(10_000_000_000)

    def p_hooks() -> None:
        m.prefill_ready("t", 1)
        m.registration("t", None, 2)
        m.write_finished(report)
        m.released("t", None)

    def d_hooks() -> None:
        m.register_sent("t")
        m.received("t", True, None, 20_000_000_000_000_000)

    rows = [("P hooks of one transfer", us(p_hooks)), ("D hooks of one transfer", us(d_hooks))]
    m.drain()
    for held in (0, 100, 1000):
        thread = _thread(held)
        rows.append((f"census, {held} transfers holding blocks", us(lambda t=thread: census(t, 0))))
    rows.append(("drain, nothing new", us(m.drain)))

    def step() -> None:
        p_hooks()
        m.publish(thread, 0, force=True)
        m.drain()

    rows.append(("one transfer: hooks + census (1000 held) + drain", us(step)))
    one = m.drain() or {}
    p_hooks()
    data = m.drain() or one

    def aggregate() -> None:
        # A fresh accumulator each time: aggregate extends its lists in place.
        mine = {
            "samples": {k: list(v) for k, v in data["samples"].items()},
            "counts": dict(data["counts"]),
            "gauges": dict(data["gauges"]),
        }
        PushkvStats(mine).aggregate(PushkvStats(data))

    rows.append(("vLLM: aggregate two ranks' stats", us(aggregate)))
    registry = CollectorRegistry()
    types = {c: functools.partial(c, registry=registry) for c in (Gauge, PCounter, Histogram)}
    prom = PushkvPromMetrics(types, ["model_name", "engine"], {0: ["m", "0"]})
    step_data = {**data, "gauges": {"0": census(_thread(10), 0)[1]}}
    rows.append(("API server: observe one transfer's stats", us(lambda: prom.observe(step_data))))
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value:8.2f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

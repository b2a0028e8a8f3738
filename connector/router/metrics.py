"""The router's Prometheus metrics, served on its ``/metrics``.

Owns: ``RouterMetrics``, one private registry per router instance (several apps in one
test process never collide). Requests, legs and the latency histograms are recorded as
they end (``RequestTrace`` calls ``leg_ended``, the endpoint ``request_ended``); retries,
degraded attempts, backends' health and outstanding legs are read from the router's own
state when scraped, so serving pays nothing for them. Names, kinds and labels come from
``telemetry.schema.METRICS``. The TTFT and end-to-end histograms carry the request's trace
id as an exemplar (``trace_id``), served when the scraper asks for OpenMetrics (Prometheus
with exemplar storage does): a slow bucket then links to one request that landed in it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from connector.router.policy import Health
from telemetry.schema import EXEMPLAR_TRACE_ID, METRICS, Metric, Outcome

if TYPE_CHECKING:
    from connector.router.app import RouterState

_SECONDS = [0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
BUCKETS = {
    Metric.ROUTER_TTFT: _SECONDS,
    Metric.ROUTER_E2E: _SECONDS,
    Metric.ROUTER_OVERHEAD: [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1],
}


def _labels(metric: Metric) -> list[str]:
    return [label.value for label in METRICS[metric][1]]


def _help(metric: Metric) -> str:
    return METRICS[metric][2]


def request_outcome(status: int | None, error: str | None) -> str:
    """A request's ``outcome`` label: a bounded set, never free text."""
    if error == Outcome.CANCELLED.value:
        return error
    if status is not None and status >= 400:
        return f"http_{status}"
    return "error" if error else Outcome.OK.value


class _StateCollector(Collector):
    """What the router's state already counts, read at scrape time."""

    def __init__(self, state: Callable[[], RouterState]) -> None:
        self._state = state

    def collect(self) -> Iterator[Any]:
        state = self._state()
        retries = CounterMetricFamily(
            Metric.ROUTER_RETRIES.value, _help(Metric.ROUTER_RETRIES), labels=["role"]
        )
        for role, n in sorted(state.retries.items()):
            retries.add_metric([role], n)
        yield retries
        degraded = CounterMetricFamily(
            Metric.ROUTER_DEGRADED.value, _help(Metric.ROUTER_DEGRADED), labels=[]
        )
        degraded.add_metric([], state.degraded)
        yield degraded
        names = _labels(Metric.ROUTER_BACKEND_HEALTHY)
        healthy = GaugeMetricFamily(
            Metric.ROUTER_BACKEND_HEALTHY.value, _help(Metric.ROUTER_BACKEND_HEALTHY), labels=names
        )
        outstanding = GaugeMetricFamily(
            Metric.ROUTER_OUTSTANDING.value, _help(Metric.ROUTER_OUTSTANDING), labels=names
        )
        draining = GaugeMetricFamily(
            Metric.ROUTER_DRAINING.value, _help(Metric.ROUTER_DRAINING), labels=names
        )
        for b in state.backends.all:
            healthy.add_metric([b.role.value, b.url], float(b.load.health is Health.HEALTHY))
            outstanding.add_metric([b.role.value, b.url], b.load.outstanding)
            draining.add_metric([b.role.value, b.url], float(b.load.draining))
        yield healthy
        yield outstanding
        yield draining
        lag = GaugeMetricFamily(
            Metric.ROUTER_LOOP_LAG.value, _help(Metric.ROUTER_LOOP_LAG), labels=[]
        )
        lag.add_metric([], state.loop_lag.worst_since(time.monotonic_ns() - 1_000_000_000) / 1e9)
        yield lag


class RouterMetrics:
    def __init__(self, state: RouterState) -> None:
        self.mode = state.config.mode.value
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self._requests = Counter(
            Metric.ROUTER_REQUESTS.value,
            _help(Metric.ROUTER_REQUESTS),
            _labels(Metric.ROUTER_REQUESTS),
            registry=r,
        )
        self._legs = Counter(
            Metric.ROUTER_LEGS.value,
            _help(Metric.ROUTER_LEGS),
            _labels(Metric.ROUTER_LEGS),
            registry=r,
        )
        self._hist = {
            m: Histogram(m.value, _help(m), _labels(m), buckets=BUCKETS[m], registry=r)
            for m in BUCKETS
        }
        r.register(_StateCollector(lambda: state))

    def leg_ended(self, role: str, url: str, error: str | None) -> None:
        outcome = (
            Outcome.OK.value
            if error is None
            else (error if error == Outcome.CANCELLED.value else "error")
        )
        self._legs.labels(role, url, outcome).inc()

    def request_ended(
        self,
        status: int | None,
        error: str | None,
        *,
        start_ns: int,
        first_leg_ns: int,
        first_chunk_ns: int,
        end_ns: int,
        trace_id: str | None = None,
    ) -> None:
        """``trace_id``: the request's (hex), kept as the latency histograms' exemplar."""
        outcome = request_outcome(status, error)
        self._requests.labels(self.mode, outcome).inc()
        if first_leg_ns:
            self._observe(Metric.ROUTER_OVERHEAD, first_leg_ns - start_ns)
        if outcome != Outcome.OK.value:
            return
        exemplar = {EXEMPLAR_TRACE_ID: trace_id} if trace_id else None
        if first_chunk_ns:
            self._observe(Metric.ROUTER_TTFT, first_chunk_ns - start_ns, exemplar)
        self._observe(Metric.ROUTER_E2E, end_ns - start_ns, exemplar)

    def _observe(self, metric: Metric, ns: int, exemplar: dict[str, str] | None = None) -> None:
        self._hist[metric].labels(self.mode).observe(max(ns, 0) / 1e9, exemplar)

    def render(self, accept: str = "") -> tuple[bytes, str]:
        """The exposition and its content type: OpenMetrics (with exemplars) when ``accept``,
        the scraper's Accept header, asks for it, else Prometheus' text format."""
        encode, content_type = choose_encoder(accept)
        return encode(self.registry), content_type

"""The router's /metrics after requests through the mock backends, and the ids and timings
every answer carries (traceresponse, Server-Timing, the trace id in a stream's last event)."""

from __future__ import annotations

import json
import re

import pytest
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families

from connector.router.tracing import TraceStamp
from telemetry.schema import EXEMPLAR_TRACE_ID, METRICS, Metric
from tests.unit.router.conftest import Cluster, MakeCluster

pytestmark = pytest.mark.anyio

BODY = {"model": "m", "prompt": "hello", "max_tokens": 8}
TRACERESPONSE = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-0[01]$")


async def scrape(c: Cluster) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    r = await c.client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(r.text)
        for s in fam.samples
    }


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


async def test_metrics_count_requests_legs_and_latencies(cluster: MakeCluster) -> None:
    c = await cluster()
    for stream in (False, True, True):
        r = await c.client.post("/v1/completions", json={**BODY, "stream": stream})
        assert r.status_code == 200
    await c.background_done()
    c.d[0].fail_first_n, c.d[0].error_status = 1, 400  # a refusal: not retried
    assert (await c.client.post("/v1/completions", json=BODY)).status_code == 400
    await c.background_done()
    m = await scrape(c)
    p_url, d_url = c.p_servers[0].url, c.d_servers[0].url
    assert value(m, "pushkv_router_requests_total", mode="push", outcome="ok") == 3
    assert value(m, "pushkv_router_requests_total", mode="push", outcome="http_400") == 1
    assert value(m, "pushkv_router_legs_total", role="prefill", backend=p_url, outcome="ok") == 4
    assert value(m, "pushkv_router_legs_total", role="decode", backend=d_url, outcome="ok") == 3
    assert value(m, "pushkv_router_legs_total", role="decode", backend=d_url, outcome="error") == 1
    for name in ("pushkv_router_ttft_seconds", "pushkv_router_e2e_seconds"):
        assert value(m, f"{name}_count", mode="push") == 3, "ok requests only"
    assert value(m, "pushkv_router_overhead_seconds_count", mode="push") == 4
    assert value(m, "pushkv_router_backend_healthy", role="decode", backend=d_url) == 1
    assert value(m, "pushkv_router_backend_outstanding_legs", role="prefill", backend=p_url) == 0
    assert value(m, "pushkv_router_retries_total") == 0


async def test_metrics_show_retries_degraded_requests_and_health(cluster: MakeCluster) -> None:
    c = await cluster(n_d=2, max_attempts=2)
    c.d[0].fail_first_n = c.d[1].fail_first_n = 1  # 500s: the first attempt is retried
    r = await c.client.post("/v1/completions", json=BODY)
    await c.background_done()
    m = await scrape(c)
    assert value(m, "pushkv_router_retries_total", role="decode") == 1
    assert r.status_code == 500
    assert value(m, "pushkv_router_requests_total", mode="push", outcome="http_500") == 1
    suspect = (c.d_servers[0].url, c.d_servers[1].url)
    healthy = [value(m, "pushkv_router_backend_healthy", role="decode", backend=u) for u in suspect]
    assert healthy == [0, 0], "a 5xx makes a backend suspect"
    # No P usable: degraded, D alone.
    c.p[0].healthy = False
    await c.check_health()
    assert (await c.client.post("/v1/completions", json=BODY)).status_code == 200
    m = await scrape(c)
    assert value(m, "pushkv_router_degraded_requests_total") == 1
    assert (
        value(m, "pushkv_router_backend_healthy", role="prefill", backend=c.p_servers[0].url) == 0
    )


async def test_every_answer_names_its_trace(cluster: MakeCluster) -> None:
    c = await cluster()
    incoming = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    r = await c.client.post("/v1/completions", json=BODY, headers={"traceparent": incoming})
    got = TRACERESPONSE.match(r.headers["traceresponse"])
    assert got and got[1] == "0af7651916cd43dd8448eb211c80319c", "the client's trace is kept"
    assert got[2] != "b7ad6b7169203331", "the span is the router's own"
    # Errors too: a 400 answered by the router itself.
    bad = await c.client.post("/v1/completions", json={"prompt": 1})
    assert bad.status_code == 400 and TRACERESPONSE.match(bad.headers["traceresponse"])
    other = await c.client.post("/v1/completions", json=BODY)
    assert other.headers["traceresponse"].split("-")[1] != got[1], "a fresh trace per request"


async def test_whole_answers_carry_server_timing(cluster: MakeCluster) -> None:
    c = await cluster()
    r = await c.client.post("/v1/completions", json=BODY)
    timing = dict(
        (name.strip(), float(dur.removeprefix("dur=")))
        for name, dur in (part.split(";") for part in r.headers["server-timing"].split(","))
    )
    assert {"ingress", "router", "decode", "total"} <= set(timing)
    assert all(v >= 0 for v in timing.values())
    assert timing["total"] >= max(v for k, v in timing.items() if k != "total")
    s = await c.client.post("/v1/completions", json={**BODY, "stream": True})
    assert "server-timing" not in s.headers, "a stream's headers leave before its timings exist"


async def test_a_streams_closing_event_carries_the_trace_id(cluster: MakeCluster) -> None:
    c = await cluster()
    c.d[0].chunks = [
        b'data: {"id":"1","choices":[{"text":"hel","finish_reason":null}]}\n\n',
        b'data: {"id":"1","choices":[{"text":"lo","finish_re',  # split mid-event
        b'ason":"length"}]}\n\ndata: {"id":"1","choices":[],"usage":{"completion_tokens":2}}\n\n',
        b"data: [DONE]\n\n",
    ]
    r = await c.client.post("/v1/completions", json={**BODY, "stream": True})
    trace_id = r.headers["traceresponse"].split("-")[1]
    events = [e.removeprefix("data: ") for e in r.text.split("\n\n") if e.strip()]
    assert events[-1] == "[DONE]"
    parsed = [json.loads(e) for e in events[:-1]]
    assert [e.get("pushkv_trace_id") for e in parsed] == [None, trace_id, trace_id]
    assert parsed[1]["choices"][0]["text"] == "lo", "the event is otherwise unchanged"


async def test_latency_histograms_carry_the_trace_id_as_an_exemplar(cluster: MakeCluster) -> None:
    c = await cluster()
    r = await c.client.post("/v1/completions", json=BODY)
    assert r.status_code == 200
    await c.background_done()
    trace_id = r.headers["traceresponse"].split("-")[1]
    om = await c.client.get("/metrics", headers={"accept": "application/openmetrics-text"})
    assert om.headers["content-type"].startswith("application/openmetrics-text")
    exemplars = {
        s.name: s.exemplar
        for fam in openmetrics_families(om.text)
        for s in fam.samples
        if s.exemplar is not None
    }
    for name in (Metric.ROUTER_TTFT.value, Metric.ROUTER_E2E.value):
        buckets = [e for n, e in exemplars.items() if n == f"{name}_bucket"]
        assert buckets, f"{name}: no exemplar in {sorted(exemplars)}"
        assert buckets[0].labels == {EXEMPLAR_TRACE_ID: trace_id}, "the response's trace"
    assert Metric.ROUTER_OVERHEAD.value + "_bucket" not in exemplars
    plain = await c.client.get("/metrics")  # Prometheus' text format has no exemplars
    assert plain.headers["content-type"].startswith("text/plain") and "# {" not in plain.text


def test_trace_stamp_passes_whole_events_at_once_and_holds_only_a_partial_one() -> None:
    stamp = TraceStamp("abc")
    assert stamp.feed(b'data: {"a":1}\n\ndata: {"b"') == b'data: {"a":1}\n\n'
    assert stamp.feed(b":2}\n\n") == b'data: {"b":2}\n\n'
    assert stamp.feed(b'data: {"choices":[{"finish_reason": "stop"}]}\n\n') == (
        b'data: {"pushkv_trace_id":"abc","choices":[{"finish_reason": "stop"}]}\n\n'
    )
    assert stamp.feed(b"data: [DO") == b"" and stamp.flush() == b"data: [DO"


def test_router_metric_names_are_the_schemas() -> None:
    from connector.router.metrics import BUCKETS

    router = {m for m in METRICS if m.value.startswith("pushkv_router_")}
    assert set(BUCKETS) <= router and Metric.ROUTER_REQUESTS in router

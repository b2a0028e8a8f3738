"""The router's spans (connector/router/tracing.py) against mock P and D: the tree, the
traceparent each leg carries, the client-observed TTFT, and error status on failures."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
from opentelemetry.trace import SpanKind, StatusCode

from telemetry.schema import Attr, Event, Span
from tests.unit.router.conftest import MakeCluster
from tests.unit.telemetry.memory import Recorder

pytestmark = pytest.mark.anyio

COMPLETION = {"model": "m", "prompt": "hello", "max_tokens": 16}
INCOMING = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"


def span_id_of(traceparent: str) -> int:
    return int(traceparent.split("-")[2], 16)


async def test_push_request_tree_and_leg_parents(cluster: MakeCluster) -> None:
    rec = Recorder()
    c = await cluster(tracer=rec.tracer)
    r = await c.client.post(
        "/v1/completions", json={**COMPLETION, "stream": True}, headers={"traceparent": INCOMING}
    )
    assert r.status_code == 200, r.text
    assert rec.names() == sorted(
        s.value
        for s in (
            Span.REQUEST,
            Span.CONNECT,
            Span.INGRESS,
            Span.ROUTE,
            Span.PREFILL_LEG,
            Span.DECODE_LEG,
            Span.FIRST_BYTE,
        )
    )
    root = rec.one(Span.REQUEST)
    assert root.kind is SpanKind.SERVER and root.context.trace_id == int("ab" * 16, 16)
    assert root.parent is not None and root.parent.span_id == int("cd" * 8, 16)  # the client's
    p_leg, d_leg = rec.one(Span.PREFILL_LEG), rec.one(Span.DECODE_LEG)
    assert p_leg.kind is SpanKind.CLIENT and d_leg.kind is SpanKind.CLIENT
    connect, ingress = rec.one(Span.CONNECT), rec.one(Span.INGRESS)
    route = rec.one(Span.ROUTE)
    for child in (connect, ingress, route, p_leg, d_leg):
        assert child.parent.span_id == root.context.span_id
    # The client opened a connection for it: the root starts at the server's accept, connect
    # reaches the first bytes, ingress the handler, before routing.
    assert root.attributes[Attr.ARRIVAL.value] == "server"
    assert connect.start_time == root.start_time and connect.end_time == ingress.start_time
    assert ingress.end_time <= route.start_time
    assert p_leg.start_time <= d_leg.start_time  # P's leg, the long pole, is sent first
    assert rec.one(Span.FIRST_BYTE).parent.span_id == d_leg.context.span_id
    # Each leg names its own span as the parent of what P and D record.
    pseen, dseen = c.p[0].requests[0], c.d[0].requests[0]
    assert span_id_of(pseen.headers["traceparent"]) == p_leg.context.span_id
    assert span_id_of(pseen.body["kv_transfer_params"]["traceparent"]) == p_leg.context.span_id
    assert span_id_of(dseen.headers["traceparent"]) == d_leg.context.span_id
    assert span_id_of(dseen.body["kv_transfer_params"]["traceparent"]) == d_leg.context.span_id
    # Children inside the root; the first chunk event is the client-observed TTFT.
    for s in rec.spans():
        assert root.start_time <= s.start_time <= s.end_time <= root.end_time, s.name
    (first,) = [e for e in root.events if e.name == Event.FIRST_CHUNK.value]
    assert d_leg.start_time < first.timestamp <= root.end_time
    ttft = root.attributes[Attr.TTFT_MS.value]
    assert ttft == pytest.approx((first.timestamp - root.start_time) / 1e6)
    assert root.attributes[Attr.MODE.value] == "push"
    assert root.attributes[Attr.OUTPUT_TOKENS.value] == 2  # the mock streams two tokens
    assert root.attributes[Attr.OUTCOME.value] == "ok"
    assert root.attributes[Attr.DECODE_URL.value] == c.d_servers[0].url


async def test_usage_numbers_land_on_the_root(cluster: MakeCluster) -> None:
    rec = Recorder()

    def setup(ps, ds) -> None:
        usage = {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}}
        ds[0].chunks = [b'data: {"choices":[{"text":"a"}]}\n\n'] * 3 + [
            b"data: " + json.dumps(usage, separators=(",", ":")).encode() + b"\n\n",
            b"data: [DONE]\n\n",
        ]

    c = await cluster(tracer=rec.tracer, setup=setup)
    r = await c.client.post("/v1/completions", json={**COMPLETION, "stream": True})
    assert r.status_code == 200
    root = rec.one(Span.REQUEST)
    assert root.attributes[Attr.INPUT_TOKENS.value] == 7
    assert root.attributes[Attr.OUTPUT_TOKENS.value] == 3


async def test_failed_prefill_ends_leg_and_request_in_error(cluster: MakeCluster) -> None:
    rec = Recorder()
    c = await cluster(tracer=rec.tracer, degraded=False)
    d = c.d[0]
    d.gate = asyncio.Event()  # D waits for KV that never comes
    c.p[0].gate = d.arrived
    c.p[0].fail_first_n = 1
    r = await c.client.post("/v1/completions", json=COMPLETION)
    assert r.status_code == 500
    p_leg, root = rec.one(Span.PREFILL_LEG), rec.one(Span.REQUEST)
    assert p_leg.status.status_code is StatusCode.ERROR
    assert "answered 500" in p_leg.attributes[Attr.REASON.value]
    assert root.status.status_code is StatusCode.ERROR
    assert root.attributes[Attr.HTTP_STATUS.value] == 500
    assert rec.one(Span.DECODE_LEG).status.status_code is StatusCode.ERROR


async def test_bad_body_is_a_400_request_span(cluster: MakeCluster) -> None:
    rec = Recorder()
    c = await cluster(tracer=rec.tracer)
    r = await c.client.post("/v1/completions", content=b"{not json")
    assert r.status_code == 400
    names = [n for n in rec.names() if n != Span.CONNECT.value]  # a new connection or not
    assert names == [Span.INGRESS.value, Span.REQUEST.value]
    root = rec.one(Span.REQUEST)
    assert root.attributes[Attr.OUTCOME.value] == "invalid_request"
    assert root.status.status_code is StatusCode.ERROR


async def test_without_a_tracer_both_legs_share_one_traceparent(cluster: MakeCluster) -> None:
    c = await cluster()
    assert (await c.client.post("/v1/completions", json=COMPLETION)).status_code == 200
    assert c.p[0].requests[0].headers["traceparent"] == c.d[0].requests[0].headers["traceparent"]


def test_token_events_split_across_chunks_count_once() -> None:
    from connector.router.tracing import RequestTrace

    rec = Recorder()
    trace = RequestTrace(rec.tracer, None, mode="push", endpoint="completions")
    body = b'data: {"choices":[{"text":"a"}]}\n\n' * 5 + b"data: [DONE]\n\n"
    for i in range(0, len(body), 5):  # every event split somewhere
        trace.sent(body[i : i + 5], stream=True)
    assert trace.token_events == 5
    trace.end(200)
    assert rec.one(Span.REQUEST).attributes[Attr.OUTPUT_TOKENS.value] == 5


async def test_unsampled_request_tells_both_legs_not_to_sample(
    cluster: MakeCluster, caplog: pytest.LogCaptureFixture
) -> None:
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

    rec = Recorder(sampler=ALWAYS_OFF)
    c = await cluster(tracer=rec.tracer)
    assert (await c.client.post("/v1/completions", json=COMPLETION)).status_code == 200
    assert rec.spans() == []
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    for seen in (c.p[0].requests[0], c.d[0].requests[0]):
        assert int(seen.headers["traceparent"][-2:], 16) & 1 == 0, seen.headers["traceparent"]
        assert seen.body["kv_transfer_params"]["traceparent"] == seen.headers["traceparent"]

"""Streaming passthrough: D's SSE bytes reach the client as they come; a leg failing
mid-stream ends the stream with an error event; the client leaving cancels both legs."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.unit.router.conftest import MakeCluster
from tests.unit.router.mock_backend import CHUNKS
from tests.unit.router.serving import within

pytestmark = pytest.mark.anyio

STREAM = {"model": "m", "prompt": "hello", "max_tokens": 8, "stream": True}


def sse_events(raw: bytes) -> list[str]:
    return [e.removeprefix("data: ") for e in raw.decode().split("\n\n") if e.strip()]


async def test_chunks_arrive_before_d_finishes(cluster: MakeCluster) -> None:
    c = await cluster()
    c.d[0].stream_gate = asyncio.Event()  # D holds its answer after the first chunk
    async with c.client.stream("POST", "/v1/completions", json=STREAM) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-request-id"] == c.d[0].requests[0].headers["x-request-id"]
        chunks = r.aiter_raw()
        first = await within(
            anext(chunks),
            "the first chunk while D is still generating (the router buffers the stream?)",
        )
        assert first == CHUNKS[0]
        c.d[0].stream_gate.set()
        rest = b"".join([chunk async for chunk in chunks])
    assert first + rest == b"".join(CHUNKS)


async def test_non_stream_answer_is_ds_bytes(cluster: MakeCluster) -> None:
    c = await cluster()
    r = await c.client.post("/v1/completions", json={**STREAM, "stream": False})
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/json"
    assert r.content == c.d[0].responses[0]


async def test_p_failure_mid_stream_ends_stream_and_cancels_d(cluster: MakeCluster) -> None:
    c = await cluster()
    p, d = c.p[0], c.d[0]
    d.stream_gate = asyncio.Event()  # never set: D would wait for P's KV forever
    p.gate = d.first_chunk_sent  # P fails once D's stream has started
    p.fail_first_n, p.error_status = 1, 500
    async with c.client.stream("POST", "/v1/completions", json=STREAM) as r:
        assert r.status_code == 200
        raw = await within(r.aread(), "the stream to end after P failed")
    events = sse_events(raw)
    assert events[0] == CHUNKS[0].decode().removeprefix("data: ").strip()
    err = json.loads(events[1])["error"]
    assert err["code"] == 500 and "prefill" in err["message"]
    assert events[2:] == ["[DONE]"]
    await within(d.requests[0].disconnected.wait(), "D to see its request cancelled")


async def test_d_crash_mid_stream_ends_stream_with_error(cluster: MakeCluster) -> None:
    c = await cluster()
    c.d[0].crash_mid_stream = True
    async with c.client.stream("POST", "/v1/completions", json=STREAM) as r:
        raw = await within(r.aread(), "the stream to end after D crashed")
    events = sse_events(raw)
    assert events[0].startswith('{"choices"')
    err = json.loads(events[1])["error"]
    assert (
        err["code"] == 502 and "decode" in err["message"] and c.d_servers[0].url in err["message"]
    )
    assert events[-1] == "[DONE]"
    stats = (await c.client.get("/router/stats")).json()
    assert stats["decode"][0]["health"] == "suspect" and stats["decode"][0]["failed"] == 1


async def test_error_event_does_not_glue_onto_a_partial_event(cluster: MakeCluster) -> None:
    c = await cluster()
    c.d[0].chunks = [b'data: {"choices": [{"te', b'xt": "x"}]}\n\n', b"data: [DONE]\n\n"]
    c.d[0].crash_mid_stream = True  # after the half event
    async with c.client.stream("POST", "/v1/completions", json=STREAM) as r:
        raw = await within(r.aread(), "the stream to end")
    assert raw.startswith(b'data: {"choices": [{"te\n\ndata: {"error"')


async def test_client_leaving_a_stream_cancels_both_legs(cluster: MakeCluster) -> None:
    c = await cluster()
    p, d = c.p[0], c.d[0]
    p.gate, d.stream_gate = asyncio.Event(), asyncio.Event()  # neither ever finishes
    async with c.client.stream("POST", "/v1/completions", json=STREAM) as r:
        await within(anext(r.aiter_raw()), "the first chunk")
    # Leaving the block closed the connection mid-stream.
    await within(d.requests[0].disconnected.wait(), "D to see the client's disconnect")
    await within(p.requests[0].disconnected.wait(), "P to see the client's disconnect")
    stats = (await c.client.get("/router/stats")).json()
    assert stats["prefill"][0]["outstanding"] == 0 and stats["decode"][0]["outstanding"] == 0


async def test_client_leaving_before_headers_cancels_both_legs(cluster: MakeCluster) -> None:
    c = await cluster()
    p, d = c.p[0], c.d[0]
    p.gate, d.gate = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(c.client.post("/v1/completions", json={**STREAM, "stream": False}))
    await p.wait_for(1, "the P leg")
    await d.wait_for(1, "the D leg")
    task.cancel()  # httpx closes the connection
    with pytest.raises(asyncio.CancelledError):
        await task
    await within(d.requests[0].disconnected.wait(), "D to see the client's disconnect")
    await within(p.requests[0].disconnected.wait(), "P to see the client's disconnect")


async def test_many_concurrent_streams(cluster: MakeCluster) -> None:
    c = await cluster(2, 2)
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(
        base_url=c.router.url, limits=limits, timeout=30, trust_env=False
    ) as client:

        async def one() -> bytes:
            async with client.stream("POST", "/v1/completions", json=STREAM) as r:
                assert r.status_code == 200
                return await r.aread()

        bodies = await within(asyncio.gather(*(one() for _ in range(64))), "64 streams")
    assert set(bodies) == {b"".join(CHUNKS)}
    s = (await c.client.get("/router/stats")).json()
    spread = [x["dispatched"] for x in s["decode"]]
    assert sum(spread) == 64 and min(spread) >= 16, spread

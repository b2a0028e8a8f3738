"""Taking a backend out of rotation (``/admin/backends/...``) and the router's own drain
state (what SIGTERM turns on: tests/unit/router/test_sigterm.py runs the real signal)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from urllib.parse import quote

import pytest

from tests.unit.router.conftest import MakeCluster
from tests.unit.router.mock_backend import CHUNKS
from tests.unit.router.serving import until, within
from tests.unit.router.test_choice_and_modes import COMPLETION
from tests.unit.router.test_streaming import STREAM, sse_events

pytestmark = pytest.mark.anyio
KEY = "admin-key-123"


async def test_drained_d_gets_no_new_legs_while_its_leg_in_flight_completes(
    cluster: MakeCluster,
) -> None:
    c = await cluster(1, 2)
    c.d[0].gate, c.d[1].gate = asyncio.Event(), asyncio.Event()
    first = asyncio.create_task(c.client.post("/v1/completions", json=COMPLETION))
    await c.d[0].wait_for(1, "the first request at d0 (ties go to the lower index)")
    second = asyncio.create_task(c.client.post("/v1/completions", json=COMPLETION))
    await c.d[1].wait_for(1, "the second request at d1 (d0 is busy)")

    r = await c.client.post("/admin/backends/decode/0/drain")
    assert r.status_code == 200, r.text
    assert r.json()["draining"] is True and r.json()["outstanding"] == 1
    # Both D hold one leg and have served one: without the drain, the tie goes to d0.
    third = asyncio.create_task(c.client.post("/v1/completions", json=COMPLETION))
    await c.d[1].wait_for(2, "the third request at d1 (d0 is draining)")
    assert len(c.d[0].requests) == 1

    c.d[0].gate.set()  # d0's leg in flight finishes normally
    assert (await within(first, "d0's request in flight")).status_code == 200
    listing = (await c.client.get("/admin/backends")).json()
    assert listing["decode"][0] | {"draining": True, "outstanding": 0} == listing["decode"][0]
    assert listing["decode"][1]["outstanding"] == 2 and not listing["decode"][1]["draining"]
    assert (await c.client.get("/health")).json()["decode_eligible"] == 1

    c.d[1].gate.set()
    for t in (second, third):
        assert (await within(t, "d1's requests")).status_code == 200

    r = await c.client.post("/admin/backends/decode/0/undrain")
    assert r.status_code == 200 and r.json()["draining"] is False
    # Both idle, d0 has served fewer: it is back in rotation.
    assert (await c.client.post("/v1/completions", json=COMPLETION)).status_code == 200
    assert (len(c.d[0].requests), len(c.d[1].requests)) == (2, 2)


async def test_drain_with_wait_answers_once_the_last_leg_ended_or_409_past_its_bound(
    cluster: MakeCluster,
) -> None:
    """``drain?wait=S``: a rolling restart's (or a preStop hook's) one call. It answers once
    the backend has no leg in flight; past S seconds a 409 that says how many are left,
    the backend staying drained."""
    c = await cluster(1, 2)
    c.d[0].gate, c.d[1].gate = asyncio.Event(), asyncio.Event()
    first = asyncio.create_task(c.client.post("/v1/completions", json=COMPLETION))
    await c.d[0].wait_for(1, "the first request at d0")

    drained = asyncio.create_task(c.client.post("/admin/backends/decode/0/drain?wait=60"))
    d0 = c.state.backends.decode[0]
    await until(lambda: d0.idle is not None, "the drain waiting for d0's leg")
    assert not drained.done() and not first.done() and d0.load.draining
    c.d[0].gate.set()  # its one leg ends
    r = await within(drained, "the drain's answer once d0's leg ended")
    assert r.status_code == 200 and r.json() | {"draining": True, "outstanding": 0} == r.json()
    assert (await within(first, "d0's request in flight")).status_code == 200
    r = await within(c.client.post("/admin/backends/decode/0/drain?wait=60"), "an idle drain")
    assert r.status_code == 200 and r.json()["outstanding"] == 0  # already idle: at once

    second = asyncio.create_task(c.client.post("/v1/completions", json=COMPLETION))
    await c.d[1].wait_for(1, "the second request at d1 (d0 is drained)")
    r = await c.client.post("/admin/backends/decode/1/drain?wait=0.05")
    assert r.status_code == 409, r.text
    assert "1 leg(s) still in flight after 0.05 s" in r.json()["error"]["message"]
    assert c.state.backends.decode[1].load.draining
    r = await c.client.post("/admin/backends/decode/1/drain?wait=soon")
    assert r.status_code == 400 and "wait must be a number of seconds" in r.text
    c.d[1].gate.set()
    assert (await within(second, "d1's request in flight")).status_code == 200


async def test_draining_the_only_p_serves_through_d_alone_and_only_d_is_503(
    cluster: MakeCluster,
) -> None:
    c = await cluster(1, 1)
    url = quote(c.p_servers[0].url, safe="")  # a backend may be named by its URL
    assert (await c.client.post(f"/admin/backends/prefill/{url}/drain")).status_code == 200
    assert (await c.client.get("/health")).json()["status"] == "degraded"
    assert (await c.client.post("/v1/completions", json=COMPLETION)).status_code == 200
    assert c.p[0].requests == [] and "kv_transfer_params" not in c.d[0].requests[0].body
    assert (await c.client.post("/admin/backends/prefill/0/undrain")).status_code == 200

    assert (await c.client.post("/admin/backends/decode/0/drain")).status_code == 200
    h = await c.client.get("/health")
    assert h.status_code == 503 and "decode[0]=healthy (draining)" in h.json()["reason"]
    assert (await c.client.post("/v1/completions", json=COMPLETION)).status_code == 503
    assert len(c.d[0].requests) == 1


async def test_admin_names_what_it_does_not_know(cluster: MakeCluster) -> None:
    c = await cluster(1, 1)
    for path in (
        "/admin/backends/router/0/drain",
        "/admin/backends/decode/1/drain",
        "/admin/backends/decode/http%3A%2F%2Fnowhere%3A1/drain",
        "/admin/backends/decode/0/pause",
    ):
        r = await c.client.post(path)
        assert r.status_code == 404 and r.json()["error"]["code"] == 404, path
    assert (await c.client.get("/admin/backends/decode/0/drain")).status_code == 405
    assert not any(b["draining"] for b in c.state.backends.stats()["decode"])


async def test_admin_endpoints_refuse_without_the_key(cluster: MakeCluster) -> None:
    c = await cluster(1, 1, api_key=KEY)
    for method, path in (
        ("GET", "/admin/backends"),
        ("POST", "/admin/backends/decode/0/drain"),
        ("POST", "/admin/backends/decode/0/undrain"),
    ):
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = await c.client.request(method, path, headers=headers)
            assert r.status_code == 401, (path, headers)
    assert not c.state.backends.decode[0].load.draining
    ok = {"Authorization": f"Bearer {KEY}"}
    r = await c.client.post("/admin/backends/decode/0/drain", headers=ok)
    assert r.status_code == 200 and c.state.backends.decode[0].load.draining
    assert (await c.client.get("/admin/backends", headers=ok)).json()["decode"][0]["draining"]


async def test_router_draining_refuses_new_requests_and_finishes_those_in_flight(
    cluster: MakeCluster,
) -> None:
    c = await cluster(1, 1)
    c.d[0].gate = asyncio.Event()
    in_flight = asyncio.create_task(c.client.post("/v1/completions", json=COMPLETION))
    await c.d[0].wait_for(1, "the request in flight at d0")
    c.state.drain.begin()  # what SIGTERM does first (connector/router/serve.py)
    h = await c.client.get("/health")
    assert h.status_code == 503 and h.json() == {"status": "draining", "in_flight": 1}
    r = await c.client.post("/v1/completions", json=COMPLETION)
    assert r.status_code == 503 and "draining" in r.json()["error"]["message"]
    assert len(c.d[0].requests) == 1
    assert not await c.state.drain.wait_idle(0.01)
    c.d[0].gate.set()
    assert (await within(in_flight, "the request in flight")).status_code == 200
    assert await within(c.state.drain.wait_idle(5.0), "the router to have nothing in flight")
    assert c.state.drain.in_flight == 0


async def _rest(chunks: AsyncIterator[bytes]) -> list[bytes]:
    return [chunk async for chunk in chunks]


async def test_drain_deadline_cuts_a_stream_with_an_error_event(cluster: MakeCluster) -> None:
    c = await cluster(1, 1)
    c.d[0].stream_gate = asyncio.Event()  # never set: D holds the stream after one chunk
    async with c.client.stream("POST", "/v1/completions", json=STREAM) as r:
        assert r.status_code == 200
        chunks = r.aiter_raw()
        assert await within(anext(chunks), "D's first chunk") == CHUNKS[0]
        c.state.drain.begin()
        c.state.drain.cut()  # what serve.py does when --drain-timeout has passed
        rest = b"".join(await within(_rest(chunks), "the cut stream to end"))
    events = sse_events(rest)
    assert events[-1] == "[DONE]" and "--drain-timeout" in events[-2]
    assert json.loads(events[-2])["error"]["type"] == "service_unavailable"
    await within(c.d[0].requests[0].disconnected.wait(), "D's leg to be closed")
    assert await within(c.state.drain.wait_idle(5.0), "nothing in flight")


async def test_the_draining_gauge_follows_drain_and_undrain(cluster: MakeCluster) -> None:
    from tests.unit.router.test_metrics_and_ids import scrape, value

    c = await cluster(1, 2)
    d0, d1 = (s.url for s in c.d_servers)
    gauge = "pushkv_router_backend_draining"
    m = await scrape(c)
    assert [value(m, gauge, role="decode", backend=u) for u in (d0, d1)] == [0, 0]
    assert (await c.client.post("/admin/backends/decode/0/drain")).status_code == 200
    m = await scrape(c)
    assert [value(m, gauge, role="decode", backend=u) for u in (d0, d1)] == [1, 0]
    assert value(m, gauge, role="prefill", backend=c.p_servers[0].url) == 0
    assert (await c.client.post("/admin/backends/decode/0/undrain")).status_code == 200
    assert value(await scrape(c), gauge, role="decode", backend=d0) == 0

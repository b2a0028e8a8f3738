"""Which P and D each request gets (least outstanding among healthy), pull mode, and the
small endpoints (/health, /v1/models, /router/stats, lifespan)."""

from __future__ import annotations

import asyncio

import pytest

from connector.router.config import Mode
from connector.router.coords import CoordOverride
from tests.unit.router.conftest import MakeCluster, p_pull_params
from tests.unit.router.mock_backend import MockBackend
from tests.unit.router.serving import within

pytestmark = pytest.mark.anyio

COMPLETION = {"model": "m", "prompt": "hello", "max_tokens": 8}


async def test_busy_d_is_avoided(cluster: MakeCluster) -> None:
    c = await cluster(1, 2)
    c.d[0].gate = asyncio.Event()  # d0 is slow: its request stays outstanding
    slow = asyncio.create_task(c.client.post("/v1/completions", json=COMPLETION))
    await c.d[0].wait_for(1, "the first request at d0 (ties go to the lower index)")
    for _ in range(3):  # d0 has 1 outstanding, d1 none: round-robin would use d0 again
        assert (await c.client.post("/v1/completions", json=COMPLETION)).status_code == 200
    assert (len(c.d[0].requests), len(c.d[1].requests)) == (1, 3)
    c.d[0].gate.set()
    assert (await within(slow, "the slow request")).status_code == 200


async def test_concurrent_requests_spread_over_d(cluster: MakeCluster) -> None:
    c = await cluster(1, 2)
    gate = asyncio.Event()
    c.d[0].gate = c.d[1].gate = gate
    tasks = [
        asyncio.create_task(c.client.post("/v1/completions", json=COMPLETION)) for _ in range(4)
    ]
    await c.d[0].wait_for(2, "2 of 4 concurrent requests at d0")
    await c.d[1].wait_for(2, "2 of 4 concurrent requests at d1")
    gate.set()
    for r in await within(asyncio.gather(*tasks), "the 4 requests"):
        assert r.status_code == 200


async def test_sequential_requests_alternate(cluster: MakeCluster) -> None:
    c = await cluster(2, 2)
    for _ in range(4):
        assert (await c.client.post("/v1/completions", json=COMPLETION)).status_code == 200
    assert [len(m.requests) for m in c.p + c.d] == [2, 2, 2, 2]


async def test_busy_p_is_avoided(cluster: MakeCluster) -> None:
    c = await cluster(2, 1)
    c.p[0].gate = asyncio.Event()  # p0's leg stays outstanding (D answers regardless)
    for _ in range(3):
        assert (await c.client.post("/v1/completions", json=COMPLETION)).status_code == 200
    assert (len(c.p[0].requests), len(c.p[1].requests)) == (1, 2)


async def test_unhealthy_d_is_skipped_until_it_recovers(cluster: MakeCluster) -> None:
    def d0_down(_ps: list[MockBackend], ds: list[MockBackend]) -> None:
        ds[0].healthy = False

    c = await cluster(1, 2, setup=d0_down)
    for _ in range(2):
        assert (await c.client.post("/v1/completions", json=COMPLETION)).status_code == 200
    assert (len(c.d[0].requests), len(c.d[1].requests)) == (0, 2)
    c.d[0].healthy = True
    await c.check_health()
    assert (await c.client.post("/v1/completions", json=COMPLETION)).status_code == 200
    assert len(c.d[0].requests) == 1
    c.d[1].healthy = False
    await c.check_health()
    assert (await c.client.post("/v1/completions", json=COMPLETION)).status_code == 200
    assert (len(c.d[0].requests), len(c.d[1].requests)) == (2, 2)


async def test_pull_mode_is_sequential_and_forwards_p_params(cluster: MakeCluster) -> None:
    c = await cluster(mode=Mode.PULL)
    p, d = c.p[0], c.d[0]
    p.gate = asyncio.Event()
    task = asyncio.create_task(c.client.post("/v1/completions", json=COMPLETION))
    await p.wait_for(1, "the P leg")
    # A full round trip through the router's loop: a concurrent router would have sent D by now.
    assert (await c.client.get("/router/stats")).status_code == 200
    assert d.requests == [], "pull mode sent D's leg before P answered"
    p.gate.set()
    r = await within(task, "the pull-mode answer")
    assert r.status_code == 200 and r.content == d.responses[0]
    assert c.p_kv() == {"do_remote_decode": True, "do_remote_prefill": False}
    assert p.requests[0].body["max_tokens"] == 1 and p.requests[0].body["stream"] is False
    assert c.d_kv() == p_pull_params(0)
    assert {k: v for k, v in d.requests[0].body.items() if k != "kv_transfer_params"} == COMPLETION
    assert p.requests[0].headers["x-request-id"] == d.requests[0].headers["x-request-id"]
    assert p.probes == []


async def test_pull_mode_host_override(cluster: MakeCluster) -> None:
    c = await cluster(mode=Mode.PULL, prefill_overrides=(CoordOverride(host="10.2.3.4"),))
    assert (await c.client.post("/v1/completions", json=COMPLETION)).status_code == 200
    assert c.d_kv() == {**p_pull_params(0), "remote_host": "10.2.3.4"}


async def test_pull_mode_p_answer_without_params_is_502(cluster: MakeCluster) -> None:
    def no_params(ps: list[MockBackend], _ds: list[MockBackend]) -> None:
        ps[0].pull_params = None

    c = await cluster(mode=Mode.PULL, setup=no_params, degraded=False)
    r = await c.client.post("/v1/completions", json=COMPLETION)
    assert r.status_code == 502 and "kv_transfer_params" in r.json()["error"]["message"]
    assert c.d[0].requests == []


async def test_health_endpoint(cluster: MakeCluster) -> None:
    c = await cluster(1, 2)
    r = await c.client.get("/health")
    assert r.status_code == 200
    assert r.json() == {"status": "ok", "mode": "push", "prefill_eligible": 1, "decode_eligible": 2}
    for d in c.d:
        d.healthy = False
    await c.check_health()
    r = await c.client.get("/health")
    assert r.status_code == 503 and r.json()["status"] == "unavailable"
    assert "no healthy decode server" in r.json()["reason"]
    assert "no healthy prefill" not in r.json()["reason"]


async def test_health_is_ok_while_degraded_and_says_so(cluster: MakeCluster) -> None:
    c = await cluster(1, 1)
    c.p[0].healthy = False
    await c.check_health()
    r = await c.client.get("/health")
    assert r.status_code == 200, "D alone serves every request: the router is usable"
    got = r.json()
    assert got["status"] == "degraded" and got["prefill_eligible"] == 0
    assert "no healthy prefill server" in got["reason"] and "D computes the prompt" in got["reason"]
    c.p[0].healthy = True
    await c.check_health()
    assert (await c.client.get("/health")).json()["status"] == "ok"


async def test_models_come_from_a_healthy_d(cluster: MakeCluster) -> None:
    def d0_down(_ps: list[MockBackend], ds: list[MockBackend]) -> None:
        ds[0].healthy = False

    c = await cluster(1, 2, setup=d0_down)
    r = await c.client.get("/v1/models")
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "d1-model"
    c.d[1].healthy = False
    await c.check_health()
    assert (await c.client.get("/v1/models")).status_code == 503


async def test_stats(cluster: MakeCluster) -> None:
    c = await cluster(1, 2)
    await c.client.post("/v1/completions", json=COMPLETION)
    await c.client.post("/v1/completions", json={"model": "m"})  # 400
    s = (await c.client.get("/router/stats")).json()
    assert s["mode"] == "push"
    assert s["requests"] == {
        "total": 2,
        "by_status": {"200": 1, "400": 1},
        "retried": {"total": 0},
        "degraded": 0,
        "router_errors": 0,
        "unauthorized": 0,
    }
    assert [d["dispatched"] for d in s["decode"]] == [1, 0]
    assert s["prefill"][0]["health"] == "healthy" and s["prefill"][0]["ready"] is True
    assert {d["outstanding"] for d in s["decode"] + s["prefill"]} == {0}


async def test_lifespan_closes_backend_clients(cluster: MakeCluster) -> None:
    c = await cluster(2, 2)
    clients = [b.http for b in c.state.backends.all]
    assert not any(cl.is_closed for cl in clients)
    await c.router.stop()
    assert all(cl.is_closed for cl in clients)

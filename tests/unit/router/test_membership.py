"""Live membership (``POST /admin/backends/{role}``, ``DELETE .../{role}/{backend}``) and the
engine-aware policies through the router, against mock P and D servers."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import pytest

from connector.router.chooser import Policy
from connector.router.config import Mode
from telemetry.schema import Attr, Span
from tests.unit.router.conftest import MakeCluster, p_coords
from tests.unit.router.mock_backend import MockBackend
from tests.unit.router.serving import WAIT_S, InLoopServer, until, within
from tests.unit.router.test_choice_and_modes import COMPLETION
from tests.unit.telemetry.memory import Recorder

pytestmark = pytest.mark.anyio
KEY = "admin-key-123"


@contextlib.asynccontextmanager
async def serving(mock: MockBackend) -> AsyncIterator[InLoopServer]:
    server = await InLoopServer(mock.app()).start()
    try:
        yield server
    finally:
        mock.release()
        await server.stop()


# -- adding ------------------------------------------------------------------------------


async def test_added_d_is_checked_first_and_then_takes_legs(cluster: MakeCluster) -> None:
    c = await cluster(1, 1)
    c.d[0].gate = asyncio.Event()  # d0 stays busy with one leg
    busy = asyncio.create_task(c.client.post("/v1/completions", json=COMPLETION))
    await c.d[0].wait_for(1, "the first request at d0")
    new = MockBackend("d-new")
    async with serving(new) as server:
        r = await c.client.post("/admin/backends/decode", json={"url": server.url})
        assert r.status_code == 201, r.text
        body = r.json()
        assert body["in_rotation"] is True and body["health"] == "healthy" and body["index"] == 1
        assert new.health_checks == 1  # checked before the answer, before any leg
        assert (await c.client.post("/v1/completions", json=COMPLETION)).status_code == 200
        assert len(new.requests) == 1  # d0 was busy: the new D took it
        c.d[0].gate.set()
        assert (await within(busy, "d0's request")).status_code == 200
        listing = (await c.client.get("/admin/backends")).json()
        assert [d["url"] for d in listing["decode"]] == [c.d_servers[0].url, server.url]


async def test_added_backend_is_checked_once_though_the_recheck_loop_runs_meanwhile(
    cluster: MakeCluster,
) -> None:
    c = await cluster(1, 1)
    new = MockBackend("d-new")
    new.health_gate = asyncio.Event()  # add's check waits at the mock
    async with serving(new) as server:
        add = asyncio.create_task(c.client.post("/admin/backends/decode", json={"url": server.url}))
        await new.wait_health(1, "add's check of the new D")
        # The recheck loop's round while add's check is on the wire: the new D is not in
        # service yet, but add is checking it; the round waits for that check and skips it.
        recheck = asyncio.create_task(c.state.backends.recheck_out())
        new.health_gate.set()
        r, _ = await within(asyncio.gather(add, recheck), "the add and the recheck round")
        assert r.status_code == 201 and r.json()["health"] == "healthy", r.text
        assert new.health_checks == 1


async def test_added_backend_that_is_down_gets_no_legs_until_healthy(
    cluster: MakeCluster,
) -> None:
    c = await cluster(1, 1)
    new = MockBackend("d-new")
    new.healthy = False
    async with serving(new) as server:
        r = await c.client.post("/admin/backends/decode", json={"url": server.url})
        assert r.status_code == 201 and r.json()["in_rotation"] is False
        assert r.json()["health"] == "down"
        for _ in range(3):
            assert (await c.client.post("/v1/completions", json=COMPLETION)).status_code == 200
        assert new.requests == [] and len(c.d[0].requests) == 3
        new.healthy = True
        await c.check_health()
        assert (await c.client.post("/v1/completions", json=COMPLETION)).status_code == 200
        assert len(new.requests) == 1  # served fewer: the tie goes to it


async def test_added_push_p_is_probed_before_it_gets_legs(cluster: MakeCluster) -> None:
    c = await cluster(1, 1)
    new = MockBackend("p-new", coords=p_coords(7))
    async with serving(new) as server:
        r = await c.client.post("/admin/backends/prefill", json={"url": server.url})
        assert r.status_code == 201, r.text
        assert r.json()["coords"]["engine_id"] == "p7-engine" and r.json()["in_rotation"]
        assert len(new.probes) == 1
        c.p[0].gate = asyncio.Event()
        busy = asyncio.create_task(c.client.post("/v1/completions", json=COMPLETION))
        await c.p[0].wait_for(1, "the first request at p0")
        assert (await c.client.post("/v1/completions", json=COMPLETION)).status_code == 200
        assert len(new.requests) == 1
        assert c.d_kv(1)["remote_engine_id"] == "p7-engine"  # D was told the new P's coords
        c.p[0].gate.set()
        assert (await within(busy, "p0's request")).status_code == 200


async def test_add_refuses_bad_bodies_and_duplicates(cluster: MakeCluster) -> None:
    c = await cluster(1, 1)
    d0 = c.d_servers[0].url
    for role, body, status, words in (
        ("decode", b"not json", 400, "must be JSON"),
        ("decode", b'{"uri": "http://x:1"}', 400, "string 'url'"),
        ("decode", b'{"url": "x:1"}', 400, "must start with http"),
        ("decode", b'{"url": "http://x:1", "color": 1}', 400, "unknown field(s) ['color']"),
        ("decode", b'{"url": "http://x:1", "engine_id": "e"}', 400, "not a decode server's"),
        ("prefill", b'{"url": "http://x:1", "kv_port": "5"}', 400, "'kv_port' must be an integer"),
        ("prefill", b'{"url": "http://x:1", "kv_port": 70000}', 400, "kv_port out of range"),
        ("decode", f'{{"url": "{d0}/"}}'.encode(), 409, "already a member"),
        ("router", b'{"url": "http://x:1"}', 404, "no role 'router'"),
    ):
        r = await c.client.post(f"/admin/backends/{role}", content=body)
        assert r.status_code == status and words in r.json()["error"]["message"], (body, r.text)
    assert len(c.state.backends.decode) == 1 and len(c.state.backends.prefill) == 1


async def test_vllm_push_needs_the_new_ps_coordinates(cluster: MakeCluster) -> None:
    c = await cluster(1, 1, mode=Mode.PULL)
    # pull mode: P's coordinates come from its answer, none needed
    r = await c.client.post("/admin/backends/prefill", json={"url": "http://127.0.0.1:9"})
    assert r.status_code == 201 and r.json()["in_rotation"] is False  # nothing listens there
    from connector.router.backends import Role
    from connector.router.membership import parse_new_backend

    with pytest.raises(ValueError, match="vllm-push needs engine_id"):
        parse_new_backend(b'{"url": "http://x:1"}', Role.PREFILL, Mode.VLLM_PUSH)
    url, o = parse_new_backend(
        b'{"url": "http://x:1", "engine_id": "e", "kv_host": "h", "kv_port": 5}',
        Role.PREFILL,
        Mode.VLLM_PUSH,
    )
    assert url == "http://x:1" and o.complete and o.tp_size == 1


@pytest.mark.parametrize(
    ("body", "mode", "error"),
    [
        ({"pp_size": 0}, Mode.PUSH, "pp_size must be >= 1"),
        ({"pp_size": "2"}, Mode.PUSH, "'pp_size' must be an integer"),
        ({"pp_size": 2}, Mode.PULL, "pp_size above 1 needs --mode push"),
    ],
)
def test_a_new_ps_stages_are_checked(body: dict[str, object], mode: Mode, error: str) -> None:
    from connector.router.backends import Role
    from connector.router.membership import parse_new_backend

    raw = json.dumps({"url": "http://x:1", **body}).encode()
    with pytest.raises(ValueError, match=error):
        parse_new_backend(raw, Role.PREFILL, mode)


def test_a_new_ps_stages_reach_its_override() -> None:
    from connector.router.backends import Role
    from connector.router.membership import parse_new_backend

    with pytest.raises(ValueError, match="a prefill server's, not a decode"):
        parse_new_backend(b'{"url": "http://x:1", "pp_size": 1}', Role.DECODE, Mode.PUSH)
    _, o = parse_new_backend(b'{"url": "http://x:1", "pp_size": 2}', Role.PREFILL, Mode.PUSH)
    assert o.pp_size == 2 and not o.complete


# -- removing ----------------------------------------------------------------------------


async def test_remove_drains_then_forgets(cluster: MakeCluster) -> None:
    c = await cluster(1, 2)
    c.d[0].gate = asyncio.Event()
    in_flight = asyncio.create_task(c.client.post("/v1/completions", json=COMPLETION))
    await c.d[0].wait_for(1, "the request in flight at d0")
    removing = asyncio.create_task(c.client.delete("/admin/backends/decode/0"))
    await until(lambda: c.state.backends.decode[0].load.draining, "d0 draining")
    # While d0 drains, new requests go to d1 (without the drain the tie would not matter:
    # d0 is busy anyway, so make d1 busier to show the drain decides).
    c.d[1].gate = asyncio.Event()
    held = [
        asyncio.create_task(c.client.post("/v1/completions", json=COMPLETION)) for _ in range(2)
    ]
    await c.d[1].wait_for(2, "both new requests at d1")
    assert len(c.d[0].requests) == 1 and not removing.done()

    c.d[0].gate.set()  # its leg in flight finishes normally, then it is forgotten
    assert (await within(in_flight, "d0's request")).status_code == 200
    r = await within(removing, "the removal")
    assert r.status_code == 200 and r.json()["removed"] is True and r.json()["outstanding"] == 0
    c.d[1].gate.set()
    for t in held:
        assert (await within(t, "d1's requests")).status_code == 200
    listing = (await c.client.get("/admin/backends")).json()
    assert [d["index"] for d in listing["decode"]] == [1]  # indexes are not reused
    assert (await c.client.delete("/admin/backends/decode/0")).status_code == 404
    assert (await c.client.post("/v1/completions", json=COMPLETION)).status_code == 200
    assert len(c.d[0].requests) == 1 and len(c.d[1].requests) == 3


async def test_remove_past_its_timeout_leaves_it_draining(cluster: MakeCluster) -> None:
    c = await cluster(1, 2)
    c.d[0].gate = asyncio.Event()
    in_flight = asyncio.create_task(c.client.post("/v1/completions", json=COMPLETION))
    await c.d[0].wait_for(1, "the request in flight at d0")
    r = await c.client.delete("/admin/backends/decode/0?timeout=0.05")
    assert r.status_code == 409 and "1 leg(s) still in flight" in r.json()["error"]["message"]
    assert c.state.backends.decode[0].load.draining and len(c.state.backends.decode) == 2
    c.d[0].gate.set()
    assert (await within(in_flight, "d0's request")).status_code == 200
    # Idle now, or within a loop turn of the answer: a wait that must not run out.
    r = await c.client.delete(f"/admin/backends/decode/0?timeout={WAIT_S:g}")
    assert r.status_code == 200 and len(c.state.backends.decode) == 1
    assert (await c.client.delete("/admin/backends/decode/1?timeout=x")).status_code == 400


async def test_the_last_d_is_not_removed_but_the_last_p_is(cluster: MakeCluster) -> None:
    c = await cluster(1, 1)
    r = await c.client.delete("/admin/backends/decode/0")
    assert r.status_code == 409 and "only decode server" in r.json()["error"]["message"]
    assert (await c.client.delete("/admin/backends/prefill/0")).status_code == 200
    h = (await c.client.get("/health")).json()
    assert h["status"] == "degraded"  # D alone serves
    assert (await c.client.post("/v1/completions", json=COMPLETION)).status_code == 200


async def test_membership_needs_the_key(cluster: MakeCluster) -> None:
    c = await cluster(1, 2, api_key=KEY)
    for method, path in (
        ("POST", "/admin/backends/decode"),
        ("DELETE", "/admin/backends/decode/1"),
    ):
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = await c.client.request(method, path, headers=headers, json={"url": "http://x:1"})
            assert r.status_code == 401, (path, headers)
    assert len(c.state.backends.decode) == 2
    ok = {"Authorization": f"Bearer {KEY}"}
    assert (await c.client.delete("/admin/backends/decode/1", headers=ok)).status_code == 200


# -- the policies through the router -------------------------------------------------------


async def test_engine_load_routes_away_from_a_queued_engine_and_says_why(
    cluster: MakeCluster,
) -> None:
    rec = Recorder()
    c = await cluster(1, 2, policy=Policy.ENGINE_LOAD, tracer=rec.tracer)
    c.d[0].waiting, c.d[0].running = 6, 2  # a queue the router did not send
    await c.state.backends.read_signals()
    for _ in range(3):
        assert (await c.client.post("/v1/completions", json=COMPLETION)).status_code == 200
    assert len(c.d[0].requests) == 0 and len(c.d[1].requests) == 3
    stats = (await c.client.get("/router/stats")).json()
    assert stats["policy"] == "engine-load"
    assert stats["decode"][0]["signals"] == {"waiting": 6.0, "running": 2.0, "kv": 0.0}
    root = rec.named(Span.REQUEST)[-1]
    assert root.attributes[Attr.ROUTE_POLICY.value] == "engine-load"
    assert root.attributes[Attr.ROUTE_REASON.value].startswith("engine-load: cost 0.00")
    assert root.attributes[Attr.ROUTE_PREFILL_REASON.value].startswith("engine-load:")
    # Its /metrics failing keeps the last good signals (the chooser ignores them once stale).
    c.d[1].metrics_status = 500
    await c.state.backends.read_signals()
    assert c.state.backends.decode[1].load.signals is not None  # the last good ones kept


async def test_prefix_policy_keeps_a_shared_prefix_on_one_d(cluster: MakeCluster) -> None:
    rec = Recorder()
    c = await cluster(1, 3, policy=Policy.PREFIX, prefix_block_chars=16, tracer=rec.tracer)
    shared = "You are a terse assistant. Answer in one word. " * 3
    for i in range(4):
        body = {**COMPLETION, "prompt": f"{shared}Question {i}?"}
        assert (await c.client.post("/v1/completions", json=body)).status_code == 200
    counts = sorted(len(d.requests) for d in c.d)
    assert counts == [0, 0, 4]  # least-load would have spread them 2/1/1
    roots = rec.named(Span.REQUEST)
    assert roots[0].attributes[Attr.ROUTE_PREFIX_BLOCKS.value] == 0
    blocks = len(shared) // 16
    for root in roots[1:]:
        assert root.attributes[Attr.ROUTE_PREFIX_BLOCKS.value] >= blocks
        assert root.attributes[Attr.ROUTE_REASON.value].startswith("prefix: holds")

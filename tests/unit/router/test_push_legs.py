"""Push mode (pushkv): both legs at the same moment, what each leg carries, the probe and
the coordinate overrides."""

from __future__ import annotations

import asyncio
import re

import pytest

from connector.router.config import Mode
from connector.router.coords import CoordOverride
from tests.unit.router.conftest import MakeCluster, p_coords
from tests.unit.router.serving import within

pytestmark = pytest.mark.anyio

COMPLETION = {"model": "m", "prompt": "hello", "max_tokens": 16}
TRACEPARENT = re.compile(r"^00-[0-9a-f]{32}-[0-9a-f]{16}-01$")


async def test_both_legs_are_in_flight_at_once(cluster: MakeCluster) -> None:
    c = await cluster()
    p, d = c.p[0], c.d[0]
    # Each mock answers only once the other's leg has arrived: a router that sends one leg
    # after the other's answer deadlocks here, whichever it sends first.
    p.gate, d.gate = d.arrived, p.arrived
    r = await within(
        c.client.post("/v1/completions", json=COMPLETION),
        "the answer: P waits for D's leg and D for P's, so the router did not "
        "send both legs at the same time",
    )
    assert r.status_code == 200, r.text


async def test_leg_bodies_and_shared_ids(cluster: MakeCluster) -> None:
    c = await cluster()
    r = await c.client.post("/v1/completions", json=COMPLETION)
    assert r.status_code == 200, r.text
    (pseen,), (dseen,) = c.p[0].requests, c.d[0].requests
    tid = pseen.body["kv_transfer_params"]["transfer_id"]
    tp = pseen.headers["traceparent"]
    assert re.fullmatch(r"[0-9a-f]{32}", tid)
    assert TRACEPARENT.match(tp)
    assert pseen.body == {
        **COMPLETION,
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "transfer_id": tid,
            "traceparent": tp,
        },
    }
    coords = p_coords(0)
    assert dseen.body == {
        **COMPLETION,
        "kv_transfer_params": {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "transfer_id": tid,
            "remote_engine_id": coords["engine_id"],
            "remote_host": coords["host"],
            "remote_port": coords["port"],
            "remote_tp_size": coords["tp_size"],
            "traceparent": tp,
        },
    }
    assert dseen.headers["traceparent"] == tp
    rid = pseen.headers["x-request-id"]
    assert dseen.headers["x-request-id"] == rid == r.headers["x-request-id"]


async def test_transfer_id_is_fresh_per_request(cluster: MakeCluster) -> None:
    c = await cluster()
    for _ in range(3):
        assert (await c.client.post("/v1/completions", json=COMPLETION)).status_code == 200
    p_ids = [s.body["kv_transfer_params"]["transfer_id"] for s in c.p[0].requests]
    d_ids = [s.body["kv_transfer_params"]["transfer_id"] for s in c.d[0].requests]
    assert p_ids == d_ids
    assert len(set(p_ids)) == 3
    rids = {s.headers["x-request-id"] for s in c.p[0].requests}
    traces = {s.headers["traceparent"] for s in c.p[0].requests}
    assert len(rids) == 3 and len(traces) == 3


async def test_client_request_id_and_trace_id_are_kept(cluster: MakeCluster) -> None:
    c = await cluster()
    incoming = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"
    r = await c.client.post(
        "/v1/completions",
        json=COMPLETION,
        headers={"X-Request-Id": "client-42", "traceparent": incoming},
    )
    assert r.status_code == 200
    for seen in (c.p[0].requests[0], c.d[0].requests[0]):
        assert seen.headers["x-request-id"] == "client-42"
        tp = seen.headers["traceparent"]
        assert tp.split("-")[1] == "ab" * 16  # same trace
        assert tp.split("-")[2] != "cd" * 8  # the router's own span as parent
        assert seen.body["kv_transfer_params"]["traceparent"] == tp


async def test_chat_prefill_leg_is_one_token_and_not_streamed(cluster: MakeCluster) -> None:
    c = await cluster()
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "max_completion_tokens": 50,
        "stream_options": {"include_usage": True},
        "min_tokens": 4,
    }
    async with c.client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        await r.aread()
    pbody, dbody = c.p[0].requests[0].body, c.d[0].requests[0].body
    assert c.p[0].requests[0].path == "/v1/chat/completions"
    assert pbody["max_tokens"] == 1 and pbody["max_completion_tokens"] == 1
    assert pbody["stream"] is False
    assert "stream_options" not in pbody and "min_tokens" not in pbody  # vLLM rejects them
    assert {k: v for k, v in dbody.items() if k != "kv_transfer_params"} == body


async def test_probe_learns_coordinates(cluster: MakeCluster) -> None:
    c = await cluster(2, 1)
    for i, p in enumerate(c.p):
        (probe,) = p.probes
        assert probe.body == {
            "model": f"p{i}-model",
            "prompt": "probe",
            "max_tokens": 1,
            "stream": False,
            "kv_transfer_params": {"pushkv_probe": True},
        }
    stats = (await c.client.get("/router/stats")).json()
    assert [s["coords"] for s in stats["prefill"]] == [p_coords(0), p_coords(1)]


async def test_full_override_skips_the_probe(cluster: MakeCluster) -> None:
    o = CoordOverride(engine_id="flag-engine", host="192.168.1.9", port=7777, tp_size=2)
    c = await cluster(prefill_overrides=(o,))
    assert (await c.client.post("/v1/completions", json=COMPLETION)).status_code == 200
    assert c.p[0].probes == []
    kv = c.d_kv()
    assert (kv["remote_engine_id"], kv["remote_host"], kv["remote_port"], kv["remote_tp_size"]) == (
        "flag-engine",
        "192.168.1.9",
        7777,
        2,
    )


async def test_partial_override_merges_with_the_probe(cluster: MakeCluster) -> None:
    c = await cluster(prefill_overrides=(CoordOverride(host="10.9.9.9"),))
    assert (await c.client.post("/v1/completions", json=COMPLETION)).status_code == 200
    assert len(c.p[0].probes) == 1
    kv, coords = c.d_kv(), p_coords(0)
    assert kv["remote_host"] == "10.9.9.9"
    assert (kv["remote_engine_id"], kv["remote_port"]) == (coords["engine_id"], coords["port"])


async def test_p_that_comes_back_is_probed_again(cluster: MakeCluster) -> None:
    def down(ps: list, _ds: list) -> None:
        ps[0].healthy = False

    c = await cluster(setup=down, degraded=False)  # 503s while P is away
    assert c.p[0].probes == []  # not probed while down
    r = await c.client.post("/v1/completions", json=COMPLETION)
    assert r.status_code == 503 and "prefill" in r.json()["error"]["message"]
    # It comes back (as a restarted engine, with a new id): probed, and the new id is used.
    c.p[0].healthy = True
    c.p[0].coords = {**p_coords(0), "engine_id": "p0-restarted"}
    await c.check_health()
    assert len(c.p[0].probes) == 1
    assert (await c.client.post("/v1/completions", json=COMPLETION)).status_code == 200
    assert c.d_kv()["remote_engine_id"] == "p0-restarted"
    # Down again, then up with yet another id: forgotten, then re-learned.
    c.p[0].healthy = False
    await c.check_health()
    assert (await c.client.post("/v1/completions", json=COMPLETION)).status_code == 503
    c.p[0].healthy = True
    c.p[0].coords = {**p_coords(0), "engine_id": "p0-third"}
    await c.check_health()
    assert (await c.client.post("/v1/completions", json=COMPLETION)).status_code == 200
    assert c.d_kv(1)["remote_engine_id"] == "p0-third"


async def test_p_checked_by_two_rounds_at_once_is_probed_once(cluster: MakeCluster) -> None:
    def down(ps: list, _ds: list) -> None:
        ps[0].healthy = False

    c = await cluster(setup=down, degraded=False)
    p = c.p[0]
    p.healthy, p.health_gate = True, asyncio.Event()  # back, its next check held at the mock
    first = asyncio.create_task(c.check_health())
    await p.wait_health(p.health_checks + 1, "the first round's check of p0")
    # The recheck loop's round and another full round while that check is on the wire:
    # each may see P come back, but only the first may probe it.
    others = [asyncio.create_task(c.state.backends.recheck_out()), c.check_health()]
    p.health_gate.set()
    await within(asyncio.gather(first, *others), "three health rounds")
    assert len(p.probes) == 1
    assert (await c.client.post("/v1/completions", json=COMPLETION)).status_code == 200


async def test_bad_probe_answer_keeps_p_out(cluster: MakeCluster) -> None:
    def no_coords(ps: list, _ds: list) -> None:
        ps[0].coords = None  # an old connector: no kv_transfer_params.pushkv

    c = await cluster(setup=no_coords, degraded=False)
    r = await c.client.get("/health")
    assert r.status_code == 503 and "not probed" in r.json()["reason"]
    assert (await c.client.post("/v1/completions", json=COMPLETION)).status_code == 503
    assert c.p[0].requests == []


async def test_vllm_push_mode_legs(cluster: MakeCluster) -> None:
    o = CoordOverride(engine_id="vllm-p", host="10.1.1.1", port=5557, tp_size=1)
    c = await cluster(mode=Mode.VLLM_PUSH, prefill_overrides=(o,))
    p, d = c.p[0], c.d[0]
    p.gate, d.gate = d.arrived, p.arrived  # concurrent here too
    r = await within(
        c.client.post("/v1/completions", json=COMPLETION, headers={"X-Request-Id": "abc123"}),
        "both legs in vllm-push mode (sent one after the other?)",
    )
    assert r.status_code == 200
    assert p.probes == []
    assert c.p_kv() == {"do_remote_decode": True, "do_remote_prefill": False}
    assert p.requests[0].body["max_tokens"] == 1 and p.requests[0].body["stream"] is False
    kv = c.d_kv()
    assert re.fullmatch(r"xfer-[0-9a-f-]{36}", kv.pop("transfer_id"))
    assert kv == {
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "remote_engine_id": "vllm-p",
        "remote_host": "10.1.1.1",
        "remote_port": 5557,
        "tp_size": 1,
        "pp_size": 1,
        "remote_request_id": "abc123",
    }
    assert p.requests[0].headers["x-request-id"] == d.requests[0].headers["x-request-id"]


async def test_d_answer_first_leaves_p_to_finish_in_background(cluster: MakeCluster) -> None:
    c = await cluster()
    c.p[0].gate = asyncio.Event()  # P's HTTP answer lags D's whole answer
    r = await c.client.post("/v1/completions", json=COMPLETION)
    assert r.status_code == 200 and r.content == c.d[0].responses[0]
    assert c.p[0].requests[0].disconnected.is_set() is False  # not cancelled
    stats = (await c.client.get("/router/stats")).json()
    assert stats["prefill"][0]["outstanding"] == 1 and stats["background_prefill_legs"] == 1
    c.p[0].gate.set()
    await c.background_done()
    stats = (await c.client.get("/router/stats")).json()
    assert stats["prefill"][0]["outstanding"] == 0 and stats["decode"][0]["outstanding"] == 0


def _two_rank_p(ps: list, _ds: list) -> None:
    """Cluster setup: P0 runs TP 2, each rank on its own port with its own NIXL agent."""
    ps[0].coords = {
        "engine_id": "p0",
        "host": "10.0.0.1",
        "port": 5600,
        "tp_size": 2,
        "ports": [5600, 5611],
        "agents": ["p0-tp0-x", "p0-tp1-x"],
    }


async def test_per_rank_ports_and_agents_reach_d(cluster: MakeCluster) -> None:
    c = await cluster(setup=_two_rank_p)
    assert (await c.client.post("/v1/completions", json=COMPLETION)).status_code == 200
    kv = c.d_kv()
    assert (kv["remote_tp_size"], kv["remote_ports"], kv["remote_agents"]) == (
        2,
        [5600, 5611],
        ["p0-tp0-x", "p0-tp1-x"],
    )


async def test_legs_parse_with_the_connectors_schema(cluster: MakeCluster) -> None:
    """Contract: what the router sends is what connector/kv_params.py accepts."""
    kv_params = pytest.importorskip("connector.kv_params")
    c = await cluster(setup=_two_rank_p)
    assert (await c.client.post("/v1/completions", json=COMPLETION)).status_code == 200
    p_leg = kv_params.parse_prefill_leg(c.p_kv())
    d_leg = kv_params.parse_decode_leg(c.d_kv())
    assert p_leg.transfer_id == d_leg.transfer_id
    assert p_leg.traceparent == d_leg.traceparent == c.p[0].requests[0].headers["traceparent"]
    assert [d_leg.port_of(r) for r in range(2)] == [5600, 5611]
    assert [d_leg.agent_of(r) for r in range(2)] == ["p0-tp0-x", "p0-tp1-x"]
    assert kv_params.is_probe(c.p[0].probes[0].body["kv_transfer_params"])

"""What the client gets when something is wrong: its own body (400), no backend (503), a
backend unreachable (502), too slow (504) or refusing (its status and body); and which leg
is cancelled when the other fails."""

from __future__ import annotations

import asyncio
import json

import pytest

from connector.router.config import Mode
from tests.unit.router.conftest import MakeCluster
from tests.unit.router.mock_backend import MockBackend
from tests.unit.router.serving import LoopClock, until, within

pytestmark = pytest.mark.anyio

COMPLETION = {"model": "m", "prompt": "hello", "max_tokens": 8}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
# The timeout tests' --timeout: reached only when the test moves the loop's clock past it
# (LoopClock), so a slow machine can neither fire it early nor let a leg lose a race to it.
# Past it by 2 s (aiohttp rounds deadlines of 5 s or more up to the next second) and short
# of the client's 30 s and uvicorn's 30 s keep-alive, which must not fire.
LEG_S = 10.0
PAST_LEG_S = LEG_S + 2


@pytest.mark.parametrize(
    ("path", "raw", "needle"),
    [
        ("/v1/completions", b"{not json", "not valid JSON"),
        ("/v1/completions", b"[1, 2]", "JSON object"),
        ("/v1/completions", b'"prompt"', "JSON object"),
        ("/v1/completions", json.dumps({"model": "m"}).encode(), "'prompt'"),
        ("/v1/chat/completions", json.dumps({"model": "m", "prompt": "x"}).encode(), "'messages'"),
        ("/v1/chat/completions", json.dumps({**CHAT, "messages": []}).encode(), "non-empty"),
        (
            "/v1/completions",
            json.dumps({**COMPLETION, "kv_transfer_params": {}}).encode(),
            "kv_transfer_params",
        ),
        (
            "/v1/chat/completions",
            json.dumps({**CHAT, "kv_transfer_params": {"x": 1}}).encode(),
            "kv_transfer_params",
        ),
        ("/v1/completions", json.dumps({**COMPLETION, "stream": "yes"}).encode(), "boolean"),
    ],
)
async def test_bad_bodies_are_400_and_never_forwarded(
    cluster: MakeCluster, path: str, raw: bytes, needle: str
) -> None:
    c = await cluster()
    r = await c.client.post(path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and needle in err["message"]
    assert c.p[0].requests == [] and c.d[0].requests == []


async def test_token_prompt_is_one_prompt(cluster: MakeCluster) -> None:
    c = await cluster()
    r = await c.client.post("/v1/completions", json={**COMPLETION, "prompt": [1, 2, 3]})
    assert r.status_code == 200


@pytest.mark.parametrize("down", ["prefill", "decode"])
async def test_no_healthy_backend_is_503(cluster: MakeCluster, down: str) -> None:
    def setup(ps: list[MockBackend], ds: list[MockBackend]) -> None:
        for m in ps if down == "prefill" else ds:
            m.healthy = False

    c = await cluster(setup=setup, degraded=False)  # degraded mode would serve without P
    r = await c.client.post("/v1/completions", json=COMPLETION)
    assert r.status_code == 503
    assert f"no healthy {down} server" in r.json()["error"]["message"]
    assert c.p[0].requests == [] and c.d[0].requests == []
    r = await c.client.get("/health")
    assert r.status_code == 503 and f"no healthy {down}" in r.json()["reason"]


async def test_unreachable_d_is_502_naming_it_and_marks_it_suspect(cluster: MakeCluster) -> None:
    c = await cluster(1, 2, max_attempts=1)  # no retry on d1
    await c.d_servers[0].stop()  # healthy at the last check, gone now
    r = await c.client.post("/v1/completions", json=COMPLETION)
    assert r.status_code == 502
    err = r.json()["error"]
    assert c.d_servers[0].url in err["message"] and err["backend"].startswith("decode[0]")
    # Suspect until the next good health check: the next request goes to d1.
    assert (await c.client.post("/v1/completions", json=COMPLETION)).status_code == 200
    assert len(c.d[1].requests) == 1
    s = (await c.client.get("/router/stats")).json()
    assert s["decode"][0]["health"] == "suspect" and s["decode"][0]["outstanding"] == 0
    await c.check_health()
    assert (await c.client.get("/router/stats")).json()["decode"][0]["health"] == "down"


async def test_unreachable_p_is_502_and_cancels_d(cluster: MakeCluster) -> None:
    c = await cluster(degraded=False)
    c.d[0].gate = asyncio.Event()
    await c.p_servers[0].stop()
    r = await c.client.post("/v1/completions", json=COMPLETION)
    assert r.status_code == 502 and c.p_servers[0].url in r.json()["error"]["message"]
    if c.d[0].requests:  # D's leg may or may not have reached D before P's failed
        await within(c.d[0].requests[0].disconnected.wait(), "D's leg to be cancelled")


async def test_hung_legs_are_504_and_both_closed(cluster: MakeCluster) -> None:
    c = await cluster(timeout_s=LEG_S)
    clock = LoopClock()
    c.p[0].gate, c.d[0].gate = asyncio.Event(), asyncio.Event()  # neither answers
    answer = asyncio.create_task(c.client.post("/v1/completions", json=COMPLETION))
    await c.p[0].wait_for(1)
    await c.d[0].wait_for(1)
    clock.advance(PAST_LEG_S)
    r = await within(answer, "the router's answer once both legs' deadlines passed")
    # P's deadline and D's read timeout are the same --timeout: either may fire first.
    assert r.status_code == 504 and "timed out" in r.json()["error"]["message"]
    await within(c.d[0].requests[0].disconnected.wait(), "D's leg to be closed")
    await within(c.p[0].requests[0].disconnected.wait(), "P's leg to be closed")
    s = (await c.client.get("/router/stats")).json()
    assert s["decode"][0]["outstanding"] == 0 and s["prefill"][0]["outstanding"] == 0


async def test_p_timeout_is_504(cluster: MakeCluster) -> None:
    c = await cluster(mode=Mode.PULL, timeout_s=LEG_S, degraded=False)  # P alone on the clock
    clock = LoopClock()
    c.p[0].gate = asyncio.Event()
    answer = asyncio.create_task(c.client.post("/v1/completions", json=COMPLETION))
    await c.p[0].wait_for(1)
    clock.advance(PAST_LEG_S)
    r = await within(answer, "the router's answer once P's deadline passed")
    assert r.status_code == 504
    assert r.json()["error"]["message"].startswith("prefill[0]")
    await within(c.p[0].requests[0].disconnected.wait(), "P's timed-out leg to be closed")
    assert c.d[0].requests == []


async def test_d_timeout_is_504(cluster: MakeCluster) -> None:
    c = await cluster(timeout_s=LEG_S)
    clock = LoopClock()
    c.d[0].gate = asyncio.Event()  # P answers; D never does
    answer = asyncio.create_task(c.client.post("/v1/completions", json=COMPLETION))
    await c.d[0].wait_for(1)
    p = c.state.backends.prefill[0].load
    await until(lambda: len(c.p[0].requests) == 1 and p.outstanding == 0, "P's leg to end")
    clock.advance(PAST_LEG_S)  # past D's read timeout only: P's leg is over
    r = await within(answer, "the router's answer once D's read timeout passed")
    assert r.status_code == 504
    assert r.json()["error"]["message"].startswith("decode[0]")
    await within(c.d[0].requests[0].disconnected.wait(), "D's timed-out leg to be closed")


async def test_d_error_status_is_passed_through(cluster: MakeCluster) -> None:
    def d_refuses(_ps: list[MockBackend], ds: list[MockBackend]) -> None:
        ds[0].fail_first_n, ds[0].error_status = 1, 400
        ds[0].error_body = {
            "error": {
                "message": "This model's maximum context length is 8",
                "type": "BadRequestError",
                "code": 400,
            }
        }

    c = await cluster(setup=d_refuses)
    c.p[0].gate = asyncio.Event()  # P still working when D refuses
    r = await c.client.post("/v1/completions", json={**COMPLETION, "stream": True})
    assert r.status_code == 400
    assert r.json() == c.d[0].error_body
    await within(c.p[0].requests[0].disconnected.wait(), "P's leg to be cancelled")
    # A refused request is not the backend's fault: d0 stays healthy.
    assert (await c.client.get("/router/stats")).json()["decode"][0]["health"] == "healthy"


async def test_p_error_status_is_passed_through_and_cancels_d(cluster: MakeCluster) -> None:
    def p_refuses(ps: list[MockBackend], _ds: list[MockBackend]) -> None:
        ps[0].fail_first_n, ps[0].error_status = 1, 400
        ps[0].error_body = {"error": {"message": "prompt too long", "type": "BadRequestError"}}

    c = await cluster(setup=p_refuses)
    d = c.d[0]
    d.gate = asyncio.Event()
    c.p[0].gate = d.arrived  # P answers its error while D is working
    r = await c.client.post("/v1/completions", json=COMPLETION)
    assert r.status_code == 400 and r.json() == c.p[0].error_body
    await within(d.requests[0].disconnected.wait(), "D's leg to be cancelled")


async def test_p_5xx_while_d_works_cancels_d(cluster: MakeCluster) -> None:
    c = await cluster(degraded=False)
    d = c.d[0]
    d.gate = asyncio.Event()
    c.p[0].gate = d.arrived
    c.p[0].fail_first_n = 1
    r = await c.client.post("/v1/completions", json=COMPLETION)
    assert r.status_code == 500 and r.json() == c.p[0].error_body
    await within(d.requests[0].disconnected.wait(), "D's leg to be cancelled")
    s = (await c.client.get("/router/stats")).json()
    assert s["prefill"][0]["health"] == "suspect" and s["prefill"][0]["failed"] == 1
    assert s["decode"][0]["outstanding"] == 0 and s["prefill"][0]["outstanding"] == 0


async def test_the_only_p_stays_in_use_after_one_failed_leg(cluster: MakeCluster) -> None:
    # One dropped connection must not turn every request into a 503 until the next health
    # check: a suspect backend is used while no healthy one is left.
    c = await cluster(degraded=False)
    d = c.d[0]
    d.gate = asyncio.Event()
    c.p[0].gate = d.arrived  # P answers its error while D is working
    c.p[0].fail_first_n = 1
    assert (await c.client.post("/v1/completions", json=COMPLETION)).status_code == 500
    assert (await c.client.get("/router/stats")).json()["prefill"][0]["health"] == "suspect"
    d.gate.set()
    r = await c.client.post("/v1/completions", json=COMPLETION)
    assert r.status_code == 200 and len(c.p[0].requests) == 2
    assert (await c.client.get("/health")).status_code == 200


async def test_p_failure_after_d_answered_is_harmless(cluster: MakeCluster) -> None:
    c = await cluster()
    c.p[0].gate = asyncio.Event()
    c.p[0].fail_first_n = 1
    r = await c.client.post("/v1/completions", json=COMPLETION)
    assert r.status_code == 200 and r.content == c.d[0].responses[0]
    c.p[0].gate.set()
    await c.background_done()
    s = (await c.client.get("/router/stats")).json()
    assert s["prefill"][0]["failed"] == 1 and s["prefill"][0]["outstanding"] == 0


async def test_p_refusing_the_transfer_fails_the_request(cluster: MakeCluster) -> None:
    def refuses(ps: list[MockBackend], _ds: list[MockBackend]) -> None:
        ps[0].pull_params = {"pushkv_error": "kv_transfer_params: bad transfer_id"}

    c = await cluster(setup=refuses, degraded=False)
    d = c.d[0]
    d.gate = asyncio.Event()  # D waits for KV that will never come
    c.p[0].gate = d.arrived
    r = await c.client.post("/v1/completions", json=COMPLETION)
    assert r.status_code == 502 and "bad transfer_id" in r.json()["error"]["message"]
    await within(d.requests[0].disconnected.wait(), "D's leg to be cancelled")

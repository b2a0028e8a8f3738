"""Faults the router absorbs (issue #21): a leg failing before the client's first byte is
retried on another backend with a fresh transfer_id (bounded), never after it; a race of
the router's own is never a bare 500; with no P usable, D serves whole requests (degraded
mode); health checks stay out of the INFO log. Each outcome is in the trace."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from connector.core.errors import ConfigError
from connector.router import legs
from connector.router.config import RouterConfig, parse_args
from telemetry.schema import Attr, Event, Span
from tests.unit.router.conftest import Cluster, MakeCluster, p_coords
from tests.unit.router.mock_backend import CHUNKS, MockBackend
from tests.unit.router.serving import within
from tests.unit.telemetry.memory import Recorder

pytestmark = pytest.mark.anyio

COMPLETION = {"model": "m", "prompt": "hello", "max_tokens": 8}


def d0_fails_once(_ps: list[MockBackend], ds: list[MockBackend]) -> None:
    ds[0].fail_first_n = 1  # a 500 before any byte of its answer


async def stats(c: Cluster) -> dict:
    return (await c.client.get("/router/stats")).json()


# -- retry before the first byte ----------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_d_failing_before_its_first_byte_is_retried_on_the_other_d(
    cluster: MakeCluster, stream: bool
) -> None:
    rec = Recorder()
    c = await cluster(1, 2, setup=d0_fails_once, tracer=rec.tracer)
    c.p[0].gate = asyncio.Event()  # P still working when d0 fails: its leg must be cancelled
    r = await c.client.post("/v1/completions", json={**COMPLETION, "stream": stream})
    assert r.status_code == 200, r.text
    if stream:
        assert r.content == b"".join(CHUNKS)
    else:
        assert r.content == c.d[1].responses[0]
    assert len(c.d[0].requests) == 1 and len(c.d[1].requests) == 1
    assert c.d_kv(d=0)["transfer_id"] != c.d_kv(d=1)["transfer_id"]  # a fresh transfer_id
    await c.p[0].wait_for(2)  # the second attempt's P leg (D answered without waiting)
    assert c.p_kv(0)["transfer_id"] == c.d_kv(d=0)["transfer_id"]
    assert c.p_kv(1)["transfer_id"] == c.d_kv(d=1)["transfer_id"]
    await within(c.p[0].requests[0].disconnected.wait(), "the failed attempt's P leg to close")
    c.p[0].gate.set()
    await c.background_done()
    s = await stats(c)
    assert s["requests"]["retried"] == {"total": 1, "decode": 1}
    assert s["decode"][0]["health"] == "suspect" and s["decode"][1]["health"] == "healthy"
    assert all(b["outstanding"] == 0 for b in s["prefill"] + s["decode"])
    root = rec.one(Span.REQUEST)
    (event,) = [e for e in root.events if e.name == Event.ATTEMPT_FAILED.value]
    assert event.attributes[Attr.ATTEMPT.value] == 1
    assert event.attributes[Attr.FAILED_ROLE.value] == "decode"
    assert "answered 500" in event.attributes[Attr.REASON.value]
    assert root.attributes[Attr.ATTEMPTS.value] == 2
    assert root.attributes[Attr.DEGRADED.value] is False
    assert root.attributes[Attr.OUTCOME.value] == "ok"
    first, second = sorted(rec.named(Span.DECODE_LEG), key=lambda s: s.start_time)
    assert "answered 500" in first.attributes[Attr.REASON.value]
    assert second.attributes[Attr.OUTCOME.value] == "ok"
    assert len(rec.named(Span.PREFILL_LEG)) == 2 and len(rec.named(Span.ROUTE)) == 2


async def test_unreachable_d_is_retried_on_the_other_d(cluster: MakeCluster) -> None:
    c = await cluster(1, 2)
    await c.d_servers[0].stop()
    r = await c.client.post("/v1/completions", json=COMPLETION)
    assert r.status_code == 200 and r.content == c.d[1].responses[0]
    assert (await stats(c))["decode"][0]["health"] == "suspect"


async def open_once_first_leg_closed(d: MockBackend) -> None:
    """Let D answer once the failed attempt's D leg was closed (its KV never came)."""
    await d.wait_for(1)
    await d.requests[0].disconnected.wait()
    assert d.gate is not None
    d.gate.set()


async def test_p_failing_before_the_first_byte_is_retried_on_the_other_p(
    cluster: MakeCluster,
) -> None:
    c = await cluster(2, 1)
    d = c.d[0]
    d.gate = asyncio.Event()  # D waits for KV while p0 fails
    c.p[0].gate, c.p[0].fail_first_n = d.arrived, 1
    opener = asyncio.create_task(open_once_first_leg_closed(d))
    r = await c.client.post("/v1/completions", json={**COMPLETION, "stream": True})
    await within(opener, "D's first leg to be cancelled")
    assert r.status_code == 200 and r.content == b"".join(CHUNKS)
    assert len(c.p[0].requests) == 1 and len(c.p[1].requests) == 1
    assert [c.d_kv(i)["remote_engine_id"] for i in range(2)] == ["p0-engine", "p1-engine"]
    assert c.d_kv(0)["transfer_id"] != c.d_kv(1)["transfer_id"]
    s = await stats(c)
    assert s["requests"]["retried"] == {"total": 1, "prefill": 1}
    assert s["prefill"][0]["health"] == "suspect"


async def test_the_only_p_failing_before_the_first_byte_is_retried_on_d_alone(
    cluster: MakeCluster,
) -> None:
    """Losing the only P mid-flight (before the client got a byte) costs a local prefill on
    D, not an error: the next attempt is degraded, with the client's whole request."""
    rec = Recorder()
    c = await cluster(1, 1, tracer=rec.tracer)
    d = c.d[0]
    d.gate = asyncio.Event()  # D waits for KV while P fails
    c.p[0].gate, c.p[0].fail_first_n = d.arrived, 1
    opener = asyncio.create_task(open_once_first_leg_closed(d))
    r = await c.client.post("/v1/completions", json={**COMPLETION, "stream": True})
    await within(opener, "D's first leg to be cancelled")
    assert r.status_code == 200 and r.content == b"".join(CHUNKS)
    assert len(c.p[0].requests) == 1 and len(d.requests) == 2
    assert d.requests[1].body == {**COMPLETION, "stream": True}  # D computes the prompt
    s = await stats(c)
    assert s["requests"]["retried"] == {"total": 1, "prefill": 1}
    assert s["requests"]["degraded"] == 1
    assert rec.one(Span.REQUEST).attributes[Attr.DEGRADED.value] is True


async def test_no_retry_after_the_first_byte(cluster: MakeCluster) -> None:
    def d0_crashes(_ps: list[MockBackend], ds: list[MockBackend]) -> None:
        ds[0].crash_mid_stream = True

    c = await cluster(1, 2, setup=d0_crashes)
    r = await c.client.post("/v1/completions", json={**COMPLETION, "stream": True})
    assert r.status_code == 200
    assert r.content.startswith(CHUNKS[0]) and b'"error"' in r.content
    assert r.content.endswith(b"data: [DONE]\n\n")
    assert c.d[1].requests == []
    assert (await stats(c))["requests"]["retried"] == {"total": 0}


@pytest.mark.parametrize("max_attempts", [1, 2, 3])
async def test_attempts_are_bounded(cluster: MakeCluster, max_attempts: int) -> None:
    def all_fail(_ps: list[MockBackend], ds: list[MockBackend]) -> None:
        for d in ds:
            d.fail_first_n = 5

    c = await cluster(1, 4, setup=all_fail, max_attempts=max_attempts)
    r = await c.client.post("/v1/completions", json=COMPLETION)
    last = [d for d in c.d if d.requests][-1]
    assert r.status_code == 500 and r.json() == last.error_body  # the last failure answers
    assert sum(len(d.requests) for d in c.d) == max_attempts
    assert all(len(d.requests) <= 1 for d in c.d)  # each attempt on another D
    assert (await stats(c))["requests"]["retried"].get("decode", 0) == max_attempts - 1


async def test_no_other_backend_left_answers_the_last_failure(cluster: MakeCluster) -> None:
    c = await cluster(1, 1, setup=d0_fails_once)
    r = await c.client.post("/v1/completions", json=COMPLETION)
    assert r.status_code == 500 and r.json() == c.d[0].error_body
    assert len(c.d[0].requests) == 1  # not retried on the D that just failed


async def test_a_refusal_is_not_retried(cluster: MakeCluster) -> None:
    def d0_refuses(_ps: list[MockBackend], ds: list[MockBackend]) -> None:
        ds[0].fail_first_n, ds[0].error_status = 1, 400

    c = await cluster(1, 2, setup=d0_refuses)
    r = await c.client.post("/v1/completions", json=COMPLETION)
    assert r.status_code == 400 and c.d[1].requests == []


# -- races and bugs of the router's own -----------------------------------------------------


async def test_p_coordinates_dropped_after_the_choice_are_no_500(
    cluster: MakeCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    c = await cluster()
    backends = c.state.backends
    prefill_body = legs.prefill_body

    def lose_coords_then_build(*args: Any, **kwargs: Any) -> dict[str, Any]:
        # What a failed health check does to P while its leg is under way (P's task runs
        # before D's leg is built).
        p = backends.prefill[0]
        p.coords, p.load.ready = None, False
        return prefill_body(*args, **kwargs)

    monkeypatch.setattr(legs, "prefill_body", lose_coords_then_build)
    r = await c.client.post("/v1/completions", json=COMPLETION)
    assert r.status_code == 200, r.text
    assert c.d_kv()["remote_engine_id"] == p_coords(0)["engine_id"]


async def test_a_p_without_coordinates_is_not_chosen(cluster: MakeCluster) -> None:
    c = await cluster(2, 1)
    c.state.backends.prefill[0].coords = None  # ready, yet its coordinates are gone
    for _ in range(2):
        assert (await c.client.post("/v1/completions", json=COMPLETION)).status_code == 200
    assert c.p[0].requests == [] and len(c.p[1].requests) == 2


async def test_an_unexpected_error_is_a_clear_502(
    cluster: MakeCluster, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(*_args: object, **_kwargs: object) -> None:
        raise ValueError("a bug of the router's own")

    rec = Recorder()
    c = await cluster(tracer=rec.tracer)
    monkeypatch.setattr(legs, "decode_body", broken)
    with caplog.at_level(logging.ERROR, logger="connector.router.proxy"):
        r = await c.client.post("/v1/completions", json=COMPLETION)
    assert r.status_code == 502
    err = r.json()["error"]
    assert err["type"] == "router_error" and "a bug of the router's own" in err["message"]
    (logged,) = [x for x in caplog.records if x.name == "connector.router.proxy"]
    assert logged.exc_info is not None  # once, with the traceback
    assert (await stats(c))["requests"]["router_errors"] == 1
    root = rec.one(Span.REQUEST)
    assert root.attributes[Attr.REASON.value] == "router_error"
    await c.background_done()
    s = await stats(c)
    assert s["prefill"][0]["outstanding"] == 0 and s["decode"][0]["outstanding"] == 0


# -- degraded mode ----------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_degraded_mode_serves_through_d_and_returns_to_pd(
    cluster: MakeCluster, stream: bool
) -> None:
    def p_down(ps: list[MockBackend], _ds: list[MockBackend]) -> None:
        ps[0].healthy = False

    rec = Recorder()
    c = await cluster(setup=p_down, tracer=rec.tracer)
    body = {**COMPLETION, "stream": stream}
    r = await c.client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert c.p[0].requests == []
    assert c.d[0].requests[0].body == body  # the whole request: D computes the prompt
    root = rec.one(Span.REQUEST)
    assert root.attributes[Attr.DEGRADED.value] is True
    assert root.attributes[Attr.OUTCOME.value] == "ok"
    assert "degraded" in rec.one(Span.ROUTE).attributes[Attr.ROUTE_REASON.value]
    assert rec.named(Span.PREFILL_LEG) == []
    assert (await stats(c))["requests"]["degraded"] == 1
    # P is back: P/D again.
    c.p[0].healthy = True
    await c.check_health()
    assert (await c.client.post("/v1/completions", json=body)).status_code == 200
    assert len(c.p[0].requests) == 1
    assert c.d_kv(1)["transfer_id"] == c.p_kv(0)["transfer_id"]
    assert (await stats(c))["requests"]["degraded"] == 1


async def test_no_degraded_is_503_while_no_p_is_healthy(cluster: MakeCluster) -> None:
    def p_down(ps: list[MockBackend], _ds: list[MockBackend]) -> None:
        ps[0].healthy = False

    c = await cluster(setup=p_down, degraded=False)
    r = await c.client.post("/v1/completions", json=COMPLETION)
    assert r.status_code == 503 and "no healthy prefill" in r.json()["error"]["message"]
    assert c.d[0].requests == []
    assert (await c.client.get("/health")).status_code == 503  # nothing can be served


async def test_a_degraded_attempt_is_retried_on_the_other_d(cluster: MakeCluster) -> None:
    def p_down(ps: list[MockBackend], ds: list[MockBackend]) -> None:
        ps[0].healthy = False
        ds[0].fail_first_n = 1

    c = await cluster(1, 2, setup=p_down)
    r = await c.client.post("/v1/completions", json=COMPLETION)
    assert r.status_code == 200 and r.content == c.d[1].responses[0]
    assert (await stats(c))["requests"]["degraded"] == 2


# -- logs ---------------------------------------------------------------------------------


async def test_health_checks_log_state_changes_only(
    cluster: MakeCluster, caplog: pytest.LogCaptureFixture
) -> None:
    c = await cluster()
    caplog.set_level(logging.DEBUG)
    for _ in range(3):
        await c.check_health()
    assert [r for r in caplog.records if r.levelno >= logging.INFO] == []
    c.d[0].healthy = False
    for _ in range(3):
        await c.check_health()
    c.d[0].healthy = True
    for _ in range(3):
        await c.check_health()
    changes = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert len(changes) == 2, changes
    assert changes[0].endswith("healthy -> down") and changes[1].endswith("down -> healthy")


async def test_a_backend_turning_suspect_is_logged_once(
    cluster: MakeCluster, caplog: pytest.LogCaptureFixture
) -> None:
    def d0_fails(_ps: list[MockBackend], ds: list[MockBackend]) -> None:
        ds[0].fail_first_n = 2

    c = await cluster(setup=d0_fails)
    caplog.set_level(logging.WARNING, logger="connector.router.backends")
    for _ in range(2):
        await c.client.post("/v1/completions", json=COMPLETION)
    turned = [r for r in caplog.records if r.getMessage().endswith("healthy -> suspect")]
    assert len(turned) == 1


# -- flags ----------------------------------------------------------------------------------


def test_retry_and_degraded_flags() -> None:
    base = ["--prefill", "http://p:1", "--decode", "http://d:2", "--port", "8000"]
    default = parse_args(base)
    assert (default.max_attempts, default.degraded) == (2, True)
    cfg = parse_args([*base, "--max-attempts", "1", "--no-degraded"])
    assert (cfg.max_attempts, cfg.degraded) == (1, False)
    with pytest.raises(ConfigError, match="max_attempts"):
        RouterConfig(prefill_urls=("http://p:1",), decode_urls=("http://d:2",), max_attempts=0)

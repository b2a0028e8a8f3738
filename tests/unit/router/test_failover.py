"""Bounded failover (issue #31): D failing a leg because its P died is P's failure, not D's.

Under vLLM's ``kv_load_failure_policy: fail`` D answers the decode leg 500 (or, streamed, an
error event before its first token) when the push from its P failed with ``peer_lost``. The
router then asks whether this attempt's P is gone (its leg failed, or its /health fails
now): if so, D is not marked suspect, P leaves rotation at once, and the request is retried
without that P (D alone, or another P). If P is alive, the failure stays D's, as before. A
backend out of service is checked again within ``RECHECK_S``, not a health interval.
"""

from __future__ import annotations

import asyncio

import pytest

from connector.router.backends import RECHECK_S
from tests.unit.router.conftest import Cluster, MakeCluster
from tests.unit.router.mock_backend import CHUNKS
from tests.unit.router.serving import within

pytestmark = pytest.mark.anyio

COMPLETION = {"model": "m", "prompt": "hello", "max_tokens": 8}


async def stats(c: Cluster) -> dict:
    return (await c.client.get("/router/stats")).json()


def health(s: dict, role: str, i: int = 0) -> str:
    h: str = s[role][i]["health"]
    return h


@pytest.mark.parametrize("stream", [False, True])
async def test_d_failing_because_its_p_died_is_retried_on_d_alone_and_d_stays_healthy(
    cluster: MakeCluster, stream: bool
) -> None:
    c = await cluster(1, 1)
    p, d = c.p[0], c.d[0]
    p.healthy = False  # P answered its leg, then died: its /health no longer answers 200
    if stream:
        d.stream_error_first_n = 1  # vLLM streams the failed load as an error event
    else:
        d.fail_first_n = 1  # vLLM answers the failed load 500
    r = await c.client.post("/v1/completions", json={**COMPLETION, "stream": stream})
    assert r.status_code == 200, r.text
    if stream:
        assert r.content == b"".join(CHUNKS) and b"error" not in r.content
    assert len(d.requests) == 2
    assert d.requests[1].body == {**COMPLETION, "stream": stream}  # D alone, whole request
    s = await stats(c)
    assert s["requests"]["retried"] == {"total": 1, "prefill": 1}
    assert s["requests"]["degraded"] == 1
    assert health(s, "decode") == "healthy", "D was blamed for its P's death"
    assert health(s, "prefill") == "down", "P stays in rotation after it was found gone"
    # The next request does not try the dead P again: D alone at once.
    r = await c.client.post("/v1/completions", json=COMPLETION)
    assert r.status_code == 200 and len(p.requests) == 1
    assert (await stats(c))["requests"]["degraded"] == 2


async def test_d_failing_while_its_p_is_alive_is_ds_failure_as_before(
    cluster: MakeCluster,
) -> None:
    c = await cluster(1, 1)
    c.d[0].fail_first_n = 1
    r = await c.client.post("/v1/completions", json=COMPLETION)
    assert r.status_code == 500  # the only D failed: its answer passes on
    s = await stats(c)
    assert health(s, "decode") == "suspect" and health(s, "prefill") == "healthy"
    assert s["requests"]["retried"] == {"total": 1, "decode": 1}


async def test_a_streamed_error_with_p_alive_reaches_the_client_as_d_sent_it(
    cluster: MakeCluster,
) -> None:
    c = await cluster(1, 1)
    c.d[0].stream_error_first_n = 1
    r = await c.client.post("/v1/completions", json={**COMPLETION, "stream": True})
    assert r.status_code == 200 and r.content.startswith(b'data: {"error"')
    s = await stats(c)
    assert health(s, "decode") == "healthy"  # as before: a streamed error marks nobody
    assert s["requests"]["retried"].get("total", 0) == 0


async def test_with_two_ps_the_retry_goes_to_the_live_one(cluster: MakeCluster) -> None:
    c = await cluster(2, 1)
    d = c.d[0]
    c.p[0].healthy = False
    d.fail_first_n = 1
    r = await c.client.post("/v1/completions", json=COMPLETION)
    assert r.status_code == 200, r.text
    assert [c.d_kv(i)["remote_engine_id"] for i in range(2)] == ["p0-engine", "p1-engine"]
    s = await stats(c)
    assert health(s, "decode") == "healthy" and health(s, "prefill", 0) == "down"
    assert s["requests"]["degraded"] == 0


async def test_a_p_out_of_service_is_checked_again_within_the_recheck_interval(
    cluster: MakeCluster,
) -> None:
    # The health interval is an hour: only the recheck of a backend out of service runs.
    c = await cluster(1, 1)
    p = c.p[0]
    p.healthy = False
    await c.check_health()
    assert health(await stats(c), "prefill") == "down"
    probes = len(p.probes)
    p.healthy = True  # restarted: /health answers again

    async def back_in_rotation() -> None:
        while health(await stats(c), "prefill") != "healthy" or len(p.probes) == probes:
            await asyncio.sleep(0.01)  # pacing of the poll, not synchronisation

    loop = asyncio.get_running_loop()
    t0 = loop.time()
    await within(back_in_rotation(), "the restarted P to be probed and healthy")
    assert loop.time() - t0 < 4 * RECHECK_S
    r = await c.client.post("/v1/completions", json=COMPLETION)
    assert r.status_code == 200 and len(p.requests) == 1  # used again
    checks = c.d[0].health_checks
    await asyncio.sleep(3 * RECHECK_S)  # an in-service D is not rechecked meanwhile
    assert c.d[0].health_checks == checks

"""pushkv's metrics on real vLLM: P's and D's /metrics (through vLLM's connector-stats
hooks) and the router's, scraped before and after a few requests through the router.

Every request served by push is one transfer on each side: the transfer histograms and the
``done`` counters grow by exactly the number of requests, the router counts them ok with a
TTFT each, and the gauges of pending work are back at zero once the stack is idle.
"""

from __future__ import annotations

import random
import time
from typing import TYPE_CHECKING

import httpx
import pytest

from connector.tools.pdstack import metric_sum

if TYPE_CHECKING:
    from conftest import Pd  # tests/e2e/conftest.py (the fixture's type)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

REQUESTS = 4
SETTLE_S = 30.0  # stats reach /metrics with vLLM's next engine step after the transfer

P_COUNTS = {
    "write": ("vllm:pushkv_write_seconds_count", {"path": "direct"}),
    "bytes": ("vllm:pushkv_transfer_bytes_count", {}),
    "push": ("vllm:pushkv_push_seconds_count", {}),
    "done": ("vllm:pushkv_transfers_total", {"side": "send", "outcome": "done"}),
}
D_COUNTS = {
    "kv_wait": ("vllm:pushkv_kv_wait_seconds_count", {}),
    "done": ("vllm:pushkv_transfers_total", {"side": "recv", "outcome": "done"}),
}
ROUTER_COUNTS = {
    "ok": ("pushkv_router_requests_total", {"outcome": "ok"}),
    "ttft": ("pushkv_router_ttft_seconds_count", {}),
    "p_legs": ("pushkv_router_legs_total", {"role": "prefill", "outcome": "ok"}),
    "d_legs": ("pushkv_router_legs_total", {"role": "decode", "outcome": "ok"}),
}
P_GAUGES = (
    "vllm:pushkv_registrations_waiting",
    "vllm:pushkv_prefills_waiting",
    "vllm:pushkv_blocks_held",
    "vllm:pushkv_writes_in_flight",
)
D_GAUGES = ("vllm:pushkv_transfers_awaiting_kv",)


def counts(client: httpx.Client, which: dict[str, tuple[str, dict[str, str]]]) -> dict[str, float]:
    text = client.get("/metrics").text
    return {k: metric_sum(text, name, **labels) or 0.0 for k, (name, labels) in which.items()}


def settled(
    client: httpx.Client, which: dict[str, tuple[str, dict[str, str]]], want: dict[str, float]
) -> dict[str, float]:
    """The counts once every one reached ``want`` (bounded), else as they are then."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        now = counts(client, which)
        if all(now[k] >= want[k] for k in want) or time.monotonic() > deadline:
            return now
        time.sleep(0.2)


def test_transfer_metrics_count_every_request_and_gauges_return_to_zero(pd: Pd) -> None:
    before_p = counts(pd.prefill, P_COUNTS)
    before_d = counts(pd.decode, D_COUNTS)
    before_r = counts(pd.router, ROUTER_COUNTS)
    rng = random.Random(1515)
    for i in range(REQUESTS):
        prompt = [rng.randrange(3, 4096) for _ in range(200 + i)]  # fresh: no prefix hit on D
        resp = pd.router.post(
            "/v1/completions",
            json={"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0},
        )
        assert resp.status_code == 200, resp.text
        assert resp.headers["traceresponse"].startswith("00-")
        assert "total;dur=" in resp.headers["server-timing"]
    want = lambda before: {k: v + REQUESTS for k, v in before.items()}  # noqa: E731
    after_p = settled(pd.prefill, P_COUNTS, want(before_p))
    after_d = settled(pd.decode, D_COUNTS, want(before_d))
    after_r = settled(pd.router, ROUTER_COUNTS, want(before_r))
    assert {k: after_p[k] - before_p[k] for k in P_COUNTS} == dict.fromkeys(P_COUNTS, REQUESTS)
    assert {k: after_d[k] - before_d[k] for k in D_COUNTS} == dict.fromkeys(D_COUNTS, REQUESTS)
    assert {k: after_r[k] - before_r[k] for k in ROUTER_COUNTS} == dict.fromkeys(
        ROUTER_COUNTS, REQUESTS
    )
    p_text = pd.prefill.get("/metrics").text
    assert 'model_name="tiny"' in p_text.split("vllm:pushkv_write_seconds_count", 1)[1][:200]
    # Idle: nothing waits, nothing is held (the last engine step published the zeros).
    deadline = time.monotonic() + SETTLE_S
    while True:
        p_text, d_text = pd.prefill.get("/metrics").text, pd.decode.get("/metrics").text
        gauges = {g: metric_sum(p_text, g) for g in P_GAUGES}
        gauges |= {g: metric_sum(d_text, g) for g in D_GAUGES}
        if all(v == 0.0 for v in gauges.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert gauges == dict.fromkeys(gauges, 0.0), f"pending work left when idle: {gauges}"
    r_text = pd.router.get("/metrics").text
    assert metric_sum(r_text, "pushkv_router_backend_healthy") == 2.0
    assert metric_sum(r_text, "pushkv_router_backend_outstanding_legs") == 0.0

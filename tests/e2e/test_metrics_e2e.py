"""pushkv's metrics on real vLLM: P's and D's /metrics (through vLLM's connector-stats
hooks) and the router's, scraped before and after a few requests through the router.

Every request served by push is one transfer on each side: the transfer histograms and the
``done`` counters grow by exactly the number of requests, the router counts them ok with a
TTFT each, and the gauges of pending work are back at zero once the stack is idle. Failures
count by outcome and reason. A real Prometheus (Debian's package) scrapes all three,
answers every query of the Grafana board and keeps the router's exemplars: the trace ids of
the responses, as the board's exemplar links use them.
"""

from __future__ import annotations

import random
import shutil
import subprocess
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
import yaml
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)

from connector.tools.pdstack import metric_sum
from connector.tools.stack import free_port
from telemetry.schema import EXEMPLAR_TRACE_ID, Metric
from tests.unit.dashboard.test_metrics_board import board_queries

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


def _leg_to(port: int) -> dict[str, Any]:
    """A D leg naming a P that nobody serves (connector/kv_params.py: DecodeLeg)."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "transfer_id": uuid.uuid4().hex,
        "remote_engine_id": "ghost",
        "remote_host": "127.0.0.1",
        "remote_port": port,
        "remote_tp_size": 1,
    }


FAILURES = {
    "failed": ("vllm:pushkv_transfers_total", {"side": "recv", "outcome": "failed"}),
    "recomputed": ("vllm:pushkv_recomputed_requests_total", {"reason": "transfer_failed"}),
    "bad_params": ("vllm:pushkv_recomputed_requests_total", {"reason": "bad_params"}),
}


def test_failures_count_by_outcome_and_reason(pd: Pd) -> None:
    before = counts(pd.decode, FAILURES)
    body = {"model": "tiny", "prompt": "x " * 80, "max_tokens": 2, "temperature": 0}
    ghost = pd.decode.post(
        "/v1/completions", json={**body, "kv_transfer_params": _leg_to(free_port())}
    )
    assert ghost.status_code == 200, ghost.text  # recomputed by D
    bad = pd.decode.post(
        "/v1/completions", json={**body, "kv_transfer_params": {"do_remote_prefill": True}}
    )
    assert bad.status_code == 200, bad.text
    after = settled(pd.decode, FAILURES, {k: v + 1 for k, v in before.items()})
    assert {k: after[k] - before[k] for k in FAILURES} == dict.fromkeys(FAILURES, 1)


# Board queries that need what this workload does not cause: drops, retries, heartbeats
# (a transfer waiting over 5 s), legs failing through the router.
MAY_BE_EMPTY = ("messages_dropped", "retries_total", "heartbeats_total", 'outcome!="ok"')


def test_a_real_prometheus_answers_every_board_query(pd: Pd, tmp_path: Path) -> None:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("no prometheus (Debian's package; scripts/install.sh installs it)")
    port = free_port()
    targets = {
        "pushkv-prefill": pd.stack.prefill.url,
        "pushkv-decode": pd.stack.decode.url,
        "pushkv-router": pd.stack.url,
    }
    config = {
        "global": {"scrape_interval": "1s"},
        "scrape_configs": [
            {"job_name": job, "static_configs": [{"targets": [url.removeprefix("http://")]}]}
            for job, url in targets.items()
        ],
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    log = (tmp_path / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--enable-feature=exemplar-storage",  # as compose.yaml runs it
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10, trust_env=False) as prom:
            _wait_ready(prom, proc)
            earlier = _exposed_exemplar_trace_ids(pd.router)
            rng = random.Random(2525)
            start = time.time()
            trace_ids = set()
            for i in range(REQUESTS):
                prompt = [rng.randrange(3, 4096) for _ in range(150 + i)]
                stream = bool(i % 2)
                body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "stream": stream}
                r = pd.router.post("/v1/completions", json=body)
                assert r.status_code == 200
                trace_ids.add(r.headers["traceresponse"].split("-")[1])
            results = _settled_queries(prom)
            exemplars = _exemplar_trace_ids(prom, start)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()
    errors = {q: r for q, r in results.items() if r["status"] != "success"}
    assert not errors, f"Prometheus refused board queries: {errors}"
    empty = [q for q, r in results.items() if not r["data"]["result"]]
    unexpected = [q for q in empty if not any(m in q for m in MAY_BE_EMPTY)]
    assert not unexpected, f"board queries without data after a workload: {unexpected}"
    # A bucket keeps its latest exemplar: buckets these requests did not hit still show the
    # earlier tests' requests (scraped now, so stored after ``start``).
    assert exemplars & trace_ids and exemplars <= trace_ids | earlier, (
        f"the TTFT histogram's exemplars {exemplars} are neither the responses' {trace_ids}"
        f" nor those exposed before them {earlier}"
    )


def _exposed_exemplar_trace_ids(router: httpx.Client) -> set[str]:
    """The trace ids the router's TTFT histogram exposes as exemplars right now."""
    om = router.get("/metrics", headers={"accept": "application/openmetrics-text"})
    return {
        s.exemplar.labels[EXEMPLAR_TRACE_ID]
        for fam in openmetrics_families(om.text)
        for s in fam.samples
        if s.name == f"{Metric.ROUTER_TTFT.value}_bucket"
        and s.exemplar is not None
        and EXEMPLAR_TRACE_ID in s.exemplar.labels
    }


def _exemplar_trace_ids(prom: httpx.Client, start: float) -> set[str]:
    """The trace ids of the router TTFT histogram's exemplars stored since ``start``
    (bounded wait: they arrive with the next scrape)."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        params = {
            "query": f"{Metric.ROUTER_TTFT.value}_bucket",
            "start": start - 1,
            "end": time.time() + 1,
        }
        answer = prom.get("/api/v1/query_exemplars", params=params).json()
        assert answer["status"] == "success", answer
        found = {
            e["labels"][EXEMPLAR_TRACE_ID]
            for series in answer["data"]
            for e in series["exemplars"]
            if EXEMPLAR_TRACE_ID in e["labels"]
        }
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def _wait_ready(prom: httpx.Client, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, "prometheus exited"
        try:
            if prom.get("/-/ready").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError("prometheus not ready within 60 s")


def _settled_queries(prom: httpx.Client) -> dict[str, dict[str, Any]]:
    """Every board query's answer, once the workload's series are in (bounded)."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        results = {
            q: prom.get("/api/v1/query", params={"query": q}).json() for q in board_queries("1m")
        }
        missing = [
            q
            for q, r in results.items()
            if r.get("status") == "success"
            and not r["data"]["result"]
            and not any(m in q for m in MAY_BE_EMPTY)
        ]
        if not missing or time.monotonic() > deadline:
            return results
        time.sleep(1.0)

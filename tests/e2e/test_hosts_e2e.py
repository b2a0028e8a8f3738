"""2P2D on simulated hosts: real vLLM P and D servers on the tiny model, each in
a network namespace of its own, the router outside.

Each server binds its API, side channel and doorbell to its host's address and advertises
that address; UCX runs over TCP on the host's veth only (``connector.tools.hoststack``). The
router, in the root namespace, reaches them over the bed's bridge. One stack for the module
(four servers take most of its time); the tests run in file order and the last one kills a
P and a D. Skipped, with the reason, only where namespaces cannot be created (not root).
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from connector.tools.hoststack import TWO_BY_TWO, HostStack, Instance
from connector.tools.netbed import Unavailable
from connector.tools.pdstack import metric_sum
from connector.tools.stack import ServerError
from dashboard.data import request_frame
from telemetry.critical_path import critical_path
from telemetry.otlp_json import Trace
from telemetry.schema import Attr, Metric, Resource, Span
from telemetry.traces import read_run
from tests.e2e.greedy import assert_matches_reference, greedy_body
from tests.e2e.test_push_e2e import post_ok, random_prompt, source_tokens

pytestmark = [pytest.mark.e2e, pytest.mark.netns, pytest.mark.timeout(420)]

START_TIMEOUT_S = 300.0
HTTP_TIMEOUT_S = 60.0
METRIC_SETTLE_S = 10.0  # vLLM's counters may trail the answer a moment
SPAN_WAIT_S = 20.0  # the exporters write in batches (100 ms engines, 500 ms router)
HEALTH_WAIT_S = 15.0  # a few of the router's health intervals
D_CONFIG = {
    "receive_timeout_s": 10.0,
    "write_timeout_s": 5.0,
    "dial_timeout_s": 2.0,
    "grace_s": 2.0,
}
# A request can meet the killed P and then the killed D: three attempts cover both.
ROUTER_ARGS = ["--max-attempts", "3"]
PROMPTS = [random_prompt(40 + 23 * i, seed=100 + i) for i in range(12)]


@dataclass
class Hosts:
    stack: HostStack
    router: httpx.Client
    refs: list[dict[str, Any]]  # the single instance's answer to each of PROMPTS


def _client(url: str) -> httpx.Client:
    return httpx.Client(base_url=url, timeout=HTTP_TIMEOUT_S, trust_env=False)


def _warm_up(url: str, **extra: object) -> None:
    with _client(url) as c:  # a fresh server's first logprobs request takes seconds
        post_ok(c, "/v1/completions", greedy_body("warm up", max_tokens=2, **extra))


@pytest.fixture(scope="module")
def hosts(tiny_model: Path, e2e_log_dir: Path) -> Iterator[Hosts]:
    stack = HostStack(
        tiny_model,
        e2e_log_dir / "hosts-2p2d",
        decode_instances=[Instance(i.cpus, i.tp, D_CONFIG) for i in TWO_BY_TWO[1]],
        router_args=ROUTER_ARGS,
    )
    try:
        stack.start(START_TIMEOUT_S)
    except Unavailable as exc:
        pytest.skip(str(exc))
    except ServerError:
        print(f"\n[hosts] errors in the servers' logs:\n{stack.log_errors()}")
        raise
    try:
        print(f"\n[hosts] 2P2D healthy after {stack.start_duration_s:.1f} s\n{stack.describe()}")
        for s in stack.prefills:
            _warm_up(s.url)
        for s in stack.decodes:
            _warm_up(s.url, cache_salt=uuid.uuid4().hex)
        _warm_up(stack.url)
        # The single instance: each prompt straight to a D, computed there (a fresh salt).
        refs = []
        for i, prompt in enumerate(PROMPTS):
            with _client(stack.decodes[i % 2].url) as d:
                refs.append(
                    post_ok(d, "/v1/completions", greedy_body(prompt, cache_salt=uuid.uuid4().hex))
                )
        with _client(stack.url) as router:
            yield Hosts(stack, router, refs)
    finally:
        stack.stop()


def traced_post(client: httpx.Client, body: dict[str, Any]) -> tuple[httpx.Response, str]:
    trace_id = uuid.uuid4().hex
    headers = {"traceparent": f"00-{trace_id}-{uuid.uuid4().hex[:16]}-01"}
    return client.post("/v1/completions", json=body, headers=headers), trace_id


def legs_ok(hosts: Hosts) -> Counter[tuple[str, str]]:
    """Legs the router ended ok so far, by (role, backend URL)."""
    text = hosts.router.get("/metrics").text
    out: Counter[tuple[str, str]] = Counter()
    for role, servers in (("prefill", hosts.stack.prefills), ("decode", hosts.stack.decodes)):
        for s in servers:
            n = metric_sum(text, Metric.ROUTER_LEGS.value, role=role, backend=s.url, outcome="ok")
            out[(role, s.url)] = int(n or 0)
    return out


def external_tokens(stack: HostStack) -> float:
    """Prompt tokens whose KV the Ds took from a P, so far, over both Ds."""
    total = 0.0
    for d in stack.decodes:
        with _client(d.url) as c:
            total += source_tokens(c)["external_kv_transfer"]
    return total


def wait_traces(run_dir: Path, trace_ids: list[str]) -> dict[str, Trace]:
    """Each trace once its router request span and D's await_kv are written."""
    deadline = time.monotonic() + SPAN_WAIT_S
    while True:
        run = read_run(run_dir)
        got = {tid: run.trace(tid) for tid in trace_ids}
        done = {
            tid: t
            for tid, t in got.items()
            if t is not None and t.first(Span.REQUEST.value) and t.first(Span.AWAIT_KV.value)
        }
        if len(done) == len(trace_ids):
            return done
        if time.monotonic() > deadline:
            missing = sorted(set(trace_ids) - set(done))
            pytest.fail(f"{len(missing)} trace(s) incomplete after {SPAN_WAIT_S:.0f} s: {missing}")
        time.sleep(0.5)


# ------------------------------------------------------------------------------ tests


def test_greedy_outputs_equal_a_single_instance_across_hosts(hosts: Hosts) -> None:
    before = external_tokens(hosts.stack)
    for i in range(4):
        got = post_ok(hosts.router, "/v1/completions", greedy_body(PROMPTS[i]))
        assert_matches_reference(got, hosts.refs[i], f"prompt {i} across hosts")
    # The prompts' KV came from P over the bridge (D computes at most the last token).
    deadline = time.monotonic() + METRIC_SETTLE_S
    want = sum(len(p) - 1 for p in PROMPTS[:4])
    while (got_tokens := external_tokens(hosts.stack) - before) < want:
        assert time.monotonic() < deadline, f"D took {got_tokens} prompt tokens' KV, not {want}"
        time.sleep(0.1)


def test_requests_spread_over_both_p_and_both_d(hosts: Hosts) -> None:
    bed = hosts.stack.bed
    assert bed is not None
    before, bytes_before = legs_ok(hosts), [bed.link_bytes(h) for h in bed.hosts]
    for i in range(4, 8):
        got = post_ok(hosts.router, "/v1/completions", greedy_body(PROMPTS[i]))
        assert_matches_reference(got, hosts.refs[i], f"prompt {i}")
    delta = legs_ok(hosts) - before
    print(f"\n[hosts] legs per backend: {dict(delta)}")
    for role, servers in (("prefill", hosts.stack.prefills), ("decode", hosts.stack.decodes)):
        for s in servers:  # least outstanding, then least served: sequential requests alternate
            assert delta[(role, s.url)] == 2, f"{role} {s.url}: {delta[(role, s.url)]} of 4 legs"
    # Every host's veth carried traffic: the KV left both P hosts and reached both D hosts.
    grown = [bed.link_bytes(h) - b for h, b in zip(bed.hosts, bytes_before, strict=True)]
    assert all(g > 16 * 1024 for g in grown), grown


def test_every_request_one_trace_showing_its_hosts(hosts: Hosts) -> None:
    trace_ids = []
    for i in range(8, 12):
        resp, tid = traced_post(hosts.router, greedy_body(PROMPTS[i]))
        assert resp.status_code == 200, resp.text
        trace_ids.append(tid)
    traces = wait_traces(hosts.stack.run_dir, trace_ids)
    frame = request_frame(list(traces.values()), {t: critical_path(tr) for t, tr in traces.items()})
    served: set[tuple[str, str]] = set()
    for tid, trace in traces.items():
        req = trace.first(Span.REQUEST.value)
        assert req is not None
        p_url, d_url = req.attr(Attr.PREFILL_URL.value), req.attr(Attr.DECODE_URL.value)
        p_host, d_host = urlsplit(p_url).hostname, urlsplit(d_url).hostname
        # P's and D's own spans are in the same trace and name the hosts the router chose.
        for name, host in ((Span.PREFILL, p_host), (Span.WRITE, p_host), (Span.AWAIT_KV, d_host)):
            spans = trace.named(name.value)
            assert spans, (
                f"trace {tid}: no {name.value} span ({sorted({s.name for s in trace.spans})})"
            )
            assert {s.resource.get(Resource.HOST_ADDR.value) for s in spans} == {host}, name
        row = frame.loc[frame["trace_id"] == tid].iloc[0]
        assert (row["prefill"], row["decode"]) == (urlsplit(p_url).netloc, urlsplit(d_url).netloc)
        served.add((p_host or "", d_host or ""))
    hosts_p = {h for h, _ in served}
    hosts_d = {h for _, h in served}
    assert len(hosts_p) == 2 and len(hosts_d) == 2, f"the dashboard shows only {served}"


def test_one_p_and_one_d_killed_under_load(hosts: Hosts) -> None:
    """Kill P 0 and then D 0 (kill -9 of the process group) while 3 clients send requests:
    each request is retried before its first byte, so every one is answered, right."""
    stack = hosts.stack
    done: list[tuple[int, int, str]] = []  # (prompt index, HTTP status, body head)
    cv = threading.Condition()

    def one(i: int) -> None:
        with _client(stack.url) as c:
            r = c.post("/v1/completions", json=greedy_body(PROMPTS[i]))
            if r.status_code == 200:
                assert_matches_reference(r.json(), hosts.refs[i], f"prompt {i} under the kills")
        with cv:
            done.append((i, r.status_code, r.text[:200]))
            cv.notify_all()

    def wait_done(n: int) -> None:
        with cv:
            assert cv.wait_for(lambda: len(done) >= n, timeout=HTTP_TIMEOUT_S), (
                f"only {len(done)} answers, waiting for {n}"
            )

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(one, i % len(PROMPTS)) for i in range(18)]
        wait_done(2)
        stack.prefills[0].kill()
        wait_done(7)
        stack.decodes[0].kill()
        for f in futures:
            f.result(timeout=HTTP_TIMEOUT_S)  # re-raises a wrong answer
    statuses = Counter(status for _, status, _ in done)
    stats = hosts.router.get("/router/stats").json()
    print(f"\n[hosts] 18 requests across the kills: {statuses}; router: {stats}")
    errors = [(i, s, body) for i, s, body in done if s != 200]
    assert not errors, f"requests not answered: {errors}"
    # The survivors serve on: P 1 and D 1 only, still correct.
    before = legs_ok(hosts)
    got = post_ok(hosts.router, "/v1/completions", greedy_body(PROMPTS[0]))
    assert_matches_reference(got, hosts.refs[0], "after the kills")
    delta = legs_ok(hosts) - before
    assert set(delta) == {("prefill", stack.prefills[1].url), ("decode", stack.decodes[1].url)}
    # Its health checks (every 2 s) see both gone.
    deadline = time.monotonic() + HEALTH_WAIT_S
    for role, s in (("prefill", stack.prefills[0]), ("decode", stack.decodes[0])):
        while (
            metric_sum(
                hosts.router.get("/metrics").text,
                Metric.ROUTER_BACKEND_HEALTHY.value,
                role=role,
                backend=s.url,
            )
            != 0
        ):
            assert time.monotonic() < deadline, f"the router still counts {role} {s.url} healthy"
            time.sleep(0.2)

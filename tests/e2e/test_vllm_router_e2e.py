"""pushkv behind routers written for vLLM's NixlConnector: ``vllm-router`` (PyPI, in its
``--vllm-pd-disaggregation --kv-connector nixl`` mode) and a minimal sequential proxy.

One P and one D with PushConnector, exactly as behind pushkv's own router; nothing about
them knows which router is in front. Checks: greedy outputs equal the single instance's
(tests/e2e/greedy.py's rule) for the cold first request, which vllm-router sends
sequentially (P's answer first, then D), and for the concurrent requests after it, which it
sends to P and D at once (P's answer said ``transfer_mode: "push"``); D computes no prompt
token itself (``vllm:prompt_tokens_by_source_total``: external only); the transfers are
paired by vllm-router's X-Request-Id (P's ``rendezvous_wait`` spans name it), for chat
completions too (vLLM decorates the id differently there); each request's P and D spans
are one trace (derived from the transfer id: core/leg_trace.py); a sequential
proxy (P first, then D with P's returned ``kv_transfer_params``, as vLLM's toy proxy and
llm-d's sidecar do) gives the same; and a D leg whose P never got the request ends at D's
own receive deadline, computed by D (vllm-router never aborts D).

Every process is started here and stopped by PID (its process group) on the way out.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from connector.core.leg_trace import derived_traceparent
from connector.tools.pdstack import PdStack, distinct_free_ports
from connector.tools.stack import Stack
from connector.tools.vllm_router import VllmRouterProcess, vllm_router_installed
from tests.e2e.conftest import Pd
from tests.e2e.greedy import MAX_TOKENS, assert_matches_reference, greedy_body
from tests.e2e.test_push_e2e import (
    post_ok,
    random_prompt,
    reference,
    settled_source_tokens,
    source_tokens,
)
from tests.unit.core.test_pairing import VLLM_ROUTER_P_LEG, vllm_router_d_leg

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(900),
    pytest.mark.skipif(
        not vllm_router_installed(),
        reason="vllm-router is not installed (pip install -e '.[test]')",
    ),
]

CONCURRENT = 19  # after the cold first request: 20 prompts in all
LENGTHS = (20, 64, 127, 128, 129, 200, 300)
HTTP_TIMEOUT_S = 180.0
# D's own deadlines, short enough for the test where P never gets the request (default 120
# s); still far above a transfer's time on this box. write_timeout_s < receive_timeout_s.
RECEIVE_TIMEOUT_S = 8.0
WRITE_TIMEOUT_S = 4.0
# D gives up at its receive deadline, waits for P's answer to its cancel, then computes.
P_FAILED_BOUND_S = RECEIVE_TIMEOUT_S + 20.0
SPANS_WAIT_S = 30.0
RENDEZVOUS = "pushkv.rendezvous_wait"
AWAIT_KV = "pushkv.await_kv"
CLIENT_TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
FIRST_ARRIVED = "pushkv.rendezvous.first"
TRANSFER_ID = "pushkv.transfer_id"


@pytest.fixture(scope="module")
def stand(tiny_model: Path, e2e_log_dir: Path) -> Iterator[Pd]:
    """P and D (PushConnector, as PdStack configures them) and vllm-router in front; P and D
    first (the router checks its workers when it starts)."""
    stack = PdStack(
        tiny_model,
        e2e_log_dir / "vllm-router",
        decode_extra_config={
            "receive_timeout_s": RECEIVE_TIMEOUT_S,
            "write_timeout_s": WRITE_TIMEOUT_S,
        },
    )
    port, metrics_port = distinct_free_ports(2)
    router = VllmRouterProcess(
        stack.prefill.url,
        stack.decode.url,
        port,
        metrics_port,
        log_path=stack.run_dir / "vllm-router.log",
        request_timeout_s=int(HTTP_TIMEOUT_S),
    )
    stack.run_dir.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as running:
        running.enter_context(Stack([stack.prefill, stack.decode]))
        running.enter_context(Stack([router]))
        clients = [
            running.enter_context(
                httpx.Client(base_url=url, timeout=HTTP_TIMEOUT_S, trust_env=False)
            )
            for url in (router.url, stack.prefill.url, stack.decode.url)
        ]
        yield Pd(stack, *clients)


def rendezvous_spans(run_dir: Path, want: int, name: str = RENDEZVOUS) -> list[dict[str, str]]:
    """P's ``rendezvous_wait`` spans (or ``name``'s): their string attributes and
    ``traceId``, once there are ``want``."""
    deadline = time.monotonic() + SPANS_WAIT_S
    while True:
        found = []
        for path in sorted(run_dir.glob("traces-*.jsonl")):
            for line in path.read_text().split("\n")[:-1]:  # whole lines only
                for rs in json.loads(line)["resourceSpans"] if line.strip() else ():
                    for ss in rs["scopeSpans"]:
                        for sp in ss["spans"]:
                            if sp["name"] == name:
                                found.append(
                                    {
                                        "traceId": sp["traceId"],
                                        **{
                                            a["key"]: a["value"].get("stringValue", "")
                                            for a in sp.get("attributes", ())
                                        },
                                    }
                                )
        if len(found) >= want or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def cold_then_concurrent(
    stand: Pd,
    label: str,
    headers: dict[str, str] | None = None,
    after_first: Callable[[], object] = lambda: None,
    recomputed_prompts: int = 0,
) -> tuple[list[list[int]], list[dict[str, Any]]]:
    """20 prompts through the router: a cold first one (``headers`` on it; ``after_first``
    runs once it is answered), which vllm-router sends sequentially, then the rest at once;
    D took every prompt token from P, but for at most ``recomputed_prompts`` whole prompts it
    computed itself. The prompts and their answers."""
    prompts = [random_prompt(LENGTHS[i % len(LENGTHS)], seed=7000 + i) for i in range(20)]
    before = source_tokens(stand.decode)
    t0 = time.monotonic()
    resp = stand.router.post("/v1/completions", json=greedy_body(prompts[0]), headers=headers)
    assert resp.status_code == 200, resp.text
    first = resp.json()
    print(f"\n[{label}] cold first request: {(time.monotonic() - t0) * 1000:.0f} ms")
    after_first()
    t0 = time.monotonic()
    with ThreadPoolExecutor(CONCURRENT) as pool:
        rest = list(
            pool.map(
                lambda p: post_ok(stand.router, "/v1/completions", greedy_body(p)), prompts[1:]
            )
        )
    print(f"[{label}] {CONCURRENT} concurrent requests: {(time.monotonic() - t0):.1f} s")
    total = sum(len(p) for p in prompts)
    after = settled_source_tokens(stand.decode, before["external_kv_transfer"] + total)
    delta = {k: after[k] - before[k] for k in after}
    print(f"[{label}] D's prompt tokens by source over {total}: {delta}")
    # Taken before the references, which D computes itself.
    local = delta["local_compute"]
    allowed = sorted(len(p) for p in prompts)[-recomputed_prompts:] if recomputed_prompts else []
    assert delta["external_kv_transfer"] + local == total and local <= sum(allowed), (
        f"D did not take every prompt token from P: {delta}; logs in {stand.stack.run_dir}"
    )
    return prompts, [first, *rest]


def test_cold_first_then_concurrent_requests_equal_single_instance(stand: Pd) -> None:
    # A client trace context on the cold request: vllm-router forwards the header, but vLLM
    # drops it before the engine unless its own tracing is on (docs/routers.md).
    first_spans: list[dict[str, str]] = []
    prompts, answers = cold_then_concurrent(
        stand,
        "vllm-router",
        headers={"traceparent": CLIENT_TRACEPARENT},
        after_first=lambda: first_spans.extend(rendezvous_spans(stand.stack.run_dir, 1)),
    )
    spans = rendezvous_spans(stand.stack.run_dir, len(prompts))
    firsts = [s.get(FIRST_ARRIVED) for s in spans]
    print(f"[vllm-router] P's rendezvous, which came first: {firsts}")
    assert len(spans) == len(prompts), f"{len(spans)} pushes for {len(prompts)} requests"
    # Paired by vllm-router's X-Request-Id; the cold request was sequential: P's prefill
    # had finished before D's registration came.
    assert all(s[TRANSFER_ID].startswith("___prefill_addr_") for s in spans), spans
    assert [s.get(FIRST_ARRIVED) for s in first_spans] == ["prefill"], first_spans
    # Then P's answer switched vllm-router to push mode: both legs at once, so D's
    # registrations reached P before its prefills had finished (all of them, on this box).
    assert "registration" in firsts, firsts
    # One trace per request, P's and D's spans in it (no traceparent in vllm-router's legs,
    # none from vLLM): the one derived from the transfer id both sides share.
    d_spans = rendezvous_spans(stand.stack.run_dir, len(prompts), AWAIT_KV)
    awaits = {s[TRANSFER_ID]: s["traceId"] for s in d_spans}
    for s in spans:
        want = derived_traceparent(s[TRANSFER_ID]).split("-")[1]
        assert (s["traceId"], awaits.get(s[TRANSFER_ID])) == (want, want), (s, awaits)
    for i, (prompt, got) in enumerate(zip(prompts, answers, strict=True)):
        assert_matches_reference(got, reference(stand, prompt), f"request {i}")


def chat_body(text: str, **extra: Any) -> dict[str, Any]:
    """greedy_body's request as a chat completion (logprobs of the top two)."""
    body = greedy_body(text, **extra)
    del body["prompt"]
    return {
        **body,
        "messages": [{"role": "user", "content": text}],
        "top_logprobs": 2,
        "logprobs": True,
    }


def as_completion(chat: dict[str, Any]) -> dict[str, Any]:
    """A chat completion in a completion's shape, for greedy.py's comparison."""
    choice, entries = chat["choices"][0], chat["choices"][0]["logprobs"]["content"]
    logprobs = {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
    }
    text = choice["message"]["content"]
    return {"choices": [{"text": text, "logprobs": logprobs}], "usage": chat["usage"]}


def test_chat_completions_pair_as_well(stand: Pd) -> None:
    """/v1/chat/completions: vLLM decorates the X-Request-Id as chatcmpl-X-<random>, with no
    prompt index; P and D still pair (vllm-router in push mode by now)."""
    # Apart from the chat template's first tokens (less than a KV block: no prefix hit on D).
    texts = [f"{word} is the word; tell me about it." for word in ("Alpha", "Gamma", "Zeta", "Pi")]
    before = source_tokens(stand.decode)
    with ThreadPoolExecutor(len(texts)) as pool:
        got = list(
            pool.map(lambda t: post_ok(stand.router, "/v1/chat/completions", chat_body(t)), texts)
        )
    total = sum(g["usage"]["prompt_tokens"] for g in got)
    after = settled_source_tokens(stand.decode, before["external_kv_transfer"] + total)
    delta = {k: after[k] - before[k] for k in after}
    assert delta["external_kv_transfer"] == total and delta["local_compute"] == 0, delta
    for text, out in zip(texts, got, strict=True):
        body = chat_body(text, cache_salt=uuid.uuid4().hex)
        ref = post_ok(stand.decode, "/v1/chat/completions", body)
        assert_matches_reference(as_completion(out), as_completion(ref), f"chat {text!r}")


def test_a_list_of_prompts_pairs_each_prompt(stand: Pd) -> None:
    """vllm-router in push mode with a list of prompts: vLLM makes one engine request per
    prompt (``cmpl-X-<i>-<random>``) on P and on D, and each prompt pairs with its own."""
    post_ok(stand.router, "/v1/completions", greedy_body(random_prompt(20, seed=9500)))  # P known
    prompts = [random_prompt(n, seed=9600 + n) for n in (30, 129, 200)]
    before = source_tokens(stand.decode)
    out = post_ok(stand.router, "/v1/completions", greedy_body(prompts))
    total = sum(len(p) for p in prompts)
    after = settled_source_tokens(stand.decode, before["external_kv_transfer"] + total)
    delta = {k: after[k] - before[k] for k in after}
    assert delta["external_kv_transfer"] == total and delta["local_compute"] == 0, delta
    by_index = {c["index"]: c for c in out["choices"]}
    for i, prompt in enumerate(prompts):
        got = {"choices": [by_index[i]], "usage": {"completion_tokens": MAX_TOKENS}}
        assert_matches_reference(got, reference(stand, prompt), f"prompt {i} of the list")


def sequential_proxy(stand: Pd, body: dict[str, Any]) -> dict[str, Any]:
    """vLLM's toy proxy: P with max_tokens 1 and NixlConnector's P leg, then D with the
    ``kv_transfer_params`` P returned, unchanged."""
    p_body = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": VLLM_ROUTER_P_LEG}
    answer = post_ok(stand.prefill, "/v1/completions", p_body)
    params = answer["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["transfer_id"], params
    return post_ok(stand.decode, "/v1/completions", {**body, "kv_transfer_params": params})


def test_sequential_proxy_equals_single_instance(stand: Pd) -> None:
    prompts = [random_prompt(n, seed=8000 + n) for n in LENGTHS]
    before = source_tokens(stand.decode)
    got = [sequential_proxy(stand, greedy_body(p)) for p in prompts]
    total = sum(LENGTHS)
    after = settled_source_tokens(stand.decode, before["external_kv_transfer"] + total)
    delta = {k: after[k] - before[k] for k in after}
    assert delta["external_kv_transfer"] == total and delta["local_compute"] == 0, delta
    for n, prompt, out in zip(LENGTHS, prompts, got, strict=True):
        assert_matches_reference(out, reference(stand, prompt), f"{n}-token prompt")


def test_d_ends_a_request_whose_p_never_came_at_its_own_deadline(stand: Pd) -> None:
    """vllm-router's push-mode D leg for an X-Request-Id P never saw (its leg failed on the
    way): D cancels at its receive deadline, computes the prompt itself and answers."""
    # P's coordinates, as vllm-router caches them from P's first answer.
    answer = post_ok(
        stand.prefill,
        "/v1/completions",
        {
            "model": "tiny",
            "prompt": "where are you",
            "max_tokens": 1,
            "kv_transfer_params": VLLM_ROUTER_P_LEG,
        },
    )["kv_transfer_params"]
    x = f"___prefill_addr_nowhere___decode_addr_here_{uuid.uuid4().hex}"
    leg = vllm_router_d_leg(answer, x)
    prompt = random_prompt(129, seed=9001)
    before = source_tokens(stand.decode)
    t0 = time.monotonic()
    resp = stand.decode.post(
        "/v1/completions",
        json=greedy_body(prompt, kv_transfer_params=leg),
        headers={"X-Request-Id": x},
        timeout=P_FAILED_BOUND_S,
    )
    took_s = time.monotonic() - t0
    print(f"\n[vllm-router] D alone, P never came: answered after {took_s:.1f} s")
    assert resp.status_code == 200, resp.text
    assert RECEIVE_TIMEOUT_S - 1.0 <= took_s < P_FAILED_BOUND_S
    deadline = time.monotonic() + SPANS_WAIT_S  # the counters may trail the answer
    while source_tokens(stand.decode)["local_compute"] <= before["local_compute"]:
        assert time.monotonic() < deadline, "D's answer did not count a token D computed"
        time.sleep(0.2)
    assert_matches_reference(resp.json(), reference(stand, prompt), "P never came")

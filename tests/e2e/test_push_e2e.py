"""PushConnector end to end: real vLLM P and D on the tiny model, through pushkv's router.

Checks that disaggregated greedy output equals a single instance (tokens and text exactly,
logprobs within tests/e2e/greedy.py's tolerance: D computes the first token in a one-token
forward, and P's KV comes from P's own batches), that D
took the whole prompt's KV from P (its prompt-token metric by source), that the KV really came
from P (a negative control), both OpenAI endpoints streamed and not, the handling of bad
input, and that the pair returns to idle: no KV blocks held and almost no CPU.

The single-instance reference is the same prompt sent straight to D with no
``kv_transfer_params`` and a unique ``cache_salt`` (which forces local compute). The tests
share one session-scoped stack (``pd`` in conftest.py) and run in file order; the last two
check the state the earlier ones leave behind.
"""

from __future__ import annotations

import concurrent.futures
import json
import random
import time
import uuid
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from bench.soak_stream import post_stream
from connector.tools.pdstack import metric_sum
from connector.tools.stack import free_port
from telemetry.schema import Metric
from tests.budget import BOUNDS, Budget, RecordProperty, cpu_share
from tests.e2e.greedy import (
    MAX_TOKENS,
    assert_greedy_agrees,
    assert_matches_reference,
    choice,
    greedy_body,
)

if TYPE_CHECKING:
    from conftest import Pd  # tests/e2e/conftest.py (the fixture's type)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

PROMPT_LENGTHS = (20, 127, 128, 129, 300, 600, 1000)  # around the 128-token block edge
HEAVY_PROMPT_LENGTHS = (20, 129, 1000)  # tiny-kv: 32 MiB of KV for the longest
VOCAB = (3, 4096)  # ids 0-2 are <s>, </s>, <pad>
SOURCE_METRIC = "vllm:prompt_tokens_by_source_total"
KV_USAGE_METRIC = "vllm:kv_cache_usage_perc"
METRIC_SETTLE_S = 10.0
IDLE_WAIT_S = 90.0  # covers P's 30 s lease, should anything be stranded
IDLE_WINDOW_S = 10.0
SETTLE_WAIT_S = 30.0
# Both servers together, idle: under 5 % of a core (`make perf`); 20 % in CI, where a busy
# loop in either still fails it.
IDLE_PAIR_CPU = Budget("idle_pair_cpu_share", precise=0.05, unit="%")


# ------------------------------------------------------------------------------ helpers


def random_prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(*VOCAB) for _ in range(n)]


def post_ok(client: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    resp = client.post(path, json=body)
    assert resp.status_code == 200, f"{client.base_url}{path}: {resp.status_code} {resp.text}"
    out: dict[str, Any] = resp.json()
    return out


def reference(pd: Pd, prompt: list[int] | str) -> dict[str, Any]:
    """Single instance: straight to D, no kv_transfer_params, a fresh cache_salt."""
    return post_ok(pd.decode, "/v1/completions", greedy_body(prompt, cache_salt=uuid.uuid4().hex))


def source_tokens(client: httpx.Client) -> dict[str, float]:
    text = client.get("/metrics").text
    return {
        src: metric_sum(text, SOURCE_METRIC, source=src) or 0.0
        for src in ("external_kv_transfer", "local_compute", "local_cache_hit")
    }


def settled_source_tokens(client: httpx.Client, expect_external: float) -> dict[str, float]:
    """The counters once ``external_kv_transfer`` reached ``expect_external`` (they may trail
    the response by a moment), or as they are after METRIC_SETTLE_S."""
    deadline = time.monotonic() + METRIC_SETTLE_S
    while True:
        now = source_tokens(client)
        if now["external_kv_transfer"] >= expect_external or time.monotonic() > deadline:
            return now
        time.sleep(0.1)


def assert_prompt_tokens_from_p(
    decode: httpx.Client, before: dict[str, float], total: int, where: object
) -> dict[str, float]:
    """D's prompt-token counters since ``before``, once settled: all ``total`` tokens came
    from P and D computed none (take it before any reference request, which computes on D).
    ``where``: named in the failure (a run folder, a configuration)."""
    after = settled_source_tokens(decode, before["external_kv_transfer"] + total)
    delta = {k: after[k] - before[k] for k in after}
    assert delta["external_kv_transfer"] == total and delta["local_compute"] == 0, (
        f"D did not take all {total} prompt tokens from P: {delta}; {where}"
    )
    return delta


def stream_text(client: httpx.Client, path: str, body: dict[str, Any]) -> tuple[str, int]:
    """POST with ``stream: true``; the concatenated text of the SSE chunks and their count."""
    parts: list[str] = []
    with client.stream("POST", path, json={**body, "stream": True}) as resp:
        assert resp.status_code == 200, resp.read().decode()
        done = False
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            assert "error" not in chunk, chunk
            for c in chunk.get("choices", ()):
                piece = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
                parts.append(piece or "")
        assert done, "stream ended without [DONE]"
    return "".join(parts), len(parts)


def decode_leg(coords: dict[str, Any], transfer_id: str, **override: Any) -> dict[str, Any]:
    """A D leg as the router builds it (connector/kv_params.py: DecodeLeg)."""
    leg = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "transfer_id": transfer_id,
        "remote_engine_id": coords["engine_id"],
        "remote_host": coords["host"],
        "remote_port": coords["port"],
        "remote_tp_size": coords["tp_size"],
    }
    if coords.get("ports"):
        leg["remote_ports"] = coords["ports"]
    if coords.get("agents"):
        leg["remote_agents"] = coords["agents"]
    leg.update(override)
    return leg


def probe_prefill(pd: Pd) -> dict[str, Any]:
    out = post_ok(
        pd.prefill,
        "/v1/completions",
        {
            "model": "tiny",
            "prompt": "probe",
            "max_tokens": 1,
            "kv_transfer_params": {"pushkv_probe": True},
        },
    )
    coords: dict[str, Any] = out["kv_transfer_params"]["pushkv"]
    return coords


def kv_usage(client: httpx.Client) -> float | None:
    return metric_sum(client.get("/metrics").text, KV_USAGE_METRIC)


def wait_idle(pd: Pd, timeout_s: float = IDLE_WAIT_S) -> dict[str, float | None]:
    deadline = time.monotonic() + timeout_s
    while True:
        usage = {"prefill": kv_usage(pd.prefill), "decode": kv_usage(pd.decode)}
        if all(u == 0.0 for u in usage.values()) or time.monotonic() > deadline:
            return usage
        time.sleep(0.5)


# ------------------------------------------------------------------------------ tests


def check_greedy_equals_single_instance(pd: Pd, lengths: tuple[int, ...]) -> None:
    prompts = {n: random_prompt(n, seed=1000 + n) for n in lengths}
    before = source_tokens(pd.decode)
    disagg: dict[int, dict[str, Any]] = {}
    for n, prompt in prompts.items():
        t0 = time.monotonic()
        disagg[n] = post_ok(pd.router, "/v1/completions", greedy_body(prompt))
        print(
            f"\n[pd] {n:5}-token prompt via router: {(time.monotonic() - t0) * 1000:.0f} ms", end=""
        )
        assert disagg[n]["usage"]["prompt_tokens"] == n
    total = sum(lengths)
    delta = assert_prompt_tokens_from_p(pd.decode, before, total, f"logs in {pd.stack.run_dir}")
    print(f"\n[pd] D prompt tokens by source over {total} prompt tokens: {delta}")
    for n, prompt in prompts.items():
        assert_matches_reference(disagg[n], reference(pd, prompt), f"{n}-token prompt")


def test_heavy_kv_model_greedy_equals_single_instance(pd_kv: Pd) -> None:
    """tiny-kv (32 KiB of KV per token, 8 layers): a few lengths across block edges."""
    check_greedy_equals_single_instance(pd_kv, HEAVY_PROMPT_LENGTHS)


def test_greedy_equals_single_instance(pd: Pd) -> None:
    check_greedy_equals_single_instance(pd, PROMPT_LENGTHS)


def test_negative_control_kv_comes_from_prefill(pd: Pd) -> None:
    """P computes a different prompt of the same length (same last 8 tokens) under D's
    transfer id: if D's output then differs from D's own reference, D used P's KV."""
    n = 200
    d_prompt = random_prompt(n, seed=7)
    p_prompt = random_prompt(n - 8, seed=8) + d_prompt[-8:]
    coords = probe_prefill(pd)
    tid = uuid.uuid4().hex
    p_body = {
        "model": "tiny",
        "prompt": p_prompt,
        "max_tokens": 1,
        "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True, "transfer_id": tid},
    }
    d_body = greedy_body(d_prompt, kv_transfer_params=decode_leg(coords, tid))
    before = source_tokens(pd.decode)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        d_future = pool.submit(post_ok, pd.decode, "/v1/completions", d_body)
        p_future = pool.submit(post_ok, pd.prefill, "/v1/completions", p_body)
        got = d_future.result(timeout=120)
        p_future.result(timeout=120)
    assert_prompt_tokens_from_p(pd.decode, before, n, f"logs in {pd.stack.run_dir}")
    ref = reference(pd, d_prompt)
    text, tokens, lps = choice(got)
    ref_text, ref_tokens, ref_lps = choice(ref)
    print(f"\n[pd] negative control: {text!r} (P's KV) vs {ref_text!r} (local)")
    assert (tokens, lps) != (ref_tokens, ref_lps), "D ignored the KV P sent"
    assert text != ref_text


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_streamed_equals_non_streamed(pd: Pd, endpoint: str) -> None:
    if endpoint == "completions":
        path = "/v1/completions"
        body: dict[str, Any] = {
            "model": "tiny",
            "prompt": random_prompt(150, seed=11),
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
        }
    else:
        path = "/v1/chat/completions"
        body = {
            "model": "tiny",
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "messages": [
                {
                    "role": "user",
                    "content": "Tell me about foxes and crows, the bridge and the seven dogs.",
                }
            ],
        }
    whole = post_ok(pd.router, path, body)
    c = whole["choices"][0]
    text = c["text"] if endpoint == "completions" else c["message"]["content"]
    assert whole["usage"]["completion_tokens"] == MAX_TOKENS
    assert text
    streamed, chunks = stream_text(pd.router, path, body)
    print(f"\n[pd] {endpoint}: {chunks} streamed chunks, text {text!r}")
    assert streamed == text


def test_decode_leg_missing_fields_is_computed_locally(pd: Pd) -> None:
    prompt = random_prompt(64, seed=21)
    out = post_ok(
        pd.decode,
        "/v1/completions",
        greedy_body(prompt, kv_transfer_params={"do_remote_prefill": True}),
    )
    params = out.get("kv_transfer_params") or {}
    assert "pushkv_error" in params, out
    print(f"\n[pd] missing fields: {params['pushkv_error']}")
    assert_matches_reference(out, reference(pd, prompt), "missing-fields D leg")


def test_decode_leg_wrong_types_is_computed_locally(pd: Pd) -> None:
    prompt = random_prompt(64, seed=22)
    bad = {
        "do_remote_prefill": True,
        "transfer_id": 42,
        "remote_engine_id": ["prefill"],
        "remote_host": 127,
        "remote_port": "not-a-port",
        "remote_tp_size": "1",
    }
    out = post_ok(pd.decode, "/v1/completions", greedy_body(prompt, kv_transfer_params=bad))
    params = out.get("kv_transfer_params") or {}
    assert "pushkv_error" in params, out
    print(f"\n[pd] wrong types: {params['pushkv_error']}")
    assert_matches_reference(out, reference(pd, prompt), "wrong-types D leg")


def test_decode_leg_naming_unreachable_prefill(pd: Pd) -> None:
    """Nobody listens at the named P: D gives up after its dial timeout and, with the
    recompute policy, computes the prompt itself, within a bounded time."""
    prompt = random_prompt(96, seed=23)
    ghost = {"engine_id": "ghost", "host": "127.0.0.1", "port": free_port(), "tp_size": 1}
    leg = decode_leg(ghost, uuid.uuid4().hex)
    bound_s = float(pd.stack.decode_extra_config["dial_timeout_s"]) + 30
    t0 = time.monotonic()
    resp = pd.decode.post(
        "/v1/completions", json=greedy_body(prompt, kv_transfer_params=leg), timeout=bound_s
    )
    elapsed_s = time.monotonic() - t0
    print(f"\n[pd] unreachable P: HTTP {resp.status_code} after {elapsed_s:.1f} s")
    assert resp.status_code == 200, resp.text
    assert_matches_reference(resp.json(), reference(pd, prompt), "D leg with unreachable P")


def test_router_rejects_client_kv_transfer_params(pd: Pd) -> None:
    resp = pd.router.post(
        "/v1/completions", json=greedy_body("hello", kv_transfer_params={"do_remote_prefill": True})
    )
    assert resp.status_code == 400, resp.text
    assert "kv_transfer_params" in resp.json()["error"]["message"]


def test_engines_alive_after_bad_input(pd: Pd) -> None:
    prompt = random_prompt(130, seed=31)
    got = post_ok(pd.router, "/v1/completions", greedy_body(prompt))
    assert_matches_reference(got, reference(pd, prompt), "request after bad input")
    for client in (pd.prefill, pd.decode, pd.router):
        assert client.get("/health").status_code == 200


def test_kv_cache_returns_to_idle(pd: Pd) -> None:
    t0 = time.monotonic()
    usage = wait_idle(pd)
    print(f"\n[pd] KV cache usage {usage} after {time.monotonic() - t0:.1f} s")
    assert usage == {"prefill": 0.0, "decode": 0.0}, (
        f"KV blocks still held {IDLE_WAIT_S:.0f} s after the last request: {usage}"
    )


@pytest.mark.parametrize("bound", BOUNDS)
def test_idle_pair_uses_almost_no_cpu(pd: Pd, record_property: RecordProperty, bound: str) -> None:
    usage = wait_idle(pd)
    assert usage == {"prefill": 0.0, "decode": 0.0}, f"not idle: {usage}"
    # vLLM's own worker busy-spins on its shared-memory queue for 1 s after each step
    # (SpinCondition, busy_loop_s=1, in vllm/distributed/device_communicators/
    # shm_broadcast.py), so the pair is quiet only a moment after its last request.
    server_cpu_s, limit = pd.stack.server_cpu_s, IDLE_PAIR_CPU.limit(bound)
    t0, deadline = time.monotonic(), time.monotonic() + SETTLE_WAIT_S
    while (settle := cpu_share(server_cpu_s, 1.0)) >= limit:
        assert time.monotonic() < deadline, (
            f"P+D still use {settle:.1%} of a core {SETTLE_WAIT_S:.0f} s after the traffic"
        )
    settled_s = time.monotonic() - t0
    share = cpu_share(server_cpu_s, IDLE_WINDOW_S)
    print(
        f"\n[pd] idle P+D (quiet after {settled_s:.1f} s): {share:.2%} of a core over "
        f"{IDLE_WINDOW_S:.0f} s (utime+stime of both servers' process groups)"
    )
    IDLE_PAIR_CPU.check(record_property, bound, share)


def stream_with_logprobs(
    client: httpx.Client, body: dict[str, Any]
) -> tuple[str, list[str], list[float], dict[str, Any]]:
    """A streamed completion: its text, tokens, logprobs and usage (read by the soak's
    ``bench.soak_stream.post_stream``)."""
    read = post_stream(client, body, timeout_s=120.0)
    assert read.response.status_code == 200, read.response.text
    assert read.error is None and not read.garbled, (read.error, read.garbled)
    return "".join(read.text), read.tokens, read.token_logprobs, read.usage or {}


def test_first_token_from_prefill_equals_single_instance(pd: Pd) -> None:
    """``--first-token prefill``: the client's first token is P's, D continues from it with
    the prompt's KV pushed by P (D computes only P's token); the stream equals D alone's."""
    from connector.tools.pdstack import RouterProcess

    stack = pd.stack
    router = RouterProcess(
        prefill_url=stack.prefill.url,
        decode_url=stack.decode.url,
        port=free_port(),
        extra_args=["--first-token", "prefill", "--health-timeout", "5"],
        log_path=stack.run_dir / "router-first-token.log",
    )
    lengths = (20, 128, 129, 600)
    prompts = {n: random_prompt(n, seed=2000 + n) for n in lengths}
    router.start()
    try:
        router.wait_healthy(60.0)
        before = source_tokens(pd.decode)
        got = {}
        with httpx.Client(base_url=router.url, timeout=120.0, trust_env=False) as client:
            for n, prompt in prompts.items():
                got[n] = stream_with_logprobs(client, greedy_body(prompt))
            after = settled_source_tokens(pd.decode, before["external_kv_transfer"] + sum(lengths))
            _first_token_that_stops_frees_p(pd, client)
    finally:
        router.stop()
    delta = {k: after[k] - before[k] for k in after}
    # D's prompt is the prompt plus P's token: the prompt's KV came from P, the token is D's.
    assert delta["external_kv_transfer"] == sum(lengths), (delta, stack.run_dir)
    assert delta["local_compute"] == len(lengths), delta
    for n, prompt in prompts.items():
        text, tokens, lps, usage = got[n]
        ref = reference(pd, prompt)
        ref_text = choice(ref)[0]
        assert usage["prompt_tokens"] == n and usage["completion_tokens"] == MAX_TOKENS, usage
        agreed = assert_greedy_agrees(tokens, lps, ref, f"{n}-token prompt, first token from P")
        if agreed == MAX_TOKENS:
            assert text == ref_text, f"{n}-token prompt"


def _p_not_needed(pd: Pd) -> tuple[float, float]:
    """P's transfers ended "not needed" and its finished prefills waiting for a D."""
    text = pd.prefill.get("/metrics").text
    ended = metric_sum(text, Metric.TRANSFERS.value, side="send", reason="not_needed") or 0.0
    return ended, metric_sum(text, Metric.PREFILLS_WAITING.value) or 0.0


def _first_token_that_stops_frees_p(pd: Pd, client: httpx.Client) -> None:
    """P's token ends the request (here a stop token): the client gets it with
    finish_reason "stop", no D leg is sent, and P frees the blocks at once (its leg says
    ``release_on_stop``) instead of holding them for the lease (30 s)."""
    prompt = random_prompt(64, seed=77)
    d_before = sum(source_tokens(pd.decode).values())
    body = greedy_body(prompt, max_tokens=1, return_token_ids=True)
    first = post_ok(pd.decode, "/v1/completions", body)["choices"][0]["token_ids"][0]
    deadline = time.monotonic() + METRIC_SETTLE_S
    d_seen = source_tokens(pd.decode)
    while sum(d_seen.values()) < d_before + len(prompt):  # D's counters trail its answer
        assert time.monotonic() < deadline, f"D's prompt tokens by source: {d_seen}"
        time.sleep(0.1)
        d_seen = source_tokens(pd.decode)
    ended_before, _ = _p_not_needed(pd)
    text, tokens, _, usage = stream_with_logprobs(
        client, greedy_body(prompt, stop_token_ids=[first])
    )
    assert usage["completion_tokens"] == 1 and len(tokens) <= 1, (text, tokens, usage)
    deadline = time.monotonic() + METRIC_SETTLE_S
    while (now := _p_not_needed(pd)) != (ended_before + 1, 0.0):
        assert time.monotonic() < deadline, (
            f"P still holds the stopped request's prefill after {METRIC_SETTLE_S} s "
            f"(transfers ended not_needed, prefills waiting: {now}; before {ended_before})"
        )
        time.sleep(0.1)
    assert source_tokens(pd.decode) == d_seen, "a D leg was sent for a finished request"

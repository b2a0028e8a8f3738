"""The router's own cost under bursts: its CPU per request, its segments, trace fidelity.

Starts fake P and D servers (P answers after ``--prefill-ms``; D streams its first token
``--decode-ms`` after its leg arrives, then one every ``--itl-ms``, ``--tokens`` in all), the
real router (``pushkv router``, tracing to JSON-lines files) and a lean asyncio client that
sends bursts of ``--concurrency`` requests at once, ``--bursts`` times. Prints, per burst
size: the client's TTFT, the router's CPU per request (from /proc), the median of each
router-side segment of the traces (ingress: server stamp -> handler; handler -> P leg sent;
D's first byte -> first chunk sent) and the share of requests whose trace accounts for the
client's TTFT within 2 % + 2 ms.

    python -m bench.router_cost --concurrency 8 16 --bursts 20
    python -m bench.router_cost --no-trace          # the same with tracing off
    python -m bench.router_cost --router-src ../before  # a router from another checkout

Use it to compare router changes in one run on this machine (2 shared cores: a burst of 16 is
16 handlers queued on one event loop); the absolute numbers drift with the machine's load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx

from connector.tools.bench import fidelity
from connector.tools.stack import group_cpu_s, stop_process_group
from connector.transport.ports import free_port
from telemetry.otlp_json import Trace
from telemetry.schema import Attr, Event, Span
from telemetry.traces import read_run


def fake_app(prefill_s: float, decode_s: float, tokens: int, itl_s: float) -> Any:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    coords = {"engine_id": "fake-p", "host": "127.0.0.1", "port": 1, "tp_size": 1}

    async def health(_r: Request) -> Response:
        return Response(status_code=200)

    async def models(_r: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "tiny", "object": "model"}]})

    async def stream() -> AsyncIterator[bytes]:
        await asyncio.sleep(decode_s)
        for i in range(tokens):
            if i:
                await asyncio.sleep(itl_s)  # one token per step, as an engine streams
            yield f'data: {{"choices":[{{"index":0,"text":"t{i}"}}]}}\n\n'.encode()
        yield b"data: [DONE]\n\n"

    async def generate(request: Request) -> Response:
        body = await request.json()
        kv = body.get("kv_transfer_params") or {}
        if kv.get("pushkv_probe"):
            return JSONResponse(
                {"choices": [{"text": "x"}], "kv_transfer_params": {"pushkv": coords}}
            )
        if body.get("stream"):
            return StreamingResponse(stream(), media_type="text/event-stream")
        await asyncio.sleep(prefill_s)
        return JSONResponse({"choices": [{"index": 0, "text": "x", "finish_reason": "length"}]})

    return Starlette(
        routes=[
            Route("/health", health),
            Route("/v1/models", models),
            Route("/v1/completions", generate, methods=["POST"]),
        ]
    )


async def one_request(port: int, rid: str) -> tuple[str, float]:
    """Send one streamed completion; the client's TTFT (s) to the first token event."""
    body = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 4, "stream": True})
    head = (
        f"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        f"x-request-id: {rid}\r\ncontent-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    t0 = time.perf_counter()
    writer.write(head.encode() + body.encode())
    ttft = -1.0
    seen = b""
    while chunk := await reader.read(65536):
        seen += chunk
        if ttft < 0 and b"data: {" in seen:
            ttft = time.perf_counter() - t0
    writer.close()
    return rid, ttft


def wait_http_ok(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1.0, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)  # polling a server's start-up, bounded by the deadline
    raise SystemExit(f"{url} not healthy after {timeout_s:.0f} s")


def segments_ms(traces: list[Trace], prefix: str) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {
        "connect": [],
        "ingress": [],
        "handler -> P leg": [],
        "first byte -> chunk": [],
        "loop lag": [],
    }
    for t in traces:
        names = (Span.REQUEST, Span.INGRESS, Span.PREFILL_LEG, Span.FIRST_BYTE, Span.CONNECT)
        req, ing, leg, fb, conn = (t.first(s.value) for s in names)
        if req is None or not str(req.attr(Attr.REQUEST_ID.value, "")).startswith(prefix):
            continue
        chunk = req.event(Event.FIRST_CHUNK.value)
        handler = ing.end_ns if ing else req.start_ns
        out["ingress"].append((handler - (ing.start_ns if ing else req.start_ns)) / 1e6)
        out["connect"].append((conn.end_ns - conn.start_ns) / 1e6 if conn else 0.0)
        out["loop lag"].append(float(req.attr(Attr.LOOP_LAG_MS.value, 0.0)))
        if leg:
            out["handler -> P leg"].append((leg.start_ns - handler) / 1e6)
        if fb and chunk:
            out["first byte -> chunk"].append((chunk.time_ns - fb.end_ns) / 1e6)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[8, 16])
    p.add_argument("--bursts", type=int, default=20)
    p.add_argument("--prefill-ms", type=float, default=20.0)
    p.add_argument("--decode-ms", type=float, default=10.0)
    p.add_argument("--tokens", type=int, default=4)
    p.add_argument("--itl-ms", type=float, default=2.0, help="D's time between tokens")
    p.add_argument("--no-trace", action="store_true")
    p.add_argument("--profile", type=Path, help="run the router under cProfile, stats here")
    p.add_argument(
        "--router-src",
        type=Path,
        help="run the router from this checkout (e.g. a `git worktree` of an older commit), "
        "to compare before and after in one run",
    )
    p.add_argument("--serve-fake", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve_fake:
        import uvicorn

        app = fake_app(args.prefill_ms / 1e3, args.decode_ms / 1e3, args.tokens, args.itl_ms / 1e3)
        uvicorn.run(app, host="127.0.0.1", port=args.serve_fake, log_level="warning")
        return 0
    run_dir = Path(tempfile.mkdtemp(prefix="router-cost-"))
    print(f"traces in {run_dir}", flush=True)
    env = {**os.environ, "PUSHKV_RUN_DIR": str(run_dir)}
    if args.router_src:
        env["PYTHONPATH"] = str(args.router_src.resolve())
    if args.no_trace:
        env["OTEL_SDK_DISABLED"] = "true"
    fp, fd, rp = free_port(), free_port(), free_port()
    procs = []
    try:
        for port in (fp, fd):
            cmd = [sys.executable, "-m", "bench.router_cost", "--serve-fake", str(port)]
            cmd += ["--prefill-ms", str(args.prefill_ms), "--decode-ms", str(args.decode_ms)]
            cmd += ["--tokens", str(args.tokens), "--itl-ms", str(args.itl_ms)]
            procs.append(subprocess.Popen(cmd, start_new_session=True))
        for port in (fp, fd):
            wait_http_ok(f"http://127.0.0.1:{port}/health", 30.0)
        profile = ["-m", "cProfile", "-o", str(args.profile)] if args.profile else []
        router = subprocess.Popen(
            [
                sys.executable,
                *profile,
                "-m",
                "connector.cli",
                "router",
                "--port",
                str(rp),
                "--prefill",
                f"http://127.0.0.1:{fp}",
                "--decode",
                f"http://127.0.0.1:{fd}",
                "--log-level",
                "warning",
            ],
            env=env,
            cwd=args.router_src or None,
            start_new_session=True,
        )
        procs.append(router)
        print(f"router pid {router.pid}", flush=True)
        wait_http_ok(f"http://127.0.0.1:{rp}/health", 30.0)
        results: dict[int, dict[str, Any]] = {}
        for conc in args.concurrency:
            asyncio.run(burst(rp, conc, f"warm-{conc}-", 2))
            before = group_cpu_s(router.pid)
            client = asyncio.run(burst(rp, conc, f"c{conc}-", args.bursts))
            results[conc] = {
                "client": client,
                "cpu_ms_per_request": (group_cpu_s(router.pid) - before) * 1e3 / len(client),
            }
    finally:
        for proc in reversed(procs):
            stop_process_group(proc, 10.0)
    traces = [] if args.no_trace else list(read_run(run_dir).traces)
    for conc, r in results.items():
        client = r["client"]
        ttfts = sorted(v * 1e3 for v in client.values() if v > 0)
        line = (
            f"c={conc}: {len(ttfts)} requests, client TTFT p50 {statistics.median(ttfts):.1f} "
            f"ms p90 {ttfts[int(0.9 * len(ttfts))]:.1f} ms; router CPU "
            f"{r['cpu_ms_per_request']:.2f} ms/request"
        )
        if traces:
            prefix = f"c{conc}-"
            bench = {"ttfts": [client.get(f"{prefix}{i}", -1) for i in range(len(client))]}
            fid = fidelity.check(bench, prefix, traces)
            segs = segments_ms(traces, prefix)
            line += "; " + ", ".join(
                f"{k} p50 {statistics.median(v):.2f} p90 {sorted(v)[int(0.9 * len(v))]:.2f} ms"
                for k, v in segs.items()
                if v
            )
            line += f"; fidelity {fid.summary()}"
        print(line, flush=True)
    return 0


async def burst(port: int, conc: int, prefix: str, bursts: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for b in range(bursts):
        got = await asyncio.gather(
            *(one_request(port, f"{prefix}{b * conc + i}") for i in range(conc))
        )
        out.update(got)
        await asyncio.sleep(0.05)  # pacing between bursts, not synchronisation
    return out


if __name__ == "__main__":
    sys.exit(main())

"""Soak: thousands of requests through a real P/D stack, random client aborts, one P crash.

Starts P, D and the router on the tiny model (``connector.tools.pdstack``, short deadlines),
computes each of ``--prompts`` prompts' single-instance answer on D (no KV transfer, a fresh
``cache_salt``), then sends ``--requests`` requests at ``--concurrency``, each a random one
of those prompts; a share ``--abort-rate`` of them gives up after a random 10-500 ms (the
client disconnects mid-prefill or mid-decode). When ``--restart-at`` of them were sent, P is
killed (SIGKILL of its process group) and started again under the same engine id.

Prints one report and writes it as JSON to ``<run-dir>/soak.json``. It fails (exit 1)
unless: no request hung (each ended within ``--request-timeout``), every completed answer
equals the single-instance one, every failed one is a clear error (JSON with a message;
never a bare 500), and both servers' KV cache is back to idle afterwards.

    python -m bench.soak                      # 2,000 requests, 16 at a time
    python -m bench.soak --requests 200       # a quick one
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import random
import re
import sys
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from connector.tools.pdstack import PdStack, metric_sum
from connector.tools.tinymodel import make_tiny_model

VOCAB = (3, 4096)
MAX_TOKENS = 16
KV_USAGE = "vllm:kv_cache_usage_perc"
_IDS = re.compile(r"[0-9a-f]{32}")  # transfer and request ids: errors group by their text
P_CONFIG = {"lease_s": 10.0, "write_timeout_s": 2.0}
D_CONFIG = {"receive_timeout_s": 10.0, "write_timeout_s": 2.0, "grace_s": 2.0}


@dataclass
class Report:
    requests: int
    concurrency: int
    abort_rate: float
    outcomes: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)  # "status: message" of failed ones
    mismatches: list[str] = field(default_factory=list)
    p_restart: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    idle_after_s: float | None = None
    kv_usage_after: dict[str, float | None] = field(default_factory=dict)
    latency_p50_s: float = 0.0
    latency_p99_s: float = 0.0
    latency_max_s: float = 0.0
    problems: list[str] = field(default_factory=list)


def body(prompt: list[int], **extra: Any) -> dict[str, Any]:
    return {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }


def clear_error(resp: httpx.Response) -> str | None:
    """The error's message if the answer is a clear one (JSON with a message), else None."""
    try:
        err = resp.json().get("error")
    except ValueError:
        return None
    msg = err.get("message") if isinstance(err, dict) else err
    return str(msg) if msg else None


def kv_usage(client: httpx.Client) -> float | None:
    try:
        return metric_sum(client.get("/metrics").text, KV_USAGE)
    except httpx.HTTPError:
        return None


def run(args: argparse.Namespace) -> Report:
    rng = random.Random(args.seed)
    run_dir = Path(args.run_dir)
    stack = PdStack(
        make_tiny_model(),
        run_dir,
        prefill_extra_config=P_CONFIG,
        decode_extra_config=D_CONFIG,
        tracing=False,
    )
    report = Report(args.requests, args.concurrency, args.abort_rate)
    stack.start(300)
    print(f"stack healthy after {stack.start_duration_s:.0f} s\n{stack.describe()}", flush=True)
    try:
        with httpx.Client(base_url=stack.decode.url, timeout=60, trust_env=False) as d:
            prompts = [
                [rng.randrange(*VOCAB) for _ in range(rng.randrange(16, 600))]
                for _ in range(args.prompts)
            ]
            refs = []
            for p in prompts:
                r = d.post("/v1/completions", json=body(p, cache_salt=uuid.uuid4().hex))
                r.raise_for_status()
                refs.append(r.json()["choices"][0]["text"])
        print(f"{len(refs)} references computed", flush=True)
        soak(stack, args, rng, prompts, refs, report)
    finally:
        stack.stop()
    return report


def soak(
    stack: PdStack,
    args: argparse.Namespace,
    rng: random.Random,
    prompts: list[list[int]],
    refs: list[str],
    report: Report,
) -> None:
    lock = threading.Lock()
    sent = 0
    latencies: list[float] = []
    restart_due = int(args.requests * args.restart_at)
    restart_now = threading.Event()
    plan = [
        (rng.randrange(len(prompts)), rng.random() < args.abort_rate, rng.uniform(0.01, 0.5))
        for _ in range(args.requests)
    ]

    def one(i: int, client: httpx.Client) -> None:
        nonlocal sent
        k, abort, patience = plan[i]
        with lock:
            sent += 1
            if sent == restart_due:
                restart_now.set()
        t0 = time.monotonic()
        timeout = patience if abort else args.request_timeout
        try:
            resp = client.post("/v1/completions", json=body(prompts[k]), timeout=timeout)
        except httpx.TimeoutException:
            outcome = "aborted" if abort else "hung"
        except httpx.HTTPError as exc:
            outcome = "transport_error"
            with lock:
                report.errors[f"client: {exc!r}"[:160]] += 1
        else:
            if resp.status_code == 200:
                text = resp.json()["choices"][0]["text"]
                outcome = "ok" if text == refs[k] else "mismatch"
                if outcome == "mismatch":
                    with lock:
                        report.mismatches.append(f"prompt {k}: {text!r} != {refs[k]!r}")
            else:
                msg = clear_error(resp)
                outcome = "error" if msg and resp.status_code != 500 else "unclear_error"
                what = _IDS.sub("*", (msg or resp.text)[:160])
                with lock:
                    report.errors[f"{resp.status_code}: {what}"] += 1
        took = time.monotonic() - t0
        with lock:
            report.outcomes[outcome] += 1
            if not abort:
                latencies.append(took)

    def restarter() -> None:
        restart_now.wait()
        if stop.is_set():
            return
        t0 = time.monotonic()
        stack.prefill.kill()
        report.p_restart["killed_at_request"] = restart_due
        stack.prefill.log_path = stack.run_dir / "prefill-restarted.log"
        stack.prefill.start()
        stack.prefill.wait_healthy(300)
        report.p_restart["back_after_s"] = round(time.monotonic() - t0, 1)
        print(f"P restarted in {report.p_restart['back_after_s']} s", flush=True)

    stop = threading.Event()
    t_start = time.monotonic()
    clients = [
        httpx.Client(base_url=stack.url, timeout=args.request_timeout, trust_env=False)
        for _ in range(args.concurrency)
    ]
    local = threading.local()
    pool_ids = iter(range(args.concurrency))
    id_lock = threading.Lock()

    def client() -> httpx.Client:
        if not hasattr(local, "c"):
            with id_lock:
                local.c = clients[next(pool_ids)]
        c: httpx.Client = local.c
        return c

    watcher = threading.Thread(target=restarter, daemon=True)
    watcher.start()
    try:
        with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
            for f in [pool.submit(lambda i=i: one(i, client())) for i in range(args.requests)]:
                f.result()
        watcher.join(timeout=330)
    finally:
        stop.set()
        restart_now.set()
        for c in clients:
            c.close()
    report.seconds = round(time.monotonic() - t_start, 1)
    latencies.sort()
    if latencies:
        report.latency_p50_s = round(latencies[len(latencies) // 2], 3)
        report.latency_p99_s = round(latencies[int(len(latencies) * 0.99)], 3)
        report.latency_max_s = round(latencies[-1], 3)
    idle(stack, report)


def idle(stack: PdStack, report: Report, timeout_s: float = 120.0) -> None:
    t0 = time.monotonic()
    with (
        httpx.Client(base_url=stack.prefill.url, timeout=10, trust_env=False) as p,
        httpx.Client(base_url=stack.decode.url, timeout=10, trust_env=False) as d,
    ):
        while True:
            usage = {"prefill": kv_usage(p), "decode": kv_usage(d)}
            if all(u == 0.0 for u in usage.values()):
                report.idle_after_s = round(time.monotonic() - t0, 1)
                break
            if time.monotonic() - t0 > timeout_s:
                break
            time.sleep(0.5)
    report.kv_usage_after = usage


def check(report: Report) -> None:
    o = report.outcomes
    if o["hung"]:
        report.problems.append(f"{o['hung']} requests hung")
    if o["mismatch"]:
        report.problems.append(f"{o['mismatch']} answers differ from the single instance")
    if o["unclear_error"] or o["transport_error"]:
        report.problems.append("failed requests without a clear error")
    if report.idle_after_s is None:
        report.problems.append(f"KV cache not idle afterwards: {report.kv_usage_after}")
    if sum(o.values()) != report.requests:
        report.problems.append("requests unaccounted for")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--abort-rate", type=float, default=0.1)
    ap.add_argument("--restart-at", type=float, default=0.5, help="share sent before P's crash")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--request-timeout", type=float, default=120.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--run-dir", default=f"runs/soak-{time.strftime('%Y%m%d-%H%M%S')}")
    args = ap.parse_args(argv)
    report = run(args)
    check(report)
    out = {k: dict(v) if isinstance(v, Counter) else v for k, v in vars(report).items()}
    Path(args.run_dir, "soak.json").write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))
    print("PASS" if not report.problems else "FAIL: " + "; ".join(report.problems))
    return 0 if not report.problems else 1


if __name__ == "__main__":
    sys.exit(main())

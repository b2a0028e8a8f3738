"""pushkv inside a CUDA vLLM: one P and one D (``vllm serve``, both on one GPU, each with its
share of memory) and the router; greedy output through P/D against D alone, what vLLM handed
the connector, the path each transfer took, and one trace per request.

    python -m bench.gpu_serve_check --model /tmp/models/llama8b --out $OUT/check

Checks, per prompt length (random token ids; by default one past a multiple of 64, so
that D's cached answer below computes exactly the last prompt token, as D does after a push,
whatever vLLM's block size: 16, or 64 for FlashMLA):
- tokens through the router against D alone's, asked twice with one fresh cache_salt: the
  second answer reads the prompt's KV from D's own prefix cache and computes only the tail,
  the same path as D reading P's pushed KV, so it is the reference. The tail's length
  matters for MLA: one token runs vLLM's decode kernel (absorbed query), more its prefill
  kernel, and on a random-weight DeepSeek-V3 rank the two part at the first token
  (bench/results/gpu-20261207c-h100/README.md). P/D agrees if it passes the end-to-end
  tests' rule (tests/e2e/greedy.py: tokens equal but past a near-tie, logprobs
  within LOGPROB_TOL) or stays within D's own two-path floor: D's first (cold, whole prompt
  in one prefill) answer against its second. On random bf16 weights on an H100 those two
  parted at token 9 of 16 and differed by 0.40 in logprob at 16k tokens
  (bench/results/gpu-20261205-h100/check.txt), above the CPU tests' tolerance; wrong KV
  parts at the first tokens, far below any floor that keeps nine;
- D took every prompt token from P (``vllm:prompt_tokens_by_source_total``: external only);
- D's KV equals what P pushed (``kv_checksum_every`` 1 by default: P's device-side digest
  with each completion, D's check of its blocks; every await_kv span says ``ok``);
- every request is one trace holding the router's, P's and D's spans;
and records the KV layout and attention backend (from the servers' logs) and each WRITE's
path, descriptors, bytes and time (from P's spans). Exit 1 if a check fails.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from connector.tools.pdstack import PdStack, metric_sum
from telemetry.schema import Attr, Event, Span
from telemetry.traces import RunTraces, read_run
from tests.e2e.greedy import LOGPROB_TOL, assert_greedy_agrees, choice, greedy_body

VOCAB = (3, 4096)  # the local tokenizer's ids; 0-2 are <s>, </s>, <pad>
SOURCE_METRIC = "vllm:prompt_tokens_by_source_total"
LOG_PATTERNS = (  # what vLLM and pushkv say at start-up about the KV
    r"pushkv worker .*",
    r"Using .*[Bb]ackend.*",
    r"Allocating a cross layer KV cache.*",
    r"KV cache layout.*",
    r"[Ss]etting KV cache layout.*",
    r"Connectors do not specify a kv cache layout.*",
    r"GPU KV cache size.*",
    r"pushkv: vLLM .*",
    r"IPC offer .*",
)


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(*VOCAB) for _ in range(n)]


def greedy(tokens: list[int], max_tokens: int, **extra: Any) -> dict[str, Any]:
    return greedy_body(tokens, model="model", max_tokens=max_tokens, **extra)


def complete(client: httpx.Client, body: dict[str, Any]) -> dict[str, Any]:
    r = client.post("/v1/completions", json=body)
    if r.status_code != 200:
        raise RuntimeError(f"{client.base_url}: {r.status_code} {r.text[:500]}")
    out: dict[str, Any] = r.json()
    return out


def sources(client: httpx.Client) -> dict[str, float]:
    text = client.get("/metrics").text
    return {
        s: metric_sum(text, SOURCE_METRIC, source=s) or 0.0
        for s in ("external_kv_transfer", "local_compute", "local_cache_hit")
    }


def log_facts(log: Path) -> list[str]:
    text = log.read_text(errors="replace") if log.exists() else ""
    seen: list[str] = []
    for pat in LOG_PATTERNS:
        for m in re.finditer(pat, text):
            line = m.group(0).strip()
            if line not in seen:
                seen.append(line)
    return seen


def compare(got: dict[str, Any], ref: dict[str, Any], what: str) -> tuple[bool, int, str]:
    """Whether ``got`` agrees with D alone's ``ref``, how many tokens agree, and why not."""
    _, tokens, lps = choice(got)
    try:
        return True, assert_greedy_agrees(tokens, lps, ref, what), ""
    except AssertionError as exc:
        return False, 0, str(exc)


def deviation(got: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    """Where ``got``'s tokens first part from ``ref``'s and the largest logprob difference
    before that: how far apart two answers are, to report next to the gate."""
    _, tokens, lps = choice(got)
    _, ref_tokens, ref_lps = choice(ref)
    pairs = enumerate(zip(tokens, ref_tokens, strict=True))
    k = next((i for i, (a, b) in pairs if a != b), len(tokens))
    worst = max((abs(a - b) for a, b in zip(lps[:k], ref_lps[:k], strict=True)), default=0.0)
    return {"same_tokens": k, "max_logprob_diff": round(worst, 4)}


def within_floor(pd: dict[str, Any], floor: dict[str, Any], tol: float) -> bool:
    """P/D's ``deviation`` from the reference is no larger than D's own two paths': its
    tokens agree at least as far as D's cold and cached answers agree with each other (at
    least one token), and its logprobs before its parting are within ``tol``."""
    return (
        floor["same_tokens"] > 0
        and pd["same_tokens"] >= floor["same_tokens"]
        and pd["max_logprob_diff"] <= tol
    )


def write_rows(run: RunTraces) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Each WRITE span of P (path, descriptors, bytes, ms) and how the traces look."""
    rows: list[dict[str, Any]] = []
    shape = {"traces": 0, "requests": 0, "complete": 0}
    for t in run.traces:
        shape["traces"] += 1
        if not t.named(Span.REQUEST.value):
            continue
        shape["requests"] += 1
        roles = {sp.attr(Attr.ROLE.value) for sp in t.spans}
        if {"router", "prefill", "decode"} <= roles:
            shape["complete"] += 1
        tokens = next(
            (
                sp.attr(Attr.PROMPT_TOKENS.value)
                for sp in t.spans
                if sp.attr(Attr.PROMPT_TOKENS.value)
            ),
            None,
        )
        for w in t.named(Span.WRITE.value):
            a = w.attributes
            rows.append(
                {
                    "tokens": tokens,
                    "path": a.get(Attr.XFER_PATH.value),
                    "reason": a.get(Attr.XFER_REASON.value),
                    "descriptors": a.get(Attr.DESCRIPTORS.value),
                    "bytes": a.get(Attr.BYTES.value),
                    "write_ms": (w.end_ns - w.start_ns) / 1e6,
                    "copy_ms": a.get(Attr.XFER_COPY_MS.value),
                    "gbps": a.get(Attr.GBPS.value),
                }
            )
    return rows, shape


def run(args: argparse.Namespace) -> int:
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    longest = max(args.lengths)
    gpu = not args.cpu
    server_args = [
        "--served-model-name",
        "model",
        "--max-model-len",
        str(longest + args.max_tokens + 16),
        *(["--gpu-memory-utilization", str(args.gpu_share)] if gpu else []),
        *args.server_args.split(),
    ]
    extra = {
        "xfer_paths": args.xfer_paths,
        "kv_checksum_every": args.kv_checksum_every,
        **json.loads(args.push_config),
    }
    stack = PdStack(
        args.model,
        out,
        server_args=server_args,
        pin_servers=not gpu,
        prefill_gpus=args.gpu if gpu else None,
        decode_gpus=args.gpu if gpu else None,
        kv_buffer_device="cuda" if gpu else "cpu",
        decode_extra_config=extra,
        prefill_extra_config=extra,
    )
    for srv in (stack.prefill, stack.decode):
        srv.kv_cache_memory_bytes = args.kv_cache_bytes
    report: dict[str, Any] = {"model": str(args.model), "lengths": args.lengths, "checks": []}
    ok = True
    t0 = time.monotonic()
    try:
        report["start_s"] = stack.start(timeout_s=args.start_timeout)
        print(f"stack up in {report['start_s']:.0f} s", flush=True)
        timeout = httpx.Timeout(300.0)
        with (
            httpx.Client(base_url=stack.url, timeout=timeout) as router,
            httpx.Client(base_url=stack.decode.url, timeout=timeout) as d,
        ):
            complete(router, greedy(prompt(32, 1), 4))  # warm-up: first request's one-offs
            complete(d, greedy(prompt(32, 2), 4, cache_salt=uuid.uuid4().hex))
            before = sources(d)
            results = {}
            for n in args.lengths:
                t = time.monotonic()
                results[n] = complete(router, greedy(prompt(n, 1000 + n), args.max_tokens))
                print(f"{n:6} tokens via P/D: {(time.monotonic() - t) * 1e3:7.1f} ms", flush=True)
            want = before["external_kv_transfer"] + sum(args.lengths)
            deadline = time.monotonic() + 10.0
            after = sources(d)
            while after["external_kv_transfer"] < want and time.monotonic() < deadline:
                time.sleep(0.2)
                after = sources(d)
            delta = {k: after[k] - before[k] for k in after}
            took_all = (
                delta["external_kv_transfer"] == sum(args.lengths) and delta["local_compute"] == 0
            )
            report["d_prompt_tokens_by_source"] = delta
            ok &= took_all
            print(f"D's prompt tokens by source: {delta} ({'ok' if took_all else 'FAIL'})")
            answers = {}
            for n in args.lengths:
                body = greedy(prompt(n, 1000 + n), args.max_tokens, cache_salt=uuid.uuid4().hex)
                answers[n] = (complete(d, body), complete(d, body))  # cold, then cached
            floors = {n: deviation(ref, cold) for n, (cold, ref) in answers.items()}
            # The run's largest two-path logprob difference, never below the CPU tests'.
            tol = max([LOGPROB_TOL, *(f["max_logprob_diff"] for f in floors.values())])
            report["floor_logprob_tol"] = tol
            for n, (cold, ref) in answers.items():
                by_rule, agree, why = compare(results[n], ref, f"{n}-token prompt")
                vs_ref = deviation(results[n], ref)
                by_floor = within_floor(vs_ref, floors[n], tol)
                good = by_rule or by_floor
                ok &= good
                rule = "e2e rule" if by_rule else "within D's floor" if by_floor else "neither"
                report["checks"].append(
                    {
                        "tokens": n,
                        "agrees": good,
                        "rule": rule,
                        "tokens_agreeing": agree,
                        "why": why,
                        "pd_vs_cached": vs_ref,
                        "cached_vs_cold": floors[n],
                        "pd_vs_cold": deviation(results[n], cold),
                    }
                )
                print(
                    f"{n:6} tokens: {'agrees' if good else 'DIFFERENT'} ({rule}): P/D vs D "
                    f"cached {vs_ref}; D cached vs cold {floors[n]} (tolerance {tol})"
                    + ("" if good else f"\n        {why}")
                )
    finally:
        stack.stop()
    report["seconds"] = time.monotonic() - t0
    report["prefill_log"] = log_facts(stack.prefill.log)
    report["decode_log"] = log_facts(stack.decode.log)
    run = read_run(out)  # once: the WRITE rows, the handovers and the KV checks
    rows, shape = write_rows(run)
    report["writes"], report["traces"] = rows, shape
    one_trace = shape["requests"] == shape["complete"] == len(args.lengths) + 1
    ok &= one_trace
    print(f"traces: {shape} ({'ok' if one_trace else 'FAIL'}: one per request through P/D)")
    report["handovers"] = hand = handovers(run)
    for key in ("counted_to_seen", "seen_to_scheduled", "scheduled_to_out"):
        ms = sorted(round(h[key], 1) for h in hand)
        print(f"D's handover, {key.replace('_', ' ')} ms: {ms}")
    checks = kv_checks(run)
    report["kv_checks"] = checks
    if args.kv_checksum_every == 1:  # every transfer through P/D checked, every one equal
        kv_ok = checks == {"ok": len(args.lengths) + 1}
        ok &= kv_ok
        print(f"D's KV checks: {checks} ({'ok' if kv_ok else 'FAIL'}: D's blocks equal P's)")
    for side in ("prefill_log", "decode_log"):
        print(f"{side}:")
        for line in report[side]:
            print(f"  {line[:220]}")
    print("| tokens | path | reason | descriptors | MiB | WRITE ms | copy ms | GB/s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        mib = (r["bytes"] or 0) / 2**20
        print(
            f"| {r['tokens']} | {r['path']} | {r['reason']} | {r['descriptors']} | {mib:.0f} "
            f"| {r['write_ms']:.2f} | {r['copy_ms']} | {r['gbps']} |"
        )
    report["ok"] = ok
    (out / "check.json").write_text(json.dumps(report, indent=1, default=str))
    print("CHECK", "PASSED" if ok else "FAILED")
    return 0 if ok else 1


def handovers(run: RunTraces) -> list[dict[str, float]]:
    """Per request through P/D, D's side of the handover from its traces, in ms: its
    transfer thread counted the KV (await_kv's end) -> its scheduler saw it (first_token's
    start) -> the request scheduled -> its first token out: where a push's TTFT beyond P's
    prefill goes on D."""
    rows = []
    for t in run.traces:
        ft, aw = t.first(Span.FIRST_TOKEN.value), t.first(Span.AWAIT_KV.value)
        ev = ft.event(Event.SCHEDULED.value) if ft is not None else None
        if ft is None or aw is None or ev is None:
            continue
        rows.append(
            {
                "counted_to_seen": (ft.start_ns - aw.end_ns) / 1e6,
                "seen_to_scheduled": (ev.time_ns - ft.start_ns) / 1e6,
                "scheduled_to_out": (ft.end_ns - ev.time_ns) / 1e6,
            }
        )
    return rows


def kv_checks(run: RunTraces) -> dict[str, int]:
    """D's verdicts on the digests P sent (await_kv spans' ``kv_check``), by verdict;
    ``unchecked`` for a transfer D did not check."""
    verdicts: dict[str, int] = {}
    for t in run.traces:
        for a in t.named(Span.AWAIT_KV.value):
            v = str(a.attr(Attr.KV_CHECK.value) or "unchecked")
            verdicts[v] = verdicts.get(v, 0) + 1
    return verdicts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_serve_check", description=__doc__)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--lengths", type=int, nargs="+", default=[17, 257, 1025, 4097, 16385])
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--gpu", default="0", help="CUDA_VISIBLE_DEVICES of both servers")
    p.add_argument(
        "--gpu-share", type=float, default=0.35, help="each server's --gpu-memory-utilization"
    )
    p.add_argument("--kv-cache-bytes", type=int, default=8 << 30)
    p.add_argument("--xfer-paths", default="auto", choices=("auto", "direct", "ipc"))
    p.add_argument(
        "--kv-checksum-every",
        type=int,
        default=1,
        help="pushkv's kv_checksum_every on both sides (1: every transfer checked; 0: off)",
    )
    p.add_argument("--server-args", default="", help="more vLLM flags for both servers")
    p.add_argument(
        "--push-config",
        default="{}",
        help="more of pushkv's settings for both sides, as JSON: '{\"idle_step_wait_s\": 0}'",
    )
    p.add_argument("--start-timeout", type=float, default=400.0)
    p.add_argument(
        "--cpu", action="store_true", help="a dry run of this script on vLLM's CPU build"
    )
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

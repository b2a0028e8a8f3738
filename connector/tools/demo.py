"""``pushkv demo`` (``make demo``): real vLLM P and D on the tiny model, through the router.

Owns: the demo's workload (streamed completions of random token prompts, a few at a time),
its per-request measurements (TTFT = time to the first streamed token; TPOT = time between
the first and the last token over the tokens in between) and its report. The stack is a
``PdStack`` on the locally built tiny model (no download), or with ``hosts=True`` (``pushkv
demo --hosts``) a ``HostStack``: 2 P and 2 D on simulated hosts; ``keep=True`` leaves a
``PdStack`` running and says how to stop it. ``pushkv demo --transport``
(transport_demo.py) is the NIXL-only demo.

Must not import vLLM, NIXL or torch (they live in the servers); needs httpx and rich.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx

from connector.tools.pdstack import CONNECTORS, PdStack, RouterProcess, metric_sum
from connector.tools.stack import VllmServer
from connector.tools.tinymodel import ARCH, make_tiny_model
from connector.tools.tinytokenizer import VOCAB_SIZE

SOURCE_METRIC = "vllm:prompt_tokens_by_source_total"
# NIXL byte counters of vLLM's connectors (on the WRITE's or READ's owner); pushkv has none yet.
BYTES_METRICS = ("vllm:nixl_bytes_transferred_sum",)
FIRST_VOCAB_ID = 3  # 0-2 are <s>, </s>, <pad>
REQUEST_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Sample:
    """One streamed request as the client saw it."""

    ok: bool
    ttft_s: float = math.nan
    tpot_s: float = math.nan
    tokens: int = 0
    error: str = ""


@dataclass(frozen=True)
class Workload:
    requests: int = 24
    concurrency: int = 4
    input_len: int = 256
    output_len: int = 32
    seed: int = 0

    def prompts(self) -> list[list[int]]:
        rng = random.Random(self.seed)
        return [
            [rng.randrange(FIRST_VOCAB_ID, VOCAB_SIZE) for _ in range(self.input_len)]
            for _ in range(self.requests)
        ]


class DemoStack(Protocol):
    """What the demo drives: a ``PdStack`` or a ``hoststack.HostStack``."""

    connector_name: str
    router: RouterProcess
    start_duration_s: float | None

    @property
    def url(self) -> str: ...
    @property
    def prefills(self) -> tuple[VllmServer, ...]: ...
    @property
    def decodes(self) -> tuple[VllmServer, ...]: ...
    def start(self, timeout_s: float = ...) -> float: ...
    def stop(self, timeout_s: float = ...) -> None: ...
    def describe(self) -> str: ...


async def _one(client: httpx.AsyncClient, prompt: list[int], output_len: int) -> Sample:
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    stamps: list[float] = []
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread())[:200]
                return Sample(False, error=f"HTTP {resp.status_code}: {text!r}")
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: ") :])
                if "error" in chunk:
                    return Sample(False, error=str(chunk["error"])[:200])
                if chunk.get("choices"):  # vLLM streams one chunk per generated token
                    stamps.append(time.perf_counter())
    except httpx.HTTPError as exc:
        return Sample(False, error=repr(exc))
    if not stamps:
        return Sample(False, error="no token streamed")
    n = len(stamps)
    tpot = (stamps[-1] - stamps[0]) / (n - 1) if n > 1 else math.nan
    return Sample(True, stamps[0] - t0, tpot, n)


async def _run(url: str, workload: Workload) -> tuple[list[Sample], float]:
    limits = httpx.Limits(max_connections=workload.concurrency * 2)
    async with httpx.AsyncClient(
        base_url=url, timeout=REQUEST_TIMEOUT_S, limits=limits, trust_env=False
    ) as client:
        gate = asyncio.Semaphore(workload.concurrency)

        async def gated(prompt: list[int]) -> Sample:
            async with gate:
                return await _one(client, prompt, workload.output_len)

        t0 = time.perf_counter()
        samples = await asyncio.gather(*(gated(p) for p in workload.prompts()))
        return list(samples), time.perf_counter() - t0


def _warm_up(stack: DemoStack) -> None:
    """The first request with logprobs on a fresh server takes seconds; pay it here."""
    body = {
        "model": "tiny",
        "prompt": "warm up",
        "max_tokens": 4,
        "logprobs": 1,
        "temperature": 0,
        "ignore_eos": True,
    }
    with httpx.Client(timeout=REQUEST_TIMEOUT_S, trust_env=False) as c:
        salted = {"cache_salt": uuid.uuid4().hex}  # D computes locally, as a single instance
        legs: tuple[tuple[str, dict[str, Any]], ...] = (
            *((p.url, {}) for p in stack.prefills),
            *((d.url, salted) for d in stack.decodes),
            (stack.url, {}),
            (stack.url, {"stream": True}),
        )
        for url, extra in legs:
            r = c.post(f"{url}/v1/completions", json={**body, **extra})
            r.raise_for_status()


def _sum(values: list[float | None]) -> float | None:
    found = [v for v in values if v is not None]
    return sum(found) if found else None


def _metrics(stack: DemoStack) -> dict[str, float | None]:
    with httpx.Client(timeout=10, trust_env=False) as c:
        ps = [c.get(f"{s.url}/metrics").text for s in stack.prefills]
        ds = [c.get(f"{s.url}/metrics").text for s in stack.decodes]
    return {
        "external": _sum([metric_sum(d, SOURCE_METRIC, source="external_kv_transfer") for d in ds]),
        "local": _sum([metric_sum(d, SOURCE_METRIC, source="local_compute") for d in ds]),
        "bytes": _sum([metric_sum(t, name) for name in BYTES_METRICS for t in (*ps, *ds)]),
    }


def _delta(after: float | None, before: float | None) -> float | None:
    return None if after is None else after - (before or 0.0)


def _pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def kv_bytes_per_token() -> int:
    """K and V of every layer and KV head, bf16: what one prompt token's KV weighs."""
    return ARCH["num_hidden_layers"] * 2 * ARCH["num_key_value_heads"] * ARCH["head_dim"] * 2


def report(
    samples: list[Sample],
    wall_s: float,
    workload: Workload,
    delta: dict[str, float | None],
    stack: DemoStack,
) -> dict[str, Any]:
    ok = [s for s in samples if s.ok]
    ttft = [s.ttft_s for s in ok]
    tpot = [s.tpot_s for s in ok if not math.isnan(s.tpot_s)]
    ext = delta["external"]
    return {
        "connector": stack.connector_name,
        "mode": stack.router.mode,
        "start_s": stack.start_duration_s,
        "requests": len(samples),
        "ok": len(ok),
        "errors": [s.error for s in samples if not s.ok],
        "median_ttft_ms": statistics.median(ttft) * 1e3 if ttft else math.nan,
        "p90_ttft_ms": _pct(ttft, 90) * 1e3 if ttft else math.nan,
        "mean_tpot_ms": statistics.fmean(tpot) * 1e3 if tpot else math.nan,
        "req_per_s": len(ok) / wall_s,
        "out_tok_per_s": sum(s.tokens for s in ok) / wall_s,
        "wall_s": wall_s,
        "kv_tokens": ext,
        "local_tokens": delta["local"],
        "kv_bytes": (
            delta["bytes"]
            if delta["bytes"] is not None
            else (ext * kv_bytes_per_token() if ext is not None else None)
        ),
        "kv_bytes_from": "NIXL counters" if delta["bytes"] is not None else "D's tokens x KV/token",
        "workload": workload,
    }


def print_report(r: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    w: Workload = r["workload"]
    table = Table(
        title=f"pushkv demo: {r['connector']} (router mode {r['mode']}), "
        f"{w.requests} streamed requests, concurrency {w.concurrency}, "
        f"{w.input_len} in / {w.output_len} out"
    )
    table.add_column("metric")
    table.add_column("value", justify="right")
    kv = r["kv_bytes"]
    rows = [
        ("stack start (P, D, router healthy)", f"{r['start_s']:.1f} s"),
        ("requests ok / sent", f"{r['ok']} / {r['requests']}"),
        ("median TTFT", f"{r['median_ttft_ms']:.1f} ms"),
        ("p90 TTFT", f"{r['p90_ttft_ms']:.1f} ms"),
        ("mean TPOT", f"{r['mean_tpot_ms']:.2f} ms"),
        ("throughput", f"{r['req_per_s']:.2f} req/s, {r['out_tok_per_s']:.0f} output tok/s"),
        (
            "D prompt tokens: KV transfer / local compute",
            f"{r['kv_tokens']:.0f} / {r['local_tokens']:.0f}"
            if r["kv_tokens"] is not None
            else "n/a",
        ),
        (f"KV moved ({r['kv_bytes_from']})", f"{kv / 2**20:.2f} MiB" if kv is not None else "n/a"),
    ]
    for k, v in rows:
        table.add_row(k, v)
    Console().print(table)
    for err in r["errors"][:5]:
        Console().print(f"[red]error:[/red] {err}")


def run_demo(
    workload: Workload = Workload(),
    keep: bool = False,
    run_dir: Path | None = None,
    connector_name: str = "PushConnector",
    hosts: bool = False,
) -> dict[str, Any]:
    from rich.console import Console

    console = Console()
    if connector_name not in CONNECTORS:
        raise ValueError(f"unknown connector {connector_name!r}; known: {sorted(CONNECTORS)}")
    if hosts and (keep or connector_name != "PushConnector"):
        # The hosts (network namespaces) go with this process; they are pushkv's set-up.
        raise ValueError("--hosts runs PushConnector only, and cannot --keep the stack")
    run_dir = run_dir or _new_run_dir()
    model = make_tiny_model()
    stack: DemoStack
    if hosts:
        from connector.tools.hoststack import HostStack

        stack = HostStack(model, run_dir)
    else:
        stack = PdStack(model, run_dir, connector_name=connector_name)
    what = "2 P and 2 D on hosts of their own" if hosts else f"P, D ({connector_name})"
    kept = False
    try:
        with console.status(f"starting {what} and the router; logs in {run_dir}"):
            stack.start()
        console.print(f"stack healthy in {stack.start_duration_s:.1f} s")
        with console.status("warming up"):
            _warm_up(stack)
        before = _metrics(stack)
        with console.status(f"{workload.requests} requests, {workload.concurrency} at a time"):
            samples, wall_s = asyncio.run(_run(stack.url, workload))
        after = _metrics(stack)
        delta = {k: _delta(after[k], before[k]) for k in after}
        result = report(samples, wall_s, workload, delta, stack)
        print_report(result)
        if keep:
            pids = " ".join(f"-{s.pid}" for s in (stack.router, *stack.prefills, *stack.decodes))
            console.print(
                f"\nThe stack keeps running (send requests to {stack.url}):\n"
                f"{stack.describe()}\n"
                f"Stop it (each PID leads its process group): kill -TERM -- {pids}"
            )
            kept = True
        return result
    finally:
        if not kept:  # also on errors and Ctrl-C, even with keep
            with console.status("stopping the stack"):
                stack.stop()
        if any(run_dir.glob("traces-*.jsonl")):
            console.print(
                f"\nEvery request's trace is in {run_dir}. Where its TTFT went:\n"
                f"  pushkv dashboard {run_dir}\n"
                f"  (or: streamlit run dashboard/app.py -- --run-dir {run_dir})"
            )


def _new_run_dir() -> Path:
    """runs/demo-<time>/ under the current folder, and runs/latest pointing at it."""
    import time

    runs = Path("runs")
    run_dir = runs / time.strftime("demo-%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    latest = runs / "latest"
    try:
        if latest.is_symlink():
            latest.unlink()
        if not latest.exists():
            latest.symlink_to(run_dir.name)
    except OSError:
        pass  # a folder named latest, or no symlinks here: the printed path still works
    return run_dir


if __name__ == "__main__":
    run_demo()

"""What an idle pushkv pair costs in CPU, against an idle plain vLLM pair in the same run.

Run: python -m bench.idle_cost [--seconds 20] [--rounds 3] [--settle 15] [--out FILE.jsonl]

Starts, side by side, a plain pair (two vLLM servers of the tiny model, no KV connector,
pinned like P and D: CPU 0 and CPU 1) and a pushkv pair (``pushkv bench``'s ``push``
stack: P and D with the PushConnector, tracing on, and the router). Each server gets one
warm-up request (the pushkv pair two through the router, so P has dialed D, the tracer
exists and every lazy set-up has happened), then all settle for ``--settle`` seconds.
Then it measures every group over the same windows (concurrently, ``--rounds`` windows of
``--seconds``): the CPU time of every thread of every process of each server's process
group, from ``/proc/<pid>/task/<tid>/schedstat`` (nanoseconds, so a 20 s window resolves
far below 0.01 % of a core; ``/proc/<pid>/stat``'s ticks, which also count threads that
ended in the window, are printed as a check). The plain servers get the router's
``/health`` checks too (``--health-plain``, every 2 s like ``pushkv router``), so the
difference is the connector's and not the health checks'; the router's own CPU is
printed apart.

Prints each group's share of one core (median and min-max over the rounds), the
difference pushkv - plain (the connector's idle share per pair), each process's share
(API server, EngineCore, ...) for both pairs, and every thread of the pushkv pair with its
share and wake-ups per second (``schedstat``'s timeslices: a thread that polls every
100 ms shows ~10/s). ``--out`` appends the whole result as one JSON line.

Linux only. The machine should be otherwise quiet (run it under the heavy-work lock).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.proc_cpu import Spread, Window, group_pct, pct, snapshot, window

PLAIN, PUSHKV, ROUTER = "plain", "pushkv", "router"
REQUEST_TIMEOUT_S = 120.0

# ---------------------------------------------------------------- the stacks


def _post(url: str, body: Mapping[str, Any]) -> None:
    import httpx

    with httpx.Client(timeout=REQUEST_TIMEOUT_S, trust_env=False) as c:
        c.post(f"{url}/v1/completions", json=dict(body)).raise_for_status()


WARMUP = {"model": "tiny", "prompt": "warm up the idle bench", "max_tokens": 4, "temperature": 0}


class HealthChecks:
    """``GET /health`` on each URL every ``interval_s`` from a thread, as the router does to
    P and D (``connector/router/backends.py``), so the plain pair gets the same checks."""

    def __init__(self, urls: Sequence[str], interval_s: float) -> None:
        self._urls, self._interval_s = list(urls), interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="health-checks")

    def start(self) -> None:
        if self._interval_s > 0 and self._urls:
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10.0)

    def _run(self) -> None:
        import httpx

        with httpx.Client(timeout=5.0, trust_env=False) as c:
            while not self._stop.wait(self._interval_s):  # the schedule, not a sync
                for url in self._urls:
                    try:
                        c.get(f"{url}/health")
                    except httpx.HTTPError:
                        pass  # a missed check changes nothing here


def _git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        )
        dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True)
        return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "?"


def measure(
    leaders: Mapping[str, int], rounds: int, seconds: float, log: Any = print
) -> list[Window]:
    windows = []
    for i in range(rounds):
        a = snapshot(leaders)
        time.sleep(seconds)  # the measurement window itself
        b = snapshot(leaders)
        windows.append(window(a, b))
        log(f"  round {i + 1}/{rounds}: {windows[-1].seconds:.1f} s")
    return windows


def run(args: argparse.Namespace) -> dict[str, Any]:
    from connector.tools.bench.single import SingleStack
    from connector.tools.bench.stacks import CONFIGS, make_stack
    from connector.tools.tinymodel import make_tiny_model

    model = make_tiny_model(name=args.model)
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="pushkv-idle-"))
    plain_p = SingleStack(model, run_dir / "plain-p", cpus="0")
    plain_d = SingleStack(model, run_dir / "plain-d", cpus="1")
    push = make_stack(CONFIGS["push"], model, run_dir / "push")
    print(f"run folder {run_dir}; model {model}")
    stacks: list[Any] = [plain_p, plain_d, push]
    started: list[Any] = []
    health = HealthChecks([plain_p.url, plain_d.url], args.health_plain)
    try:
        t0 = time.monotonic()
        # All five processes start together; their start-ups overlap.
        for s in stacks:
            started.append(s)
            if isinstance(s, SingleStack):
                s.server.start()
            else:
                s.start()
        for s in (plain_p, plain_d):
            s.server.wait_healthy(300.0)
        print(f"all healthy after {time.monotonic() - t0:.0f} s; warming up")
        _post(plain_p.url, WARMUP)
        _post(plain_d.url, WARMUP)
        _post(push.url, WARMUP)
        _post(push.url, {**WARMUP, "prompt": "a second request through the router"})
        health.start()
        print(f"settling for {args.settle:.0f} s")
        time.sleep(args.settle)  # let start-up and warm-up work die down before measuring
        leaders = {
            "plain-P": plain_p.server.pid,
            "plain-D": plain_d.server.pid,
            "pushkv-P": push.prefill.pid,
            "pushkv-D": push.decode.pid,
            ROUTER: push.router.pid,
        }
        assert all(pid is not None for pid in leaders.values())
        print(f"measuring {args.rounds} x {args.seconds:.0f} s, all groups at once")
        windows = measure({k: int(v) for k, v in leaders.items() if v}, args.rounds, args.seconds)
    finally:
        health.stop()
        for s in reversed(started):
            try:
                s.stop() if not isinstance(s, SingleStack) else s.server.stop()
            except Exception as exc:  # keep stopping the rest
                print(f"stopping {s}: {exc}", file=sys.stderr)
    return summarize(windows, args)


GROUPS = {PLAIN: ("plain-P", "plain-D"), PUSHKV: ("pushkv-P", "pushkv-D"), ROUTER: (ROUTER,)}


def summarize(windows: list[Window], args: argparse.Namespace) -> dict[str, Any]:
    groups = {g: [group_pct(w, s) for w in windows] for g, s in GROUPS.items()}
    ticks = {g: [group_pct(w, s, ticks=True) for w in windows] for g, s in GROUPS.items()}
    diff = [p - q for p, q in zip(groups[PUSHKV], groups[PLAIN], strict=True)]
    servers = sorted({s for w in windows for s in w.cpu_s})
    per_server = {s: [pct(w.cpu_s[s], w.seconds) for w in windows] for s in servers}
    per_proc: dict[str, dict[str, list[float]]] = {}
    for w in windows:
        for s, procs in w.processes.items():
            for label, cpu in procs.items():
                per_proc.setdefault(s, {}).setdefault(label, []).append(pct(cpu, w.seconds))
    per_thread: dict[tuple[str, str, str], list[tuple[float, float, int]]] = {}
    for w in windows:
        for t in w.threads:
            per_thread.setdefault((t.server, t.process, t.thread), []).append(
                (pct(t.cpu_s, w.seconds), t.slices / w.seconds, t.count)
            )
    return {
        "bench": "idle_cost",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "commit": _git_commit(),
        "command": "python -m bench.idle_cost " + " ".join(sys.argv[1:]),
        "seconds": args.seconds,
        "rounds": args.rounds,
        "settle_s": args.settle,
        "health_plain_s": args.health_plain,
        "pct_of_core": {g: v for g, v in groups.items()},
        "pct_of_core_ticks": ticks,
        "connector_share_pct": diff,
        "servers": per_server,
        "processes": per_proc,
        "threads": [
            {
                "server": k[0],
                "process": k[1],
                "thread": k[2],
                "pct": [v[0] for v in vals],
                "wakeups_per_s": [v[1] for v in vals],
                "count": vals[-1][2],
            }
            for k, vals in sorted(per_thread.items())
        ],
        "threads_born": {s: [w.born.get(s, 0) for w in windows] for s in servers},
        "threads_ended": {s: [w.ended.get(s, 0) for w in windows] for s in servers},
    }


def print_report(r: Mapping[str, Any], min_pct: float) -> None:
    print(f"\nidle CPU, % of one core over {r['rounds']} x {r['seconds']:.0f} s (median, min-max)")
    print(f"commit {r['commit']} on {r['host']} ({r['cpus']} CPUs)")
    for g in (PLAIN, PUSHKV, ROUTER):
        t = Spread.of(r["pct_of_core_ticks"][g])
        print(f"  {g:8s} {Spread.of(r['pct_of_core'][g])}   [stat ticks: {t}]")
    print(
        f"  connector's idle share per pair (pushkv - plain): {Spread.of(r['connector_share_pct'])}"
    )
    print("\nper server and process")
    for s, vals in r["servers"].items():
        print(f"  {s:9s} {'(all)':18s} {Spread.of(vals)}")
        for label, pv in sorted(
            r["processes"][s].items(), key=lambda kv: -statistics.median(kv[1])
        ):
            print(f"  {'':9s} {label:18s} {Spread.of(pv)}")
    print(f"\nthreads at >= {min_pct} % of a core or >= 1 wake-up/s (name: /proc comm)")
    for t in r["threads"]:
        share, wakes = statistics.median(t["pct"]), statistics.median(t["wakeups_per_s"])
        if share >= min_pct or wakes >= 1.0:
            n = f" x{t['count']}" if t["count"] > 1 else ""
            print(
                f"  {t['server']:9s} {t['process']:14s} {t['thread'] + n:22s} "
                f"{share:6.3f} %  {wakes:7.1f} wake-ups/s"
            )
    born, ended = r["threads_born"], r["threads_ended"]
    print(f"\nthreads born per round {born}; ended {ended}")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=20.0, help="length of one window")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--settle", type=float, default=15.0, help="seconds idle before measuring")
    ap.add_argument(
        "--health-plain",
        type=float,
        default=2.0,
        help="GET /health on the plain servers this often (the router's interval; 0: never)",
    )
    ap.add_argument("--model", default="tiny", help="connector.tools.tinymodel's model name")
    ap.add_argument("--run-dir", default=None, help="logs and traces (default: a temp folder)")
    ap.add_argument("--out", default=None, help="append the result as one JSON line here")
    ap.add_argument("--min-pct", type=float, default=0.02, help="threads listed from this share")
    args = ap.parse_args(argv)
    r = run(args)
    print_report(r, args.min_pct)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("a") as f:
            f.write(json.dumps(r) + "\n")
        print(f"\nappended to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

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
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

HZ = os.sysconf("SC_CLK_TCK")
PLAIN, PUSHKV, ROUTER = "plain", "pushkv", "router"
REQUEST_TIMEOUT_S = 120.0


# ---------------------------------------------------------------- /proc snapshots (pure-ish)


@dataclass
class ThreadSample:
    name: str  # /proc/<pid>/task/<tid>/comm (Linux keeps 15 bytes)
    run_ns: int  # schedstat: time on a CPU
    slices: int  # schedstat: timeslices run, about one per wake-up


@dataclass
class ProcSample:
    label: str  # what the process is: APIServer, EngineCore, ...
    ticks: int  # utime + stime of the whole process, ended threads included
    threads: dict[int, ThreadSample] = field(default_factory=dict)


@dataclass
class Snapshot:
    t: float
    # server name -> pid -> sample (a server: the process group its leader leads)
    servers: dict[str, dict[int, ProcSample]] = field(default_factory=dict)


def _read(path: str) -> str:
    with open(path, "rb") as f:
        return f.read().decode(errors="replace")


def process_label(cmdline: str, comm: str) -> str:
    """A short, stable name for a server's process (its pid changes with every run)."""
    if cmdline.startswith("VLLM::"):  # vLLM's proctitle: VLLM::EngineCore, VLLM::Worker_...
        return cmdline.split()[0].removeprefix("VLLM::")
    if "vllm.entrypoints" in cmdline or "vllm serve" in cmdline:
        return "APIServer"
    if "connector.cli router" in cmdline or "pushkv router" in cmdline:
        return "router"
    if "resource_tracker" in cmdline:
        return "resource_tracker"
    if "multiprocessing" in cmdline:
        return "mp-helper"
    return comm or "?"


def snapshot(leaders: Mapping[str, int]) -> Snapshot:
    """Every thread of every process in the process groups led by ``leaders`` (name -> pgid)."""
    by_pgid = {pgid: name for name, pgid in leaders.items()}
    snap = Snapshot(time.monotonic(), {name: {} for name in leaders})
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            fields = _read(f"/proc/{pid}/stat").rsplit(")", 1)[1].split()
            name = by_pgid.get(int(fields[2]))
            if name is None:
                continue
            cmd = _read(f"/proc/{pid}/cmdline").replace("\0", " ").strip()
            comm = _read(f"/proc/{pid}/comm").strip()
            proc = ProcSample(process_label(cmd, comm), int(fields[11]) + int(fields[12]))
            for tid in os.listdir(f"/proc/{pid}/task"):
                run_ns, _, slices = _read(f"/proc/{pid}/task/{tid}/schedstat").split()[:3]
                tname = _read(f"/proc/{pid}/task/{tid}/comm").strip()
                proc.threads[int(tid)] = ThreadSample(tname, int(run_ns), int(slices))
        except (OSError, ValueError, IndexError):  # the process ended while we looked
            continue
        snap.servers[name][pid] = proc
    return snap


@dataclass
class ThreadUse:
    server: str
    process: str
    thread: str
    cpu_s: float
    slices: int
    count: int = 1  # threads of that name in that process


@dataclass
class Window:
    """What each server used between two snapshots."""

    seconds: float
    cpu_s: dict[str, float]  # server -> CPU seconds (schedstat, live threads)
    ticks_s: dict[str, float]  # server -> CPU seconds (stat ticks, whole processes)
    processes: dict[str, dict[str, float]]  # server -> process label -> CPU seconds
    threads: list[ThreadUse]
    born: dict[str, int]  # server -> threads that appeared in the window
    ended: dict[str, int]  # server -> threads that ended in it


def window(a: Snapshot, b: Snapshot) -> Window:
    """CPU per server, process and thread between snapshots ``a`` and ``b``. A thread born
    in between counts from zero; one that ended is missing from the schedstat sums (the
    ticks sums keep it), and both are counted in ``born``/``ended``."""
    out = Window(b.t - a.t, {}, {}, {}, [], {}, {})
    for server, procs in b.servers.items():
        before = a.servers.get(server, {})
        total, ticks, born, ended = 0.0, 0.0, 0, 0
        per_proc: dict[str, float] = {}
        per_thread: dict[tuple[str, str], ThreadUse] = {}
        for pid, proc in procs.items():
            prev = before.get(pid)
            ticks += (proc.ticks - (prev.ticks if prev else 0)) / HZ
            for tid, t in proc.threads.items():
                p = prev.threads.get(tid) if prev else None
                if p is None:
                    born += 1
                cpu = (t.run_ns - (p.run_ns if p else 0)) / 1e9
                slices = t.slices - (p.slices if p else 0)
                total += cpu
                per_proc[proc.label] = per_proc.get(proc.label, 0.0) + cpu
                k = (proc.label, t.name)
                if k in per_thread:
                    per_thread[k].cpu_s += cpu
                    per_thread[k].slices += slices
                    per_thread[k].count += 1
                else:
                    per_thread[k] = ThreadUse(server, proc.label, t.name, cpu, slices)
            if prev is not None:
                ended += sum(1 for tid in prev.threads if tid not in proc.threads)
        ended += sum(len(p.threads) for pid, p in before.items() if pid not in procs)
        out.cpu_s[server], out.ticks_s[server] = total, ticks
        out.processes[server] = per_proc
        out.threads += per_thread.values()
        out.born[server], out.ended[server] = born, ended
    return out


def pct(cpu_s: float, seconds: float) -> float:
    """CPU seconds over a window as a share of one core, in %."""
    return 100.0 * cpu_s / seconds if seconds > 0 else 0.0


@dataclass
class Spread:
    median: float
    lo: float
    hi: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        return cls(statistics.median(values), min(values), max(values))

    def __str__(self) -> str:
        return f"{self.median:6.2f} % ({self.lo:.2f}-{self.hi:.2f})"


def group_pct(w: Window, servers: Iterable[str], ticks: bool = False) -> float:
    src = w.ticks_s if ticks else w.cpu_s
    return pct(sum(src.get(s, 0.0) for s in servers), w.seconds)


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

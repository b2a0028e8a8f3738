"""Where the CPU goes during a benchmark: per role (P, D, router, load generator) and thread.

Run: python -m bench.cpu_split [--min-share 0.4] --
         pushkv bench --configs push vllm-push-noprog --levels 16:480
Runs the command (its output passes through), samples every thread's CPU ticks from
``/proc`` once a second meanwhile, and then prints, for every ``vllm bench serve`` run of
it that lasted long enough (the warm-ups and each level, in the order they ran), each
role's and each busy thread's share of one core over that run. Roles come from the stack
lines the benchmark prints (``prefill http://... pid N``): a process belongs to the role of
the nearest ancestor named there; ``vllm bench serve`` processes are the load generator.

Linux only; CPU ticks are 1/100 s (``SC_CLK_TCK``). Owns nothing the connector imports.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

HZ = os.sysconf("SC_CLK_TCK")
_STACK_LINE = re.compile(r"^(router|prefill|decode)\s+http\S+\s+pid (\d+)")
_ROLES = {"router": "router", "prefill": "P", "decode": "D"}
_CLIENT = "bench serve"


@dataclass
class Proc:
    ppid: int
    cmd: str
    threads: dict[int, tuple[str, int]]  # tid -> (name, ticks)


@dataclass
class Snap:
    t: float
    procs: dict[int, Proc] = field(default_factory=dict)


def _read(path: str) -> str:
    with open(path, "rb") as f:
        return f.read().decode(errors="replace")


def snapshot() -> Snap:
    snap = Snap(time.monotonic())
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            cmd = _read(f"/proc/{pid}/cmdline").replace("\0", " ")
            stat = _read(f"/proc/{pid}/stat")
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            threads = {}
            for tid in os.listdir(f"/proc/{pid}/task"):
                s = _read(f"/proc/{pid}/task/{tid}/stat")
                fields = s.rsplit(")", 1)[1].split()
                threads[int(tid)] = (
                    s[s.index("(") + 1 : s.rindex(")")],
                    int(fields[11]) + int(fields[12]),
                )  # utime + stime
        except (OSError, ValueError, IndexError):  # the process ended meanwhile
            continue
        snap.procs[pid] = Proc(ppid, cmd, threads)
    return snap


def role_of(snap: Snap, pid: int, roles: dict[int, str]) -> str | None:
    for _ in range(16):  # walk up to the nearest process with a known role
        if pid in roles:
            return roles[pid]
        proc = snap.procs.get(pid)
        if proc is None:
            return None
        if _CLIENT in proc.cmd:
            return "client"
        pid = proc.ppid
    return None


def split(a: Snap, b: Snap, roles: dict[int, str]) -> Counter[tuple[str, str]]:
    """CPU ticks per (role, thread name) between two snapshots."""
    out: Counter[tuple[str, str]] = Counter()
    for pid, proc in b.procs.items():
        role = role_of(b, pid, roles)
        if role is None:
            continue
        before = a.procs.get(pid)
        for tid, (name, ticks) in proc.threads.items():
            prev = before.threads.get(tid, (name, 0))[1] if before is not None else 0
            if ticks > prev:
                out[(role, name)] += ticks - prev
    return out


def client_runs(snaps: list[Snap], min_s: float) -> list[tuple[int, int, int]]:
    """(first, last snapshot index, pid) of every load-generator process seen long enough."""
    seen: dict[int, list[int]] = {}
    for i, s in enumerate(snaps):
        for pid, proc in s.procs.items():
            parent = s.procs.get(proc.ppid)
            if _CLIENT in proc.cmd and (parent is None or _CLIENT not in parent.cmd):
                seen.setdefault(pid, []).append(i)
    runs = [
        (v[0], v[-1], pid) for pid, v in seen.items() if snaps[v[-1]].t - snaps[v[0]].t >= min_s
    ]
    return sorted(runs)


def report(snaps: list[Snap], roles: dict[int, str], min_share: float, min_s: float) -> None:
    for first, last, pid in client_runs(snaps, min_s):
        a, b = snaps[first], snaps[last]
        dt = b.t - a.t
        ticks = split(a, b, roles)
        cmd = snaps[last].procs[pid].cmd
        label = re.search(r"--result-filename (\S+)", cmd)
        print(f"\n{label.group(1) if label else f'client pid {pid}'}: {dt:.1f} s")
        totals: Counter[str] = Counter()
        for (role, name), n in sorted(ticks.items(), key=lambda kv: (kv[0][0], -kv[1])):
            totals[role] += n
            share = 100 * n / HZ / dt
            if share >= min_share:
                print(f"  {role:7s} {name:16s} {share:6.1f} % of a core")
        for role, n in sorted(totals.items()):
            print(f"  {role:7s} {'(all threads)':16s} {100 * n / HZ / dt:6.1f} % of a core")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--min-share", type=float, default=0.4, help="list threads using at least this %% of a core"
    )
    ap.add_argument(
        "--min-run-s",
        type=float,
        default=8.0,
        help="ignore load-generator runs shorter than this (seconds)",
    )
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("give the benchmark command after --")
    snaps: list[Snap] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            snaps.append(snapshot())
            stop.wait(1.0)  # a sampling period, not a synchronisation

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    roles: dict[int, str] = {}
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, bufsize=1)
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stdout.write(line)
        m = _STACK_LINE.match(line)
        if m:
            roles[int(m.group(2))] = _ROLES[m.group(1)]
    code = proc.wait()
    stop.set()
    sampler.join(5.0)
    report(snaps, roles, args.min_share, args.min_run_s)
    return code


if __name__ == "__main__":
    sys.exit(main())

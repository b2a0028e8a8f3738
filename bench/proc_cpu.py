"""CPU time of process groups from ``/proc``, thread by thread, between two snapshots: what
``bench.idle_cost`` measures with. ``/proc/<pid>/task/<tid>/schedstat`` gives nanoseconds (a
20 s window resolves far below 0.01 % of a core); ``/proc/<pid>/stat``'s ticks, which also
count threads that ended in the window, are kept as a check. Linux only; no processes
started here.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

HZ = os.sysconf("SC_CLK_TCK")


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

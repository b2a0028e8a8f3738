"""A child server's process group, read from /proc and signalled as a whole.

Owns: ``group_pids``, ``group_rss_bytes`` and ``group_cpu_s`` (the live processes of a group,
exited ones awaiting reaping left out, and their summed RSS and CPU time: a vLLM server is an
API process, an engine core and workers),
``group_states`` and ``group_stopped`` (the whole group frozen by SIGSTOP, as on a hung host,
and continued on the way out) and ``stop_process_group`` (SIGTERM the leader, then the group,
then SIGKILL; reaped).
Linux only; needs nothing but the standard library.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path


def _stat(pid: int) -> tuple[str, int] | None:
    """A process's state letter and process group, None if it is gone (Linux /proc)."""
    try:
        # Fields after the ")" of comm: state ppid pgrp ...
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return fields[0], int(fields[2])
    except (OSError, ValueError, IndexError):
        return None


def _running(stat: tuple[str, int] | None, pgid: int) -> bool:
    # A zombie (Z) or dead (X) process has exited: it holds no port, memory or CPU, and an
    # orphaned one waits for PID 1 to reap it, which can take seconds (this CI VM's init
    # reaps about once a second), so it does not count as a live member of the group.
    return stat is not None and stat[1] == pgid and stat[0] not in ("Z", "X")


def _group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs (exited ones awaiting reaping do not)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, but not ours: never signal it
        return False
    # The leader running answers it with one read; else look for any other member.
    return _running(_stat(pgid), pgid) or bool(group_pids(pgid))


def group_rss_bytes(pgid: int) -> int:
    """Summed RSS of every live process in group ``pgid`` (Linux /proc; shared pages count
    once per process, so this over-reports a little)."""
    total = 0
    for pid in group_pids(pgid):
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            continue  # exited while we looked
    return total


def group_pids(pgid: int) -> list[int]:
    """Every live process in group ``pgid``: not those that exited and wait to be reaped
    (Linux /proc)."""
    return [
        int(entry.name)
        for entry in Path("/proc").iterdir()
        if entry.name.isdigit() and _running(_stat(int(entry.name)), pgid)
    ]


def group_states(pgid: int) -> dict[int, str]:
    """Each live process of group ``pgid`` and its state letter (``T``: stopped by a signal)."""
    return {pid: stat[0] for pid in group_pids(pgid) if (stat := _stat(pid)) is not None}


@contextlib.contextmanager
def group_stopped(pgid: int) -> Iterator[None]:
    """SIGSTOP every process of group ``pgid`` (a hung host: sockets stay open, nothing
    answers) for the block, and SIGCONT them on the way out, whatever the block raised."""
    os.killpg(pgid, signal.SIGSTOP)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):  # killed meanwhile: nothing to continue
            os.killpg(pgid, signal.SIGCONT)


def group_cpu_s(pgid: int) -> float:
    """CPU time (utime + stime, all threads) used so far by the live processes of group
    ``pgid``, in seconds. Processes that exit between two readings drop out of the sum."""
    ticks = 0
    for pid in group_pids(pgid):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)
        except (OSError, ValueError, IndexError):
            continue  # exited while we looked
    return ticks / os.sysconf("SC_CLK_TCK")


def stop_process_group(proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    """Stop a child started with ``start_new_session``: SIGTERM the leader, then (after half
    of ``timeout_s``) its whole group, then SIGKILL the group at ``timeout_s``; reap it."""
    pgid = proc.pid  # start_new_session: the child leads its own group
    start = time.monotonic()
    for sig_group, until in ((False, start + timeout_s / 2), (True, start + timeout_s)):
        if not _group_alive(pgid):
            break
        with contextlib.suppress(ProcessLookupError):  # exited meanwhile: nothing to signal
            if sig_group:
                os.killpg(pgid, signal.SIGTERM)
            elif proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        # The leader may be gone while a child of it still shuts down.
        while _group_alive(pgid) and time.monotonic() < until:
            proc.poll()  # reap the leader as soon as it exits
            time.sleep(0.1)
    if _group_alive(pgid):
        with contextlib.suppress(ProcessLookupError):  # exited meanwhile: nothing to kill
            os.killpg(pgid, signal.SIGKILL)
    proc.wait()
    kill_deadline = time.monotonic() + 5.0  # SIGKILLed members free their ports soon
    while _group_alive(pgid) and time.monotonic() < kill_deadline:
        time.sleep(0.05)

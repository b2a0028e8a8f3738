"""The router's CPU priority on a shared host: SCHED_FIFO, so its loop runs the moment a
request or a chunk arrives instead of waiting for a core the engines hold.

Owns: ``realtime(priority)``, which puts the calling thread (and so every thread it starts
afterwards) in the SCHED_FIFO class, and says why not where it cannot (it needs root or
CAP_SYS_NICE, and Linux). On two cores both running engines, a request waited 3-5 ms (p50)
for the router to be scheduled before any span could start; with the router and the client
at SCHED_FIFO the traces accounted for the client's TTFT within 2 % + 2 ms for 95 % of
requests at concurrency 8 and 16, against 31-52 % without (``pushkv bench --configs push``,
``bench/results/fidelity_20261202/``). The router uses a few % of a core, so it takes little
from the engines; the kernel's RT throttle still leaves others 5 % if it ever spun.
"""

from __future__ import annotations

import os


def realtime(priority: int) -> str | None:
    """Put this thread in SCHED_FIFO at ``priority`` (1-99); None if done, else why not."""
    if not hasattr(os, "sched_setscheduler"):
        return "SCHED_FIFO is Linux only"
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(priority))
    except PermissionError:
        return "needs root or CAP_SYS_NICE"
    except OSError as exc:
        return str(exc)
    return None

"""The transfer thread's CPU mask: it escapes vLLM's OpenMP pin but stays inside its server's.

Each case runs in a child "server" process with a chosen mask, whose own child (the
"worker") narrows its main thread as vLLM's CPU worker does, then starts a thread that
calls ``unpin`` and reports its mask. Subprocesses, because masks are per process tree.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux CPU masks")

# The "worker": narrows its main thread to `narrow`, starts a thread that calls unpin and
# prints that thread's mask and its parent's (the "server").
WORKER = textwrap.dedent("""
    import json, os, sys, threading
    from connector.transfer.thread_os import unpin
    os.sched_setaffinity(0, set(json.loads(sys.argv[1])))
    out = {}
    def run():
        unpin()
        out["thread"] = sorted(os.sched_getaffinity(0))
    t = threading.Thread(target=run)
    t.start()
    t.join()
    out["server"] = sorted(os.sched_getaffinity(os.getppid()))
    print(json.dumps(out))
""")
# The "server": confines itself to `mask`, then runs the worker as its child.
SERVER = textwrap.dedent("""
    import json, os, subprocess, sys
    os.sched_setaffinity(0, set(json.loads(sys.argv[1])))
    worker = subprocess.run([sys.executable, "-c", sys.argv[3], sys.argv[2]],
                            capture_output=True, text=True, timeout=60)
    sys.stdout.write(worker.stdout)
    sys.stderr.write(worker.stderr)
    sys.exit(worker.returncode)
""")


def _thread_mask(server: set[int], narrow: set[int]) -> dict[str, list[int]]:
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            SERVER,
            json.dumps(sorted(server)),
            json.dumps(sorted(narrow)),
            WORKER,
        ],
        capture_output=True,
        text=True,
        timeout=90,
        # the repository root, so the child imports this checkout's connector
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__)))),
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _two_cpus() -> tuple[int, int]:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs")
    return cpus[0], cpus[1]


def test_thread_leaves_the_openmp_core_for_every_cpu_of_its_server() -> None:
    a, b = _two_cpus()
    out = _thread_mask(server={a, b}, narrow={b})
    assert out == {"thread": [a, b], "server": [a, b]}


def test_thread_never_leaves_its_servers_cpus() -> None:
    # A server pinned to one CPU (taskset, numactl, the benchmark's pin): widening to every
    # CPU put D's thread on P's core and doubled P's median TTFT at c=16.
    a, _ = _two_cpus()
    out = _thread_mask(server={a}, narrow={a})
    assert out == {"thread": [a], "server": [a]}

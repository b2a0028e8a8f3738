"""What the transfer threads' polling costs: CPU of a P rank and a D rank (real NIXL over
loopback, synthetic KV, ``connector.tools.loopback``) while D waits for KV that never comes,
and per transfer in a paced stream shaped like the serving benchmark's (a registration
every 20 ms, its prefill done 30 ms later, so transfers overlap).

Run: python -m bench.poll_cost [--transfers 150] [--no-doorbell] [--secret]
Prints one line per measurement (CPU per transfer and each transfer's latency from P's
prefill done to D counting its KV, then D's CPU while it waits); compare with and without
``--no-doorbell`` (doorbells: ``connector/transfer/doorbell.py``), and with ``--secret``
(every message and ring sealed: docs/security.md) to see what authentication costs. CPU
is the whole rank process (its transfer thread and the command loop that feeds it), from
``getrusage``.
"""

from __future__ import annotations

import argparse
import heapq
import os
import secrets
import statistics
import sys
import time

from connector.core import events as ev
from connector.tools.loopback import RankProcess, RankSpec, expected_event
from connector.tools.stack import free_port

REGISTER_EVERY_S = 0.02
PREFILL_S = 0.03


def awaiting_kv(p: RankProcess, d: RankProcess, seconds: float) -> tuple[float, float]:
    """D's share of a core idle, then while it waits for a WRITE that never comes."""
    c0, t0 = d.cpu_seconds(), time.monotonic()
    time.sleep(seconds)  # measuring an interval, not waiting for an event
    idle = (d.cpu_seconds() - c0) / (time.monotonic() - t0)
    held = p.counters().transfers
    d.submit(expected_event("never", [p.spec], d.spec, (1, 2, 3), 48))
    p.wait("D's registration", lambda r: r.counters().transfers > held, 10)
    c0, t0 = d.cpu_seconds(), time.monotonic()
    time.sleep(seconds)
    return idle, (d.cpu_seconds() - c0) / (time.monotonic() - t0)


def paced_stream(p: RankProcess, d: RankProcess, n: int) -> tuple[float, float, float, list[float]]:
    """CPU seconds per transfer of P and D, the stream's wall time, and each transfer's
    latency from its PrefillDone to D counting it (seconds; what TTFT waits for)."""
    cp0, cd0, t0 = p.cpu_seconds(), d.cpu_seconds(), time.monotonic()
    due: list[tuple[float, str, tuple[int, ...]]] = []
    done_ns: dict[str, int] = {}

    def prefill_done(t: str, b: tuple[int, ...]) -> None:
        done_ns[t] = time.time_ns()
        p.submit(ev.PrefillDone(t, f"preq-{t}", (b,), 128))

    for i in range(n):
        tid, blocks = f"t{i}", tuple(range(8 * (i % 30), 8 * (i % 30) + 8))
        start_at = t0 + i * REGISTER_EVERY_S
        while True:
            now = time.monotonic()
            while due and due[0][0] <= now:
                _, t, b = heapq.heappop(due)
                prefill_done(t, b)
            if now >= start_at:
                break
            time.sleep(min(start_at, due[0][0] if due else start_at) - now)  # pacing
        d.submit(expected_event(tid, [p.spec], d.spec, blocks, 128))
        heapq.heappush(due, (time.monotonic() + PREFILL_S, tid, blocks))
    while due:
        at, t, b = heapq.heappop(due)
        time.sleep(max(0.0, at - time.monotonic()))
        prefill_done(t, b)
    d.wait(
        "every transfer", lambda r: sum(x.transfer_id.startswith("t") for x in r.received) >= n, 30
    )
    got = [x for x in d.received if x.transfer_id.startswith("t")]
    assert all(x.ok for x in got), [x for x in got if not x.ok][:3]
    wall = time.monotonic() - t0
    latency = [(x.at_ns - done_ns[x.transfer_id]) / 1e9 for x in got]
    return (p.cpu_seconds() - cp0) / n, (d.cpu_seconds() - cd0) / n, wall, latency


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--transfers", type=int, default=150)
    ap.add_argument("--seconds", type=float, default=3.0, help="length of each CPU interval")
    ap.add_argument("--no-doorbell", action="store_true")
    ap.add_argument("--secret", action="store_true", help="P and D share a random secret")
    args = ap.parse_args()
    os.environ.setdefault("UCX_TLS", "tcp,sm,self")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    bell = not args.no_doorbell
    key = secrets.token_bytes(32) if args.secret else None
    p = RankProcess(
        RankSpec("P", "p", 0, 1, free_port(), num_blocks=256, doorbell=bell, secret=key)
    )
    d = RankProcess(
        RankSpec("D", "d", 0, 1, free_port(), num_blocks=256, doorbell=bell, secret=key)
    )
    try:
        p_us, d_us, wall, latency = paced_stream(p, d, args.transfers)
        lat = sorted(latency)
        print(
            f"doorbells {'on' if bell else 'off'}, secret {'on' if key else 'off'}: "
            f"{args.transfers} overlapping transfers in "
            f"{wall:.1f} s: P {1000 * p_us:.2f} ms of CPU per transfer, D {1000 * d_us:.2f} ms; "
            f"prefill done -> D has the KV: median {1000 * statistics.median(lat):.2f} ms, "
            f"p90 {1000 * lat[int(0.9 * (len(lat) - 1))]:.2f} ms"
        )
        idle, waiting = awaiting_kv(p, d, args.seconds)
        print(
            f"doorbells {'on' if bell else 'off'}: D idle {100 * idle:.2f} % of a core, "
            f"waiting for KV {100 * waiting:.2f} %"
        )
    finally:
        p.stop()
        d.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())

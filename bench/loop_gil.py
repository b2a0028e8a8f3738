"""How late an asyncio loop wakes while another thread of the process computes, by the GIL's
switch interval: the router's span exporter encodes JSON in a thread of its own.

    python -m bench.loop_gil                # 5 ms (CPython's default) against 0.5 ms, twice

Prints the loop's lag (how much later than asked a 2 ms sleep returns) at the median, p90
and max for each interval, while a thread encodes JSON without pause (the worst case; the
exporter is busy a few % of the time under load, ``python -m bench.router_cost``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time


def hog(stop: threading.Event) -> None:
    doc = [{f"k{i}": list(range(50))} for i in range(200)]
    while not stop.is_set():
        json.dumps(doc)


async def lags_ms(n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        await asyncio.sleep(0.002)
        out.append((time.perf_counter() - t - 0.002) * 1e3)
    return sorted(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--intervals-ms", type=float, nargs="+", default=[5.0, 0.5, 5.0, 0.5])
    p.add_argument("--samples", type=int, default=300)
    args = p.parse_args()
    for ms in args.intervals_ms:
        sys.setswitchinterval(ms / 1e3)
        stop = threading.Event()
        th = threading.Thread(target=hog, args=(stop,))
        th.start()
        try:
            lags = asyncio.run(lags_ms(args.samples))
        finally:
            stop.set()
            th.join()
        print(
            f"switch interval {ms:.1f} ms: loop lag p50 {lags[len(lags) // 2]:.2f}, "
            f"p90 {lags[int(0.9 * len(lags))]:.2f}, max {lags[-1]:.2f} ms",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

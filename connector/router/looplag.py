"""How late the router's event loop runs: a stall shows up as such, not as prefill time.

Owns: ``LoopLag``, a task that asks to wake every ``interval_s`` and records how much later
than asked it woke (its lag: whatever held the loop, from a blocking call to a burst of
requests), keeping the last minute. Each request's span carries the worst lag seen while it
was open (``pushkv.router.loop_lag_ms``) and ``/metrics`` the worst of the last second: a
request that waited where no span can see it (a router process not scheduled, a loop busy
with other requests: docs/operations.md#tracing) is then explained by the loop, not blamed
on P or D.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import deque


class LoopLag:
    def __init__(self, interval_s: float = 0.02, keep_s: float = 60.0) -> None:
        self.interval_s = interval_s
        self._keep_ns = int(keep_s * 1e9)
        self._samples: deque[tuple[int, int]] = deque()  # (woke at ns, lag ns)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="loop-lag")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        step_ns = int(self.interval_s * 1e9)
        while True:
            asked = time.monotonic_ns() + step_ns
            await asyncio.sleep(self.interval_s)
            now = time.monotonic_ns()
            self.record(now, max(0, now - asked))

    def record(self, at_ns: int, lag_ns: int) -> None:
        self._samples.append((at_ns, lag_ns))
        while self._samples and self._samples[0][0] < at_ns - self._keep_ns:
            self._samples.popleft()

    def worst_since(self, since_ns: int) -> int:
        """The largest lag (ns) of the wakes at or after ``since_ns`` (monotonic), 0 if none."""
        recent = itertools.takewhile(lambda s: s[0] >= since_ns, reversed(self._samples))
        return max((lag for _, lag in recent), default=0)

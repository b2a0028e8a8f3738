"""A min-heap of per-transfer deadlines with lazy invalidation.

Owns: "which transfer is due next". Records keep their own ``deadline_ns``; the caller
pushes every new value a deadline takes, so the heap may hold stale entries, which
``pop_due`` skips. Pure: no clock, times are arguments.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator


class DeadlineHeap:
    def __init__(self) -> None:
        self._heap: list[tuple[int, str]] = []

    def push(self, deadline_ns: int, transfer_id: str) -> None:
        heapq.heappush(self._heap, (deadline_ns, transfer_id))

    def pop_due(self, now_ns: int, current: Callable[[str], int | None]) -> Iterator[str]:
        """Yield each transfer whose *current* deadline (per ``current``) is <= now_ns.

        ``current`` returns the record's deadline now, or None if the record is gone.
        """
        while self._heap and self._heap[0][0] <= now_ns:
            deadline, tid = heapq.heappop(self._heap)
            cur = current(tid)
            if cur == deadline:
                yield tid
            # else: stale entry; the caller pushed the record's newer deadline when it changed

    def next_ns(self) -> int | None:
        return self._heap[0][0] if self._heap else None

    def __len__(self) -> int:
        return len(self._heap)

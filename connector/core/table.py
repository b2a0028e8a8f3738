"""What P's and D's tables share: records by transfer id, their deadlines, drop counting.

Owns: ``TransferTable``, the base of ``SenderTable`` (sender_table.py) and ``ReceiverTable``
(receiver_table.py). A transition that raises RemoteProtocolError (a stale, duplicate or
out-of-turn message) is dropped, counted, and logged throttled (the 1st, 2nd, 4th, 8th...
time) so a misbehaving peer cannot flood the log. Pure: no threads, no clocks.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any, Generic, Protocol, TypeVar

from connector.core.deadlines import DeadlineHeap
from connector.core.errors import RemoteProtocolError

logger = logging.getLogger(__name__)


class _State(Protocol):
    @property
    def terminal(self) -> bool: ...


class _Record(Protocol):
    deadline_ns: int
    reason: Any

    @property
    def state(self) -> _State: ...


R = TypeVar("R", bound=_Record)
E = TypeVar("E")  # the events a transition takes
A = TypeVar("A")  # the actions it returns


class TransferTable(Generic[R, E, A]):
    def __init__(self) -> None:
        self._records: dict[str, R] = {}
        self._deadlines = DeadlineHeap()
        self.dropped: Counter[str] = Counter()
        self.last_drop = ""
        self.live: Counter[Any] = Counter()  # non-terminal records by state
        self.ended: Counter[tuple[Any, Any]] = Counter()  # (terminal state, reason) entered

    def _apply(
        self,
        tid: str,
        event: E,
        transition: Callable[[R | None, E], tuple[R | None, list[A]]],
    ) -> list[A]:
        """Run one transition on the record of ``tid``; keep the deadline heap current."""
        rec = self._records.get(tid)
        before = rec.deadline_ns if rec is not None else None
        was = rec.state if rec is not None else None
        try:
            rec, actions = transition(rec, event)
        except RemoteProtocolError as exc:
            self._drop(type(event).__name__, str(exc))
            actions = []
        else:
            if rec is not None:
                self._records[tid] = rec
                if rec.deadline_ns != before:
                    self._deadlines.push(rec.deadline_ns, tid)
        self._count(was, self._records.get(tid))
        return actions

    def _count(self, was: Any, rec: R | None) -> None:
        # Read the state back even after a raise: the census must follow the records.
        now = rec.state if rec is not None else None
        if now == was:
            return
        if was is not None and not was.terminal:
            self.live[was] -= 1
        if now is not None and not now.terminal:
            self.live[now] += 1
        elif now is not None and (was is None or not was.terminal):
            assert rec is not None
            self.ended[(now, rec.reason)] += 1

    def _drop(self, kind: str, why: str) -> None:
        self.dropped[kind] += 1
        self.last_drop = why
        total = sum(self.dropped.values())
        if total & (total - 1) == 0:
            logger.warning("Dropped %s: %s (%d dropped so far)", kind, why, total)

    def _due(self, now_ns: int) -> Iterator[str]:
        """Transfers whose deadline is due; terminal ones (tombstones) are forgotten instead."""
        for tid in list(self._deadlines.pop_due(now_ns, self._deadline_of)):
            if self._records[tid].state.terminal:
                del self._records[tid]
            else:
                yield tid

    def _deadline_of(self, tid: str) -> int | None:
        rec = self._records.get(tid)
        return rec.deadline_ns if rec is not None else None

    def next_deadline_ns(self) -> int | None:
        return self._deadlines.next_ns()

    def get(self, transfer_id: str) -> R | None:
        return self._records.get(transfer_id)

    def __len__(self) -> int:
        return len(self._records)

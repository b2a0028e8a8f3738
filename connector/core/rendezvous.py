"""P's rendezvous table: registrations and finished prefills matched by ``transfer_id``.

Owns: the records of every transfer this P rank knows, their deadlines (leases,
registration TTLs, write timeouts, tombstones) and the drop counters. The transitions
themselves live in state.py. Pure: no threads, no clocks (``now_ns`` is an argument), no
vLLM, no NIXL. Called from one thread only (the transfer thread).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from connector.core import events as ev
from connector.core.deadlines import DeadlineHeap
from connector.core.errors import RemoteProtocolError
from connector.core.state import (
    DeadlinePassed,
    SendCtx,
    SenderPolicy,
    SendRecord,
    SendState,
    send_transition,
)


def _transfer_id(event: Any) -> str:
    return event.reg.transfer_id if isinstance(event, ev.Registered) else event.transfer_id


class SenderTable:
    """Feed events in, get actions out. Remote misbehaviour is dropped and counted."""

    def __init__(
        self,
        targets_for: Callable[[int], frozenset[int]],
        policy: SenderPolicy = SenderPolicy(),
        max_records: int = 1 << 16,
    ) -> None:
        self._targets_for = targets_for
        self.policy = policy
        self._max_records = max_records
        self._records: dict[str, SendRecord] = {}
        self._deadlines = DeadlineHeap()
        self.dropped: Counter[str] = Counter()
        self.last_drop = ""

    # ------------------------------------------------------------------ events
    def handle(self, event: ev.SenderEvent, now_ns: int) -> list[Any]:
        tid = _transfer_id(event)
        rec = self._records.get(tid)
        if rec is None and isinstance(event, ev.Registered) and len(self._records) >= self._max_records:
            self.dropped["table_full"] += 1
            return []
        return self._apply(tid, rec, event, now_ns)

    def tick(self, now_ns: int) -> list[Any]:
        """Fire every deadline that is due; forget tombstones that are old enough."""
        out: list[Any] = []
        for tid in list(self._deadlines.pop_due(now_ns, self._deadline_of)):
            rec = self._records[tid]
            if rec.state.terminal:
                del self._records[tid]
                continue
            out += self._apply(tid, rec, DeadlinePassed(tid), now_ns)
        return out

    def _apply(self, tid: str, rec: SendRecord | None, event: Any, now_ns: int) -> list[Any]:
        before = rec.deadline_ns if rec is not None else None
        try:
            rec, actions = send_transition(rec, event, SendCtx(now_ns, self.policy, self._targets_for))
        except RemoteProtocolError as exc:
            self.dropped[type(event).__name__] += 1
            self.last_drop = str(exc)
            return []
        if rec is not None:
            self._records[tid] = rec
            if rec.deadline_ns != before:
                self._deadlines.push(rec.deadline_ns, tid)
        return actions

    # ------------------------------------------------------------------ queries
    def _deadline_of(self, tid: str) -> int | None:
        rec = self._records.get(tid)
        return rec.deadline_ns if rec is not None else None

    def next_deadline_ns(self) -> int | None:
        return self._deadlines.next_ns()

    def get(self, transfer_id: str) -> SendRecord | None:
        return self._records.get(transfer_id)

    def state_of(self, transfer_id: str) -> SendState | None:
        rec = self._records.get(transfer_id)
        return rec.state if rec is not None else None

    def holding_blocks(self) -> int:
        """Transfers whose source blocks we still owe the scheduler (has_pending_push_work)."""
        return sum(1 for r in self._records.values() if r.blocks_held)

    def awaiting_network(self) -> bool:
        """True when something on the critical path may arrive any moment: poll fast."""
        return any(r.state in (SendState.PREFILLED, SendState.WRITING) for r in self._records.values())

    def __len__(self) -> int:
        return len(self._records)

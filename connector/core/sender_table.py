"""P's sender table: D's registrations and P's finished prefills meet by ``transfer_id``.

Owns: P's records (via ``TransferTable``): leases, registration TTLs, write timeouts and
tombstones. The transitions live in state.py. Pure: no threads, no clocks (``now_ns`` is an
argument), no vLLM, no NIXL. Called from one thread only (the transfer thread).
"""

from __future__ import annotations

from collections.abc import Callable

from connector.core import events as ev
from connector.core.send_state import (
    SendCtx,
    SenderPolicy,
    SendRecord,
    SendState,
    send_transition,
)
from connector.core.table import TransferTable
from connector.core.transition import DeadlinePassed

SendTableEvent = ev.SendEvent | DeadlinePassed


def _transfer_id(event: ev.SendEvent) -> str:
    return event.reg.transfer_id if isinstance(event, ev.Registered) else event.transfer_id


class SenderTable(TransferTable[SendRecord, SendTableEvent, ev.SendAction]):
    """Feed events in, get actions out. Remote misbehaviour is dropped and counted."""

    def __init__(
        self,
        targets_for: Callable[[int], frozenset[int]],
        policy: SenderPolicy = SenderPolicy(),
        max_records: int = 1 << 16,
        writes: bool = True,
    ) -> None:
        """``writes``: False for a P rank that writes no D rank (``SendCtx.writes``)."""
        super().__init__()
        self._targets_for = targets_for
        self._writes = writes
        self.policy = policy
        self._max_records = max_records
        # Transfers whose source blocks we hold -> (since, blocks), in the order they were
        # first held (now_ns only grows): the oldest is the first, O(1) for metrics.
        self._held: dict[str, tuple[int, int]] = {}
        self._held_blocks = 0  # the sum of their blocks

    def handle(self, event: ev.SendEvent, now_ns: int) -> list[ev.SendAction]:
        tid = _transfer_id(event)
        if (
            tid not in self._records
            and isinstance(event, ev.Registered)
            and len(self._records) >= self._max_records
        ):
            self._drop("table_full", f"{tid}: {len(self._records)} transfers already tracked")
            return []
        return self._held_after(tid, now_ns, self._apply(tid, event, self._transition(now_ns)))

    def tick(self, now_ns: int) -> list[ev.SendAction]:
        """Fire every deadline that is due; forget tombstones that are old enough."""
        out: list[ev.SendAction] = []
        for tid in self._due(now_ns):
            out += self._held_after(
                tid, now_ns, self._apply(tid, DeadlinePassed(tid), self._transition(now_ns))
            )
        return out

    def shut_down(self, now_ns: int) -> list[ev.SendAction]:
        """Shutting down: every transfer not writing yet ends now (``ShutdownDue``); WRITEs
        in flight run on. Called again for transfers that arrive later."""
        out: list[ev.SendAction] = []
        waiting = (SendState.REGISTERED, SendState.PREFILLED)
        if not any(self.live[s] for s in waiting):
            return out  # the common case while shutting down: one check per poll
        for tid in [t for t, r in self._records.items() if r.state in waiting]:
            out += self.handle(ev.ShutdownDue(tid), now_ns)
        return out

    def settled(self) -> bool:
        """No transfer is waiting or writing: nothing left to finish or to hand back."""
        return not any(self.live.values())

    def _held_after(
        self, tid: str, now_ns: int, actions: list[ev.SendAction]
    ) -> list[ev.SendAction]:
        rec = self._records.get(tid)
        if rec is not None and rec.blocks_held:
            if tid not in self._held:
                n = sum(len(g) for g in rec.block_ids)
                self._held[tid] = (now_ns, n)
                self._held_blocks += n
        elif (gone := self._held.pop(tid, None)) is not None:
            self._held_blocks -= gone[1]
        return actions

    def _transition(
        self, now_ns: int
    ) -> Callable[[SendRecord | None, SendTableEvent], tuple[SendRecord, list[ev.SendAction]]]:
        ctx = SendCtx(now_ns, self.policy, self._targets_for, self._writes)
        return lambda rec, event: send_transition(rec, event, ctx)

    def holding_blocks(self) -> int:
        """Transfers whose source blocks we still owe the scheduler (has_pending_push_work)."""
        return len(self._held)

    def held(self, now_ns: int) -> tuple[int, int]:
        """For metrics: source blocks held for pushes, and how long (ns) the oldest of
        them has been held (0 when none)."""
        if not self._held:
            return 0, 0
        oldest = next(iter(self._held.values()))[0]
        return self._held_blocks, now_ns - oldest

    def awaiting_network(self) -> bool:
        """True when something on the critical path may arrive any moment: poll fast."""
        return any(
            r.state in (SendState.PREFILLED, SendState.WRITING) for r in self._records.values()
        )

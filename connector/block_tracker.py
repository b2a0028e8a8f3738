"""P's block ids on vLLM 0.26, which binds the connector no KV cache manager.

Owns: ``BlockTracker``, the scheduler role's stand-in for ``KVCacheManager.get_block_ids``
(connector/vllm_compat.py says when it is used), kept from each step's ``SchedulerOutput``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class BlockTracker:
    """vLLM 0.26's stand-in for ``KVCacheManager.get_block_ids`` (0.26 binds no cache
    manager): each wanted request's block ids, kept from every step's ``SchedulerOutput``
    (a new request carries its whole table, a running one the blocks appended this step, a
    resumed one its table anew), as vLLM's model runner keeps its block tables."""

    tables: dict[str, tuple[list[int], ...]] = field(default_factory=dict)

    def update(self, out: Any, wanted: set[str]) -> None:
        """Take one step's ``SchedulerOutput``; ``wanted``: the request ids to keep."""
        for rid in set(out.preempted_req_ids or ()) | set(out.finished_req_ids or ()):
            self.tables.pop(rid, None)
        for rid in set(self.tables) - wanted:
            del self.tables[rid]
        for new in out.scheduled_new_reqs:
            if new.req_id in wanted:
                self.tables[new.req_id] = tuple(list(g) for g in new.block_ids)
        cached = out.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", None) or set()
        for rid, ids in zip(cached.req_ids, cached.new_block_ids, strict=True):
            if rid not in wanted or ids is None:
                continue
            table = self.tables.get(rid)
            if rid in resumed:
                self.tables[rid] = tuple(list(g) for g in ids)
            elif table is not None:  # (never seen whole: not guessed from a tail)
                for group, more in zip(table, ids, strict=True):
                    group.extend(more)

    def get_block_ids(self, rid: str) -> tuple[list[int], ...]:
        return self.tables.get(rid, ())

"""Which backend gets a leg, per ``--policy``: pure (the clock is an argument).

Owns: ``Policy``, ``Choice`` (the backend and the reason, which goes on the route span),
``engine_cost`` (a backend's load from its engine's signals and the router's own count)
and ``Chooser`` (one per router: the policy, its knobs and one ``affinity.PrefixTable``
per role).

- ``least-load``: ``policy.choose``, the router's own count of outstanding legs.
- ``engine-load``: the lowest ``engine_cost``: the engine's queue (waiting + running, at
  least the legs the router has in flight there, which a scrape up to a second old misses)
  plus its waiting requests once more and ``KV_WEIGHT`` times its KV cache usage; a backend
  whose signals are older than ``stale_s`` counts its outstanding legs only.
- ``prefix``: the backend the prefix table says holds the longest part of the prompt, while
  its cost is at most ``max_imbalance`` above the least-loaded one's; a prefix it names
  nowhere goes by rendezvous hash of its first block among those within that bound; a
  prompt shorter than one block goes by ``engine-load``.

Must not import: httpx, aiohttp, starlette, asyncio, or anything else of the router but
``policy`` and ``affinity``.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from connector.router.affinity import PrefixTable, rendezvous
from connector.router.policy import BackendLoad, choose, usable

# A full KV cache weighs like this many queued requests: past it the engine preempts.
KV_WEIGHT = 4.0


class Policy(enum.Enum):
    LEAST_LOAD = "least-load"
    ENGINE_LOAD = "engine-load"
    PREFIX = "prefix"

    @property
    def needs_signals(self) -> bool:
        return self is not Policy.LEAST_LOAD


@dataclass(frozen=True)
class Choice:
    load: BackendLoad
    reason: str
    prefix_blocks: int | None = None  # prefix policy: blocks of the prompt it holds


def fresh(b: BackendLoad, now: float, stale_s: float) -> bool:
    return b.signals is not None and now - b.signals.at <= stale_s


def engine_cost(b: BackendLoad, now: float, stale_s: float) -> float:
    """The backend's load in queued-request units (lower is better)."""
    s = b.signals
    if s is None or not fresh(b, now, stale_s):
        return float(b.outstanding)
    queue = max(float(b.outstanding), s.waiting + s.running)
    return queue + s.waiting + KV_WEIGHT * s.kv_usage


def _describe(b: BackendLoad, now: float, stale_s: float) -> str:
    s = b.signals
    if s is None or not fresh(b, now, stale_s):
        why = "no signals" if s is None else f"signals {now - s.at:.1f} s old"
        return f"{why}, {b.outstanding} outstanding"
    return (
        f"cost {engine_cost(b, now, stale_s):.2f}: waiting {s.waiting:g}, running "
        f"{s.running:g}, kv {s.kv_usage:.0%}, {b.outstanding} outstanding"
    )


class Chooser:
    """The router's policy with its state (the prefix tables, keyed by role name)."""

    def __init__(
        self,
        policy: Policy = Policy.LEAST_LOAD,
        *,
        stale_s: float = 3.0,
        max_imbalance: float = 4.0,
        table_entries: int | None = None,
    ) -> None:
        if stale_s <= 0:
            raise ValueError(f"stale_s must be > 0, got {stale_s}")
        if max_imbalance < 0:
            raise ValueError(f"max_imbalance must be >= 0, got {max_imbalance}")
        self.policy = policy
        self.stale_s = stale_s
        self.max_imbalance = max_imbalance
        self._table_entries = table_entries
        self.tables: dict[str, PrefixTable] = {}

    def table(self, role: str) -> PrefixTable:
        if role not in self.tables:
            n = self._table_entries
            self.tables[role] = PrefixTable() if n is None else PrefixTable(n)
        return self.tables[role]

    def choose(
        self, role: str, loads: Iterable[BackendLoad], prefix: Sequence[int], now: float
    ) -> Choice | None:
        """The backend for one leg of ``role`` among ``loads`` (eligible ones, else suspect
        ones), and why; records the prefix's new holder. ``prefix``: the prompt's block
        hashes (``affinity.block_hashes``); ``now``: the scraper's clock."""
        pool = usable(loads)
        if not pool:
            return None
        if self.policy is Policy.LEAST_LOAD:
            picked = choose(pool)
            assert picked is not None
            return Choice(picked, f"least-load: {picked.outstanding} outstanding")
        if self.policy is Policy.ENGINE_LOAD or not prefix:
            c = self._least_cost(pool, now)
            if self.policy is Policy.PREFIX:
                c = Choice(c.load, f"prefix: prompt under one block; {c.reason}")
            return c
        c = self._by_prefix(role, pool, prefix, now)
        self.table(role).record(prefix, c.load.index)
        return c

    def _least_cost(self, pool: list[BackendLoad], now: float) -> Choice:
        best = min(pool, key=lambda b: (engine_cost(b, now, self.stale_s), b.dispatched, b.index))
        return Choice(best, f"engine-load: {_describe(best, now, self.stale_s)}")

    def _by_prefix(
        self, role: str, pool: list[BackendLoad], prefix: Sequence[int], now: float
    ) -> Choice:
        costs = {b.index: engine_cost(b, now, self.stale_s) for b in pool}
        bound = min(costs.values()) + self.max_imbalance
        within = [b for b in pool if costs[b.index] <= bound]
        by_index = {b.index: b for b in within}
        skipped: list[str] = []
        for index, blocks in self.table(role).holders(prefix):
            if index in by_index:
                b = by_index[index]
                why = f"prefix: holds {blocks} of {len(prefix)} blocks"
                if skipped:
                    why += f" ({'; '.join(skipped)})"
                return Choice(b, f"{why}; {_describe(b, now, self.stale_s)}", blocks)
            if index in costs:
                skipped.append(
                    f"[{index}] holds {blocks} but cost {costs[index]:.2f} > bound {bound:.2f}"
                )
        b = within[rendezvous(prefix[0], [x.key or str(x.index) for x in within])]
        why = "prefix: new prefix, rendezvous on its first block"
        if skipped:
            why += f" ({'; '.join(skipped)})"
        return Choice(b, f"{why}; {_describe(b, now, self.stale_s)}", 0)

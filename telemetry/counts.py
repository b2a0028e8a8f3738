"""A component's counters, named only by ``telemetry.schema.Count``.

Owns ``Counts``: a ``Counter`` (readers, merges and logs see plain string keys, the names
``Count`` holds) that its component writes through ``add`` and reads through ``of``, so no
counter name is spelled outside the schema and no component writes into another's.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from telemetry.schema import Count


class Counts(Counter[str]):
    def add(self, name: Count, detail: str = "", n: int = 1) -> None:
        """Count ``n`` under ``name``; ``detail`` (a reason, a kind) completes a prefix name,
        one whose value ends in "_"."""
        self[name.value + detail] += n

    def of(self, name: Count, detail: str = "") -> int:
        return self[name.value + detail]

    def merge(self, other: Mapping[str, int], prefix: Count | None = None) -> None:
        """Add another component's counters (its names, under ``prefix`` if given)."""
        head = prefix.value if prefix is not None else ""
        self.update({head + k: v for k, v in other.items()})

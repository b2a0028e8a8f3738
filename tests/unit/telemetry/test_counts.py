"""Counter names live in ``telemetry.schema.Count`` only: components count through
``Counts.add``, never by subscripting a counter with a literal name."""

from __future__ import annotations

import re
from pathlib import Path

from telemetry.counts import Counts
from telemetry.schema import Count

ROOT = Path(__file__).resolve().parents[3]
# A literal subscript or an f-string key on something named *counters.
_RAW = re.compile(r"counters\[f?[\"']|counters\.get\(f?[\"']")


def test_add_names_by_count_and_details_complete_prefixes() -> None:
    c = Counts()
    c.add(Count.POLLS)
    c.add(Count.RECV_FAILED, "deadline", n=2)
    c.merge({"rung": 3}, prefix=Count.BELL)
    assert dict(c) == {"polls": 1, "recv_failed_deadline": 2, "bell_rung": 3}
    assert c.of(Count.RECV_FAILED, "deadline") == 2 and c.of(Count.HEARD) == 0


def test_product_code_spells_no_counter_name() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for top in ("connector", "telemetry", "dashboard", "pushkv_testing")
        for path in sorted((ROOT / top).rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if _RAW.search(line) and not line.lstrip().startswith(("#", "counted under"))
    ]
    assert not found, "count through Counts.add(Count.X):\n" + "\n".join(found)


def test_count_values_are_unique() -> None:
    values = [c.value for c in Count]
    assert len(values) == len(set(values))

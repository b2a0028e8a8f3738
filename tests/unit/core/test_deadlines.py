"""Tests of connector/core/deadlines.py: the lazy min-heap of per-transfer deadlines."""

from connector.core.deadlines import DeadlineHeap


def test_pop_due_yields_current_deadlines_in_order_and_skips_stale_ones() -> None:
    heap = DeadlineHeap()
    current = {"a": 30, "b": 10, "c": 50}
    for tid, at in (("a", 20), ("a", 30), ("b", 10), ("c", 50), ("gone", 5)):
        heap.push(at, tid)
    assert heap.next_ns() == 5 and len(heap) == 5
    # "gone" has no record any more and a's deadline moved from 20 to 30: both are skipped.
    assert list(heap.pop_due(30, current.get)) == ["b", "a"]
    assert heap.next_ns() == 50 and len(heap) == 1
    assert list(heap.pop_due(49, current.get)) == []
    assert list(heap.pop_due(50, current.get)) == ["c"]
    assert heap.next_ns() is None

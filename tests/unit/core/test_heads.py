"""Tests of connector/core/heads.py: vLLM's TP head split and who writes which heads where."""

import itertools
from collections import Counter

import pytest

from connector.core.errors import LayoutError
from connector.core.heads import assign_writers, head_range, sources_of, targets_of


def test_head_range_exhaustive():
    for tp, heads in itertools.product(range(1, 9), range(1, 17)):
        valid = heads % tp == 0 if tp <= heads else tp % heads == 0
        if not valid:
            with pytest.raises(LayoutError):
                head_range(0, tp, heads)
            continue
        ranges = [head_range(r, tp, heads) for r in range(tp)]
        held = Counter(h for lo, hi in ranges for h in range(lo, hi))
        assert set(held) == set(range(heads))
        assert len(set(held.values())) == 1  # every head replicated equally often
        assert ranges == sorted(ranges)


def test_head_range_errors():
    for args in [(2, 2, 4), (-1, 2, 4), (0, 0, 4), (0, 2, 0), (0, 3, 4), (0, 6, 4)]:
        with pytest.raises(LayoutError):
            head_range(*args)


def test_assign_writers_exhaustive():
    for heads in range(1, 17):
        tps = [tp for tp in range(1, 9) if (heads % tp == 0 if tp <= heads else tp % heads == 0)]
        for p_tp, d_tp in itertools.product(tps, tps):
            p_heads = [head_range(r, p_tp, heads) for r in range(p_tp)]
            d_heads = [head_range(r, d_tp, heads) for r in range(d_tp)]
            a = assign_writers(p_heads, d_heads)
            for d, (d0, d1) in enumerate(d_heads):
                writers = Counter()
                for p in sources_of(a, d):
                    lo, hi = a[(p, d)]
                    assert d0 <= lo < hi <= d1
                    assert p_heads[p][0] <= lo and hi <= p_heads[p][1]
                    for h in range(lo, hi):
                        writers[h] += 1
                        assert p == min(q for q, (q0, q1) in enumerate(p_heads) if q0 <= h < q1)
                assert writers == Counter(range(d0, d1))  # exactly one writer per head
            for p in range(p_tp):
                assert all((p, d) in a for d in targets_of(a, p))
            assert sum(len(targets_of(a, p)) for p in range(p_tp)) == len(a)


def test_assign_writers_errors():
    with pytest.raises(LayoutError):
        assign_writers([(0, 2)], [(0, 4)])  # heads 2, 3 have no writer
    with pytest.raises(LayoutError):
        assign_writers([(1, 2), (0, 3)], [(0, 3)])  # P rank 1 would write heads {0, 2}

"""The bytes a KV checksum covers: D's own runs equal, byte for byte, the destinations of
every piece P plans, whatever P's layout, block size and TP split (pure, no memory)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from connector.core.digest_ranges import dest_runs, source_runs
from connector.core.errors import LayoutError
from connector.core.plan import plan_transfer
from tests.unit.core.factories import make_layout

KEYS = [(0, 0, 0), (0, 0, 1), (1, 0, 0), (1, 0, 1)]


def _bytes(addr: np.ndarray, length: np.ndarray) -> np.ndarray:
    """Every byte address the runs cover, in run order."""
    if addr.size == 0:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([np.arange(a, a + n) for a, n in zip(addr, length, strict=True)])


@settings(max_examples=60, deadline=None)
@given(
    p_order=st.sampled_from(["HND", "NHD"]),
    d_order=st.sampled_from(["HND", "NHD"]),
    p_bs=st.sampled_from([2, 4, 8]),
    d_bs=st.sampled_from([2, 4, 8]),
    d_split=st.booleans(),
    d_heads=st.sampled_from([(0, 4), (0, 2), (2, 4)]),  # D at TP 1 or one of TP 2
    writer=st.sampled_from([(0, 4), (0, 2), (2, 4), (1, 2), (3, 4)]),  # P rank's heads
    first_blocks=st.integers(0, 2),
    tokens=st.integers(1, 20),
)
def test_d_runs_are_the_destinations_p_plans(
    p_order: str,
    d_order: str,
    p_bs: int,
    d_bs: int,
    d_split: bool,
    d_heads: tuple[int, int],
    writer: tuple[int, int],
    first_blocks: int,
    tokens: int,
) -> None:
    heads = (max(writer[0], d_heads[0]), min(writer[1], d_heads[1]))
    if heads[0] >= heads[1]:
        return  # this P rank writes nothing into this D rank
    p = make_layout(
        KEYS, block_size=p_bs, num_blocks=32, heads=writer, token_bytes=4, order=p_order
    )
    d = make_layout(
        KEYS,
        block_size=d_bs,
        num_blocks=32,
        heads=d_heads,
        token_bytes=4,
        order=d_order,
        base=1 << 24,
        kv_split=d_split,
    )
    first = first_blocks * d_bs
    num = first + tokens
    p_blocks = (tuple(range(31, 31 - (-(-num // p_bs)), -1)),)  # scattered, descending
    d_blocks = (tuple(range(3, 3 + 2 * (-(-tokens // d_bs)), 2)),)
    pieces = plan_transfer(p, p_blocks, d, d_blocks, first_token=first, num_tokens=num, heads=heads)
    d_addr, d_len = dest_runs(d, d_blocks, first_token=first, num_tokens=num, heads=heads)
    assert np.all(d_addr[1:] > d_addr[:-1] + d_len[:-1])  # sorted, disjoint, joined
    src, src_len = source_runs(pieces)
    order = np.argsort(pieces.dst, kind="stable")
    # P hashes its sources in the order of their destinations, which are D's runs' bytes.
    assert np.array_equal(_bytes(pieces.dst[order], pieces.length[order]), _bytes(d_addr, d_len))
    assert np.array_equal(src, pieces.src[order]) and int(src_len.sum()) == int(d_len.sum())


def test_a_first_token_off_a_block_boundary_is_refused() -> None:
    d = make_layout(KEYS, block_size=4, num_blocks=8, heads=(0, 2), token_bytes=4, order="HND")
    with pytest.raises(LayoutError):
        dest_runs(d, ((1, 2),), first_token=2, num_tokens=8, heads=(0, 2))

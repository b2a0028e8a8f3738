"""Tests of connector/core/plan.py against a brute-force, element-by-element reference."""

import ctypes
from collections import Counter

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from connector.core.errors import LayoutError
from connector.core.heads import assign_writers, head_range, sources_of
from connector.core.layout import KVLayout, Region
from connector.core.plan import Pieces, merge, plan_transfer
from tests.unit.core.factories import base_layout, make_layout

BLOCK_SIZES = (1, 2, 3, 4, 8, 16)


# ---------------------------------------------------------------- reference


def elem_addr(lay: KVLayout, region: Region, block: int, head: int, n: int) -> int:
    """Address of (global head, token n of the block) by the formulas of the layout model."""
    h = head - lay.heads[0]
    if lay.head_stride:  # explicit strides (e.g. vLLM's CPU cache: K then V per head)
        off = h * lay.head_stride + n * lay.token_stride
    elif lay.order == "HND":
        off = (h * lay.block_size + n) * lay.token_bytes
    else:
        off = (n * lay.num_heads + h) * lay.token_bytes
    return region.base_addr + block * region.block_stride + off


def elements(src, sb, dst, db, first, n, heads):
    """Every (src addr, dst addr) element of token_bytes bytes, one per (region, token, head)."""
    d_by_key = {r.key: r for r in dst.regions}
    out = []
    for sr in src.regions:
        dr, g = d_by_key[sr.key], sr.group
        for t in range(first, n):
            s_blk, s_n = sb[g][t // src.block_size], t % src.block_size
            d_blk, d_n = db[g][(t - first) // dst.block_size], (t - first) % dst.block_size
            for h in range(*heads):
                out.append((elem_addr(src, sr, s_blk, h, s_n), elem_addr(dst, dr, d_blk, h, d_n)))
    return out


def reference(src, sb, dst, db, first, n, heads) -> Pieces:
    el = elements(src, sb, dst, db, first, n, heads)
    s = [a for a, _ in el]
    d = [b for _, b in el]
    return merge(s, d, [src.token_bytes] * len(el))


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def valid_tp(heads: int) -> list[int]:
    return [tp for tp in (1, 2, 3, 4, 6, 8) if heads % tp == 0 or tp % heads == 0]


@st.composite
def scenarios(draw):
    """A P/D pair of layout families (one per TP rank) and one request to move."""
    num_heads = draw(st.sampled_from([1, 2, 3, 4, 6, 8]))
    p_tp = draw(st.sampled_from(valid_tp(num_heads)))
    d_tp = draw(st.sampled_from(valid_tp(num_heads)))
    n_groups = draw(st.integers(1, 2))
    keys = draw(
        st.lists(
            st.tuples(st.integers(0, 2), st.integers(0, n_groups - 1), st.integers(0, 1)),
            min_size=1,
            max_size=3,
            unique=True,
        )
    )
    d_keys = draw(st.permutations(keys))  # region order in the tuple must not matter
    bs, bd = draw(st.sampled_from(BLOCK_SIZES)), draw(st.sampled_from(BLOCK_SIZES))
    num_tokens = draw(st.integers(1, 40))
    first = bd * draw(st.integers(0, num_tokens // bd))
    tb = draw(st.sampled_from([1, 2, 4, 6]))
    s_need, d_need = ceil_div(num_tokens, bs), ceil_div(num_tokens - first, bd)
    s_nb = s_need + draw(st.integers(0, 3))
    d_nb = d_need + draw(st.integers(0, 3))
    groups = range(max(k[1] for k in keys) + 1)
    sb = [draw(st.permutations(range(s_nb)))[: s_need + draw(st.integers(0, 1))] for _ in groups]
    db = [draw(st.permutations(range(d_nb)))[: d_need + draw(st.integers(0, 1))] for _ in groups]
    orders = st.sampled_from(["HND", "NHD"])
    # A K/V-split layout has both parts of every layer, so both sides get all of them.
    split_s, split_d = draw(st.booleans()), draw(st.booleans())
    if split_s or split_d:
        keys = sorted({(k[0], k[1], p) for k in keys for p in (0, 1)})
        d_keys = draw(st.permutations(keys))

    def side(keys, block_size, num_blocks, pads, base, kv_split):
        """make_layout's arguments for one side; order, pad and gap drawn."""
        return dict(
            keys=keys,
            block_size=block_size,
            num_blocks=num_blocks,
            order=draw(orders),
            token_bytes=tb,
            pad=draw(st.sampled_from(pads)),
            base=base,
            gap=draw(st.integers(0, 3)),
            kv_split=kv_split,
        )

    src = side(keys, bs, s_nb, [0, 0, 1, 7], 4096, split_s)
    dst = side(d_keys, bd, d_nb, [0, 0, 3], 1 << 30, split_d)
    return num_heads, p_tp, d_tp, src, sb, dst, db, first, num_tokens


# ---------------------------------------------------------------- plan_transfer vs reference


@settings(max_examples=200, deadline=None)
@given(scenarios())
def test_plan_matches_reference_for_every_writer_pair(sc):
    num_heads, p_tp, d_tp, src_kw, sb, dst_kw, db, first, n = sc
    p_heads = [head_range(r, p_tp, num_heads) for r in range(p_tp)]
    d_heads = [head_range(r, d_tp, num_heads) for r in range(d_tp)]
    for (p, d), heads in assign_writers(p_heads, d_heads).items():
        src = make_layout(heads=p_heads[p], **src_kw)
        dst = make_layout(heads=d_heads[d], **dst_kw)
        src.validate()
        dst.validate()
        got = plan_transfer(src, sb, dst, db, first_token=first, num_tokens=n, heads=heads)
        assert got == reference(src, sb, dst, db, first, n, heads)
        nh = heads[1] - heads[0]
        assert got.bytes_total == len(src.regions) * (n - first) * nh * src.token_bytes


def test_realistic_same_layout_contiguous_blocks_is_one_piece_per_region():
    keys = [(layer, 0, part) for layer in range(4) for part in (0, 1)]
    lay = make_layout(
        keys, block_size=16, num_blocks=64, heads=(0, 8), token_bytes=256, order="HND", gap=4096
    )
    lay.validate()
    blocks = [list(range(5, 21))]
    got = plan_transfer(lay, blocks, lay, blocks, first_token=0, num_tokens=16 * 16, heads=(0, 8))
    assert got.count == len(keys)
    assert (got.length == 16 * 16 * 8 * 256).all()
    assert set(got.src.tolist()) == {r.base_addr + 5 * r.block_stride for r in lay.regions}
    assert got == reference(lay, blocks, lay, blocks, 0, 256, (0, 8))


def test_adjacent_regions_with_all_blocks_merge_across_regions():
    lay = make_layout(
        [(0, 0, 0), (1, 0, 0)], block_size=4, num_blocks=8, heads=(0, 2), token_bytes=8, order="NHD"
    )
    blocks = [list(range(8))]
    got = plan_transfer(lay, blocks, lay, blocks, first_token=0, num_tokens=32, heads=(0, 2))
    assert got.count == 1 and got.bytes_total == 2 * 32 * 2 * 8


def test_block_size_and_head_split_mismatch_realistic():
    # P: TP 1, 8 heads, block 16, HND. D: TP 2, block 32, NHD; D rank 1 gets heads 4..8.
    keys = [(layer, 0, 0) for layer in range(3)]
    src = make_layout(keys, block_size=16, num_blocks=16, heads=(0, 8), token_bytes=4, order="HND")
    dst = make_layout(
        keys, block_size=32, num_blocks=8, heads=(4, 8), token_bytes=4, order="NHD", base=1 << 30
    )
    sb, db = [[3, 1, 4, 0, 5, 9, 2, 6]], [[1, 2, 3, 0]]
    got = plan_transfer(src, sb, dst, db, first_token=32, num_tokens=120, heads=(4, 8))
    assert got == reference(src, sb, dst, db, 32, 120, (4, 8))


def test_empty_token_range_is_empty():
    lay = make_layout(
        [(0, 0, 0)], block_size=4, num_blocks=4, heads=(0, 1), token_bytes=2, order="HND"
    )
    got = plan_transfer(lay, [[]], lay, [[]], first_token=8, num_tokens=8, heads=(0, 1))
    assert got == Pieces.empty() and got.count == 0 and got.bytes_total == 0


# ---------------------------------------------------------------- byte-level end to end


def apply(pieces: Pieces) -> None:
    cols = (pieces.src.tolist(), pieces.dst.tolist(), pieces.length.tolist())
    for s, d, n in zip(*cols, strict=True):
        ctypes.memmove(d, s, n)


E2E_SHAPES = [
    # (bs, s_order, bd, d_order, p_tp, d_tp, num_heads, first, n, pad)
    (16, "HND", 16, "HND", 1, 1, 4, 0, 70, 0),
    (4, "HND", 8, "NHD", 2, 1, 4, 8, 45, 5),
    (3, "NHD", 2, "HND", 1, 4, 4, 6, 31, 0),
    (8, "NHD", 8, "NHD", 4, 2, 2, 16, 40, 16),
    (1, "HND", 16, "HND", 2, 8, 4, 0, 33, 3),
]


@pytest.mark.parametrize("shape", E2E_SHAPES)
def test_bytes_land_where_the_formula_says(shape):
    bs, s_order, bd, d_order, p_tp, d_tp, num_heads, first, n, pad = shape
    rng = np.random.default_rng(sum(shape[:1]) + n)
    keys = [(0, 0, 0), (0, 0, 1), (1, 1, 0)]
    tb = 6
    s_nb, d_nb = ceil_div(n, bs) + 2, ceil_div(n - first, bd) + 2
    sb = [rng.permutation(s_nb).tolist() for _ in range(2)]
    db = [rng.permutation(d_nb).tolist() for _ in range(2)]
    p_heads = [head_range(r, p_tp, num_heads) for r in range(p_tp)]
    d_heads = [head_range(r, d_tp, num_heads) for r in range(d_tp)]
    assignment = assign_writers(p_heads, d_heads)

    def size(block_size, num_blocks, heads):
        return len(keys) * num_blocks * ((heads[1] - heads[0]) * block_size * tb + pad) + 64

    def layout(block_size, num_blocks, heads, order, buf):
        """``keys`` laid out 32 bytes into ``buf`` (a buffer of ``size(...)`` bytes)."""
        return make_layout(
            keys,
            block_size=block_size,
            num_blocks=num_blocks,
            heads=heads,
            token_bytes=tb,
            order=order,
            pad=pad,
            base=buf.ctypes.data + 32,
        )

    srcs = {}
    for p, heads in enumerate(p_heads):
        srcs[p] = rng.integers(0, 256, size(bs, s_nb, heads), dtype=np.uint8)
    for d, dh in enumerate(d_heads):
        dbuf = np.zeros(size(bd, d_nb, dh), dtype=np.uint8)
        dst = layout(bd, d_nb, dh, d_order, dbuf)
        written = np.zeros(dbuf.size, dtype=bool)
        for p in sources_of(assignment, d):
            sbuf = srcs[p]
            src = layout(bs, s_nb, p_heads[p], s_order, sbuf)
            src.validate()
            dst.validate()
            heads = assignment[(p, d)]
            apply(plan_transfer(src, sb, dst, db, first_token=first, num_tokens=n, heads=heads))
            for sa, da in elements(src, sb, dst, db, first, n, heads):
                so, do = sa - sbuf.ctypes.data, da - dbuf.ctypes.data
                assert not written[do : do + tb].any(), "two writers for one element"
                written[do : do + tb] = True
                assert (dbuf[do : do + tb] == sbuf[so : so + tb]).all()
        assert written.sum() == len(keys) * (n - first) * (dh[1] - dh[0]) * tb
        assert not dbuf[~written].any(), "bytes outside the planned destination were touched"


# ---------------------------------------------------------------- merge


def test_merge_contiguous_run_is_one_piece():
    got = merge([0, 4, 8], [100, 104, 108], [4, 4, 4])
    assert got == Pieces(np.array([0]), np.array([100]), np.array([12]))


def test_merge_break_on_one_side_only_prevents_merging():
    assert merge([0, 4], [100, 200], [4, 4]).count == 2  # dst breaks
    assert merge([0, 8], [100, 104], [4, 4]).count == 2  # src breaks


def test_merge_sorts_unsorted_input_and_drops_empty():
    got = merge([8, 0, 4, 50], [108, 100, 104, 7], [4, 4, 4, 0])
    assert got == merge([0], [100], [12])


def test_merge_of_nothing_and_errors():
    assert merge([], [], []) == Pieces.empty()
    with pytest.raises(LayoutError):
        merge([0], [0], [-1])
    with pytest.raises(LayoutError):
        merge([0, 1], [0], [1])


def byte_map(src, dst, length) -> Counter:
    return Counter(
        (s + i, d + i) for s, d, n in zip(src, dst, length, strict=True) for i in range(int(n))
    )


piece_lists = st.lists(
    st.tuples(st.integers(0, 40), st.integers(0, 40), st.integers(0, 6)), max_size=25
)


@settings(max_examples=300, deadline=None)
@given(piece_lists, st.booleans(), st.randoms(use_true_random=False))
def test_merge_properties(pieces, chain, rnd):
    if chain:  # make long runs likely: pieces end to end on both sides, given in reverse
        ends = np.cumsum([0] + [n for _, _, n in pieces]).tolist()
        pieces = [(ends[i], ends[i] + 7, n) for i, (_, _, n) in enumerate(pieces)][::-1]
    src, dst, length = (list(x) for x in zip(*pieces, strict=True)) if pieces else ([], [], [])
    got = merge(src, dst, length)
    assert merge(got.src, got.dst, got.length) == got  # idempotent
    assert got.bytes_total == sum(length)
    assert (got.length > 0).all()
    assert byte_map(got.src.tolist(), got.dst.tolist(), got.length.tolist()) == byte_map(
        src, dst, length
    )
    assert (np.diff(got.src) >= 0).all()  # canonical: sorted by src ...
    rnd.shuffle(pieces)
    shuffled = (list(x) for x in zip(*pieces, strict=True)) if pieces else ([], [], [])
    assert merge(*shuffled) == got  # ... and independent of the input order


def test_pieces_as_descs_and_equality():
    p = Pieces(np.array([10, 20]), np.array([30, 40]), np.array([1, 2]))
    s, d = p.as_descs(3, dst_device_id=5)
    assert s.dtype == np.uint64 and s.shape == (2, 3)
    assert s.tolist() == [[10, 1, 3], [20, 2, 3]]
    assert d.tolist() == [[30, 1, 5], [40, 2, 5]]
    assert p.as_descs(1)[1][:, 2].tolist() == [1, 1]
    assert p == Pieces([10, 20], [30, 40], [1, 2])
    assert p != Pieces([10, 20], [30, 41], [1, 2])
    assert not p.src.flags.writeable


# ---------------------------------------------------------------- plan_transfer errors


def test_plan_transfer_errors():
    src = base_layout()
    ok = dict(first_token=4, num_tokens=12, heads=(0, 2))
    blocks = [list(range(8))]
    plan_transfer(src, blocks, src, blocks, **ok)  # the baseline is fine
    plan_transfer(src, [[99, 0, 1]], src, blocks, **ok)  # P's block for tokens 0..3 is not read
    other_keys = base_layout(keys=[(0, 0, 0), (2, 0, 0)])
    cases = [
        (src, blocks, other_keys, blocks, ok),  # region keys differ
        (src, blocks, base_layout(token_bytes=8), blocks, ok),  # token_bytes differ
        (src, [[0, 1]], src, blocks, ok),  # P needs 3 blocks
        (src, blocks, src, [[0]], ok),  # D needs 2 blocks
        (src, [[0, 1, 8]], src, blocks, ok),  # block id out of range
        (src, [[0, 9, 1]], src, blocks, ok),
        (src, blocks, src, [[0, -1]], ok),
        (src, blocks, src, blocks, ok | {"first_token": 2}),  # not a multiple of Bd
        (src, blocks, src, blocks, ok | {"first_token": 16}),  # first > num_tokens
        (src, blocks, src, blocks, ok | {"heads": (1, 3)}),  # outside both
        (src, blocks, base_layout(heads=(1, 2)), blocks, ok),  # outside D's range
        (src, [], src, blocks, ok),  # no table for group 0
        (src, blocks, src, blocks, ok | {"heads": (1, 1)}),  # empty head range
    ]
    for s, sb, d, db, kw in cases:
        with pytest.raises(LayoutError):
            plan_transfer(s, sb, d, db, **kw)


def test_plan_transfer_refuses_different_kv_dtypes():
    """Same token_bytes, different element types (fp8_e4m3 vs fp8_e5m2): refused by name."""
    src = msgspec.structs.replace(base_layout(), dtype="fp8_e4m3")
    blocks = [list(range(8))]
    ok = dict(first_token=0, num_tokens=12, heads=(0, 2))
    plan_transfer(src, blocks, src, blocks, **ok)
    for other in ("fp8_e5m2", "fp8", "bfloat16", ""):
        dst = msgspec.structs.replace(src, dtype=other)
        with pytest.raises(LayoutError, match="KV dtypes differ: P stores fp8_e4m3, D"):
            plan_transfer(src, blocks, dst, blocks, **ok)


@settings(max_examples=100, deadline=None)
@given(scenarios(), st.booleans())
def test_opaque_blocks_move_whole_blocks(sc, on_src):
    num_heads, p_tp, d_tp, src_kw, sb, dst_kw, db, first, n = sc
    dst_kw = {**dst_kw, "block_size": src_kw["block_size"]}
    bs = src_kw["block_size"]
    first = first - first % bs
    need_s, need_d = ceil_div(n, bs), ceil_div(n - first, bs)
    sb = [list(range(need_s))[::-1] for _ in sb]
    db = [list(range(need_d)) for _ in db]
    src_kw = {**src_kw, "num_blocks": max(need_s, 1)}
    dst_kw = {**dst_kw, "num_blocks": max(need_d, 1)}
    heads = head_range(0, 1, num_heads)
    src = make_layout(heads=heads, **src_kw)
    dst = make_layout(heads=heads, **dst_kw)
    opaque = {"opaque_blocks": True}
    src = msgspec.structs.replace(src, **opaque) if on_src else src
    dst = dst if on_src else msgspec.structs.replace(dst, **opaque)
    got = plan_transfer(src, sb, dst, db, first_token=first, num_tokens=n, heads=heads)
    whole = ceil_div(n, bs) * bs
    assert got == reference(src, sb, dst, db, first, whole, heads)


def test_opaque_blocks_need_equal_block_sizes():
    a = make_layout(
        [(0, 0, 0)], block_size=4, num_blocks=4, heads=(0, 1), token_bytes=2, order="HND"
    )
    b = msgspec.structs.replace(
        make_layout(
            [(0, 0, 0)], block_size=8, num_blocks=4, heads=(0, 1), token_bytes=2, order="HND"
        ),
        opaque_blocks=True,
    )
    with pytest.raises(LayoutError, match="opaque"):
        plan_transfer(a, [[0, 1]], b, [[0]], first_token=0, num_tokens=6, heads=(0, 1))

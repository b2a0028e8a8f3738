"""The IPC copy plan (connector/core/ipc_plan.py), simulated byte for byte: for any block
sizes that divide, head-major or token-major blocks, any TP split of P and D and any token
range, applying the plan's segments to P's and D's rows puts every byte of every (token,
head) P writes where D expects it, exactly once, and touches nothing else (copies go in units
of the smaller block, so the last unit's slots past the prompt move too)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from connector.core.ipc_plan import IpcPlan, Rows, plan_ipc
from tests.unit.core.factories import make_layout

KEYS = [(0, 0, 0)]
TB = 2  # bytes per (token, head): small, so every byte is checked


@st.composite
def cases(draw: st.DrawFn) -> dict:
    order = draw(st.sampled_from(["HND", "NHD"]))
    bp = draw(st.sampled_from([2, 4, 8]))
    bd = draw(st.sampled_from([b for b in (2, 4, 8) if max(b, bp) % min(b, bp) == 0]))
    heads_total = draw(st.sampled_from([2, 4]))
    p_tp = draw(st.sampled_from([t for t in (1, 2) if heads_total % t == 0]))
    d_tp = draw(st.sampled_from([t for t in (1, 2) if heads_total % t == 0]))
    p_rank, d_rank = draw(st.integers(0, p_tp - 1)), draw(st.integers(0, d_tp - 1))
    p_heads = (p_rank * heads_total // p_tp, (p_rank + 1) * heads_total // p_tp)
    d_heads = (d_rank * heads_total // d_tp, (d_rank + 1) * heads_total // d_tp)
    writes = (max(p_heads[0], d_heads[0]), min(p_heads[1], d_heads[1]))
    if writes[0] >= writes[1]:
        writes = d_heads  # no overlap: let the plan see a range P does not hold, below
    first = bd * draw(st.integers(0, 2))
    num = first + draw(st.integers(1, 5 * bd))
    p_need, d_need = -(-num // bp), -(-(num - first) // bd)
    p_blocks = draw(st.permutations(range(p_need + 3)))[:p_need]
    d_blocks = draw(st.permutations(range(d_need + 3)))[:d_need]
    return dict(
        order=order, bp=bp, bd=bd, p_heads=p_heads, d_heads=d_heads, writes=writes,
        first=first, num=num, p_blocks=list(p_blocks), d_blocks=list(d_blocks),
    )  # fmt: skip


def _offset(order: str, heads: tuple[int, int], block: int, h: int, t: int) -> int:
    if order == "HND":
        return ((h - heads[0]) * block + t) * TB
    return (t * (heads[1] - heads[0]) + (h - heads[0])) * TB


@settings(max_examples=300, deadline=None)
@given(cases())
def test_every_byte_p_writes_lands_once_where_d_expects_it(c: dict) -> None:
    if not (c["p_heads"][0] <= c["writes"][0] and c["writes"][1] <= c["p_heads"][1]):
        return  # P writes only heads it holds (assign_writers): nothing to plan
    p = make_layout(
        KEYS, block_size=c["bp"], num_blocks=64, heads=c["p_heads"], token_bytes=TB,
        order=c["order"],
    )  # fmt: skip
    d = make_layout(
        KEYS, block_size=c["bd"], num_blocks=64, heads=c["d_heads"], token_bytes=TB,
        order=c["order"],
    )  # fmt: skip
    plan = plan_ipc(
        p,
        Rows(1, p.block_bytes),
        d,
        Rows(1, d.block_bytes),
        [c["p_blocks"]],
        [c["d_blocks"]],
        c["first"],
        c["num"],
        c["writes"],
    )
    if isinstance(plan, str):
        # Only token-major blocks between different head splits cannot be served by runs.
        assert c["order"] == "NHD" and plan == "another TP size with token-major blocks"
        assert not c["writes"] == c["p_heads"] == c["d_heads"]
        return
    assert isinstance(plan, IpcPlan)
    src = np.arange(64 * p.block_bytes, dtype=np.int64).reshape(64, p.block_bytes)
    dst = np.full((64, d.block_bytes), -1, dtype=np.int64)
    writes = np.zeros_like(dst)
    for seg in plan.segments:
        (pa, pb), (da, db) = seg.p_cols, seg.d_cols
        assert pb - pa == db - da > 0
        dst[np.asarray(seg.dst), da:db] = src[np.asarray(seg.src), pa:pb]
        np.add.at(writes, (np.asarray(seg.dst)[:, None], np.arange(da, db)[None, :]), 1)
    # Copies go in units of the smaller block: the last unit's slots past num_tokens move too
    # (they lie in blocks of this request on both sides; D's engine writes them later).
    small = min(c["bp"], c["bd"])
    end = c["first"] + -(-(c["num"] - c["first"]) // small) * small
    expected = np.full_like(dst, -1)
    for t in range(c["first"], end):
        p_row = c["p_blocks"][t // c["bp"]]
        d_row = c["d_blocks"][(t - c["first"]) // c["bd"]]
        for h in range(*c["writes"]):
            po = _offset(c["order"], c["p_heads"], c["bp"], h, t % c["bp"])
            do = _offset(c["order"], c["d_heads"], c["bd"], h, (t - c["first"]) % c["bd"])
            expected[d_row, do : do + TB] = src[p_row, po : po + TB]
    assert np.array_equal(dst, expected), "a byte in the wrong place, missing or extra"
    assert writes.max() <= 1, "a byte written twice"
    moved = (end - c["first"]) * (c["writes"][1] - c["writes"][0]) * TB
    assert plan.nbytes_per_region == moved

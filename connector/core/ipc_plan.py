"""What an IPC copy moves between P's and D's block rows: launches of byte columns.

Owns: ``Segment`` (one copy launch: a byte column range of P's rows into one of D's, for
lists of source and destination rows), ``IpcPlan`` and ``plan_ipc``. Whole block rows when
P and D hold the same heads in the same geometry (one launch); otherwise, between TP sizes
(P writes only its heads of D's rows) or block sizes (P 16 / D 32 tokens per block), the
contiguous byte runs of each row that move, one launch per run and sub-block position.
The GPU path driver (``connector.transfer.gpu.paths``) turns each segment into one kernel
launch over row tables. Pure: no torch, no clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from connector.core.heads import HeadRange
from connector.core.layout import KVLayout

Run = tuple[int, int, int]  # (P byte offset, D byte offset, bytes) inside a block row


@dataclass(frozen=True)
class Segment:
    """One copy launch: bytes ``p_cols`` of P's rows ``src`` into ``d_cols`` of D's ``dst``."""

    p_cols: tuple[int, int]
    d_cols: tuple[int, int]
    src: list[int]
    dst: list[int]


@dataclass(frozen=True)
class IpcPlan:
    segments: list[Segment]
    units: int  # copy units (blocks, or the smaller side's blocks when sizes differ)
    whole: bool  # whole rows on both sides, one launch

    @property
    def nbytes_per_region(self) -> int:
        return sum((g.p_cols[1] - g.p_cols[0]) * len(g.src) for g in self.segments)


@dataclass(frozen=True)
class Rows:
    """A side's block rows: how many regions (layers x parts) and the bytes of one row."""

    regions: int
    row_bytes: int


def plan_ipc(
    p: KVLayout,
    p_rows: Rows,
    d: KVLayout,
    d_rows: Rows,
    src_blocks: Sequence[Sequence[int]],
    dst_blocks: Sequence[Sequence[int]],
    first_token: int,
    num_tokens: int,
    heads: HeadRange,
) -> IpcPlan | str:
    """What an IPC copy of tokens [first_token, num_tokens) of P's heads ``heads`` from P's
    blocks ``src_blocks`` into D's ``dst_blocks`` moves, or why it cannot (a reason)."""
    if (d.token_bytes, d.region_keys()) != (p.token_bytes, p.region_keys()):
        return "block geometry differs"
    if d_rows.regions != p_rows.regions:
        return "mapped rows differ"
    if len(src_blocks) != 1 or len(dst_blocks) != 1:
        return "several KV groups"
    bp, bd = p.block_size, d.block_size
    small = min(bp, bd)
    if max(bp, bd) % small or first_token % bd:
        return "block sizes do not divide"
    # One unit per `small` tokens: where it is in P's and D's blocks.
    starts = np.arange(first_token, num_tokens, small, dtype=np.int64)
    if starts.size == 0:
        return IpcPlan([], 0, True)
    p_blocks, d_blocks = np.asarray(src_blocks[0]), np.asarray(dst_blocks[0])
    p_at, p_sub = np.divmod(starts, bp)
    d_at, d_sub = np.divmod(starts - first_token, bd)
    if int(p_at[-1]) >= p_blocks.size or int(d_at[-1]) >= d_blocks.size:
        return "block counts differ"
    if bp == bd and heads == p.heads == d.heads and d.strides() == p.strides():
        if d_rows.row_bytes != p_rows.row_bytes:
            return "mapped rows differ"
        whole = (0, p_rows.row_bytes)
        seg = Segment(whole, whole, p_blocks[p_at].tolist(), d_blocks[d_at].tolist())
        return IpcPlan([seg], int(starts.size), True)
    found = byte_runs(p, d, heads, small)
    if isinstance(found, str):
        return found
    runs, step = found
    if (p_rows.row_bytes, d_rows.row_bytes) != (p.block_bytes, d.block_bytes):
        return "mapped rows differ"
    segments = []
    p_sub, d_sub = p_sub // small, d_sub // small
    for ps, ds in sorted(set(zip(p_sub.tolist(), d_sub.tolist(), strict=True))):
        pick = (p_sub == ps) & (d_sub == ds)
        src, dst = p_blocks[p_at[pick]].tolist(), d_blocks[d_at[pick]].tolist()
        for p_off, d_off, length in runs:
            p_cols = (p_off + ps * step, p_off + ps * step + length)
            d_cols = (d_off + ds * step, d_off + ds * step + length)
            segments.append(Segment(p_cols, d_cols, src, dst))
    return IpcPlan(segments, int(starts.size), False)


def byte_runs(
    p: KVLayout, d: KVLayout, heads: HeadRange, small: int
) -> tuple[list[Run], int] | str:
    """(P offset, D offset, bytes) of each run one unit of ``small`` tokens of ``heads``
    fills in a block row at sub-block 0, and the bytes sub-block j adds j times."""
    tb = p.token_bytes
    hnd_p, hnd_d = (p.block_size * tb, tb), (d.block_size * tb, tb)
    nhd_p, nhd_d = (tb, p.num_heads * tb), (tb, d.num_heads * tb)
    if p.strides() == hnd_p and d.strides() == hnd_d:  # head-major: a run per head
        runs = [
            ((h - p.heads[0]) * hnd_p[0], (h - d.heads[0]) * hnd_d[0], small * tb)
            for h in range(*heads)
        ]
        if p.block_size == d.block_size:  # consecutive heads are adjacent on both sides
            runs = [(runs[0][0], runs[0][1], small * tb * len(runs))]
        return runs, small * tb
    if p.strides() == nhd_p and d.strides() == nhd_d:  # token-major
        if not heads == p.heads == d.heads:
            return "another TP size with token-major blocks"
        return [(0, 0, small * p.num_heads * tb)], small * p.num_heads * tb
    return "block interiors differ"

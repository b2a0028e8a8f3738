"""Which bytes a KV checksum covers, and in what order (docs/protocol.md, KV integrity).

Owns: the canonical byte stream of one P rank's write into one D rank: the bytes of D's
blocks that rank fills (tokens x the heads it writes), in D's address order. P reads its
source bytes in that order (``source_runs``); D reads its own blocks (``dest_runs``) from
nothing but its registration and the heads P names, so P's and D's layouts, block sizes
and TP sizes may differ. A streaming hash over the runs does not depend on how they are cut.

Pure: imports numpy and ``connector.core`` only; reads no memory and no clock.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from connector.core.errors import LayoutError
from connector.core.heads import HeadRange
from connector.core.layout import KVLayout
from connector.core.plan import Pieces, plan_transfer

Runs = tuple[np.ndarray, np.ndarray]
"""(addresses, lengths) of byte runs, int64, in the order they are hashed."""


def source_runs(pieces: Pieces) -> Runs:
    """P: the source runs of a planned transfer, in the order of their destinations."""
    order = np.argsort(pieces.dst, kind="stable")
    return pieces.src[order], pieces.length[order]


def dest_runs(
    layout: KVLayout,
    block_ids: Sequence[Sequence[int]],
    *,
    first_token: int,
    num_tokens: int,
    heads: HeadRange,
) -> Runs:
    """D: the runs of its blocks that a writer of global heads ``heads`` fills with tokens
    [first_token, num_tokens), in address order, contiguous runs joined. ``block_ids`` is
    D's table per KV group starting at ``first_token``, as in its registration."""
    if first_token % layout.block_size:
        raise LayoutError(f"first_token {first_token} is not a multiple of {layout.block_size}")
    # The planner maps a source table from token 0: put D's table behind placeholders for
    # the blocks before first_token, which it does not read. D into itself: dst is D's runs.
    lead = (0,) * (first_token // layout.block_size)
    own = tuple(lead + tuple(g) for g in block_ids)
    pieces = plan_transfer(
        layout,
        own,
        layout,
        block_ids,
        first_token=first_token,
        num_tokens=num_tokens,
        heads=heads,
    )
    order = np.argsort(pieces.dst, kind="stable")
    dst, length = pieces.dst[order], pieces.length[order]
    if dst.size < 2:
        return dst, length
    brk = np.empty(dst.size, dtype=bool)
    brk[0] = True
    np.not_equal(dst[1:], dst[:-1] + length[:-1], out=brk[1:])
    starts = np.flatnonzero(brk)
    return dst[starts], np.add.reduceat(length, starts)

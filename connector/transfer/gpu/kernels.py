"""Triton kernels that move whole KV block rows: one launch per gather, scatter or
scattered -> scattered copy, over every region (layer x part) of a chunk.

Owns: ``launch_copy_rows`` and the kernel behind it. Imported only through
``rows.py`` where a CUDA device (or Triton's interpreter, in tests) is in use: this module
imports triton at module level. Addresses are passed as int64 word offsets from one
anchor tensor, so Triton can prove 16-byte alignment and emit 128-bit loads (a pointer
made from an integer gets 8-byte loads only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import triton
import triton.language as tl


@dataclass(frozen=True)
class Tune:
    """Launch shape: words per load step, rows per program, warps per program."""

    block_words: int = 1024
    rows: int = 1
    num_warps: int = 4


def default_tune(row_words: int) -> Tune:
    """One shape for every row size: on an H200 every shape tried ran within 11 % of a plain
    copy at 16k tokens, 4 KiB and 64 KiB rows alike (``python -m bench.gpu_kernels``)."""
    return Tune()


# Not specialised on the values that change per transfer (Triton would compile a variant for
# a row count of 1 or a multiple of 16, and for a zero dense offset): one compile per geometry.
@triton.jit(do_not_specialize=["s_dense", "d_dense", "n_rows"])
def _copy_rows(
    anchor,
    s_off,
    s_stride,
    s_ids,
    d_off,
    d_stride,
    d_ids,
    s_dense,
    d_dense,
    n_rows,
    row_words,
    BLOCK: tl.constexpr,
    VEC: tl.constexpr,
    S_DENSE: tl.constexpr,
    D_DENSE: tl.constexpr,
    EVEN: tl.constexpr,
    ROWS: tl.constexpr,
):
    # One program per ROWS consecutive rows j of one region r. A dense side is a staging
    # slot holding the chunk's rows region-major: row (r, j) at (r * n_rows + j) * row_words.
    groups = (n_rows + ROWS - 1) // ROWS
    pid = tl.program_id(0)
    r = pid // groups
    for k in range(ROWS):
        j = (pid % groups) * ROWS + k
        if j < n_rows:
            if S_DENSE:
                so = s_dense + (r.to(tl.int64) * n_rows + j) * row_words
            else:
                so = tl.load(s_off + r) + tl.load(s_ids + j) * tl.load(s_stride + r)
            if D_DENSE:
                do = d_dense + (r.to(tl.int64) * n_rows + j) * row_words
            else:
                do = tl.load(d_off + r) + tl.load(d_ids + j) * tl.load(d_stride + r)
            so = tl.multiple_of(so, VEC)
            do = tl.multiple_of(do, VEC)
            for start in range(0, row_words, BLOCK):
                o = start + tl.arange(0, BLOCK)
                if EVEN:
                    tl.store(anchor + do + o, tl.load(anchor + so + o))
                else:
                    m = o < row_words
                    tl.store(anchor + do + o, tl.load(anchor + so + o, mask=m), mask=m)


def launch_copy_rows(
    anchor: Any,
    src: tuple[Any, Any, Any] | int,
    dst: tuple[Any, Any, Any] | int,
    *,
    num_regions: int,
    n_rows: int,
    row_words: int,
    vec: int,
    tune: Tune | None = None,
) -> None:
    """Copy ``num_regions x n_rows`` rows of ``row_words`` int64 words on the current stream.

    ``src``/``dst`` is either (offsets, strides, ids) device tensors (a scattered side: row
    ``ids[j]`` of region r at ``offsets[r] + ids[j] * strides[r]`` words from ``anchor``)
    or an int word offset (a dense staging side).
    """
    if num_regions == 0 or n_rows == 0:
        return
    tune = tune or default_tune(row_words)
    block = min(tune.block_words, triton.next_power_of_2(row_words))
    s_dense = isinstance(src, int)
    d_dense = isinstance(dst, int)
    st = (anchor, anchor, anchor) if isinstance(src, int) else src
    dt = (anchor, anchor, anchor) if isinstance(dst, int) else dst
    groups = -(-n_rows // tune.rows)
    _copy_rows[(num_regions * groups,)](
        anchor,
        st[0],
        st[1],
        st[2],
        dt[0],
        dt[1],
        dt[2],
        src if s_dense else 0,
        dst if d_dense else 0,
        n_rows,
        row_words,
        BLOCK=block,
        VEC=vec,
        S_DENSE=s_dense,
        D_DENSE=d_dense,
        EVEN=row_words % block == 0,
        ROWS=tune.rows,
        num_warps=tune.num_warps,
    )

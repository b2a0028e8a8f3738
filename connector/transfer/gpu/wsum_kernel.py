"""The ``wsum64`` digest (``connector.transfer.wsum``) as one Triton kernel: each KV byte is
read once, widened, weighted and summed in registers, where torch's ops gather the runs
into a temporary first and then read it again (``python -m bench.kv_checksum --device cuda``
measures both).

Owns: ``sum_rows``. Imported only where a CUDA device (or Triton's interpreter, in tests)
is in use: this module imports triton at module level.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_WORDS = 4096  # stream words per program: divides a page (2**16 words), so one M[c] each


@triton.jit
def _wsum_rows(
    words,
    src_rows,
    n_rows,
    page,
    mult,
    out,
    first_row,
    UW: tl.constexpr,
    ROWS: tl.constexpr,
):
    # One program per ROWS consecutive stream rows of UW int32 words: stream row r is row
    # src_rows[r] of ``words``. ROWS * UW words lie in one page, so its weights are
    # M[page] * T[j] over a contiguous slice of T.
    pid = tl.program_id(0)
    r = pid * ROWS + tl.arange(0, ROWS)
    live = r < n_rows
    src = tl.load(src_rows + r, mask=live, other=0)
    j = tl.arange(0, UW)
    x = tl.load(words + (src[:, None] * UW + j[None, :]), mask=live[:, None], other=0)
    k0 = (first_row + pid * ROWS).to(tl.int64) * UW  # the program's first stream word
    t = tl.load(page + ((k0 & 0xFFFF) + tl.arange(0, ROWS)[:, None] * UW + j[None, :]))
    s = tl.sum(tl.sum(x.to(tl.int64) * t, axis=1), axis=0)  # int64 arithmetic wraps
    tl.store(out + pid, s * tl.load(mult + (k0 >> 16)))


def sum_rows(
    words: torch.Tensor,
    src_rows: torch.Tensor,
    first_row: int,
    row_words: int,
    page: torch.Tensor,
    mult: torch.Tensor,
) -> torch.Tensor:
    """``sum_k w_k * x_k`` (int64, wrapping) over stream rows ``first_row ..`` of
    ``row_words`` int32 words each, stream row ``first_row + i`` being row ``src_rows[i]``
    of ``words`` (int32, flat). ``first_row * row_words`` must be a multiple of
    ``BLOCK_WORDS`` (chunks start on a program's boundary); ``row_words`` a power of two up
    to ``BLOCK_WORDS``. ``page``: T (int64 [2**16]); ``mult``: M (int64, every page)."""
    rows = max(1, BLOCK_WORDS // row_words)
    if first_row % rows:
        raise ValueError(f"a chunk starts at stream row {first_row}, not a multiple of {rows}")
    n = src_rows.numel()
    out = torch.empty(triton.cdiv(n, rows), dtype=torch.int64, device=words.device)
    _wsum_rows[(out.numel(),)](
        words, src_rows, n, page, mult, out, first_row, UW=row_words, ROWS=rows
    )
    return out.sum()

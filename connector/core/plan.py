"""The descriptor planner: the byte pieces that move a transfer's tokens from P's blocks to D's.

Owns: ``plan_transfer``, ``merge`` and ``Pieces``. Two separate steps, so that other
strategies (cross-layer grouping, staging) can replace the first and reuse the second:
*address computation* (``_raw_pieces``: every (region, segment) as a strided box, coalesced
analytically where both sides are contiguous) and *merging* (``merge``: canonical sort plus
maximal runs). Descriptor count, not bytes, dominates transfer cost, so both steps shrink it.

Pure: imports numpy and ``connector.core`` only. Must not import vllm, nixl, torch or
threading, and reads no clock.
"""

import dataclasses
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from connector.core.errors import LayoutError
from connector.core.heads import HeadRange
from connector.core.layout import KVLayout, Region, RegionKey, check_same_dtype


def _frozen(values: npt.ArrayLike) -> np.ndarray:
    arr = np.asarray(values, dtype=np.int64).reshape(-1).view()
    arr.setflags(write=False)  # on a view: the caller's array stays writable
    return arr


@dataclasses.dataclass(frozen=True, eq=False)
class Pieces:
    """Byte pieces to copy: src[i] .. src[i] + length[i] goes to dst[i] (absolute addresses)."""

    src: np.ndarray
    dst: np.ndarray
    length: np.ndarray

    def __post_init__(self) -> None:
        for name in ("src", "dst", "length"):
            object.__setattr__(self, name, _frozen(getattr(self, name)))
        if not self.src.size == self.dst.size == self.length.size:
            raise LayoutError("pieces: src, dst and length differ in size")

    @classmethod
    def empty(cls) -> "Pieces":
        none = np.zeros(0, dtype=np.int64)
        return cls(none, none, none)

    @property
    def count(self) -> int:
        return int(self.src.size)

    @property
    def bytes_total(self) -> int:
        return int(self.length.sum())

    def as_descs(
        self, device_id: int, dst_device_id: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Nx3 uint64 (addr, len, devid) arrays for src and dst, as NIXL's get_xfer_descs takes.

        `dst_device_id` defaults to `device_id` (P and D GPU indices may differ).
        """
        dst_dev = device_id if dst_device_id is None else dst_device_id
        devs = np.ones(self.count, dtype=np.int64)
        return (
            np.column_stack((self.src, self.length, devs * device_id)).astype(np.uint64),
            np.column_stack((self.dst, self.length, devs * dst_dev)).astype(np.uint64),
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Pieces):
            return NotImplemented
        fields = ("src", "dst", "length")
        return all(np.array_equal(getattr(self, f), getattr(other, f)) for f in fields)

    __hash__ = None  # type: ignore[assignment]  # mutable-looking contents: not hashable

    def __repr__(self) -> str:
        return f"Pieces(count={self.count}, bytes_total={self.bytes_total})"


def _sorted_by_src(
    src: np.ndarray, dst: np.ndarray, length: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    if src.size < 2 or bool((src[1:] > src[:-1]).all()):
        return src, dst, length  # the planner's output is often sorted already
    order = np.argsort(src, kind="stable")
    s = src[order]
    if bool((s[1:] == s[:-1]).any()):  # ties: order fully so the result is canonical
        order = np.lexsort((length, dst, src))
    return src[order], dst[order], length[order]


def merge(src: npt.ArrayLike, dst: npt.ArrayLike, length: npt.ArrayLike) -> Pieces:
    """Canonical form: drop empty pieces, sort by src, then join maximal runs in which each
    piece starts exactly where the previous one ends on both sides."""
    s, d, n = (np.asarray(a, dtype=np.int64).reshape(-1) for a in (src, dst, length))
    if not s.size == d.size == n.size:
        raise LayoutError("merge: src, dst and length differ in size")
    if n.size and int(n.min()) < 0:
        raise LayoutError("merge: negative piece length")
    keep = n > 0
    if not keep.all():
        s, d, n = s[keep], d[keep], n[keep]
    if s.size == 0:
        return Pieces.empty()
    s, d, n = _sorted_by_src(s, d, n)
    brk = np.empty(s.size, dtype=bool)
    brk[0] = True
    np.not_equal(s[1:], s[:-1] + n[:-1], out=brk[1:])
    brk[1:] |= d[1:] != d[:-1] + n[:-1]
    starts = np.flatnonzero(brk)
    if starts.size == s.size:
        return Pieces(s, d, n)
    return Pieces(s[starts], d[starts], np.add.reduceat(n, starts))


@dataclasses.dataclass(frozen=True)
class _Side:
    """One side's geometry, regions in the shared key order."""

    layout: KVLayout
    base: np.ndarray  # (R,) region base addresses
    stride: np.ndarray  # (R,) block strides
    group_row: np.ndarray  # (R,) row of the region's group in the block id table

    def strides(self) -> tuple[int, int]:
        """Byte strides of (head, token) inside a block."""
        return self.layout.strides()

    def first_elements(self, ids: np.ndarray, offset: np.ndarray, first_head: int) -> np.ndarray:
        """(R, S) address of (first_head, first token) of each segment in each region."""
        hs, ts = self.strides()
        inner = (first_head - self.layout.heads[0]) * hs + offset * ts
        at: np.ndarray = self.base[:, None] + ids[self.group_row] * self.stride[:, None] + inner
        return at


def _pair_regions(src: KVLayout, dst: KVLayout) -> tuple[_Side, _Side, list[int]]:
    s_map = {r.key: r for r in src.regions}
    d_map = {r.key: r for r in dst.regions}
    if len(s_map) != len(src.regions) or len(d_map) != len(dst.regions):
        raise LayoutError("duplicate region keys")
    if s_map.keys() != d_map.keys():
        diff = sorted(s_map.keys() ^ d_map.keys())
        raise LayoutError(f"region keys differ between source and destination: {diff[:4]}")
    keys = sorted(s_map)
    groups = sorted({k[1] for k in keys})
    row = {g: i for i, g in enumerate(groups)}
    group_row = np.array([row[k[1]] for k in keys], dtype=np.int64)

    def side(lay: KVLayout, by_key: dict[RegionKey, Region]) -> _Side:
        regs = [by_key[k] for k in keys]
        base = np.array([r.base_addr for r in regs], dtype=np.int64)
        stride = np.array([r.block_stride for r in regs], dtype=np.int64)
        return _Side(lay, base, stride, group_row)

    return side(src, s_map), side(dst, d_map), groups


def _segments(t0: int, t1: int, bs: int, bd: int) -> tuple[np.ndarray, np.ndarray]:
    """Split [t0, t1) at every src and dst block boundary; return (starts, lengths)."""
    cuts = np.arange((t0 // bs + 1) * bs, t1, bs, dtype=np.int64)
    if bd != bs:  # t0 is a multiple of bd, so dst boundaries are multiples of bd
        cuts = np.union1d(cuts, np.arange(t0 + bd, t1, bd, dtype=np.int64))
    starts = np.concatenate(([t0], cuts)).astype(np.int64)
    ends = np.concatenate((cuts, [t1])).astype(np.int64)
    return starts, ends - starts


def _block_ids(
    tables: Sequence[Sequence[int]],
    groups: list[int],
    index: np.ndarray,
    num_blocks: int,
    name: str,
) -> np.ndarray:
    """(G, S) block ids: the block that holds each segment, per group."""
    need = int(index[-1]) + 1
    rows = []
    for g in groups:
        if g >= len(tables):
            raise LayoutError(f"{name}: no block table for kv group {g}")
        table = np.asarray(tables[g], dtype=np.int64).reshape(-1)
        if table.size < need:
            raise LayoutError(f"{name}: group {g} has {table.size} blocks, needs {need}")
        used = table[int(index[0]) : need]  # leading P blocks before first_token are not read
        if int(used.min()) < 0 or int(used.max()) >= num_blocks:
            raise LayoutError(f"{name}: group {g} block id outside [0, {num_blocks})")
        rows.append(table[index])
    return np.stack(rows)


Dim = tuple[int, int, int]  # (extent, src byte stride, dst byte stride)


def _coalesce(dims: list[Dim], elem: int) -> tuple[int, list[Dim]]:
    """Fold the dims that are contiguous on both sides into the element size; return it and
    the dims left, outermost (largest src stride) first."""
    left = [d for d in dims if d[0] > 1]  # a dim of extent 1 is contiguous whatever its stride
    while (hit := next((d for d in left if d[1] == d[2] == elem), None)) is not None:
        elem *= hit[0]
        left.remove(hit)
    return elem, sorted(left, key=lambda d: -d[1])


def _raw_pieces(
    s: _Side, s_at: np.ndarray, d: _Side, d_at: np.ndarray, seg_len: np.ndarray, nh: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Address computation: each (region, segment) is a box of nh heads x tokens starting at
    s_at / d_at, coalesced where both sides are contiguous; one piece per element left."""
    (sh, sk), (dh, dk) = s.strides(), d.strides()
    out: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    lengths = np.unique(seg_len)
    for ell in lengths.tolist():  # boxes are rectangular only among equal-length segments
        cols = slice(None) if lengths.size == 1 else np.flatnonzero(seg_len == ell)
        elem, left = _coalesce([(nh, sh, dh), (ell, sk, dk)], s.layout.token_bytes)
        sa, da = s_at[:, cols], d_at[:, cols]
        for extent, s_step, d_step in left:
            idx = np.arange(extent, dtype=np.int64)
            sa = sa[..., None] + idx * s_step
            da = da[..., None] + idx * d_step
        out.append((*_flat(sa, da), np.full(sa.size, elem, dtype=np.int64)))
    if len(out) == 1:
        return out[0]
    src, dst, length = (np.concatenate(parts) for parts in zip(*out, strict=True))
    return src, dst, length


def _flat(sa: np.ndarray, da: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pieces region-major, or segment-major where that is the source's address order
    (block-outermost layouts put a block's layers side by side), so that ``merge`` finds
    them sorted and skips its sort, a large share of planning at 16k tokens (``python -m
    bench.gpu_push`` times planning)."""
    a = sa.reshape(-1)
    if sa.ndim >= 2 and a.size > 1 and not bool((a[1:] > a[:-1]).all()):
        t = np.swapaxes(sa, 0, 1).reshape(-1)
        if bool((t[1:] > t[:-1]).all()):
            return t, np.swapaxes(da, 0, 1).reshape(-1)
    return a, da.reshape(-1)


def plan_transfer(
    src: KVLayout,
    src_blocks: Sequence[Sequence[int]],
    dst: KVLayout,
    dst_blocks: Sequence[Sequence[int]],
    *,
    first_token: int,
    num_tokens: int,
    heads: HeadRange,
) -> Pieces:
    """Pieces that copy tokens [first_token, num_tokens) of global heads `heads`, for every
    region, from `src` (P) to `dst` (D). Both layouts must have passed `validate()`.

    `src_blocks[g]` is P's block table for kv group g, starting at token 0; `dst_blocks[g]`
    is D's, starting at `first_token` (a multiple of D's block size). Tables may be longer
    than needed; the extra blocks are ignored.
    """
    s, d, groups = _pair_regions(src, dst)
    check_same_dtype(src, dst)
    if src.token_bytes != dst.token_bytes:
        raise LayoutError(f"token_bytes differ: {src.token_bytes} != {dst.token_bytes}")
    h0, h1 = heads
    for lay, name in ((src, "source"), (dst, "destination")):
        if not lay.heads[0] <= h0 < h1 <= lay.heads[1]:
            raise LayoutError(f"heads {heads} not inside the {name} range {lay.heads}")
    if first_token % dst.block_size:
        raise LayoutError(f"first_token {first_token} is not a multiple of {dst.block_size}")
    if not 0 <= first_token <= num_tokens:
        raise LayoutError(f"bad token range [{first_token}, {num_tokens})")
    if first_token == num_tokens or not groups:
        return Pieces.empty()
    if src.opaque_blocks or dst.opaque_blocks:
        if src.block_size != dst.block_size:
            raise LayoutError(
                f"block sizes differ ({src.block_size} != {dst.block_size}) but the "
                "block interiors are opaque to us (CPU attention): use one block size"
            )
        num_tokens = -(-num_tokens // dst.block_size) * dst.block_size  # whole blocks only
    starts, seg_len = _segments(first_token, num_tokens, src.block_size, dst.block_size)
    s_idx, s_off = np.divmod(starts, src.block_size)
    d_idx, d_off = np.divmod(starts - first_token, dst.block_size)
    s_ids = _block_ids(src_blocks, groups, s_idx, src.num_blocks, "source")
    d_ids = _block_ids(dst_blocks, groups, d_idx, dst.num_blocks, "destination")
    s_at = s.first_elements(s_ids, s_off, h0)
    d_at = d.first_elements(d_ids, d_off, h0)
    return merge(*_raw_pieces(s, s_at, d, d_at, seg_len, h1 - h0))

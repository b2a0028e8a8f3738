"""The wire description of one rank's KV cache: ``Region`` and ``KVLayout``.

Owns: the msgspec structs a rank publishes (and validates) for its KV cache, and their
address arithmetic (``block_addr``, ``memory_extents``). The TP head split lives in
``heads.py`` and the descriptor planner in ``plan.py``.

Pure: imports numpy, msgspec and ``connector.core.errors`` only. Must not import vllm, nixl,
torch or threading, and reads no clock.
"""

from typing import Annotated, Literal

import msgspec
import numpy as np

from connector.core.errors import LayoutError

MAX_REGIONS = 4096
_MAX_ADDR = 2**63 - 1  # addresses are int64 inside the planner

NonNeg = Annotated[int, msgspec.Meta(ge=0)]
Positive = Annotated[int, msgspec.Meta(gt=0)]
Addr = Annotated[int, msgspec.Meta(ge=0, le=_MAX_ADDR)]
RegionKey = tuple[int, int, int]  # (layer, group, part)


class Region(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The blocks of one (layer, kv group, part) on one rank."""

    layer: NonNeg
    group: NonNeg
    part: Annotated[int, msgspec.Meta(ge=0, le=1)]  # 0: packed K|V (or K); 1: V
    base_addr: Addr  # address of block 0
    block_stride: Positive  # bytes from block b to block b + 1

    @property
    def key(self) -> RegionKey:
        return (self.layer, self.group, self.part)


class KVLayout(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One rank's KV cache: where every block of every region lives, and its inner order."""

    block_size: Positive  # tokens per block
    num_blocks: NonNeg  # blocks per region
    heads: tuple[NonNeg, NonNeg]  # global KV head range [h0, h1) held by this rank
    token_bytes: Positive  # bytes of one (token, head) entry
    order: Literal["HND", "NHD"]  # head-major or token-major inside a block
    regions: Annotated[tuple[Region, ...], msgspec.Meta(max_length=MAX_REGIONS)]
    device_id: NonNeg = 0  # for NIXL descriptors (GPU index, 0 for DRAM)
    mem_type: Literal["DRAM", "VRAM"] = "DRAM"
    # Byte strides of (head, token) inside a block; 0 derives them from `order`. Explicit
    # strides describe e.g. vLLM's CPU cache, where each head holds K[N, D] then V[N, D]:
    # two regions (K, V) per layer, head stride 2*N*D, token stride D.
    head_stride: NonNeg = 0
    token_stride: NonNeg = 0
    # The order of tokens inside a block is private to the attention kernel (vLLM's CPU
    # AMX kernels tile K and V): only whole blocks of a head may move, so partial last
    # blocks travel whole and P and D must use the same block size.
    opaque_blocks: bool = False
    # The KV element type: vLLM's --kv-cache-dtype when it quantizes ("fp8", "fp8_e4m3",
    # "fp8_e5m2": all one byte, so token_bytes cannot tell them apart), else the tensors'
    # dtype ("bfloat16"). "" from a peer that predates the field. P and D must name the
    # same one (``plan_transfer``): the bytes move as they are, never converted.
    dtype: Annotated[str, msgspec.Meta(max_length=32)] = ""

    @property
    def num_heads(self) -> int:
        return self.heads[1] - self.heads[0]

    def strides(self) -> tuple[int, int]:
        """Byte strides of (head, token) inside a block."""
        if self.order == "HND":
            hs, ts = self.block_size * self.token_bytes, self.token_bytes
        else:
            hs, ts = self.token_bytes, self.num_heads * self.token_bytes
        return self.head_stride or hs, self.token_stride or ts

    @property
    def block_bytes(self) -> int:
        """Bytes of one block that hold data (the stride may add padding)."""
        return self.num_heads * self.block_size * self.token_bytes

    @property
    def block_extent(self) -> int:
        """Bytes from a region's block start to the end of its last element in the block."""
        hs, ts = self.strides()
        return (self.num_heads - 1) * hs + (self.block_size - 1) * ts + self.token_bytes

    def occupied(self) -> list[tuple[int, int]]:
        """The byte intervals one region uses inside a block, relative to its start."""
        hs, ts = self.strides()
        tb, nh, n = self.token_bytes, self.num_heads, self.block_size
        if ts == tb:  # tokens contiguous within a head
            runs = [(h * hs, h * hs + n * tb) for h in range(nh)]
        elif hs == tb:  # heads contiguous within a token
            runs = [(t * ts, t * ts + nh * tb) for t in range(n)]
        else:
            runs = [(h * hs + t * ts, h * hs + t * ts + tb) for h in range(nh) for t in range(n)]
        merged: list[list[int]] = []
        for a, b in sorted(runs):
            if merged and a <= merged[-1][1]:
                if a < merged[-1][1]:
                    raise LayoutError("elements of one block overlap (strides too small)")
                merged[-1][1] = b
            else:
                merged.append([a, b])
        return [(a, b) for a, b in merged]

    def region_keys(self) -> tuple[RegionKey, ...]:
        return tuple(r.key for r in self.regions)

    def validate(self) -> None:
        """Raise LayoutError unless the layout is well formed. Run once per received layout."""
        try:  # a struct built in Python skips the Meta constraints; a round trip applies them
            msgspec.convert(msgspec.to_builtins(self), type(self))
        except msgspec.ValidationError as exc:
            raise LayoutError(f"invalid layout: {exc}") from exc
        if self.heads[0] >= self.heads[1]:
            raise LayoutError(f"empty head range {self.heads}")
        if len(set(self.region_keys())) != len(self.regions):
            raise LayoutError("duplicate region keys")
        self.occupied()  # raises if elements of a block overlap
        for r in self.regions:
            if r.block_stride < self.block_extent:
                raise LayoutError(f"region {r.key}: stride {r.block_stride} < {self.block_extent}")
            if r.base_addr + self.num_blocks * r.block_stride > _MAX_ADDR:
                raise LayoutError(f"region {r.key} ends beyond the int64 address space")
        self._check_disjoint()

    def _span(self, r: Region) -> tuple[int, int]:
        # Ends at the last block's data, not its padding: an interleaved region (V behind K
        # inside each block's stride) must not reach past the tensor it lives in.
        if self.num_blocks == 0:
            return r.base_addr, r.base_addr
        return r.base_addr, r.base_addr + (self.num_blocks - 1) * r.block_stride + self.block_extent

    def _check_disjoint(self) -> None:
        live = sorted((r for r in self.regions if self.num_blocks), key=lambda r: r.base_addr)
        if len(live) < 2:
            return
        starts = np.array([r.base_addr for r in live], dtype=np.int64)
        used = self.occupied()
        for i, r in enumerate(live):
            end = self._span(r)[1]
            hi = int(np.searchsorted(starts, end, side="left"))
            for other in live[i + 1 : hi]:
                # Overlapping spans are fine only for regions interleaved block by block:
                # same stride, and neither's elements land on the other's (K and V of one
                # head, cross-layer blocks, [N, 2, ...] tensors).
                gap = (other.base_addr - r.base_addr) % r.block_stride
                if other.block_stride != r.block_stride or _collide(used, gap, r.block_stride):
                    raise LayoutError(f"regions {r.key} and {other.key} overlap in memory")

    def memory_extents(self) -> list[tuple[int, int]]:
        """The (addr, nbytes) spans to register with the transport, touching spans merged."""
        out: list[list[int]] = []
        for start, end in sorted(self._span(r) for r in self.regions):
            if end == start:
                continue
            if out and start <= out[-1][1]:
                out[-1][1] = max(out[-1][1], end)
            else:
                out.append([start, end])
        return [(s, e - s) for s, e in out]


def check_same_dtype(src: KVLayout, dst: KVLayout) -> None:
    """LayoutError unless P's KV (``src``) and D's (``dst``) hold the same element type:
    every transfer path copies bytes as they are, so fp8_e4m3 into fp8_e5m2 (or bf16 into
    fp8) would land as garbage of the right size."""
    if src.dtype != dst.dtype:
        raise LayoutError(
            f"KV dtypes differ: P stores {src.dtype or 'an unnamed dtype'}, D "
            f"{dst.dtype or 'an unnamed dtype'} (start both with the same --kv-cache-dtype)"
        )


def _collide(used: list[tuple[int, int]], gap: int, period: int) -> bool:
    """Do intervals `used` and the same intervals shifted by `gap` intersect, modulo period?"""
    shifted = []
    for a, b in used:
        a2, b2 = a + gap, b + gap
        for lo, hi in ((a2, b2), (a2 - period, b2 - period), (a2 + period, b2 + period)):
            shifted.append((lo, hi))
    return any(a < hi and lo < b for a, b in used for lo, hi in shifted)

"""A KV cache seen as block rows, and the three copies the GPU paths need.

Owns: ``RowTable`` (region r's block b is one contiguous row of ``row_bytes`` bytes),
``block_rows`` (that view of a vLLM KV tensor) and the copies ``gather`` (scattered rows
-> a dense staging slot), ``scatter`` (the mirror) and ``copy_rows`` (scattered ->
scattered, the IPC path). Each runs as one fused Triton launch on CUDA (``kernels.py``,
imported lazily) or as torch ``index_select``/``index_copy_`` elsewhere, so CI checks the
same calls bytewise on CPU tensors. Runs on the caller's current stream; never syncs.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from connector.core.errors import LayoutError

Backend = Literal["auto", "torch", "triton"]
_WORD = 8  # the kernel moves int64 words


def block_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as [num_blocks, row_bytes] uint8 rows, where dim 0 is the block and the dims
    after it are one block's contiguous data (FlashAttention's K is ``kv[0]``, FlashInfer's
    ``kv[:, 0]``; bf16 and fp8 alike)."""
    want, acc = [], 1
    for n in reversed(t.shape[1:]):
        want.append(acc)
        acc *= n
    if t.dim() < 1 or tuple(t.stride()[1:]) != tuple(reversed(want)):
        raise LayoutError("block_rows: the dims after the block dim are not contiguous")
    u = t.view(torch.uint8)
    return u.as_strided((t.shape[0], acc * t.element_size()), (u.stride(0), 1))


@dataclass(frozen=True, eq=False)
class RowTable:
    """Regions of one KV cache as equal-size block rows: what one launch moves."""

    tensors: tuple[torch.Tensor, ...]  # each [num_blocks, row_bytes] uint8, stride(1) == 1
    _tables: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not self.tensors:
            raise LayoutError("RowTable: no regions")
        t0 = self.tensors[0]
        for t in self.tensors:
            if t.dim() != 2 or t.dtype != torch.uint8 or t.stride(1) != 1:
                raise LayoutError("RowTable: regions must be [blocks, row_bytes] uint8 rows")
            if t.shape != t0.shape or t.device != t0.device:
                raise LayoutError("RowTable: regions differ in shape or device")

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor]) -> RowTable:
        return cls(tuple(tensors))

    @property
    def num_regions(self) -> int:
        return len(self.tensors)

    @property
    def num_blocks(self) -> int:
        return int(self.tensors[0].shape[0])

    @property
    def row_bytes(self) -> int:
        return int(self.tensors[0].shape[1])

    @property
    def device(self) -> torch.device:
        return self.tensors[0].device

    def addrs(self) -> list[int]:
        return [int(t.data_ptr()) for t in self.tensors]

    def strides(self) -> list[int]:
        return [int(t.stride(0)) for t in self.tensors]

    def word_tables(self, anchor: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(offsets, strides) in int64 words from ``anchor``, on the device; cached."""
        key = f"w{anchor}"
        if key not in self._tables:
            offs = [(a - anchor) // _WORD for a in self.addrs()]
            strides = [s // _WORD for s in self.strides()]
            dev = self.device
            self._tables[key] = (
                torch.tensor(offs, dtype=torch.int64, device=dev),
                torch.tensor(strides, dtype=torch.int64, device=dev),
            )
        return self._tables[key]  # type: ignore[no-any-return]

    def alignment(self) -> int:
        """The largest of 16, 8, 1 that divides every address, stride and the row size."""
        if "align" not in self._tables:
            vals = [*self.addrs(), *self.strides(), self.row_bytes]
            self._tables["align"] = next(a for a in (16, 8, 1) if all(v % a == 0 for v in vals))
        return int(self._tables["align"])


@functools.cache
def _kernels() -> Any:
    from connector.transfer.gpu import kernels

    return kernels


@functools.cache
def _anchor(device: torch.device) -> torch.Tensor:
    return torch.zeros(2, dtype=torch.int64, device=device)  # 256-byte aligned allocation


def triton_usable(device: torch.device) -> bool:
    """Triton is importable and can drive ``device`` (CUDA; or CPU in interpreter mode)."""
    try:
        _kernels()
    except ImportError:
        return False
    if device.type == "cuda":
        return True
    import os

    return os.environ.get("TRITON_INTERPRET") == "1"


def _pick(backend: Backend, device: torch.device, *tables: RowTable, dense: int = 16) -> str:
    if backend != "auto":
        return backend
    if device.type != "cuda" or not triton_usable(device):
        return "torch"
    ok = all(t.alignment() >= _WORD for t in tables) and dense % _WORD == 0
    return "triton" if ok else "torch"


def _ids(ids: torch.Tensor, device: torch.device) -> torch.Tensor:
    if ids.dtype != torch.int64 or ids.device != device or ids.dim() != 1:
        raise LayoutError("block ids must be a 1-d int64 tensor on the KV cache's device")
    return ids


def _slot(out: torch.Tensor, nregions: int, n: int, row: int) -> torch.Tensor:
    if out.dtype != torch.uint8 or out.dim() != 1 or not out.is_contiguous():
        raise LayoutError("staging slot must be a contiguous 1-d uint8 tensor")
    if out.numel() < nregions * n * row:
        raise LayoutError(f"staging slot holds {out.numel()} bytes, needs {nregions * n * row}")
    return out[: nregions * n * row].view(nregions, n, row)


def _vec(anchor: torch.Tensor, *tables: RowTable, dense: int | None = None) -> int:
    """Words per load the kernel may assume aligned: 2 (16 bytes) or 1."""
    vals = [anchor.data_ptr()] + ([dense] if dense is not None else [])
    ok = all(v % 16 == 0 for v in vals) and all(t.alignment() == 16 for t in tables)
    return 2 if ok else 1


def gather(
    src: RowTable,
    ids: torch.Tensor,
    out: torch.Tensor,
    regions: tuple[int, int] | None = None,
    backend: Backend = "auto",
    tune: Any = None,
) -> None:
    """Rows ``ids`` of regions [r0, r1) into ``out`` (a staging slot), region-major."""
    _dense_copy(src, ids, out, regions, backend, tune, into_slot=True)


def scatter(
    stage: torch.Tensor,
    dst: RowTable,
    ids: torch.Tensor,
    regions: tuple[int, int] | None = None,
    backend: Backend = "auto",
    tune: Any = None,
) -> None:
    """The mirror of ``gather``: ``stage``'s rows into rows ``ids`` of regions [r0, r1)."""
    _dense_copy(dst, ids, stage, regions, backend, tune, into_slot=False)


def _dense_copy(
    table: RowTable,
    ids: torch.Tensor,
    slot: torch.Tensor,
    regions: tuple[int, int] | None,
    backend: Backend,
    tune: Any,
    *,
    into_slot: bool,
) -> None:
    """``gather`` (``into_slot``) and ``scatter``: one copy between rows ``ids`` of
    ``table`` and the dense ``slot``, only its direction differs."""
    r0, r1 = regions or (0, table.num_regions)
    n, row = int(ids.numel()), table.row_bytes
    view = _slot(slot, r1 - r0, n, row)
    _ids(ids, table.device)
    if _pick(backend, table.device, table, dense=slot.data_ptr()) == "triton":
        a = _anchor(table.device)
        offs, strides = table.word_tables(a.data_ptr())
        rows = (offs[r0:r1], strides[r0:r1], ids)
        dense = (slot.data_ptr() - a.data_ptr()) // _WORD
        src, dst = (rows, dense) if into_slot else (dense, rows)
        _kernels().launch_copy_rows(
            a,
            src,
            dst,
            num_regions=r1 - r0,
            n_rows=n,
            row_words=row // _WORD,
            vec=_vec(a, table, dense=slot.data_ptr()),
            tune=tune,
        )
        return
    for k, t in enumerate(table.tensors[r0:r1]):
        if into_slot:
            torch.index_select(t, 0, ids, out=view[k])
        else:
            t.index_copy_(0, ids, view[k])


def copy_rows(
    src: RowTable,
    src_ids: torch.Tensor,
    dst: RowTable,
    dst_ids: torch.Tensor,
    regions: tuple[int, int] | None = None,
    backend: Backend = "auto",
    tune: Any = None,
) -> None:
    """Rows ``src_ids`` of ``src`` straight into rows ``dst_ids`` of ``dst`` (same region
    order and row size): the IPC path, where ``dst`` is mapped from D's process."""
    if (src.num_regions, src.row_bytes) != (dst.num_regions, dst.row_bytes):
        raise LayoutError("copy_rows: source and destination regions differ")
    if src_ids.numel() != dst_ids.numel():
        raise LayoutError("copy_rows: as many destination ids as source ids")
    r0, r1 = regions or (0, src.num_regions)
    _ids(src_ids, src.device)
    _ids(dst_ids, dst.device)
    if _pick(backend, src.device, src, dst) == "triton":
        a = _anchor(src.device)
        s_offs, s_strides = src.word_tables(a.data_ptr())
        d_offs, d_strides = dst.word_tables(a.data_ptr())
        _kernels().launch_copy_rows(
            a,
            (s_offs[r0:r1], s_strides[r0:r1], src_ids),
            (d_offs[r0:r1], d_strides[r0:r1], dst_ids),
            num_regions=r1 - r0,
            n_rows=int(src_ids.numel()),
            row_words=src.row_bytes // _WORD,
            vec=_vec(a, src, dst),
            tune=tune,
        )
        return
    for s, d in zip(src.tensors[r0:r1], dst.tensors[r0:r1], strict=True):
        d.index_copy_(0, dst_ids, s.index_select(0, src_ids))

"""The ``wsum64`` KV digest: a position-weighted sum of a byte stream, on the memory's device.

Owns: the algorithm's definition (``weight``, ``reference``) and ``digest_runs``, its torch
computation over (address, length) runs of this process's memory, host (DRAM) or GPU
(VRAM), so KV in GPU memory is digested where it lies, with no copy to the host (on CUDA
by one Triton kernel, ``gpu.wsum_kernel``, elsewhere by torch ops). Which runs, in which
order: ``connector.core.digest_ranges``.

Definition. The stream (the runs' bytes, concatenated) is zero-padded to a multiple of 4
and read as little-endian signed int32 words ``x_k``; the digest is
``sum_k w_k * x_k mod 2**64`` with bit 63 cleared (msgpack's int64), where word ``k`` lies
in page ``c = k >> 16`` at ``j = k & 0xFFFF`` and ``w_k = M[c] * T[j] mod 2**64``:
``T[j] = 2j+1 + (mix(j) << 17)``, ``M[c] = 1 + (c << 17) + (mix(c ^ SALT) << 32)``
(``mix``: splitmix64's finaliser). It depends on the bytes and their offsets in the
stream only, so any cut of the stream into runs, on P or on D, gives the same digest, and
the sum can be taken in any order (a run never needs its neighbours).

Collisions: every ``w_k`` is odd, so a change of one word (a byte flipped anywhere) always
changes the digest; below 2**31 words (8 GiB) the ``w_k`` differ mod 2**32, so swapping two
different words always changes it (the change, ``(a-b)(w_k-w_l)``, has at most 31 + 31
factors of 2); other corruptions collide with a probability of about 2**-63 for unrelated
data, like any 63-bit hash (no protection against a forger: the weights are public).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from connector.core.digest_ranges import Runs

PAGE_BITS = 16  # words per page: 2**16 (256 KiB)
PAGE = 1 << PAGE_BITS
SALT = 0x5DEECE66D
MASK63 = (1 << 63) - 1
CHUNK_BYTES = 64 << 20  # stream bytes per gather: bounds the temporaries (x3 of it)
MAX_ROWS = 1 << 20  # rows per gather: bounds the index tensors when runs are tiny


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's output function over uint64 (wrapping)."""
    z = z + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


@functools.cache
def _page_weights() -> np.ndarray:
    j = np.arange(PAGE, dtype=np.uint64)
    with np.errstate(over="ignore"):
        return (np.uint64(2) * j + np.uint64(1) + (_mix(j) << np.uint64(17))).view(np.int64)


def _page_multipliers(first: int, count: int) -> np.ndarray:
    c = np.arange(first, first + count, dtype=np.uint64)
    with np.errstate(over="ignore"):
        m = np.uint64(1) + (c << np.uint64(17)) + (_mix(c ^ np.uint64(SALT)) << np.uint64(32))
    return m.view(np.int64)


def weights(k: np.ndarray) -> np.ndarray:
    """``w_k`` as uint64, for stream word indices ``k``."""
    k = np.asarray(k, dtype=np.uint64)
    t = _page_weights().view(np.uint64)[k & np.uint64(PAGE - 1)]
    m = _page_multipliers(0, int(k.max()) // PAGE + 1).view(np.uint64)[k >> np.uint64(PAGE_BITS)]
    with np.errstate(over="ignore"):
        return m * t


def reference(data: bytes) -> int:
    """The definition in numpy's wrapping uint64, word by word (tests pin ``digest_runs``,
    which takes another route, to it)."""
    padded = data + b"\0" * (-len(data) % 4)
    x = np.frombuffer(padded, dtype="<i4").astype(np.int64).view(np.uint64)
    with np.errstate(over="ignore"):
        total = np.sum(weights(np.arange(x.size)) * x, dtype=np.uint64)
    return int(total) & MASK63


# ------------------------------------------------------------------ memory as tensors
def _interface(addr: int, n: int) -> dict[str, Any]:
    """numpy's and CUDA's array interface (version 3) of ``n`` bytes at ``addr``."""
    return {"data": (addr, False), "shape": (n,), "typestr": "|u1", "version": 3}


class _HostSpan:
    def __init__(self, addr: int, n: int) -> None:
        self.__array_interface__ = _interface(addr, n)


class _DeviceSpan:
    def __init__(self, addr: int, n: int) -> None:
        self.__cuda_array_interface__ = _interface(addr, n)


def span_tensor(addr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """The ``nbytes`` at ``addr`` of this process as a uint8 tensor on ``device`` (no copy;
    the memory must outlive it). Only the bytes of the runs asked for are ever read."""
    if device.type == "cuda":
        return torch.as_tensor(_DeviceSpan(addr, nbytes), device=device)
    return torch.from_numpy(np.asarray(_HostSpan(addr, nbytes)))


@dataclass(frozen=True)
class _Tables:
    page: torch.Tensor  # T, int64 [PAGE]
    stream: Any  # the side stream digests run on (CUDA), or None


@functools.cache
def _tables(device: torch.device) -> _Tables:
    if device.type != "cuda":
        return _Tables(torch.from_numpy(_page_weights().copy()), None)
    # Its own stream: not serialised behind the engine's forward on the default stream.
    stream = torch.cuda.Stream(device)
    with torch.cuda.stream(stream):
        page = torch.from_numpy(_page_weights().copy()).to(device)
    stream.synchronize()
    return _Tables(page, stream)


def _unit(rel: np.ndarray, length: np.ndarray) -> int:
    """The largest power of two up to 4096 dividing every run's offset and length: rows of
    this many bytes tile every run, so one gather of whole rows reads the stream."""
    g = int(np.bitwise_or.reduce(np.concatenate([rel, length]))) | 4096
    return g & -g


def digest_runs(runs: Runs, device: torch.device | str) -> int:
    """The digest of the bytes at these (address, length) runs of this process, in order;
    ``device``: where they are (``cpu``, or the CUDA device of KV in GPU memory)."""
    device = torch.device(device)
    addr, length = np.asarray(runs[0], dtype=np.int64), np.asarray(runs[1], dtype=np.int64)
    keep = length > 0
    addr, length = addr[keep], length[keep]
    if addr.size == 0:
        return 0
    base = int(addr.min())
    rel = addr - base
    unit = _unit(rel, length)
    span = span_tensor(base, int((rel + length).max()), device)
    rows = span[: span.numel() // unit * unit].view(-1, unit)
    tables = _tables(device)
    ctx = torch.cuda.stream(tables.stream) if tables.stream is not None else nullcontext()
    with ctx, torch.inference_mode():
        if _backend(device, unit) == "triton":
            total = _sum_rows_kernel(span, rel // unit, length // unit, unit, tables.page)
        else:
            total = _sum_rows(rows, rel // unit, length // unit, unit, tables.page)
        return int(total.item()) & MASK63


def _backend(device: torch.device, unit: int) -> str:
    """``triton`` (one fused kernel) on CUDA where rows are whole words and Triton imports;
    ``torch`` elsewhere. ``PUSHKV_WSUM_BACKEND=torch|triton`` forces one (benchmarks,
    tests under Triton's interpreter)."""
    forced = os.environ.get("PUSHKV_WSUM_BACKEND", "auto")
    if forced in ("torch", "triton"):
        return forced if unit % 4 == 0 else "torch"
    if device.type != "cuda" or unit % 4:
        return "torch"
    return "triton" if importlib.util.find_spec("triton") is not None else "torch"


def _stream_rows(first: torch.Tensor, cum: torch.Tensor, r0: int, r1: int) -> torch.Tensor:
    """The source row of each stream row ``r0 .. r1`` (runs ``first[i]``, ``cum``: their
    stream rows' running total)."""
    r = torch.arange(r0, r1, dtype=torch.int64, device=first.device)
    run = torch.searchsorted(cum, r, right=True) - 1
    return first[run] + (r - cum[run])


def _sum_rows_kernel(
    span: torch.Tensor, first: np.ndarray, count: np.ndarray, unit: int, page: torch.Tensor
) -> torch.Tensor:
    """``_sum_rows`` by ``gpu.wsum_kernel``: the runs' bytes are read once, in place."""
    from connector.transfer.gpu import wsum_kernel

    dev = span.device
    row_words = unit // 4
    words = span.view(torch.int32)  # span's length is a multiple of unit
    cum = np.concatenate([[0], np.cumsum(count)])
    n_rows = int(cum[-1])
    mult = torch.from_numpy(_page_multipliers(0, -(-n_rows * row_words // PAGE))).to(dev)
    first_d, cum_d = torch.from_numpy(first).to(dev), torch.from_numpy(cum).to(dev)
    per = max(1, wsum_kernel.BLOCK_WORDS // row_words)  # a launch starts on a program's rows
    step = -(-MAX_ROWS // per) * per
    total = torch.zeros((), dtype=torch.int64, device=dev)
    for r0 in range(0, n_rows, step):
        src = _stream_rows(first_d, cum_d, r0, min(n_rows, r0 + step))
        total += wsum_kernel.sum_rows(words, src, r0, row_words, page, mult)
    return total


def _sum_rows(
    rows: torch.Tensor, first: np.ndarray, count: np.ndarray, unit: int, page: torch.Tensor
) -> torch.Tensor:
    """Sum over the stream of ``rows[first[i] : first[i] + count[i]]`` for each run i."""
    dev = rows.device
    cum = np.concatenate([[0], np.cumsum(count)])
    n_rows = int(cum[-1])
    page_bytes = 4 * PAGE
    # Gathers of whole pages (but the last), bounded in bytes and in rows.
    chunk = max(page_bytes, min(CHUNK_BYTES, MAX_ROWS * unit) // page_bytes * page_bytes)
    chunk_rows = chunk // unit
    n_pages = -(-n_rows * unit // page_bytes)
    mult = torch.from_numpy(_page_multipliers(0, n_pages)).to(dev, non_blocking=False)
    first_d = torch.from_numpy(first).to(dev)
    cum_d = torch.from_numpy(cum).to(dev)
    total = torch.zeros((), dtype=torch.int64, device=dev)
    for r0 in range(0, n_rows, chunk_rows):
        idx = _stream_rows(first_d, cum_d, r0, min(n_rows, r0 + chunk_rows))
        data = rows.index_select(0, idx).view(-1)  # this chunk of the stream, in order
        if data.numel() % 4:
            data = torch.cat([data, data.new_zeros(4 - data.numel() % 4)])
        words = data.view(torch.int32)
        p0 = r0 * unit // page_bytes
        full = words.numel() // PAGE
        if full:
            sums = page_sums(words[: full * PAGE].view(full, PAGE), page, fused=dev.type == "cuda")
            total += (sums * mult[p0 : p0 + full]).sum()
        tail = words[full * PAGE :]
        if tail.numel():
            total += page_sums(tail.view(1, -1), page, fused=False)[0] * mult[p0 + full]
    return total


def page_sums(words: torch.Tensor, page: torch.Tensor, *, fused: bool) -> torch.Tensor:
    """``sum_j words[p, j] * T[j]`` per page p, int64 wrapping. ``fused``: one kernel that
    widens the int32 words as it multiplies (CUDA: half the memory traffic); torch's CPU
    kernels are faster widening first (the mixed-type product is not vectorised there)."""
    t = page[: words.shape[1]]
    if fused:
        return (words * t).sum(dim=1)
    return words.to(torch.int64).mul_(t).sum(dim=1)

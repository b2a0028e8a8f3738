"""KV integrity (optional, ``kv_checksum_every``): P's digest of what it pushes, D's check.

Owns: which transfers are checked (``sampled``), which algorithm a transfer's digest uses
(``algo_for``), the digest of byte runs in this process's memory (``digest_runs``), P's
digest of a planned transfer (``source_digest``) and D's verdict on its blocks
(``verdict``, ``verify``). Which runs, in which order: ``connector.core.digest_ranges``.
Both run on the transfer thread, never on the engine's loop.

Two algorithms, named in ``KvDigest.algo``:
- ``crc32`` (zlib, over memoryviews of the KV in DRAM): P and D both in host memory, what
  every D since the first digest checks.
- ``wsum64`` (``connector.transfer.wsum``, torch): KV in GPU memory on either side, summed
  on the device where it lies (no copy to the host); a position-weighted sum that does not
  depend on how the stream is cut, so P and D agree whatever their layouts.
A D that cannot compute a digest's algorithm (an older D, no torch, crc32 over GPU memory)
skips it with the reason (``verdict``), never fails the load for it.
"""

from __future__ import annotations

import ctypes
import enum
import logging
import zlib
from typing import NamedTuple

import numpy as np
from msgspec import UNSET, UnsetType

from connector.core import messages as m
from connector.core.digest_ranges import Runs, dest_runs, source_runs
from connector.core.errors import LayoutError
from connector.core.events import Expected
from connector.core.heads import HeadRange
from connector.core.layout import KVLayout
from connector.core.plan import Pieces
from connector.core.stages import layers_view

logger = logging.getLogger(__name__)

CRC32 = "crc32"
WSUM64 = "wsum64"
_DEVICE_ERRORS = (RuntimeError, TypeError, ValueError)  # torch's, CUDA's among them


class Check(str, enum.Enum):
    """D's verdict on one completion's digest (``pushkv.kv_check``, counter ``kv_check_``)."""

    OK = "ok"
    MISMATCH = "mismatch"
    SKIPPED = "skipped"  # no digest, an algorithm or memory we cannot read, or off here


def sampled(transfer_id: str, every: int) -> bool:
    """Checked: every transfer (1), one in ``every`` (chosen by its id, so every P rank of a
    transfer agrees), or none (0)."""
    if every <= 0:
        return False
    return every == 1 or zlib.crc32(transfer_id.encode()) % every == 0


class Verdict(NamedTuple):
    check: Check
    reason: str  # why, for a skip or a mismatch ("" when ok)


def algo_for(src_mem: str, dst_mem: str) -> str:
    """P's choice: CRC-32 where both sides hold the KV in host memory (an older D checks
    it), the device sum where either holds it in GPU memory (its reader reads it there)."""
    return CRC32 if src_mem == dst_mem == "DRAM" else WSUM64


def device_of(layout: KVLayout) -> str:
    """The torch device of a layout's memory."""
    return f"cuda:{layout.device_id}" if layout.mem_type == "VRAM" else "cpu"


def cannot_compute(algo: str, layout: KVLayout) -> str:
    """Why this process cannot compute ``algo`` over ``layout``'s memory ("" if it can)."""
    if algo == CRC32:
        return "" if layout.mem_type == "DRAM" else "crc32 is not computed over GPU memory"
    if algo != WSUM64:
        return f"unknown algorithm {algo!r}"
    try:
        import torch
    except ImportError:
        return "wsum64 needs torch, not installed here"
    if layout.mem_type == "VRAM" and not torch.cuda.is_available():
        return "wsum64 over GPU memory, but CUDA is not available here"
    return ""


def digest_runs(runs: Runs, algo: str = CRC32, layout: KVLayout | None = None) -> int:
    """The ``algo`` digest of the bytes at these (address, length) runs of this process, in
    order; ``layout``: whose memory they are in (wsum64 reads it on that device)."""
    if algo == WSUM64:
        from connector.transfer import wsum  # torch: only where a digest of this kind is due

        return wsum.digest_runs(runs, device_of(layout) if layout is not None else "cpu")
    if algo != CRC32:
        raise ValueError(f"unknown digest algorithm {algo!r}")
    crc = 0
    for addr, n in zip(runs[0].tolist(), runs[1].tolist(), strict=True):
        crc = zlib.crc32((ctypes.c_char * n).from_address(addr), crc)
    return crc


def source_digest(
    layout: KVLayout,
    pieces: Pieces,
    heads: HeadRange,
    dst_mem: str = "DRAM",
    layers: tuple[int, int] | None = None,
) -> m.KvDigest | None:
    """P: the digest of a transfer's source bytes in D's address order (``dst_mem``: where D
    holds its KV, which picks the algorithm); None where this process cannot compute it.
    ``layers``: a pipeline stage's [first, end), the only layers it wrote (D checks those)."""
    algo = algo_for(layout.mem_type, dst_mem)
    why = cannot_compute(algo, layout)
    if why:
        logger.debug("No KV digest: %s", why)
        return None
    runs = source_runs(pieces)
    try:
        value = digest_runs(runs, algo, layout)
    except _DEVICE_ERRORS as exc:  # a device error must not end the transfer thread
        logger.warning("No KV digest: %s failed: %s", algo, exc)
        return None
    return m.KvDigest(
        algo=algo,
        value=value,
        nbytes=int(runs[1].sum()),
        heads=(heads[0], heads[1]),
        layers=layers if layers is not None else UNSET,
    )


def verify(layout: KVLayout, expected: Expected, digest: m.KvDigest | None) -> Check:
    """``verdict`` without its reason."""
    return verdict(layout, expected, digest).check


def verdict(layout: KVLayout, expected: Expected, digest: m.KvDigest | None) -> Verdict:
    """D: do its blocks hold what P says it wrote? ``expected``: the registration's blocks
    and tokens. A digest D cannot check (no digest, an algorithm it cannot compute over its
    memory) is skipped; heads outside D's own range or a byte count that differs are a
    mismatch."""
    if digest is None:
        return Verdict(Check.SKIPPED, "no digest")
    why = cannot_compute(digest.algo, layout)
    if why:
        return Verdict(Check.SKIPPED, why)
    h0, h1 = digest.heads
    if not layout.heads[0] <= h0 < h1 <= layout.heads[1]:
        return Verdict(Check.MISMATCH, f"heads {h0}..{h1} outside this rank's")
    try:
        if not isinstance(digest.layers, UnsetType):  # a P pipeline stage: its layers only
            layout = layers_view(layout, digest.layers)
        runs = dest_runs(
            layout,
            expected.block_ids,
            first_token=expected.first_token,
            num_tokens=expected.num_tokens,
            heads=(h0, h1),
        )
    except LayoutError as exc:
        return Verdict(Check.MISMATCH, str(exc))
    if int(np.sum(runs[1])) != digest.nbytes:
        return Verdict(
            Check.MISMATCH, f"{digest.nbytes} bytes, this rank's blocks hold {np.sum(runs[1])}"
        )
    try:
        value = digest_runs(runs, digest.algo, layout)
    except _DEVICE_ERRORS as exc:  # cannot tell: not a mismatch
        return Verdict(Check.SKIPPED, f"{digest.algo} failed: {exc}")
    if value != digest.value:
        return Verdict(Check.MISMATCH, f"{digest.algo} differs")
    return Verdict(Check.OK, "")

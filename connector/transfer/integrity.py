"""KV integrity (optional, ``kv_checksum_every``): P's digest of what it pushes, D's check.

Owns: which transfers are checked (``sampled``), the digest of byte runs in this process's
memory (``digest_runs``), P's digest of a planned transfer (``source_digest``) and D's
verdict on its blocks (``verify``). Which runs, in which order: ``connector.core.digest_ranges``.
Both run on the transfer thread, never on the engine's loop.

The digest is CRC-32 (zlib, over memoryviews of the KV in DRAM): everywhere, vectorised in C,
and a byte flipped anywhere changes it. KV in GPU memory is not read here (a device kernel
would compute it: TODO, issue 31); such transfers carry no digest and D skips the check.
"""

from __future__ import annotations

import ctypes
import enum
import zlib

import numpy as np

from connector.core import messages as m
from connector.core.digest_ranges import Runs, dest_runs, source_runs
from connector.core.errors import LayoutError
from connector.core.events import Expected
from connector.core.heads import HeadRange
from connector.core.layout import KVLayout
from connector.core.plan import Pieces

ALGO = "crc32"


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


def digest_runs(runs: Runs) -> int:
    """CRC-32 of the bytes at these (address, length) runs of this process, in order."""
    crc = 0
    for addr, n in zip(runs[0].tolist(), runs[1].tolist(), strict=True):
        crc = zlib.crc32((ctypes.c_char * n).from_address(addr), crc)
    return crc


def source_digest(layout: KVLayout, pieces: Pieces, heads: HeadRange) -> m.KvDigest | None:
    """P: the digest of a transfer's source bytes in D's address order; None where the KV
    is not in DRAM."""
    if layout.mem_type != "DRAM":
        return None  # TODO(issue 31): a device kernel over the same runs
    runs = source_runs(pieces)
    return m.KvDigest(
        algo=ALGO, value=digest_runs(runs), nbytes=int(runs[1].sum()), heads=(heads[0], heads[1])
    )


def verify(layout: KVLayout, expected: Expected, digest: m.KvDigest | None) -> Check:
    """D: do its blocks hold what P says it wrote? ``expected``: the registration's blocks
    and tokens. A digest D cannot check (another algorithm, KV in GPU memory) is skipped;
    heads outside D's own range or a byte count that differs are a mismatch."""
    if digest is None or digest.algo != ALGO or layout.mem_type != "DRAM":
        return Check.SKIPPED
    h0, h1 = digest.heads
    if not layout.heads[0] <= h0 < h1 <= layout.heads[1]:
        return Check.MISMATCH
    try:
        runs = dest_runs(
            layout,
            expected.block_ids,
            first_token=expected.first_token,
            num_tokens=expected.num_tokens,
            heads=(h0, h1),
        )
    except LayoutError:
        return Check.MISMATCH
    if int(np.sum(runs[1])) != digest.nbytes:
        return Check.MISMATCH
    return Check.OK if digest_runs(runs) == digest.value else Check.MISMATCH

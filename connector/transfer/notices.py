"""What P tells D besides the KV itself: completion and failure notices.

Owns: ``Notices``, which builds those frames, sealed when a secret is set
(``connector.transfer.guard``), and the digest of the KV that a sampled transfer's
completion carries for D to check (``connector.transfer.integrity``). Sending them is the
caller's job.
"""

from __future__ import annotations

import logging

from connector.core import events as ev
from connector.core import messages as m
from connector.core.errors import LayoutError
from connector.core.heads import HeadRange
from connector.core.layout import KVLayout
from connector.core.plan import Pieces
from connector.core.stages import layer_span
from connector.transfer.guard import Guard
from connector.transfer.integrity import sampled, source_digest
from connector.transfer.topology import RankInfo
from connector.transfer.write_plan import plan_direct
from telemetry.counts import Counts
from telemetry.schema import Count

logger = logging.getLogger(__name__)


class Notices:
    def __init__(
        self,
        me: RankInfo,
        codec: Guard,
        counters: Counts,
        checksum_every: int = 0,
    ) -> None:
        """``checksum_every``: send a digest of the KV with one transfer in this many (0:
        none)."""
        self.me, self.codec, self.counters = me, codec, counters
        self.checksum_every = checksum_every

    def completion(
        self, tid: str, nbytes: int, descs: int, digest: m.KvDigest | None = None
    ) -> bytes:
        return self.codec.encode(
            m.Completion(
                transfer_id=tid,
                p_rank=self.me.source_rank,
                p_tp_size=self.me.tp_size,
                bytes_total=nbytes,
                descriptors=descs,
                digest=digest,
            )
        )

    def fail(self, tid: str, reason: m.FailReason) -> bytes:
        return self.codec.encode(m.Fail(transfer_id=tid, p_rank=self.me.source_rank, reason=reason))

    def digest(
        self, tid: str, src: KVLayout, pieces: Pieces, heads: HeadRange, dst_mem: str
    ) -> m.KvDigest | None:
        """The digest of our KV (in ``src``) for D to check, where this transfer is sampled
        (before the WRITE is posted: the digest travels in its own notification)."""
        if not sampled(tid, self.checksum_every) or pieces.count == 0:
            return None
        layers = layer_span(src) if self.me.pp_size > 1 else None  # a stage's layers only
        digest = source_digest(src, pieces, heads, dst_mem, layers)
        self.counters.add(Count.KV_DIGESTS if digest is not None else Count.KV_DIGESTS_SKIPPED)
        return digest

    def path_digest(
        self,
        tid: str,
        src: KVLayout,
        reg: m.Register,
        src_blocks: ev.BlockTable,
        heads: HeadRange,
    ) -> m.KvDigest | None:
        """The digest of a write on another path than direct (IPC): the same bytes in the
        same order as direct would write them, so D checks them alike. Planned only for a
        sampled transfer (the plan is what such paths skip for speed)."""
        if not sampled(tid, self.checksum_every):
            return None
        try:
            pieces = plan_direct(src, src_blocks, reg, heads)
        except LayoutError as exc:  # the path copies what the planner cannot describe
            logger.warning("Transfer %s: no KV digest on its path: %s", tid, exc)
            self.counters.add(Count.KV_DIGESTS_SKIPPED)
            return None
        return self.digest(tid, src, pieces, heads, reg.layout.mem_type)

"""Who writes which KV heads to whom, for one P rank or one D rank, cached per TP size.

Owns: the rank identity (`RankInfo`) and the head-split answers the endpoints need. Pure
(built on core.heads and core.stages); no vLLM, no NIXL.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from connector.core.heads import HeadRange, assign_writers, head_range, sources_of, targets_of
from connector.core.messages import PeerAddr
from connector.core.stages import source_rank


@dataclass(frozen=True)
class RankInfo:
    """One rank of one engine, and where its transport agent listens: its TP rank
    (``rank``) and, on a P with pipeline stages, its stage."""

    engine_id: str
    rank: int
    tp_size: int
    addr: PeerAddr
    pp_stage: int = 0
    pp_size: int = 1

    @property
    def source_rank(self) -> int:
        """This rank as a source of KV, in P's completions and doorbells: its TP rank at
        PP 1, else its rank among the engine's workers (``core.stages.source_rank``)."""
        return source_rank(self.pp_stage, self.rank, self.tp_size)


@lru_cache(maxsize=256)
def _assignment(p_tp: int, d_tp: int, num_kv_heads: int) -> dict[tuple[int, int], HeadRange]:
    return assign_writers(
        [head_range(p, p_tp, num_kv_heads) for p in range(p_tp)],
        [head_range(d, d_tp, num_kv_heads) for d in range(d_tp)],
    )


@dataclass(frozen=True)
class Topology:
    """The head split between a P engine of ``p_tp`` ranks and D engines of any TP size."""

    num_kv_heads: int
    p_tp: int

    def targets(self, p_rank: int, d_tp: int) -> frozenset[int]:
        """D ranks that ``p_rank`` writes into."""
        return frozenset(targets_of(_assignment(self.p_tp, d_tp, self.num_kv_heads), p_rank))

    def writes_any(self, p_rank: int) -> bool:
        """Whether ``p_rank`` writes into any D rank, whatever D's TP size. A head's writer
        is the lowest P rank holding it and every D engine holds every head, so a P rank
        writes for one D TP size iff it writes for all; D TP 1 answers for them. False: a
        replica (MLA's latent on P ranks past 0, GQA heads on P TP > heads) nobody reads."""
        return bool(self.targets(p_rank, 1))

    def sources(self, d_rank: int, d_tp: int) -> tuple[int, ...]:
        """P ranks that write into ``d_rank``: one completion is expected from each."""
        return sources_of(_assignment(self.p_tp, d_tp, self.num_kv_heads), d_rank)

    def heads(self, p_rank: int, d_rank: int, d_tp: int) -> HeadRange:
        """Global KV heads ``p_rank`` writes into ``d_rank``."""
        return _assignment(self.p_tp, d_tp, self.num_kv_heads)[(p_rank, d_rank)]

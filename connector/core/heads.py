"""The TP head split: which KV heads each rank holds and which P rank writes them to which D rank.

Owns: ``head_range`` (vLLM's split, GQA replication), ``assign_writers`` and its views
``sources_of``/``targets_of``. Pure: imports ``connector.core.errors`` only.
"""

from collections.abc import Sequence

from connector.core.errors import LayoutError

HeadRange = tuple[int, int]  # global KV heads [h0, h1)


def head_range(tp_rank: int, tp_size: int, num_kv_heads: int) -> HeadRange:
    """The global KV heads [h0, h1) held by one TP rank (vLLM's split, GQA replication)."""
    if tp_size <= 0 or num_kv_heads <= 0 or not 0 <= tp_rank < tp_size:
        raise LayoutError(f"bad TP rank {tp_rank}/{tp_size} for {num_kv_heads} heads")
    if tp_size <= num_kv_heads:
        if num_kv_heads % tp_size:
            raise LayoutError(f"{num_kv_heads} KV heads do not split over TP {tp_size}")
        per = num_kv_heads // tp_size
        return (tp_rank * per, (tp_rank + 1) * per)
    if tp_size % num_kv_heads:
        raise LayoutError(f"TP {tp_size} is not a multiple of {num_kv_heads} KV heads")
    head = tp_rank // (tp_size // num_kv_heads)
    return (head, head + 1)


def assign_writers(
    p_heads: Sequence[HeadRange], d_heads: Sequence[HeadRange]
) -> dict[tuple[int, int], HeadRange]:
    """Map (p_rank, d_rank) to the heads P rank p writes into D rank d.

    Every head of every D rank gets exactly one writer: the lowest P rank that holds it, so
    replicated P ranks (P TP > heads) do not write the same bytes twice.
    """
    out: dict[tuple[int, int], HeadRange] = {}
    for d, (d0, d1) in enumerate(d_heads):
        got: dict[int, list[int]] = {}
        for h in range(d0, d1):
            writer = next((p for p, (p0, p1) in enumerate(p_heads) if p0 <= h < p1), None)
            if writer is None:
                raise LayoutError(f"head {h} of D rank {d} is held by no P rank")
            got.setdefault(writer, []).append(h)
        for p, hs in got.items():
            if hs[-1] - hs[0] + 1 != len(hs):
                raise LayoutError(f"P rank {p} would write non-contiguous heads {hs} to D {d}")
            out[(p, d)] = (hs[0], hs[-1] + 1)
    return dict(sorted(out.items()))


def sources_of(assignment: dict[tuple[int, int], HeadRange], d_rank: int) -> tuple[int, ...]:
    """The P ranks that write into D rank `d_rank` (D waits for one completion from each)."""
    return tuple(sorted(p for p, d in assignment if d == d_rank))


def targets_of(assignment: dict[tuple[int, int], HeadRange], p_rank: int) -> tuple[int, ...]:
    """The D ranks that P rank `p_rank` writes into."""
    return tuple(sorted(d for p, d in assignment if p == p_rank))

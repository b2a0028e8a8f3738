"""Pipeline stages on P (connector/core/stages.py): who is which source, what D waits for,
and what each stage may write of D's KV.

The counting rule: D waits for one completion per (writing P TP rank, P stage), and every
(D rank, layer, head) is written by exactly one of those, for every head count, TP sizes on
both sides, stage count and split of the layers into stages. D reports a transfer exactly
once, when the last of those sources answers, ok only if every one completed.
"""

from __future__ import annotations

import itertools
import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from connector.core import events as ev
from connector.core.errors import LayoutError
from connector.core.heads import head_range
from connector.core.layout import KVLayout, Region
from connector.core.messages import FailReason
from connector.core.receiver_table import ReceiverTable
from connector.core.stages import (
    check_stages,
    layer_span,
    layers_view,
    source_rank,
    source_ranks,
    stage_view,
)
from connector.transfer.topology import Topology
from tests.unit.core.factories import p_addr

HEADS = (1, 2, 4, 8)


def _tps(heads: int) -> list[int]:
    """TP sizes vLLM splits ``heads`` over (head_range's rule), up to 8."""
    return [t for t in range(1, 9) if (heads % t == 0 if t <= heads else t % heads == 0)]


def _layout(layers: range | list[int], heads: tuple[int, int] = (0, 2), parts: int = 1) -> KVLayout:
    """A layout of ``layers`` (``parts`` regions each), every region in its own 4 MiB."""
    keys = [(la, pa) for la in layers for pa in range(parts)]
    return KVLayout(
        block_size=16,
        num_blocks=64,
        heads=heads,
        token_bytes=128,
        order="HND",
        regions=tuple(
            Region(layer=la, group=0, part=pa, base_addr=(1 + i) << 22, block_stride=1 << 14)
            for i, (la, pa) in enumerate(keys)
        ),
    )


def _splits(total: int, pp: int) -> list[list[int]]:
    """Every split of ``total`` layers into ``pp`` non-empty contiguous stages, as sizes."""
    return [
        [b - a for a, b in itertools.pairwise((0, *cuts, total))]
        for cuts in itertools.combinations(range(1, total), pp - 1)
    ]


def _windows(sizes: list[int]) -> list[tuple[int, int]]:
    starts = list(itertools.accumulate([0, *sizes[:-1]]))
    return [(s, s + n) for s, n in zip(starts, sizes, strict=True)]


# ---------------------------------------------------------------- identity
def test_source_ranks_are_vllms_worker_ranks_and_the_tp_rank_at_pp_1() -> None:
    for tp, pp in itertools.product(range(1, 9), range(1, 5)):
        ranks = [source_rank(s, r, tp) for s in range(pp) for r in range(tp)]
        assert ranks == list(range(tp * pp))  # stage-major, as vLLM numbers its workers
    assert [source_rank(0, r, 4) for r in range(4)] == [0, 1, 2, 3]
    for bad in [(0, 2, 2), (0, -1, 2), (-1, 0, 2), (0, 0, 0)]:
        with pytest.raises(LayoutError):
            source_rank(*bad)


def test_d_waits_for_each_writing_tp_rank_of_each_stage() -> None:
    for heads in HEADS:
        for p_tp, d_tp, pp in itertools.product(_tps(heads), _tps(heads), range(1, 5)):
            topo = Topology(heads, p_tp)
            for d in range(d_tp):
                tp_sources = topo.sources(d, d_tp)
                got = source_ranks(tp_sources, p_tp, pp)
                assert len(got) == len(set(got)) == len(tp_sources) * pp
                assert {(r // p_tp, r % p_tp) for r in got} == {
                    (s, p) for s in range(pp) for p in tp_sources
                }
                if pp == 1:
                    assert got == tp_sources  # PP 1: the sources D always waited for
    with pytest.raises(LayoutError):
        source_ranks((0,), 1, 0)


# ---------------------------------------------------------------- coverage
@pytest.mark.parametrize("heads", HEADS)
def test_every_d_rank_layer_and_head_is_written_exactly_once(heads: int) -> None:
    """All (P TP rank, stage) writers together, each through stage_view and its head range,
    write every (D rank, layer, head) once; D waits for exactly the writers of its rank."""
    for p_tp, d_tp in itertools.product(_tps(heads), _tps(heads)):
        topo = Topology(heads, p_tp)
        for total in range(1, 6):
            for pp in range(1, total + 1):
                for sizes in _splits(total, pp):
                    written: Counter[tuple[int, int, int]] = Counter()
                    writers: dict[int, set[int]] = {d: set() for d in range(d_tp)}
                    for (stage, window), p in itertools.product(
                        enumerate(_windows(sizes)), range(p_tp)
                    ):
                        src = _layout(range(*window), head_range(p, p_tp, heads))
                        for d in topo.targets(p, d_tp):
                            dst = _layout(range(total), head_range(d, d_tp, heads))
                            view = stage_view(dst, src, total) if pp > 1 else dst
                            h0, h1 = topo.heads(p, d, d_tp)
                            for r in view.regions:
                                for h in range(h0, h1):
                                    written[(d, r.layer, h)] += 1
                            writers[d].add(source_rank(stage, p, p_tp))
                    want = {
                        (d, la, h)
                        for d in range(d_tp)
                        for la in range(total)
                        for h in range(*head_range(d, d_tp, heads))
                    }
                    assert set(written) == want and set(written.values()) == {1}, (
                        heads,
                        p_tp,
                        d_tp,
                        sizes,
                    )
                    for d in range(d_tp):
                        expected = source_ranks(topo.sources(d, d_tp), p_tp, pp)
                        assert writers[d] == set(expected)


# ---------------------------------------------------------------- what a stage may write
def test_stage_view_is_ds_regions_of_the_stages_layers() -> None:
    dst = _layout(range(6), parts=2)
    src = _layout(range(2, 4), parts=2)
    view = stage_view(dst, src, 6)
    assert view.region_keys() == src.region_keys()
    assert [r.base_addr for r in view.regions] == [r.base_addr for r in dst.regions[4:8]]
    assert layer_span(src) == (2, 4)
    assert layers_view(dst, (2, 4)) == view


@pytest.mark.parametrize(
    ("d_layers", "s_layers", "total", "d_parts", "s_parts", "says"),
    [
        (range(5), range(2, 4), 6, 1, 1, "D holds KV of 5 layers"),  # D: fewer layers
        (range(7), range(2, 4), 6, 1, 1, "D holds KV of 7 layers"),  # D: more
        (range(6), range(2, 4), 6, 2, 1, "regions differ"),  # D splits K and V, P not
        (range(6), range(2, 4), 6, 1, 2, "regions differ"),
        (range(6), range(5, 7), 6, 1, 1, "regions differ"),  # a layer D does not have
    ],
)
def test_a_stage_refuses_a_d_it_cannot_fill_exactly(
    d_layers: range, s_layers: range, total: int, d_parts: int, s_parts: int, says: str
) -> None:
    with pytest.raises(LayoutError, match=says):
        stage_view(_layout(d_layers, parts=d_parts), _layout(s_layers, parts=s_parts), total)


def test_a_stage_holds_one_run_of_layers() -> None:
    with pytest.raises(LayoutError, match="contiguous"):
        layer_span(_layout([1, 3]))
    with pytest.raises(LayoutError, match="no KV regions"):
        layers_view(_layout(range(2)), (4, 6))


def test_d_must_wait_for_as_many_stages_as_p_runs() -> None:
    check_stages(2, 2)
    for d_expects, p_runs in [(1, 2), (2, 1), (3, 2)]:
        with pytest.raises(LayoutError, match="remote_pp_size"):
            check_stages(d_expects, p_runs)


# ---------------------------------------------------------------- D's counting
MS = 1_000_000


@st.composite
def _answers(draw: st.DrawFn) -> tuple[tuple[int, ...], list[tuple[int, bool]]]:
    """A D rank's sources for some P TP size, D TP size and stage count, and the answers
    that arrive: each source's completion or fail once, in any order, with repeats and
    answers from ranks that are no source of this D rank mixed in."""
    heads = draw(st.sampled_from(HEADS))
    p_tp, d_tp = draw(st.sampled_from(_tps(heads))), draw(st.sampled_from(_tps(heads)))
    pp = draw(st.integers(1, 4))
    d = draw(st.integers(0, d_tp - 1))
    sources = source_ranks(Topology(heads, p_tp).sources(d, d_tp), p_tp, pp)
    firsts = [(s, draw(st.booleans())) for s in sources]
    order = draw(st.permutations(firsts))
    strays = draw(
        st.lists(st.tuples(st.integers(0, p_tp * pp + 2), st.booleans()), max_size=len(sources))
    )
    seq = list(order)
    for stray in strays:  # repeats of a source's answer, or a rank that is none
        seq.insert(draw(st.integers(0, len(seq))), stray)
    return sources, seq


@settings(max_examples=400, deadline=None)
@given(_answers())
def test_d_reports_once_when_the_last_stage_and_rank_answered(
    case: tuple[tuple[int, ...], list[tuple[int, bool]]],
) -> None:
    sources, seq = case
    table = ReceiverTable()
    table.handle(
        ev.Expected("t", "r", tuple(ev.Source(s, p_addr(s)) for s in sources), ((1,),), 0, 16),
        0,
    )
    answered: dict[int, bool] = {}
    reports: list[ev.ReportReceived] = []
    for i, (rank, done) in enumerate(seq, start=1):
        event: ev.RecvEvent = (
            ev.CompletionSeen("t", rank) if done else ev.FailSeen("t", rank, FailReason.DEADLINE)
        )
        out = table.handle(event, i * MS)
        if rank in sources and rank not in answered:
            answered[rank] = done
        got = [a for a in out if isinstance(a, ev.ReportReceived)]
        if len(answered) < len(sources):
            assert not got, f"reported with {len(sources) - len(answered)} sources pending"
        reports += got
    assert len(reports) == 1
    assert reports[0].ok is all(answered.values())


def test_a_stage_that_never_answers_holds_the_report_until_the_last_resort() -> None:
    """P TP 2 x PP 2 into D TP 1: stage 1's rank 1 stays silent; D reports failed only at
    its CANCELLING deadline, never ok."""
    sources = source_ranks((0, 1), 2, 2)
    table = ReceiverTable()
    table.handle(
        ev.Expected("t", "r", tuple(ev.Source(s, p_addr(s)) for s in sources), ((1,),), 0, 16),
        0,
    )
    for s in sources[:-1]:
        assert table.handle(ev.CompletionSeen("t", s), MS) == []
    rng = random.Random(7)
    now, reports = MS, []
    while not reports:
        now += rng.randint(1, 10_000) * MS
        reports = [a for a in table.tick(now) if isinstance(a, ev.ReportReceived)]
    assert [(r.ok, r.reason) for r in reports] == [(False, FailReason.DEADLINE)]
    assert table.abandoned == 1

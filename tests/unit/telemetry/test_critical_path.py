"""The critical-path model on recorded runs (every folder under tests/fixtures/traces) and on
edited copies of them for the cases a run rarely shows (missing spans, clocks out of order)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from telemetry.critical_path import (
    FIRST_TOKEN_SEGMENTS,
    PUSH_SEGMENTS,
    ROUTER_SEGMENTS,
    CriticalPath,
    Seg,
    critical_path,
)
from telemetry.otlp_json import SpanEvent, SpanRecord, Trace
from telemetry.schema import Attr, Event, Span
from telemetry.traces import read_run
from tests.fixtures.traces import HERE, run_dirs

# requests: traces with the router's request span (a real run may also hold probes' traces)
ALL = [(d, t) for d in run_dirs() for t in read_run(d).traces if t.first(Span.REQUEST.value)]
# successful push requests: every boundary should have been observed
OK_PUSH = [
    (d, t)
    for d, t in ALL
    if (p := critical_path(t)) is not None and p.model == "push" and p.ttft_ns is not None
]


def _path(t: Trace) -> CriticalPath:
    path = critical_path(t)
    assert path is not None, f"trace {t.trace_id} has no {Span.REQUEST.value} span"
    return path


def _by_outcome(run: str, outcome: str) -> list[Trace]:
    traces = read_run(HERE / run).traces
    return [
        t
        for t in traces
        if (r := t.first(Span.REQUEST.value)) and r.attr(Attr.OUTCOME.value) == outcome
    ]


@pytest.mark.parametrize("run_dir, trace", ALL, ids=[f"{d.name}-{t.trace_id[:8]}" for d, t in ALL])
def test_segments_are_consecutive_and_sum_to_ttft(run_dir: Path, trace: Trace) -> None:
    path = _path(trace)
    req = trace.first(Span.REQUEST.value)
    assert req is not None
    segs = path.segments
    assert segs[0].start_ns == req.start_ns
    assert all(a.end_ns == b.start_ns for a, b in zip(segs, segs[1:], strict=False))
    assert sum(s.duration_ns for s in segs) == path.total_ns
    chunk = req.event(Event.FIRST_CHUNK.value)
    if chunk is None:
        assert path.ttft_ns is None and path.end_ns == req.end_ns
    else:
        assert path.ttft_ns == chunk.time_ns - req.start_ns == path.total_ns
        if Attr.TTFT_MS.value in req.attributes:  # the router's own figure agrees
            assert path.ttft_ns / 1e6 == pytest.approx(req.attributes[Attr.TTFT_MS.value], abs=1e-3)
    covered = [c for s in segs for c in s.covers]
    models = {"push": PUSH_SEGMENTS, "first_token": FIRST_TOKEN_SEGMENTS}
    assert covered == list(models.get(path.model, ROUTER_SEGMENTS))
    negatives = [s for s in segs if s.negative]
    assert len(negatives) == sum("negative gap" in a for a in path.anomalies)


@pytest.mark.parametrize(
    "run_dir, trace", OK_PUSH, ids=[f"{d.name}-{t.trace_id[:8]}" for d, t in OK_PUSH]
)
def test_successful_push_requests_are_fully_measured(run_dir: Path, trace: Trace) -> None:
    path = _path(trace)
    assert [s.name for s in path.segments] == list(PUSH_SEGMENTS)
    assert not any(s.error for s in path.segments)
    writes = trace.named(Span.WRITE.value)
    write_seg = next(s for s in path.segments if s.name is Seg.WRITE)
    assert write_seg.end_ns == max(w.end_ns for w in writes)  # TP>1: the last WRITE is critical
    first_token = trace.first(Span.FIRST_TOKEN.value)
    assert first_token is not None
    assert next(s for s in path.segments if s.name is Seg.D_STEP).end_ns == first_token.end_ns
    rdv = next(s for s in path.segments if s.name is Seg.RENDEZVOUS)
    wait = next(w for w in trace.named(Span.RENDEZVOUS_WAIT.value) if path.on_path(w))
    assert rdv.end_ns == wait.end_ns and rdv.duration_ns >= 0
    # the wait ends when the transfer is issued: with D registered first, what is left is
    # P's hand-off to its transfer thread (0 in the generated runs, ~1 ms in real ones)
    assert path.rendezvous_first in ("registration", "prefill")
    if path.rendezvous_first == "prefill":
        assert rdv.duration_ns > 0
        met = next(m for m in path.marks if m.label == "rendezvous met")
        assert rdv.start_ns <= met.time_ns <= rdv.end_ns


def test_tp2_uses_the_rank_whose_write_ends_last() -> None:
    seen_ranks = set()
    for t in read_run(HERE / "gen-push-tp2").traces:
        path = _path(t)
        last = max(t.named(Span.WRITE.value), key=lambda w: w.end_ns)
        assert path.critical_tp_rank == last.attr(Attr.TP_RANK.value)
        prefill = next(
            p
            for p in t.named(Span.PREFILL.value)
            if p.attr(Attr.TP_RANK.value) == path.critical_tp_rank
        )
        assert next(s for s in path.segments if s.name is Seg.P_PREFILL).end_ns == prefill.end_ns
        seen_ranks.add(path.critical_tp_rank)
        assert any(m.label.startswith("write.end (tp_rank") for m in path.marks)
    assert seen_ranks == {0, 1}  # the fixture has both ranks finishing last at least once


def test_failed_write_stops_the_path_at_the_write() -> None:
    (t,) = _by_outcome("gen-push", "write_error")
    path = _path(t)
    assert path.ttft_ns is None
    names = [s.name for s in path.segments]
    w = PUSH_SEGMENTS.index(Seg.WRITE)
    assert names[: w + 1] == list(PUSH_SEGMENTS[: w + 1]) and names[w + 1] is Seg.UNKNOWN
    assert path.segments[w].error == "write_error"  # the WRITE segment carries the reason
    assert path.segments[w + 1].covers == (Seg.NOTIFY, Seg.D_STEP, Seg.STREAM_BACK)
    assert path.segments[w + 1].error == "write_error"  # the request ended in error too


def test_cancelled_request_keeps_what_was_measured() -> None:
    (t,) = _by_outcome("gen-push", "cancelled")
    path = _path(t)
    assert path.ttft_ns is None
    rdv = next(s for s in path.segments if s.name is Seg.RENDEZVOUS)
    assert rdv.error == "cancelled"
    assert path.segments[-1].name is Seg.UNKNOWN and Seg.WRITE in path.segments[-1].covers


def test_pull_mode_uses_router_spans_only() -> None:
    for t in read_run(HERE / "gen-pull").traces:
        path = _path(t)
        assert path.model == "router" and path.mode == "pull"
        if path.ttft_ns is not None:
            assert [s.name for s in path.segments] == list(ROUTER_SEGMENTS)


# ---- edited copies of a recorded request -------------------------------------------------


def _ok_push_trace() -> Trace:
    (t, *_) = _by_outcome("gen-push", "ok")
    return t


def _without(t: Trace, *names: Span) -> Trace:
    drop = {n.value for n in names}
    return Trace(t.trace_id, tuple(sp for sp in t.spans if sp.name not in drop))


def _replace(t: Trace, name: Span, **changes: object) -> Trace:
    return Trace(
        t.trace_id,
        tuple(
            dataclasses.replace(sp, **changes) if sp.name == name.value else sp for sp in t.spans
        ),
    )


def test_missing_p_spans_become_one_unknown_segment() -> None:
    t = _without(_ok_push_trace(), Span.PREFILL, Span.RENDEZVOUS_WAIT)
    path = _path(t)
    unknown = [s for s in path.segments if s.name is Seg.UNKNOWN]
    assert len(unknown) == 1
    assert unknown[0].covers == (Seg.P_QUEUE, Seg.P_PREFILL, Seg.RENDEZVOUS, Seg.DESCRIPTORS)
    assert sum(s.duration_ns for s in path.segments) == path.ttft_ns


def test_only_router_spans_in_push_mode_is_mostly_unknown() -> None:
    router = {Span.REQUEST, Span.ROUTE, Span.PREFILL_LEG, Span.DECODE_LEG, Span.FIRST_BYTE}
    t = _without(_ok_push_trace(), *(s for s in Span if s not in router))
    path = critical_path(t, model="push")
    assert path is not None
    names = [Seg.CONNECT, Seg.INGRESS, Seg.ROUTER, Seg.UNKNOWN]
    assert [s.name for s in path.segments] == names
    assert path.segments[1].duration_ns == 0, "no ingress span: a zero-length ingress"
    assert path.segments[3].covers == PUSH_SEGMENTS[3:]
    assert sum(s.duration_ns for s in path.segments) == path.ttft_ns


def test_out_of_order_boundary_is_flagged_not_dropped() -> None:
    t = _ok_push_trace()
    write = t.first(Span.WRITE.value)
    first_token = t.first(Span.FIRST_TOKEN.value)
    assert write is not None and first_token is not None
    early = write.end_ns - 50_000  # D "scheduled" 50 us before P saw its WRITE done
    events = tuple(
        SpanEvent(e.name, early, e.attributes) if e.name == Event.SCHEDULED.value else e
        for e in first_token.events
    )
    path = _path(_replace(t, Span.FIRST_TOKEN, events=events))
    notify = next(s for s in path.segments if s.name is Seg.NOTIFY)
    assert notify.negative and notify.duration_ns == -50_000
    assert any("negative gap write.end -> first_token.scheduled" in a for a in path.anomalies)
    assert sum(s.duration_ns for s in path.segments) == path.ttft_ns


def test_first_token_from_p_ends_at_ps_answer() -> None:
    """The client's first token is P's: P queue and prefill, P's answer to the router, the
    stream back; the push and D's first step (token 2) come after it, as marks."""
    t = _ok_push_trace()
    req, leg = t.first(Span.REQUEST.value), t.first(Span.PREFILL_LEG.value)
    assert req is not None and leg is not None
    chunk = leg.end_ns + 300_000  # the router streams P's token 0.3 ms after P's answer
    events = tuple(
        SpanEvent(e.name, chunk, e.attributes) if e.name == Event.FIRST_CHUNK.value else e
        for e in req.events
    )
    attrs = {**req.attributes, Attr.FIRST_TOKEN_FROM.value: "prefill"}
    path = _path(_replace(t, Span.REQUEST, attributes=attrs, events=events))
    assert path.model == "first_token" and not path.anomalies
    assert [s.name for s in path.segments] == list(FIRST_TOKEN_SEGMENTS)
    answer = next(s for s in path.segments if s.name is Seg.P_ANSWER)
    assert answer.end_ns == leg.end_ns and path.segments[-1].duration_ns == 300_000
    assert {m.label for m in path.marks} >= {"pushkv.write.end", "pushkv.first_token.end"}


def test_trace_without_request_span_has_no_path() -> None:
    assert critical_path(_without(_ok_push_trace(), Span.REQUEST)) is None


def test_retried_prefill_leg_uses_the_last_and_says_so() -> None:
    t = _ok_push_trace()
    leg = t.first(Span.PREFILL_LEG.value)
    assert leg is not None
    earlier = dataclasses.replace(
        leg, span_id="f" * 16, start_ns=leg.start_ns - 10, end_ns=leg.start_ns - 5
    )
    path = _path(Trace(t.trace_id, (earlier, *t.spans)))
    assert path.segments[2].end_ns == leg.start_ns  # after the (zero-length) router-in ones
    assert any(f"2 {Span.PREFILL_LEG.value} spans" in a for a in path.anomalies)


def test_missing_mode_attribute_is_inferred_from_spans() -> None:
    t = _ok_push_trace()
    req = t.first(Span.REQUEST.value)
    assert req is not None
    attrs = {k: v for k, v in req.attributes.items() if k != Attr.MODE.value}
    path = _path(_replace(t, Span.REQUEST, attributes=attrs))
    assert path.mode == "unknown" and path.model == "push"


def _span(name: Span, start: int, end: int, **kw: object) -> SpanRecord:
    base = dict(
        trace_id="1" * 32,
        span_id=f"{start:016x}",
        parent_span_id=None,
        name=name.value,
        kind=0,
        start_ns=start,
        end_ns=end,
        status=0,
        status_message="",
        attributes={},
        events=(),
        resource={},
    )
    base.update(kw)
    return SpanRecord(**base)  # type: ignore[arg-type]


def test_request_without_any_child_is_one_unknown_segment() -> None:
    chunk = SpanEvent(Event.FIRST_CHUNK.value, 700, {})
    t = Trace("1" * 32, (_span(Span.REQUEST, 100, 900, events=(chunk,)),))
    path = _path(t)
    assert path.model == "router" and path.ttft_ns == 600
    assert [s.name for s in path.segments] == [Seg.CONNECT, Seg.INGRESS, Seg.UNKNOWN]
    assert path.segments[2].covers == ROUTER_SEGMENTS[2:]


# the tree of telemetry/schema.py: a span's parent (P's transfer spans hang under the decode
# leg, or under P's leg when no registration carried D's context)
PARENTS = {
    Span.CONNECT: {Span.REQUEST},
    Span.INGRESS: {Span.REQUEST},
    Span.ROUTE: {Span.REQUEST},
    Span.PREFILL_LEG: {Span.REQUEST},
    Span.DECODE_LEG: {Span.REQUEST},
    Span.FIRST_BYTE: {Span.DECODE_LEG},
    Span.REGISTER: {Span.DECODE_LEG},
    Span.AWAIT_KV: {Span.DECODE_LEG},
    Span.FIRST_TOKEN: {Span.DECODE_LEG},
    Span.PREFILL: {Span.PREFILL_LEG},
    **{
        s: {Span.DECODE_LEG, Span.PREFILL_LEG}
        for s in (Span.RENDEZVOUS_WAIT, Span.PREPARE_DESCRIPTORS, Span.WRITE)
    },
}


@pytest.mark.parametrize("run_dir, trace", ALL, ids=[f"{d.name}-{t.trace_id[:8]}" for d, t in ALL])
def test_runs_follow_the_schema_tree(run_dir: Path, trace: Trace) -> None:
    by_id = {sp.span_id: sp for sp in trace.spans}
    for sp in trace.spans:
        try:
            name = Span(sp.name)
        except ValueError:
            continue  # not one of pushkv's spans
        if name is Span.REQUEST:
            continue  # its parent, if any, is the client's
        parent = by_id.get(sp.parent_span_id or "")
        assert parent is not None, f"{sp.name} has no parent in the trace"
        assert Span(parent.name) in PARENTS[name], f"{sp.name} under {parent.name}"

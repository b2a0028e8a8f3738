"""The transfer spans of P and D (connector/transfer/spans.py) over the fake transport: which spans,
their parents, times, attributes, and error status on the failure paths."""

from __future__ import annotations

import time

from opentelemetry.trace import StatusCode

from connector.core import events as ev
from connector.core import messages as m
from connector.core.geometry import kv_geometry
from connector.transfer.spans import NO_SPANS, PrefillNote, TransferSpans, geometry_attributes
from telemetry.schema import Attr, Event, Span
from tests.unit.telemetry.memory import Recorder
from tests.unit.test_endpoints import Pair

P_TRACE = m.TraceContext("00-" + "a1" * 16 + "-" + "b1" * 8 + "-01")  # router's prefill_leg
D_TRACE = m.TraceContext("00-" + "a1" * 16 + "-" + "c1" * 8 + "-01")  # router's decode_leg
TRACE_ID = int("a1" * 16, 16)


def traced_pair() -> tuple[Pair, Recorder]:
    pair, rec = Pair(), Recorder()
    pair.sender.spans = TransferSpans(rec.tracer, "prefill", 0)
    pair.receiver.spans = TransferSpans(rec.tracer, "decode", 0)
    return pair, rec


def expect(pair: Pair, tid: str, n: int, blocks: tuple[int, ...]) -> None:
    from connector.tools.loopback import expected_event
    from connector.transfer.spans import RegisterNote

    event = expected_event(tid, [pair.p_spec], pair.d_spec, blocks, n)
    event = ev.Expected(
        event.transfer_id,
        event.request_id,
        event.sources,
        event.block_ids,
        event.first_token,
        event.num_tokens,
        D_TRACE,
    )
    pair.receiver.on_event(event, pair.now, note=RegisterNote(D_TRACE, time.time_ns() - 1000))


def prefill(pair: Pair, tid: str, n: int, blocks: tuple[int, ...], ready=None) -> None:
    now = time.time_ns()
    note = PrefillNote(P_TRACE, now - 3_000_000, now - 2_000_000, now, n)
    pair.sender.on_event(ev.PrefillDone(tid, "preq", (blocks,), n), pair.now, ready, note)


def parent_span_id(span) -> int:
    assert span.parent is not None, f"{span.name} has no parent"
    return span.parent.span_id


def test_registration_first_every_span_once_with_parents_and_times() -> None:
    pair, rec = traced_pair()
    expect(pair, "t", 40, (9, 3, 5))
    pair.pump(2)  # the registration reaches P before the prompt is done
    prefill(pair, "t", 40, (1, 2, 3))
    pair.pump()
    under_d_leg = (
        Span.RENDEZVOUS_WAIT,
        Span.PREPARE_DESCRIPTORS,
        Span.WRITE,
        Span.REGISTER,
        Span.AWAIT_KV,
    )
    assert rec.names() == sorted(s.value for s in (Span.PREFILL, *under_d_leg))
    assert {s.context.trace_id for s in rec.spans()} == {TRACE_ID}
    p_leg, d_leg = int("b1" * 8, 16), int("c1" * 8, 16)
    assert parent_span_id(rec.one(Span.PREFILL)) == p_leg
    for name in under_d_leg:
        assert parent_span_id(rec.one(name)) == d_leg, name

    pf, rv = rec.one(Span.PREFILL), rec.one(Span.RENDEZVOUS_WAIT)
    prep, wr = rec.one(Span.PREPARE_DESCRIPTORS), rec.one(Span.WRITE)
    assert pf.start_time < [e for e in pf.events if e.name == Event.SCHEDULED.value][0].timestamp
    assert rv.attributes[Attr.FIRST_ARRIVED.value] == "registration"
    assert rv.end_time == prep.start_time and prep.end_time <= wr.start_time <= wr.end_time
    assert pf.end_time == [e for e in rv.events if e.name == Event.PREFILL_DONE.value][0].timestamp
    assert wr.attributes[Attr.BYTES.value] > 0 and wr.attributes[Attr.DESCRIPTORS.value] > 0
    assert wr.attributes[Attr.PEER.value] == pair.d_spec.agent
    assert prep.attributes[Attr.BLOCKS.value] == 3
    reg, wait = rec.one(Span.REGISTER), rec.one(Span.AWAIT_KV)
    assert reg.end_time == wait.start_time <= wait.end_time
    assert wait.attributes[Attr.P_RANKS.value] == 1
    for s in rec.spans():
        assert s.status.status_code is not StatusCode.ERROR, s.name
        assert s.attributes[Attr.OUTCOME.value] == "ok"
        assert s.attributes[Attr.TRANSFER_ID.value] == "t"


def test_p_transfer_spans_carry_the_kv_geometry_and_d_spans_do_not() -> None:
    pair, rec = traced_pair()
    geometry = kv_geometry(pair.sender.layout)
    pair.sender.spans = TransferSpans(rec.tracer, "prefill", 0, kv=geometry_attributes(geometry))
    expect(pair, "t", 40, (9, 3, 5))
    prefill(pair, "t", 40, (1, 2, 3))
    pair.pump()
    kv_keys = {a.value for a in Attr if a.value.startswith("pushkv.kv.")}
    for name in (Span.PREPARE_DESCRIPTORS, Span.WRITE):
        attrs = rec.one(name).attributes
        assert attrs[Attr.KV_BYTES_PER_TOKEN.value] == geometry.bytes_per_token > 0, name
        assert attrs[Attr.KV_LAYERS.value] == geometry.layers, name
        assert attrs[Attr.KV_FORM.value] == "heads", name
    for name in (Span.PREFILL, Span.RENDEZVOUS_WAIT, Span.REGISTER, Span.AWAIT_KV):
        assert not kv_keys & set(rec.one(name).attributes), name


def test_prefill_first_is_named_first() -> None:
    pair, rec = traced_pair()
    prefill(pair, "t", 32, (1, 2))
    pair.pump(2)
    expect(pair, "t", 32, (4, 5))
    pair.pump()
    assert rec.one(Span.RENDEZVOUS_WAIT).attributes[Attr.FIRST_ARRIVED.value] == "prefill"


def test_post_error_ends_write_and_await_kv_in_error() -> None:
    pair, rec = traced_pair()
    pair.fabric.fail_writes("post", count=1)
    expect(pair, "t", 32, (1, 2))
    prefill(pair, "t", 32, (1, 2))
    pair.pump()
    wr, wait = rec.one(Span.WRITE), rec.one(Span.AWAIT_KV)
    assert wr.status.status_code is StatusCode.ERROR
    assert wr.attributes[Attr.REASON.value] == m.FailReason.POST_ERROR.value
    assert wait.status.status_code is StatusCode.ERROR
    assert wait.attributes[Attr.REASON.value] == m.FailReason.POST_ERROR.value


def test_layout_mismatch_ends_the_rendezvous_in_error_and_no_write_span() -> None:
    pair, rec = traced_pair()
    expect(pair, "t", 40, (1, 2, 3))
    prefill(pair, "t", 32, (1, 2))  # D expects 40 tokens, P computed 32
    pair.pump()
    assert not rec.named(Span.WRITE)
    rv = rec.one(Span.RENDEZVOUS_WAIT)
    assert rv.status.status_code is StatusCode.ERROR
    assert rv.attributes[Attr.REASON.value] == m.FailReason.LAYOUT_MISMATCH.value


def test_gpu_prefill_ends_when_the_step_event_fires() -> None:
    pair, rec = traced_pair()
    fired = [False]
    prefill(pair, "t", 32, (1, 2), ready=lambda: fired[0])
    pair.pump(3)
    assert not rec.named(Span.PREFILL), "the KV is not complete before the step's event fires"
    before = time.time_ns()
    fired[0] = True
    pair.pump(1)
    assert rec.one(Span.PREFILL).end_time >= before


def test_tracing_off_is_the_default_and_emits_nothing() -> None:
    pair = Pair()
    assert pair.sender.spans is NO_SPANS and pair.receiver.spans is NO_SPANS
    pair.expect("t", 32, (1, 2))
    pair.sender.on_event(ev.PrefillDone("t", "preq", ((1, 2),), 32), pair.now)
    pair.pump()
    assert [r.ok for r in pair.receiver.finished] == [True]


def test_unsampled_parent_records_nothing_so_no_trace_is_half_sampled() -> None:
    """The router decided not to sample (flags 00): P's and D's spans follow it."""
    pair, rec = traced_pair()
    unsampled = m.TraceContext(P_TRACE.traceparent[:-2] + "00")
    d_unsampled = m.TraceContext(D_TRACE.traceparent[:-2] + "00")
    from connector.tools.loopback import expected_event
    from connector.transfer.spans import RegisterNote

    e = expected_event("t", [pair.p_spec], pair.d_spec, (4, 5), 32)
    pair.receiver.on_event(
        ev.Expected(
            e.transfer_id,
            e.request_id,
            e.sources,
            e.block_ids,
            e.first_token,
            e.num_tokens,
            d_unsampled,
        ),
        pair.now,
        note=RegisterNote(d_unsampled, time.time_ns()),
    )
    now = time.time_ns()
    pair.sender.on_event(
        ev.PrefillDone("t", "preq", ((1, 2),), 32),
        pair.now,
        None,
        PrefillNote(unsampled, now - 10, now - 5, now, 32),
    )
    pair.pump()
    assert [r.ok for r in pair.receiver.finished] == [True]
    assert rec.spans() == []

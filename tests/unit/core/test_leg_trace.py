"""core/leg_trace.py: the trace a leg without a traceparent joins."""

from __future__ import annotations

from connector.core.leg_trace import derived_traceparent, valid_traceparent, with_trace
from connector.kv_params import parse_decode_leg, parse_prefill_leg

CLIENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
P_LEG = {"do_remote_decode": True, "transfer_id": "t1"}


def test_a_derived_traceparent_is_a_valid_sampled_one_per_transfer_id() -> None:
    a, b = derived_traceparent("t1"), derived_traceparent("t2")
    assert valid_traceparent(a) and a.endswith("-01") and a == derived_traceparent("t1")
    assert a.split("-")[1] != b.split("-")[1]
    leg = parse_prefill_leg(with_trace(P_LEG, None))
    assert leg is not None and leg.trace() is not None and leg.trace().traceparent == a


def test_only_a_valid_header_is_taken() -> None:
    for bad in (
        "00-00000000000000000000000000000000-b7ad6b7169203331-01",  # trace id all zeros
        "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",  # parent id all zeros
        "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",  # forbidden version
        CLIENT.upper(),
        CLIENT + "-extra",
    ):
        assert not valid_traceparent(bad)
        assert with_trace(P_LEG, {"traceparent": bad})["traceparent"] == derived_traceparent("t1")
    got = with_trace(P_LEG, {"traceparent": CLIENT, "tracestate": "x" * 513})
    assert got["traceparent"] == CLIENT and "tracestate" not in got  # over the leg's bound


def test_what_is_no_leg_or_names_a_trace_is_left_alone() -> None:
    own = {**P_LEG, "traceparent": CLIENT}
    assert with_trace(own, {"traceparent": derived_traceparent("x")}) is own
    for params in (None, "x", {"transfer_id": "t1"}, {"do_remote_decode": True}):
        assert with_trace(params, {"traceparent": CLIENT}) is params
    d_leg = {
        "do_remote_prefill": True,
        "transfer_id": "t1",
        "remote_engine_id": "prefill",
        "remote_host": "127.0.0.1",
        "remote_port": 5600,
    }
    leg = parse_decode_leg(with_trace(d_leg, {"traceparent": CLIENT, "tracestate": "k=v"}))
    assert leg is not None and leg.trace() is not None
    assert (leg.trace().traceparent, leg.trace().tracestate) == (CLIENT, "k=v")

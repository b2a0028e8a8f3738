"""The scheduler role behind routers written for NixlConnector (connector/core/pairing.py in
place): a P leg without a transfer_id and the D leg vllm-router (push mode) or a sequential
proxy (P's answer) sends stage the same transfer id, with D reaching P's rank, in either
order of D's allocation and P's prefill."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from connector.core.leg_trace import derived_traceparent
from connector.metadata import Handshake
from connector.scheduler_side import SchedulerSide
from tests.unit.core.test_pairing import VLLM_ROUTER_P_LEG, router_id, vllm_router_d_leg
from tests.unit.test_scheduler_side import Blocks, Manager, Req, SchedOut, consumer

AGENT = "prefill-tp0-5eed1234"  # a worker's agent name carries its incarnation


def producer() -> tuple[SchedulerSide, Manager]:
    s = SchedulerSide("prefill", is_producer=True, is_consumer=False)
    m = Manager()
    s.bind_kv_cache_manager(m)
    s.set_handshakes({0: Handshake(AGENT, "127.0.0.1", 5600)})
    return s, m


def prefill(x: str) -> tuple[str, dict[str, Any]]:
    """P serves vllm-router's P leg for X-Request-Id ``x``: the transfer id it pushes under,
    and its answer's kv_transfer_params."""
    s, m = producer()
    req = Req(f"cmpl-{x}-0-1a2b3c4d", dict(VLLM_ROUTER_P_LEG))
    s.on_new_request(req)
    m.ids[req.request_id] = ([3, 4, 5],)
    (staged,) = s.build_connector_meta(SchedOut({req.request_id: 300})).prefills
    delay, answer = s.request_finished(req, ([3, 4, 5],))
    assert delay and answer is not None
    return staged.transfer_id, answer


def register(params: dict[str, Any], x: str) -> tuple[str, str, int]:
    """D serves ``params`` under its own request id for ``x``: the registration's transfer
    id, and the agent and port it goes to."""
    s = consumer()
    req = Req(f"cmpl-{x}-0-0badcafe", params)
    s.on_new_request(req)
    assert s.get_num_new_matched_tokens(req, 0) == (300, True)
    s.update_state_after_alloc(req, Blocks([[7, 8, 9]]), 300)
    (reg,) = s.build_connector_meta(SchedOut({})).registrations
    return reg.transfer_id, reg.leg.agent_of(0), reg.leg.port_of(0)


def test_p_answers_what_vllm_router_needs_to_switch_to_push() -> None:
    x = router_id()
    tid, answer = prefill(x)
    assert tid == x
    assert answer["transfer_mode"] == "push" and answer["transfer_id"] == x
    assert (answer["remote_host"], answer["remote_port"], answer["tp_size"]) == (
        "127.0.0.1",
        5600,
        1,
    )
    assert answer["pushkv"]["agents"] == (AGENT,)  # pushkv's own router reads this


@pytest.mark.parametrize("flow", ["vllm-router push mode", "sequential"])
def test_d_registers_the_transfer_p_pushes(flow: str) -> None:
    x = router_id()
    tid, answer = prefill(x)
    # vllm-router forwards four of P's fields; a sequential proxy P's answer, unchanged.
    d_params = vllm_router_d_leg(answer, x) if flow == "vllm-router push mode" else dict(answer)
    assert register(d_params, x) == (tid, AGENT, 5600)


def test_d_first_then_p_pairs_the_same_way() -> None:
    """vllm-router sends both legs at once once it knows P: D's registration may come
    before P has seen the request; the ids are computed without the other side."""
    x = router_id()
    leg = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "prefill#pushkv:5eed1234",
        "remote_host": "127.0.0.1",
        "remote_port": 5600,
        "tp_size": 1,
        "remote_request_id": x,
    }
    d_tid = register(leg, x)[0]
    p_tid, _ = prefill(x)
    assert d_tid == p_tid == x


def test_pushkv_routers_legs_answer_as_before() -> None:
    s, m = producer()
    req = Req("r1", {"do_remote_decode": True, "transfer_id": "t1"})
    s.on_new_request(req)
    m.ids["r1"] = ([1],)
    s.build_connector_meta(SchedOut({"r1": 300}))
    _, answer = s.request_finished(req, ([1],))
    assert answer is not None and set(answer) == {"pushkv", "transfer_id"}


def test_a_bad_engine_reference_is_computed_locally_with_the_reason() -> None:
    s = consumer()
    leg = {**vllm_router_d_leg(prefill(router_id())[1], "x" * 40), "tp_size": 2}
    req = Req("cmpl-d-0-0badcafe", leg)
    s.on_new_request(req)
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    _, out = s.request_finished(req, ([1],))
    assert out is not None and "names 1 ranks for remote_tp_size 2" in out["pushkv_error"]


@dataclass
class TracedReq(Req):
    trace_headers: dict[str, str] | None = None  # vLLM's, from the request's headers


CLIENT_TRACE = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def traced_legs(x: str, headers: dict[str, str] | None) -> tuple[Any, Any]:
    """The trace contexts of P's staged push and D's registration for vllm-router's legs
    of X-Request-Id ``x``, both sent with ``headers`` (vllm-router forwards the client's)."""
    s, m = producer()
    p_req = TracedReq(f"cmpl-{x}-0-1a2b3c4d", dict(VLLM_ROUTER_P_LEG), trace_headers=headers)
    s.on_new_request(p_req)
    m.ids[p_req.request_id] = ([3, 4, 5],)
    (staged,) = s.build_connector_meta(SchedOut({p_req.request_id: 300})).prefills
    _, answer = s.request_finished(p_req, ([3, 4, 5],))
    assert answer is not None
    d = consumer()
    d_req = TracedReq(f"cmpl-{x}-0-0badcafe", vllm_router_d_leg(answer, x), trace_headers=headers)
    d.on_new_request(d_req)
    d.get_num_new_matched_tokens(d_req, 0)
    d.update_state_after_alloc(d_req, Blocks([[7, 8, 9]]), 300)
    (reg,) = d.build_connector_meta(SchedOut({})).registrations
    return staged.leg.trace(), reg.leg.trace()


def test_legs_without_a_traceparent_join_one_trace_per_request() -> None:
    """vllm-router puts no traceparent in the legs: P and D take the client's header when
    it sent one (forwarded to both), else one derived from the transfer id they share."""
    x = router_id()
    p, d = traced_legs(x, {"traceparent": CLIENT_TRACE, "tracestate": "k=v"})
    assert p == d and (p.traceparent, p.tracestate) == (CLIENT_TRACE, "k=v")
    p, d = traced_legs(x, None)
    assert p == d and p.traceparent == derived_traceparent(x)
    other_p, _ = traced_legs(router_id(), {"traceparent": "not-a-traceparent"})
    assert other_p.traceparent.split("-")[1] != p.traceparent.split("-")[1]  # its own trace


def test_a_legs_own_traceparent_wins_over_the_header() -> None:
    s, m = producer()
    own = "00-11111111111111111111111111111111-2222222222222222-01"
    leg = {"do_remote_decode": True, "transfer_id": "t1", "traceparent": own}
    req = TracedReq("r1", leg, trace_headers={"traceparent": CLIENT_TRACE})
    s.on_new_request(req)
    m.ids["r1"] = ([1],)
    (staged,) = s.build_connector_meta(SchedOut({"r1": 300})).prefills
    assert staged.leg.trace().traceparent == own

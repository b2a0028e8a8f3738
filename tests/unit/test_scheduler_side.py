"""The scheduler role's bookkeeping, with small stand-ins for vLLM's Request, KVCacheBlocks,
SchedulerOutput and KVConnectorOutput (pure logic; the real vLLM runs in tests/e2e)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
from opentelemetry.trace import StatusCode

from connector.core import lifecycle as lc
from connector.core.lifecycle import ReqState
from connector.kv_params import LegTrust, sign_decode_params
from connector.metadata import Handshake
from connector.scheduler_side import SchedulerSide
from telemetry.schema import Attr, Span
from tests.unit.telemetry.memory import Recorder

D_LEG = {
    "do_remote_prefill": True,
    "transfer_id": "t1",
    "remote_engine_id": "prefill",
    "remote_host": "127.0.0.1",
    "remote_port": 5000,
}


@dataclass
class Req:
    request_id: str
    kv_transfer_params: Any
    num_prompt_tokens: int = 300
    num_computed_tokens: int = 0
    num_output_tokens: int = 0


@dataclass
class Blocks:
    groups: list[list[int]]

    def get_unhashed_block_ids_all_groups(self) -> list[list[int]]:
        return self.groups


@dataclass
class Manager:
    ids: dict[str, tuple[list[int], ...]] = field(default_factory=dict)

    def get_block_ids(self, rid: str) -> tuple[list[int], ...]:
        return self.ids[rid]


@dataclass
class SchedOut:
    num_scheduled_tokens: dict[str, int]
    preempted_req_ids: set[str] = field(default_factory=set)


@dataclass
class ConnOut:
    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)


def producer() -> tuple[SchedulerSide, Manager]:
    s = SchedulerSide("prefill", is_producer=True, is_consumer=False)
    m = Manager()
    s.bind_kv_cache_manager(m)
    s.set_handshakes({0: Handshake("prefill-tp0-x", "127.0.0.1", 5000)})
    return s, m


def producer_with_request(*blocks: int) -> tuple[SchedulerSide, Manager, Req]:
    """``producer()`` with request r1 (transfer t1, pushed to D) added, holding ``blocks``."""
    s, m = producer()
    req = Req("r1", {"do_remote_decode": True, "transfer_id": "t1"})
    s.on_new_request(req)
    m.ids["r1"] = (list(blocks),)
    return s, m, req


def test_push_starts_in_the_step_that_completes_the_prompt() -> None:
    s, m, req = producer_with_request(3, 4, 5)
    assert s.build_connector_meta(SchedOut({"r1": 200})).prefills == []  # chunk 1 of 2
    req.num_computed_tokens = 200
    plan = s.build_connector_meta(SchedOut({"r1": 100}))
    assert [(p.transfer_id, p.block_ids, p.num_tokens) for p in plan.prefills] == [
        ("t1", ((3, 4, 5),), 300)
    ]
    assert s.has_pending_push_work()
    assert s.build_connector_meta(SchedOut({"r1": 1})).prefills == []  # staged once


def test_blocks_stay_until_every_worker_finished_sending() -> None:
    s, m, req = producer_with_request(1)
    s.build_connector_meta(SchedOut({"r1": 300}))
    delay, params = s.request_finished(req, ([1],))
    assert (
        delay
        and params["transfer_id"] == "t1"
        and list(params["pushkv"]["agents"]) == ["prefill-tp0-x"]
    )
    out = ConnOut(finished_sending={"r1"})
    s.update_connector_output(out)
    assert out.finished_sending == {"r1"} and not s.has_pending_push_work()


def test_a_push_done_before_request_finished_is_held_back() -> None:
    s, m, req = producer_with_request(1)
    s.build_connector_meta(SchedOut({"r1": 300}))
    out = ConnOut(finished_sending={"r1", "stranger"})
    s.update_connector_output(out)
    assert out.finished_sending == set(), "vLLM may only free finished requests"
    assert s.request_finished(req, ([1],))[0] is False  # nothing left in flight: free now


def test_every_rank_hears_of_a_push_in_progress_until_it_is_reported() -> None:
    """The plan tells every worker a transfer is in progress (so a rank with none of its
    own waits on idle steps too, instead of spinning): from the step that stages the push
    until finished_sending reports it."""
    s, m, req = producer_with_request(1)
    assert not s.build_connector_meta(SchedOut({"r1": 200})).transfers_pending  # a chunk
    req.num_computed_tokens = 200
    assert s.build_connector_meta(SchedOut({"r1": 100})).transfers_pending  # staged
    s.request_finished(req, ([1],))
    assert s.build_connector_meta(SchedOut({})).transfers_pending  # held for the push
    s.update_connector_output(ConnOut(finished_sending={"r1"}))
    assert not s.build_connector_meta(SchedOut({})).transfers_pending


def test_every_rank_hears_of_a_load_in_progress_until_it_is_reported() -> None:
    s = consumer()
    req = Req("d1", dict(D_LEG))
    s.on_new_request(req)
    s.get_num_new_matched_tokens(req, 0)
    assert not s.build_connector_meta(SchedOut({})).transfers_pending  # no blocks yet
    s.update_state_after_alloc(req, Blocks([[1, 2, 3]]), 300)
    assert s.build_connector_meta(SchedOut({})).transfers_pending  # registration staged
    assert s.build_connector_meta(SchedOut({})).transfers_pending  # waiting for the KV
    s.update_connector_output(ConnOut(finished_recving={"d1"}))
    assert not s.build_connector_meta(SchedOut({})).transfers_pending


@dataclass(frozen=True)
class Status:
    name: str  # vLLM's RequestStatus member


@pytest.mark.parametrize("release_on_stop", [True, False])
@pytest.mark.parametrize("status", ["FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED"])
def test_a_stopped_first_token_frees_p_at_once_only_when_its_leg_says_so(
    release_on_stop: bool, status: str
) -> None:
    """First token from P: a token that ends the request gets no D leg, so a leg with
    ``release_on_stop`` lets vLLM free the blocks now; the next step's forward waits until
    no WRITE reads them (stopped, as reclaimed). Any other end, or no flag, holds them."""
    s, m = producer()
    params = {"do_remote_decode": True, "transfer_id": "t1", "release_on_stop": release_on_stop}
    req = Req("r1", params)
    s.on_new_request(req)
    m.ids["r1"] = ([1, 2],)
    s.build_connector_meta(SchedOut({"r1": 300}))
    req.status = Status(status)  # type: ignore[attr-defined]
    delay, out = s.request_finished(req, ([1, 2],))
    freed_now = release_on_stop and status == "FINISHED_STOPPED"
    assert delay is not freed_now and out is not None and out["transfer_id"] == "t1"
    plan = s.build_connector_meta(SchedOut({}))
    assert plan.stopped == (["t1"] if freed_now else []) and plan.reclaimed == []
    assert s.has_pending_push_work() is not freed_now


def test_prefill_aborted_before_its_prompt_completed_tells_the_worker() -> None:
    s, _ = producer()
    req = Req("r1", {"do_remote_decode": True, "transfer_id": "t1"})
    s.on_new_request(req)
    assert s.request_finished(req, ([1],))[0] is False
    (abort,) = s.build_connector_meta(SchedOut({})).aborts
    assert (abort.transfer_id, abort.kind) == ("t1", "prefill_aborted")


def test_preempted_after_the_push_began_is_reclaimed_and_never_pushed_again() -> None:
    s, m, req = producer_with_request(1, 2)
    s.build_connector_meta(SchedOut({"r1": 300}))
    plan = s.build_connector_meta(SchedOut({}, preempted_req_ids={"r1"}))
    assert plan.reclaimed == ["t1"]
    req.num_computed_tokens = 0  # recomputed from scratch later
    assert s.build_connector_meta(SchedOut({"r1": 300})).prefills == []
    out = ConnOut(finished_sending={"r1"})
    s.update_connector_output(out)
    assert out.finished_sending == set()
    assert s.request_finished(req, ([1, 2],))[0] is False


def test_probe_returns_coordinates_and_is_not_tracked() -> None:
    s, _ = producer()
    req = Req("p", {"pushkv_probe": True})
    s.on_new_request(req)
    delay, params = s.request_finished(req, ([1],))
    assert not delay and params == {
        "pushkv": {
            "engine_id": "prefill",
            "host": "127.0.0.1",
            "port": 5000,
            "tp_size": 1,
            "ports": (5000,),
            "agents": ("prefill-tp0-x",),
        }
    }


def consumer() -> SchedulerSide:
    return SchedulerSide("decode", is_producer=False, is_consumer=True)


def test_decode_registers_the_uncached_suffix_when_blocks_are_allocated() -> None:
    s = consumer()
    req = Req("d1", dict(D_LEG))
    s.on_new_request(req)
    assert s.get_num_new_matched_tokens(req, 128) == (172, True)
    assert s.get_num_new_matched_tokens(req, 128) == (172, True)  # side-effect free
    s.update_state_after_alloc(req, Blocks([[9, 10]]), 172)
    (reg,) = s.build_connector_meta(SchedOut({})).registrations
    assert (reg.block_ids, reg.first_token, reg.num_tokens) == (((9, 10),), 128, 300)
    s.update_state_after_alloc(req, Blocks([[9, 10, 11]]), 0)  # second call after the load
    assert s.build_connector_meta(SchedOut({})).empty()


def test_decode_registers_only_the_prefix_p_computes() -> None:
    """First token from P: D's prompt is P's 299 tokens plus P's token; D loads the 299
    (even the last of them: vLLM recomputes nothing it loaded) and computes the token."""
    s = consumer()
    req = Req("d1", {**D_LEG, "remote_num_tokens": 299})
    s.on_new_request(req)
    assert s.get_num_new_matched_tokens(req, 128) == (171, True)
    assert s.get_num_new_matched_tokens(req, 298) == (1, True)
    assert s.get_num_new_matched_tokens(req, 299) == (0, False)
    s.update_state_after_alloc(req, Blocks([[9, 10, 11]]), 171)
    (reg,) = s.build_connector_meta(SchedOut({})).registrations
    assert (reg.first_token, reg.num_tokens) == (128, 299)


def test_a_prefix_longer_than_the_prompt_is_the_prompt() -> None:
    s = consumer()
    req = Req("d1", {**D_LEG, "remote_num_tokens": 999})
    s.on_new_request(req)
    assert s.get_num_new_matched_tokens(req, 128) == (172, True)


def test_decode_full_hit_frees_p_at_once() -> None:
    s = consumer()
    req = Req("d1", dict(D_LEG))
    s.on_new_request(req)
    assert s.get_num_new_matched_tokens(req, 299) == (0, False)
    s.update_state_after_alloc(req, Blocks([[1]]), 0)
    (abort,) = s.build_connector_meta(SchedOut({})).aborts
    assert abort.kind == "not_needed"


def test_decode_abort_while_receiving_waits_for_finished_recving() -> None:
    s = consumer()
    req = Req("d1", dict(D_LEG))
    s.on_new_request(req)
    s.get_num_new_matched_tokens(req, 0)
    s.update_state_after_alloc(req, Blocks([[1, 2, 3]]), 300)
    s.build_connector_meta(SchedOut({}))
    assert s.request_finished(req, ([1, 2, 3],)) == (False, None)
    (abort,) = s.build_connector_meta(SchedOut({})).aborts
    assert abort.kind == "aborted"
    out = ConnOut(finished_recving={"d1"})
    s.update_connector_output(out)
    assert out.finished_recving == {"d1"}  # vLLM frees the held blocks now
    assert s._reqs == {}


def test_malformed_decode_leg_is_served_locally_with_the_reason() -> None:
    s = consumer()
    for bad in (
        {"do_remote_prefill": True},
        {**D_LEG, "remote_port": "x"},
        {**D_LEG, "transfer_id": "has space"},
        {**D_LEG, "remote_tp_size": 0},
    ):
        req = Req("d", bad)
        s.on_new_request(req)
        assert s.get_num_new_matched_tokens(req, 0) == (0, False)
        delay, params = s.request_finished(req, ([1],))
        assert not delay and "kv_transfer_params" in params["pushkv_error"]
    assert s._reqs == {}


def test_untrusted_decode_leg_is_never_dialed_and_served_locally() -> None:
    """A leg sent straight to D naming coordinates the router did not sign: no
    registration is staged (so no worker dials), and the reason is in the response."""
    key = b"s" * 32
    s = SchedulerSide("decode", False, True, LegTrust(key))
    for i, params in enumerate(
        (
            dict(D_LEG),  # unsigned
            sign_decode_params(D_LEG, b"z" * 32, int(time.time() * 1000), 60_000),  # other key
            sign_decode_params(D_LEG, key, int(time.time() * 1000) - 120_000, 60_000),  # expired
        )
    ):
        req = Req(f"d{i}", params)
        s.on_new_request(req)
        assert s.get_num_new_matched_tokens(req, 0) == (0, False)
        s.update_state_after_alloc(req, Blocks([[1, 2]]), 0)
        assert s.build_connector_meta(SchedOut({req.request_id: 300})).registrations == []
        delay, out = s.request_finished(req, ([1, 2],))
        assert not delay and "no valid router signature" in out["pushkv_error"]
    assert s.untrusted_legs == 3
    good = Req("ok", sign_decode_params(D_LEG, key, int(time.time() * 1000), 60_000))
    s.on_new_request(good)
    assert s.get_num_new_matched_tokens(good, 0) == (300, True)


@dataclass
class FailedOut(ConnOut):
    failed_recving: set[str] = field(default_factory=set)


def test_a_refused_leg_fails_its_load_and_dials_nothing() -> None:
    """untrusted_leg: refuse. vLLM is asked to wait for a load (so the request is not
    computed), the load is reported failed in the same step (vLLM's "fail" policy then ends
    the request with an error), and no registration or abort, which would reach P, is staged."""
    s = SchedulerSide("decode", False, True, LegTrust(b"s" * 32), refuse_untrusted=True)
    req = Req("d", dict(D_LEG))
    s.on_new_request(req)
    assert s._reqs["d"].state is ReqState.REFUSED
    assert s.get_num_new_matched_tokens(req, 0) == (300, True)
    assert s.get_num_new_matched_tokens(req, 299) == (1, True)  # even one token: no compute
    s.update_state_after_alloc(req, Blocks([[1, 2]]), 300)
    plan = s.build_connector_meta(SchedOut({}))
    assert plan.failed_loads == ["d"]
    assert plan.registrations == [] and plan.aborts == []
    # vLLM (policy "fail") ends the request before it passes the report on.
    delay, out = s.request_finished(req, ([1, 2],))
    assert not delay and "refused (untrusted_leg: refuse)" in out["pushkv_error"]
    assert "no valid router signature" in out["pushkv_error"]
    s.update_connector_output(FailedOut(finished_recving={"d"}, failed_recving={"d"}))
    assert s._reqs == {} and not s.recomputed and s.untrusted_legs == 1
    assert not s.has_pending_push_work()
    # vLLM's API server then resubmits the failed request pre-aborted, for cleanup
    # (notify_kv_transfer_request_rejected): released, and not counted as another leg.
    cleanup = Req("d-cleanup", dict(D_LEG))
    cleanup.abort_immediately = True  # type: ignore[attr-defined]
    s.on_new_request(cleanup)
    s.request_finished(cleanup, ([],))
    assert s._reqs == {} and s.untrusted_legs == 1 and s.build_connector_meta(SchedOut({})).empty()


def test_refuse_keeps_trusted_legs_as_they_were() -> None:
    key = b"s" * 32
    s = SchedulerSide("decode", False, True, LegTrust(key), refuse_untrusted=True)
    good = Req("ok", sign_decode_params(D_LEG, key, int(time.time() * 1000), 60_000))
    s.on_new_request(good)
    assert s.get_num_new_matched_tokens(good, 0) == (300, True)
    s.update_state_after_alloc(good, Blocks([[1, 2]]), 300)
    plan = s.build_connector_meta(SchedOut({}))
    assert [r.transfer_id for r in plan.registrations] == ["t1"] and plan.failed_loads == []


def test_a_refused_leg_vllm_loads_nothing_for_is_computed_with_the_reason() -> None:
    """A request that skips the prefix cache gets no load from vLLM (0 external tokens):
    nothing can be failed, so it is computed here, as under "recompute"."""
    s = SchedulerSide("decode", False, True, LegTrust(b"s" * 32), refuse_untrusted=True)
    req = Req("d", dict(D_LEG))
    s.on_new_request(req)
    s.update_state_after_alloc(req, Blocks([[1, 2]]), 0)
    plan = s.build_connector_meta(SchedOut({"d": 300}))
    assert plan.empty()
    delay, out = s.request_finished(req, ([1, 2],))
    assert not delay and "refused" in out["pushkv_error"]


def test_a_raising_hook_on_an_untrusted_leg_still_dials_nothing() -> None:
    """on_new_request raised (plugin.py's guard adopts the request): the adopted record is
    checked for trust like any other, so letting go of it tells no untrusted P anything."""
    for refuse in (False, True):
        s = SchedulerSide("decode", False, True, LegTrust(b"s" * 32), refuse_untrusted=refuse)
        req = Req("d", dict(D_LEG))
        s.hook_failed("on_new_request", req)
        plan = s.build_connector_meta(SchedOut({}))
        assert plan.aborts == [] and plan.registrations == [], refuse
        if refuse:
            s.hook_failed("update_state_after_alloc", req, 300)
            assert s.build_connector_meta(SchedOut({})).failed_loads == ["d"]
            assert s.build_connector_meta(SchedOut({})).aborts == []


def test_an_untrusted_leg_is_a_span_in_the_requests_trace() -> None:
    rec = Recorder()
    s = SchedulerSide("decode", False, True, LegTrust(b"s" * 32))
    s._intake.tracer = rec.tracer
    tp = "00-" + "a1" * 16 + "-" + "c1" * 8 + "-01"
    s.on_new_request(Req("d", {**D_LEG, "traceparent": tp}))
    span = rec.one(Span.LEG_REJECTED)
    attrs = span.attributes or {}
    assert span.context.trace_id == int("a1" * 16, 16)
    assert span.status.status_code is StatusCode.ERROR
    assert attrs[Attr.PEER.value] == "127.0.0.1:5000"
    assert "no valid router signature" in str(attrs[Attr.REASON.value])


def test_states_are_records_not_set_membership() -> None:
    s = consumer()
    req = Req("d1", dict(D_LEG))
    s.on_new_request(req)
    assert s._reqs["d1"].state is ReqState.AWAITING_ALLOC


def test_every_state_change_is_a_lifecycle_transition(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[str, str]] = []
    advance = lc.advance

    def spy(state: ReqState, event: lc.ReqEvent) -> lc.Transition:
        seen.append((state.name, type(event).__name__))
        return advance(state, event)

    monkeypatch.setattr(lc, "advance", spy)
    s, m, req = producer_with_request(1)
    s.update_state_after_alloc(req, Blocks([[1]]), 0)  # P: allocation is no event
    s.build_connector_meta(SchedOut({"r1": 200}))  # a chunk of the prompt: no event
    req.num_computed_tokens = 200
    s.build_connector_meta(SchedOut({"r1": 100}))
    s.update_connector_output(ConnOut(finished_sending={"r1"}))
    s.request_finished(req, ([1],))
    d = consumer()
    dreq = Req("d1", dict(D_LEG))
    d.on_new_request(dreq)
    d.get_num_new_matched_tokens(dreq, 0)
    d.update_state_after_alloc(dreq, Blocks([[1, 2, 3]]), 300)
    d.update_connector_output(ConnOut(finished_recving={"d1"}))
    d.update_state_after_alloc(dreq, Blocks([[1, 2, 3]]), 0)
    d.build_connector_meta(SchedOut({"d1": 1}, preempted_req_ids={"d1"}))
    d.request_finished(dreq, ([1, 2, 3],))
    assert seen == [
        ("PREFILLING", "PrefillScheduled"),
        ("PUSHING", "PushReported"),
        ("PUSHED_EARLY", "RequestFinished"),
        ("AWAITING_ALLOC", "BlocksAllocated"),
        ("RECEIVING", "RecvReported"),
        ("DONE", "PromptCached"),
        ("DONE", "Preempted"),
        ("DONE", "RequestFinished"),
    ]
    assert s._reqs == {} and d._reqs == {}


def test_an_event_out_of_turn_is_logged_and_changes_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    s, m, req = producer_with_request(1)
    s.build_connector_meta(SchedOut({"r1": 300}))
    out = ConnOut(finished_recving={"r1"})  # a P request cannot have received KV
    with caplog.at_level(logging.ERROR, logger="connector.scheduler_side"):
        s.update_connector_output(out)
    assert "RecvReported for request r1 in PUSHING" in caplog.text
    assert s._reqs["r1"].state is ReqState.PUSHING and out.finished_recving == {"r1"}
    assert s.request_finished(req, ([1],))[0] is True  # the push still holds the blocks

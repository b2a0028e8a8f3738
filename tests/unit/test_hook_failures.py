"""A hook of ours that raises lets go of its request definitely, and the
test-only fault injection that makes it (and a failed WRITE, a lost ``done``) happen on
purpose (pushkv_testing/faults.py).

The guard is plugin.py's own decorator, on a stand-in connector around the real
SchedulerSide; the vLLM objects are the small stand-ins of test_scheduler_side.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from connector.config import Faults, PushkvConfig, parse_config
from connector.core import events as ev
from connector.core import messages as m
from connector.core.errors import ConfigError
from connector.core.lifecycle import ReqState
from connector.core.state import ReceiverPolicy
from connector.metadata import StepPlan
from connector.plugin import _guard
from connector.scheduler_side import SchedulerSide
from connector.worker_side import WorkerSide
from pushkv_testing.faults import FaultyTransport
from telemetry.schema import Count
from tests.unit.test_endpoints import MS, Pair
from tests.unit.test_scheduler_side import (
    D_LEG,
    Blocks,
    ConnOut,
    Req,
    SchedOut,
    consumer,
    producer_with_request,
)


class Boom(RuntimeError):
    pass


class Connector:
    """PushConnector's scheduler hooks, guarded as in plugin.py; ``fail`` names hooks that
    raise (after doing their work, the worst case: state half changed)."""

    def __init__(self, sched: SchedulerSide, faults: Faults | None = None) -> None:
        self._sched, self._faults, self.fail = sched, faults, set[str]()

    def _maybe(self, hook: str) -> None:
        if hook in self.fail:
            raise Boom(hook)

    @_guard(lambda *a: None)
    def on_new_request(self, request: Any) -> None:
        self._sched.on_new_request(request)
        self._maybe("on_new_request")

    @_guard(lambda *a: (0, False))
    def get_num_new_matched_tokens(self, request: Any, num_computed: int) -> Any:
        out = self._sched.get_num_new_matched_tokens(request, num_computed)
        self._maybe("get_num_new_matched_tokens")
        return out

    @_guard(lambda *a: None)
    def update_state_after_alloc(self, request: Any, blocks: Any, n: int) -> None:
        self._sched.update_state_after_alloc(request, blocks, n)
        self._maybe("update_state_after_alloc")

    @_guard(lambda *a: None)
    def update_connector_output(self, out: Any) -> None:
        self._sched.update_connector_output(out)
        self._maybe("update_connector_output")

    @_guard(lambda self, request, *a: (self._sched.keeps_blocks(request), None))
    def request_finished(self, request: Any, block_ids: Any) -> Any:
        out = self._sched.request_finished(request, block_ids)
        self._maybe("request_finished")
        return out


def _fail_enter_once(monkeypatch: pytest.MonkeyPatch, sched: SchedulerSide) -> None:
    """The hook raises after staging its work, before the request's state changed."""
    real = sched._enter

    def enter(*a: Any) -> None:
        monkeypatch.setattr(sched, "_enter", real)
        raise Boom("after staging, before the state changed")

    monkeypatch.setattr(sched, "_enter", enter)


def _d(fail: str = "", faults: Faults | None = None) -> tuple[Connector, Req]:
    c = Connector(consumer(), faults)
    if fail:
        c.fail.add(fail)
    req = Req("r1", dict(D_LEG))
    c.on_new_request(req)
    return c, req


def test_d_hook_raising_once_vllm_waits_reports_the_load_failed_and_sends_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    c, req = _d()
    assert c.get_num_new_matched_tokens(req, 0) == (300, True)  # vLLM will wait for KV

    _fail_enter_once(monkeypatch, c._sched)
    c.update_state_after_alloc(req, Blocks([[1, 2]]), 300)
    plan = c._sched.build_connector_meta(SchedOut({}))
    assert plan.registrations == [], "a registration staged before the raise must not go out"
    assert plan.failed_loads == ["r1"], "vLLM waits: the load must be reported failed"
    assert [(a.transfer_id, a.kind) for a in plan.aborts] == [("t1", "not_needed")]
    assert "r1" not in c._sched._reqs
    assert c._sched.counters[Count.HOOK_ERRORS.value] == 1
    assert c._sched.counters[f"{Count.HOOK_EFFECT.value}stage_load_failed"] == 1


def test_d_hook_raising_after_staging_its_registration_aborts_it() -> None:
    c, req = _d("update_state_after_alloc")
    c.get_num_new_matched_tokens(req, 0)
    c.update_state_after_alloc(req, Blocks([[1, 2]]), 300)  # done, then raised
    plan = c._sched.build_connector_meta(SchedOut({}))
    # Registered (state RECEIVING): the cancel follows it, and the report comes once P
    # answered, so no WRITE lands in blocks vLLM recomputes into.
    assert [r.transfer_id for r in plan.registrations] == ["t1"] and plan.failed_loads == []
    assert [(a.transfer_id, a.kind) for a in plan.aborts] == [("t1", "aborted")]


def test_d_hook_raising_before_vllm_waits_computes_here_and_frees_p() -> None:
    c, req = _d("get_num_new_matched_tokens")
    assert c.get_num_new_matched_tokens(req, 0) == (0, False)  # the guard's default
    c.update_state_after_alloc(req, Blocks([[1, 2]]), 0)
    plan = c._sched.build_connector_meta(SchedOut({}))
    assert plan.registrations == [] and plan.failed_loads == []
    assert [(a.transfer_id, a.kind) for a in plan.aborts] == [("t1", "not_needed")]
    delay, params = c.request_finished(req, ([1, 2],))
    assert not delay and "get_num_new_matched_tokens failed" in params["pushkv_error"]


def test_d_hook_raising_after_registering_aborts_and_waits_for_the_report() -> None:
    c, req = _d()
    c.get_num_new_matched_tokens(req, 0)
    c.update_state_after_alloc(req, Blocks([[1, 2]]), 300)
    assert len(c._sched.build_connector_meta(SchedOut({})).registrations) == 1
    c.fail.add("update_connector_output")
    c.update_connector_output(ConnOut())  # no request: counted only
    assert c._sched.counters[Count.HOOK_ERRORS.value] == 1
    c.fail = {"request_finished"}
    c.request_finished(req, ([1, 2],))
    plan = c._sched.build_connector_meta(SchedOut({}))
    # The registration went out: only P's answer makes the blocks safe, so abort and wait.
    assert [(a.transfer_id, a.kind) for a in plan.aborts] == [("t1", "aborted")]
    assert c._sched._reqs["r1"].state is ReqState.ABORTING
    c.update_connector_output(ConnOut(finished_recving={"r1"}))
    assert "r1" not in c._sched._reqs


def test_d_on_new_request_raising_still_frees_p() -> None:
    c, req = _d("on_new_request")
    # The record was adopted and let go of: P is told, D computes the prompt.
    assert c._sched._reqs["r1"].state is ReqState.DONE
    assert c.get_num_new_matched_tokens(req, 0) == (0, False)
    plan = c._sched.build_connector_meta(SchedOut({}))
    assert [(a.transfer_id, a.kind) for a in plan.aborts] == [("t1", "not_needed")]


def test_p_hook_raising_before_the_prompt_ran_tells_d_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for raise_before_state_change in (True, False):
        s, _m, req = producer_with_request(1, 2)
        c = Connector(s)
        if raise_before_state_change:
            _fail_enter_once(monkeypatch, s)
        else:
            c.fail.add("request_finished")
        assert c.request_finished(req, ([1, 2],)) == (False, None)
        plan = s.build_connector_meta(SchedOut({}))
        assert [(a.transfer_id, a.kind) for a in plan.aborts] == [("t1", "prefill_aborted")]
        assert "r1" not in s._reqs


def test_p_hook_raising_while_pushing_reclaims_the_blocks_vllm_frees(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    s, _m, req = producer_with_request(1, 2)
    s.build_connector_meta(SchedOut({"r1": 300}))  # the push is staged
    _fail_enter_once(monkeypatch, s)
    assert Connector(s).request_finished(req, ([1, 2],)) == (False, None)  # vLLM frees now...
    plan = s.build_connector_meta(SchedOut({}))
    assert plan.reclaimed == ["t1"]  # ...so the next forward waits for the WRITE to end
    assert s._reqs["r1"].state is ReqState.SPENT


def test_p_hook_raising_after_handing_over_keeps_the_blocks_for_the_push() -> None:
    s, _m, req = producer_with_request(1, 2)
    s.build_connector_meta(SchedOut({"r1": 300}))
    c = Connector(s)
    c.fail.add("request_finished")
    assert c.request_finished(req, ([1, 2],)) == (True, None)  # delay_free held
    out = ConnOut(finished_sending={"r1"})
    s.update_connector_output(out)
    assert out.finished_sending == {"r1"} and "r1" not in s._reqs  # freed by the report


def test_injected_hook_failure_hits_only_the_chosen_prompt_length() -> None:
    faults = Faults(raise_hook="update_state_after_alloc", raise_hook_tokens=300)
    c, req = _d(faults=faults)
    c.get_num_new_matched_tokens(req, 0)
    c.update_state_after_alloc(req, Blocks([[1, 2]]), 300)
    assert c._sched.build_connector_meta(SchedOut({})).failed_loads == ["r1"]
    other = Req("r2", {**D_LEG, "transfer_id": "t2"}, num_prompt_tokens=299)
    c.on_new_request(other)
    c.get_num_new_matched_tokens(other, 0)
    c.update_state_after_alloc(other, Blocks([[3]]), 299)
    plan = c._sched.build_connector_meta(SchedOut({}))
    assert [r.transfer_id for r in plan.registrations] == ["t2"] and plan.failed_loads == []


def test_worker_reports_failed_loads_received_and_failed_once() -> None:
    w = WorkerSide(PushkvConfig(), "decode", False, True, 0, 1, 4, 16, {})
    w.bind(StepPlan(failed_loads=["r1"]))
    assert w.take_results() == (set(), {"r1"}, {"r1"})
    assert w.take_results() == (set(), set(), set())


def test_faults_are_parsed_from_the_underscored_key_and_checked() -> None:
    assert parse_config({}).faults is None
    cfg = parse_config({"_faults": {"fail_write_tokens": 7}})
    assert cfg.faults == Faults(fail_write_tokens=7)
    with pytest.raises(ConfigError):
        parse_config({"_faults": {"fail_writes": 7}})


def test_injected_write_failure_fails_d_at_once() -> None:
    pair = Pair()
    pair.sender._t = faulty = FaultyTransport(pair.tp, Faults(fail_write_tokens=16))
    pair.sender.peers._t = faulty
    pair.tp = faulty  # pump reads P's notifications through the wrapper
    pair.expect("t", 16, (4,))
    pair.sender.on_event(ev.PrefillDone("t", "preq", ((1,),), 16), pair.now)
    pair.pump()
    (got,) = pair.receiver.finished
    assert not got.ok and got.reason is m.FailReason.POST_ERROR
    assert pair.sender.finished == ["preq"]
    assert faulty.counters[f"{Count.INJECTED.value}fail_write"] == 1
    assert pair.sender.counters[f"{Count.WRITE_FAILED.value}post_error"] == 1
    assert pair.sender.counters[f"{Count.FAIL_SENT.value}post_error"] == 1
    assert pair.receiver.counters[f"{Count.RECV_FAILED.value}post_error"] == 1


def _lost_done(policy: ReceiverPolicy) -> tuple[Pair, FaultyTransport]:
    """A pair whose D loses the first `done` of a 16-token transfer, started."""
    pair = Pair(recv_policy=policy)
    faulty = FaultyTransport(pair.td, Faults(drop_completion_tokens=16))
    pair.receiver.peers._t = faulty
    pair.td = faulty
    pair.expect("t", 16, (4,))
    pair.sender.on_event(ev.PrefillDone("t", "preq", ((1,),), 16), pair.now)
    return pair, faulty


def test_injected_lost_completion_is_recovered_by_ds_deadline_and_ps_resend() -> None:
    # D's first heartbeat would come after its deadline (30 ms): the cancel asks P.
    pair, faulty = _lost_done(ReceiverPolicy(timeout_ns=30 * MS, write_timeout_ns=10 * MS))
    pair.pump(rounds=10)
    assert pair.receiver.finished == [], "the first done was lost: D still waits"
    pair.pump(rounds=40)  # D's deadline: cancel; P, DONE, answers with a fresh done
    (got,) = pair.receiver.finished
    assert got.ok
    assert faulty.counters[f"{Count.INJECTED.value}drop_completion"] == 1
    assert pair.sender.counters[Count.COMPLETION_RESENT.value] == 1
    assert not any(k.startswith(Count.RECV_FAILED.value) for k in pair.receiver.counters)


def test_injected_lost_completion_is_learned_at_ds_next_heartbeat() -> None:
    # D's deadline is far (1 s): its heartbeat (every 5 ms) makes P, DONE, send `done` again.
    policy = ReceiverPolicy(
        timeout_ns=1_000 * MS, write_timeout_ns=500 * MS, heartbeat_interval_ns=5 * MS
    )
    pair, faulty = _lost_done(policy)
    pair.pump(rounds=3)
    assert pair.receiver.finished == [], "the first done was lost: D still waits"
    pair.pump(rounds=10)
    (got,) = pair.receiver.finished
    assert got.ok and pair.now <= 13 * MS  # one heartbeat after the WRITE, not 1 s
    assert faulty.counters[f"{Count.INJECTED.value}drop_completion"] == 1
    assert pair.sender.counters[Count.COMPLETION_RESENT.value] == 1
    assert pair.receiver.counters["heartbeats_sent"] >= 1

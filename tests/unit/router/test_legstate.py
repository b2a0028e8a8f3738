"""The leg-state table (every (state, event) pair is a transition or a LocalProtocolError),
which strategy an attempt runs, and the states both legs end in per mode and failure."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from connector.core.errors import LocalProtocolError
from connector.router import modes, relay
from connector.router.attempt import Attempt
from connector.router.backends import Role
from connector.router.config import FirstToken, Mode
from connector.router.legstate import ENDED, TRANSITIONS, LegEvent, LegState, LegTrack
from telemetry.schema import Outcome
from tests.unit.router.conftest import MakeCluster
from tests.unit.router.serving import within

S, E = LegState, LegEvent
COMPLETION = {"model": "m", "prompt": "hello", "max_tokens": 8}


@pytest.mark.parametrize("state", list(LegState))
@pytest.mark.parametrize("event", list(LegEvent))
def test_every_pair_is_a_transition_or_a_protocol_error(state: LegState, event: LegEvent) -> None:
    leg = LegTrack(Role.DECODE, state=state)
    if (state, event) in TRANSITIONS:
        assert leg.on(event, "why") is TRANSITIONS[(state, event)]
    else:
        with pytest.raises(LocalProtocolError, match=f"can't handle {event.value}"):
            leg.on(event)
        assert leg.state is state


def test_ended_legs_stay_ended_and_unsent_ones_can_only_be_sent() -> None:
    for (state, _event), to in TRANSITIONS.items():
        if state in ENDED:
            assert to is state, f"{state} has ended but moves to {to}"
    assert [e for (s, e) in TRANSITIONS if s is S.UNSENT] == [E.SENT]


def test_a_break_after_the_whole_answer_changes_nothing() -> None:
    leg = LegTrack(Role.DECODE)
    for event in (E.SENT, E.OPENED, E.COMPLETED):
        leg.on(event)
    leg.on(E.FAILED, "connection reset")
    leg.on(E.CANCELLED, "prefill leg failed")
    assert (leg.state, leg.reason, leg.outcome(), leg.open) == (S.DONE, None, None, False)


def test_outcome_is_the_first_reason_or_cancelled() -> None:
    leg = LegTrack(Role.DECODE)
    leg.on(E.SENT)
    assert leg.open
    leg.on(E.OPENED)
    leg.on(E.CANCELLED, "prefill leg failed")
    assert leg.outcome() == "prefill leg failed" and not leg.open
    left = LegTrack(Role.DECODE)
    left.on(E.SENT)
    left.on(E.CANCELLED)  # the client left: no reason of its own
    assert left.outcome() == Outcome.CANCELLED.value
    assert LegTrack(Role.DECODE).outcome() == Outcome.CANCELLED.value  # never sent


def test_detached_p_ends_on_its_own() -> None:
    for end, state in ((E.COMPLETED, S.DONE), (E.FAILED, S.FAILED), (E.CANCELLED, S.CANCELLED)):
        leg = LegTrack(Role.PREFILL)
        leg.on(E.SENT)
        leg.on(E.DETACHED)
        assert leg.on(end) is state


@pytest.mark.parametrize(
    ("first_token", "has_p", "mode", "strategy"),
    [
        (True, True, Mode.PUSH, modes.FirstTokenFromP),
        (False, False, Mode.PUSH, modes.Degraded),
        (False, False, Mode.PULL, modes.Degraded),
        (False, True, Mode.PULL, modes.Sequential),
        (False, True, Mode.PUSH, modes.Concurrent),
        (False, True, Mode.VLLM_PUSH, modes.Concurrent),
    ],
)
def test_strategy_per_mode(first_token: bool, has_p: bool, mode: Mode, strategy: type) -> None:
    a: Any = SimpleNamespace(
        first_token_from_p=first_token,
        p=object() if has_p else None,
        config=SimpleNamespace(mode=mode),
    )
    assert isinstance(modes.strategy_for(a), strategy)


# -- the states both legs end in, served through the router --------------------------------


@pytest.fixture
def attempts(monkeypatch: pytest.MonkeyPatch) -> list[Attempt]:
    """Every attempt the router makes, kept for the test to read its legs' states."""
    made: list[Attempt] = []

    class Recorded(Attempt):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(relay, "Attempt", Recorded)
    return made


def _states(a: Attempt) -> tuple[LegState, LegState]:
    return a.p_leg.state, a.d_leg.state


@pytest.mark.anyio
async def test_push_d_done_first_detaches_p(cluster: MakeCluster, attempts: list[Attempt]) -> None:
    c = await cluster()
    c.p[0].gate = asyncio.Event()  # P answers only after D's answer is out
    r = await c.client.post("/v1/completions", json=COMPLETION)
    assert r.status_code == 200
    (a,) = attempts
    assert _states(a) == (S.DETACHED, S.DONE)
    c.p[0].gate.set()
    await c.background_done()
    assert _states(a) == (S.DONE, S.DONE)


@pytest.mark.anyio
async def test_push_p_failing_cancels_d(cluster: MakeCluster, attempts: list[Attempt]) -> None:
    c = await cluster(degraded=False, max_attempts=1)
    c.p[0].fail_first_n, c.p[0].error_status = 1, 503
    c.d[0].gate = asyncio.Event()  # D is still waiting for its KV when P fails
    r = await c.client.post("/v1/completions", json=COMPLETION)
    assert r.status_code == 503
    (a,) = attempts
    assert _states(a) == (S.FAILED, S.CANCELLED)
    assert a.d_leg.reason == "prefill leg failed"
    assert a.retry is None


@pytest.mark.anyio
async def test_push_d_failing_cancels_p(cluster: MakeCluster, attempts: list[Attempt]) -> None:
    c = await cluster(max_attempts=1)
    c.p[0].gate = asyncio.Event()
    c.d[0].fail_first_n = 1
    r = await within(c.client.post("/v1/completions", json=COMPLETION), "D's failure answered")
    assert r.status_code == 500
    (a,) = attempts
    await a.settled()
    assert _states(a) == (S.CANCELLED, S.FAILED)


@pytest.mark.anyio
async def test_pull_runs_p_then_d(cluster: MakeCluster, attempts: list[Attempt]) -> None:
    c = await cluster(mode=Mode.PULL)
    r = await c.client.post("/v1/completions", json={**COMPLETION, "stream": True})
    assert r.status_code == 200
    (a,) = attempts
    assert _states(a) == (S.DONE, S.DONE) and a.p_leg.task is None


@pytest.mark.anyio
async def test_retried_attempt_leaves_the_first_ones_legs_failed(
    cluster: MakeCluster, attempts: list[Attempt]
) -> None:
    c = await cluster(1, 2)
    c.d[0].fail_first_n = 1  # the first D fails before the client's first byte: retried
    r = await c.client.post("/v1/completions", json=COMPLETION)
    assert r.status_code == 200
    first, second = attempts
    assert first.retry is not None and first.retry.role is Role.DECODE
    assert first.d_leg.state is S.FAILED and first.p_leg.state in (S.CANCELLED, S.DONE)
    assert second.retry is None and second.d_leg.state is S.DONE


@pytest.mark.anyio
async def test_degraded_sends_no_p_leg(cluster: MakeCluster, attempts: list[Attempt]) -> None:
    c = await cluster()
    c.p[0].healthy = False
    await c.check_health()
    r = await c.client.post("/v1/completions", json=COMPLETION)
    assert r.status_code == 200
    (a,) = attempts
    assert a.p is None and _states(a) == (S.UNSENT, S.DONE)


@pytest.mark.anyio
async def test_first_token_from_p_then_d(cluster: MakeCluster, attempts: list[Attempt]) -> None:
    c = await cluster(first_token=FirstToken.PREFILL)
    stream = {**COMPLETION, "stream": True}
    assert (await c.client.post("/v1/completions", json=stream)).status_code == 200
    c.p[0].finish_reason = "stop"  # P's token ends the request: no D leg
    assert (await c.client.post("/v1/completions", json=stream)).status_code == 200
    continued, stopped = attempts
    assert _states(continued) == (S.DONE, S.DONE)
    assert _states(stopped) == (S.DONE, S.UNSENT) and len(c.d[0].requests) == 1

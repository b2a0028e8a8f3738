"""PrefillWatch: D's awaits end early when P's leg fails, and are plain awaits otherwise."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from connector.router import watch as watch_module
from connector.router.upstream import UpstreamError
from connector.router.watch import PREFILL_FAILED, PrefillWatch

pytestmark = pytest.mark.anyio


async def _p_leg(outcome: asyncio.Future[None]) -> None:
    await outcome


async def test_p_failing_mid_await_interrupts_it() -> None:
    outcome: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    watch = PrefillWatch(asyncio.create_task(_p_leg(outcome)))
    never: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    asyncio.get_running_loop().call_later(0.01, outcome.set_exception, UpstreamError(503, "P down"))
    assert await asyncio.wait_for(watch.run(never), 5) is PREFILL_FAILED
    assert watch.failure is not None and watch.failure.status == 503
    assert await watch.run(asyncio.sleep(0, "late")) is PREFILL_FAILED  # and every later one


def _no_cancel_scopes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the watch module's cancel scope fail: the plain-await path must not open one
    (a scope per streamed chunk is a large share of the router's CPU)."""

    def boom() -> None:
        raise AssertionError("a cancel scope was opened")

    monkeypatch.setattr(watch_module, "anyio", SimpleNamespace(CancelScope=boom))


async def test_after_p_succeeded_awaits_are_plain(monkeypatch: pytest.MonkeyPatch) -> None:
    outcome: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(_p_leg(outcome))
    watch = PrefillWatch(task)
    outcome.set_result(None)
    await task  # the watch's done callback was registered first, so it has run
    _no_cancel_scopes(monkeypatch)
    assert await watch.run(asyncio.sleep(0, "chunk")) == "chunk"
    assert watch.failure is None


async def test_without_p_task_it_just_awaits(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_cancel_scopes(monkeypatch)
    watch = PrefillWatch(None)
    assert await watch.run(asyncio.sleep(0, 7)) == 7

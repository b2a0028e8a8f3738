"""A child's whole process group frozen by SIGSTOP for a block and continued after it, also
when the block raises (the e2e test of a hung P relies on that to leave no P stopped)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator

import pytest

from connector.tools.procgroup import group_states, group_stopped

WAIT_S = 10.0  # signals and /proc are quick; this only bounds a broken test


def _until(cond: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


@pytest.fixture
def group() -> Iterator[int]:
    """A leader and one child of it (as vLLM's API server and its engine core)."""
    proc = subprocess.Popen(["sh", "-c", "sleep 60 & exec sleep 60"], start_new_session=True)
    try:
        _until(lambda: len(group_states(proc.pid)) == 2, "the group never had two processes")
        yield proc.pid
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=WAIT_S)


def _all(pgid: int, stopped: bool) -> bool:
    states = group_states(pgid).values()
    return len(states) == 2 and all((s == "T") == stopped for s in states)


def test_every_process_of_the_group_stops_for_the_block_and_continues_after(group: int) -> None:
    with group_stopped(group):
        _until(lambda: _all(group, stopped=True), f"not all stopped: {group_states(group)}")
    _until(lambda: _all(group, stopped=False), f"not all continued: {group_states(group)}")


def test_the_group_continues_when_the_block_raises(group: int) -> None:
    with pytest.raises(RuntimeError, match="assertion in the block"), group_stopped(group):
        _until(lambda: _all(group, stopped=True), f"not all stopped: {group_states(group)}")
        raise RuntimeError("assertion in the block")
    _until(lambda: _all(group, stopped=False), f"not all continued: {group_states(group)}")

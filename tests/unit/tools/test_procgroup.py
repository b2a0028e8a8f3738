"""A child's whole process group frozen by SIGSTOP for a block and continued after it, also
when the block raises (the e2e test of a hung P relies on that to leave no P stopped); a
member that exited is no live member while it waits to be reaped."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from connector.tools.procgroup import (
    group_pids,
    group_states,
    group_stopped,
    stop_process_group,
)

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


def _members(pgid: int) -> dict[int, str]:
    """Every process of the group with its state, the exited ones awaiting reaping too."""
    out = {}
    for entry in Path("/proc").iterdir():
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # not a process, or gone
        if int(fields[2]) == pgid:
            out[int(entry.name)] = fields[0]
    return out


def test_a_member_that_exited_is_not_live_while_it_waits_to_be_reaped() -> None:
    """A zombie holds no port, memory or CPU; waiting for its reaping (an orphan's is up to
    PID 1, seconds late on some hosts) only makes every stop slower."""
    # The leader's child exits at once; the leader (sleep, after exec) never reaps it.
    proc = subprocess.Popen(["sh", "-c", "true & exec sleep 60"], start_new_session=True)
    try:
        _until(lambda: "Z" in _members(proc.pid).values(), "the child never exited")
        assert group_pids(proc.pid) == [proc.pid]
        assert list(group_states(proc.pid)) == [proc.pid]
    finally:
        stop_process_group(proc, WAIT_S)
    assert proc.returncode is not None and group_pids(proc.pid) == []

"""The router's SCHED_FIFO class (connector/router/priority.py, --realtime-priority)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from connector.router.config import parse_args

URLS = ["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2", "--port", "3"]


@pytest.mark.skipif(not hasattr(os, "sched_setscheduler"), reason="Linux only")
def test_realtime_takes_effect_or_says_why_not() -> None:
    # A child process: the test's own threads keep their class.
    code = (
        "import os; from connector.router.priority import realtime; why = realtime(5); "
        "print(why, os.sched_getscheduler(0), os.sched_getparam(0).sched_priority)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=30
    ).stdout.split()
    if out[0] == "None":
        assert (int(out[1]), int(out[2])) == (os.SCHED_FIFO, 5)
    else:
        assert int(out[1]) == os.SCHED_OTHER, "not applied: the normal class, and why"


def test_the_flag_is_bounded() -> None:
    assert parse_args(URLS).realtime_priority == 0
    assert parse_args([*URLS, "--realtime-priority", "10"]).realtime_priority == 10
    with pytest.raises(SystemExit):
        parse_args([*URLS, "--realtime-priority", "100"])

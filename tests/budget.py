"""CPU and time budgets: one measurement, two bounds.

A budget test is parametrized over ``BOUNDS``: its ``ci`` case (``make test``) checks a
generous bound, several times the precise one, so a noisy shared box never fails it while a
busy loop still does; its ``perf`` case (``make perf``) checks the precise bound. Either way
the figure is reported: printed (``-rA`` shows it), recorded with ``record_property`` and
named in the assert message.

Owns: ``Budget``, ``BOUNDS`` and the CPU readers the budget tests share. Test code only.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

# The `bound` argument of a budget test: "generous" runs in CI, "precise" only in `make perf`.
BOUNDS = [
    pytest.param("generous", id="ci"),
    pytest.param("precise", id="perf", marks=pytest.mark.perf),
]

RecordProperty = Callable[[str, object], None]


@dataclass(frozen=True)
class Budget:
    """An upper bound on one figure: ``precise`` for `make perf`, ``precise * slack`` in CI."""

    name: str  # the property recorded, e.g. "idle_cpu_share"
    precise: float
    slack: float = 4.0
    unit: str = "s"  # "%": the figure is a fraction, shown as a percentage

    def limit(self, bound: str) -> float:
        return self.precise if bound == "precise" else self.precise * self.slack

    def show(self, value: float) -> str:
        return f"{value * 100:.3g} %" if self.unit == "%" else f"{value:.3g} {self.unit}"

    def check(
        self, record_property: RecordProperty, bound: str, value: float, what: str = ""
    ) -> None:
        """Report ``value`` and assert it is under the bound's limit."""
        limit = self.limit(bound)
        label = f"{self.name}[{what}]" if what else self.name
        record_property(label, value)
        line = f"{label}: {self.show(value)} (limit {self.show(limit)}, {bound})"
        print(line)
        assert value < limit, f"over budget: {line}"


def proc_cpu_s(pid: int) -> float:
    """CPU time (utime + stime, all threads) of process ``pid`` so far, in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu_s(name_prefix: str) -> float:
    """CPU time (s) of this process's threads whose name starts with ``name_prefix``."""
    tids = [t.native_id for t in threading.enumerate() if t.name.startswith(name_prefix)]
    ns = sum(int(Path(f"/proc/self/task/{tid}/schedstat").read_text().split()[0]) for tid in tids)
    return ns / 1e9


def cpu_shares(readers: Mapping[str, Callable[[], float]], window_s: float) -> dict[str, float]:
    """Each reader's CPU seconds over the next ``window_s``, as a share of one core."""
    before = {name: read() for name, read in readers.items()}
    t0 = time.monotonic()
    time.sleep(window_s)  # the measurement window itself, not synchronisation
    elapsed = time.monotonic() - t0
    return {name: (read() - before[name]) / elapsed for name, read in readers.items()}


def cpu_share(read: Callable[[], float], window_s: float) -> float:
    """``read``'s CPU seconds over the next ``window_s``, as a share of one core."""
    return cpu_shares({"": read}, window_s)[""]

"""Chrome/Perfetto export: every span a slice, slices on one thread nest, the path adds up."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

from telemetry.critical_path import critical_path
from telemetry.perfetto import CRITICAL_PATH_PROCESS, chrome_trace, dumps
from telemetry.traces import read_run
from tests.fixtures.traces import run_dirs, run_ids


@pytest.mark.parametrize("run_dir", run_dirs(), ids=run_ids())
def test_run_exports_every_span_with_nesting_slices(run_dir: Path) -> None:
    run = read_run(run_dir)
    paths = {t.trace_id: critical_path(t) for t in run.traces}
    doc = json.loads(dumps(run.traces, paths))
    events = doc["traceEvents"]
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert CRITICAL_PATH_PROCESS in names
    assert {sp.service for t in run.traces for sp in t.spans} <= {n.split(" ")[0] for n in names}
    span_slices = [e for e in events if e["ph"] == "X" and e["cat"] != "critical path"]
    assert len(span_slices) == sum(len(t.spans) for t in run.traces)
    by_id = {(e["args"]["span_id"], e["name"]): e for e in span_slices}  # ids alone may collide
    origin = min(t.start_ns for t in run.traces)
    for t in run.traces:
        for sp in t.spans:
            e = by_id[(sp.span_id, sp.name)]
            assert e["ts"] == pytest.approx((sp.start_ns - origin) / 1e3)
            assert e["dur"] == pytest.approx(sp.duration_ns / 1e3)
    lanes: dict[tuple[int, int], list[dict]] = defaultdict(list)
    for e in span_slices:
        lanes[(e["pid"], e["tid"])].append(e)
    for slices in lanes.values():  # viewers need slices of one thread to nest, never straddle
        slices.sort(key=lambda e: (e["ts"], -e["dur"]))
        open_ends: list[float] = []
        for e in slices:
            while open_ends and open_ends[-1] <= e["ts"] + 1e-6:
                open_ends.pop()
            assert not open_ends or e["ts"] + e["dur"] <= open_ends[-1] + 1e-6, e["name"]
            open_ends.append(e["ts"] + e["dur"])


@pytest.mark.parametrize("run_dir", run_dirs(), ids=run_ids())
def test_critical_path_slices_add_up_to_the_path(run_dir: Path) -> None:
    run = read_run(run_dir)
    t = run.traces[0]
    path = critical_path(t)
    assert path is not None
    doc = chrome_trace([t], {t.trace_id: path})
    segs = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["cat"] == "critical path"]
    assert len(segs) == len(path.segments)
    assert sum(e["args"]["duration_ms"] for e in segs) == pytest.approx(path.total_ns / 1e6)


def test_empty_export_is_valid() -> None:
    assert chrome_trace([]) == {"traceEvents": [], "displayTimeUnit": "ms"}

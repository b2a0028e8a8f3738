"""Export traces to the Chrome trace event format (opens in ui.perfetto.dev and chrome://tracing).

Owns: the mapping span -> complete event (``ph: "X"``, microseconds), one process per emitting
instance (router, each P rank, D), and lanes (threads) so that slices on one thread always
nest, which both viewers require (the router's two legs overlap without nesting). The critical
path of each request, when given, is its own process with one slice per segment. Pure.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from telemetry.critical_path import CriticalPath, Seg
from telemetry.otlp_json import SpanRecord, Trace
from telemetry.traces import instance_label

CRITICAL_PATH_PROCESS = "critical path (TTFT)"


def _lanes(spans: list[SpanRecord]) -> list[int]:
    """Lane per span such that spans on one lane nest or follow each other (greedy)."""
    order = sorted(range(len(spans)), key=lambda i: (spans[i].start_ns, -spans[i].end_ns))
    stacks: list[list[int]] = []  # per lane: end times of the open slices
    lane_of = [0] * len(spans)
    for i in order:
        sp = spans[i]
        for lane, stack in enumerate(stacks):
            while stack and stack[-1] <= sp.start_ns:
                stack.pop()
            if not stack or sp.end_ns <= stack[-1]:
                stack.append(sp.end_ns)
                lane_of[i] = lane
                break
        else:
            stacks.append([sp.end_ns])
            lane_of[i] = len(stacks) - 1
    return lane_of


def _us(ns: int, origin_ns: int) -> float:
    return (ns - origin_ns) / 1e3


def _args(sp: SpanRecord) -> dict[str, Any]:
    args: dict[str, Any] = {"span_id": sp.span_id, "trace_id": sp.trace_id, **sp.attributes}
    if sp.is_error:
        args["status"] = f"ERROR {sp.status_message}".strip()
    return args


def chrome_trace(
    traces: Iterable[Trace], paths: Mapping[str, CriticalPath | None] | None = None
) -> dict[str, Any]:
    """One Chrome trace JSON object for ``traces`` (times relative to the earliest span)."""
    traces = list(traces)
    paths = paths or {}
    if not traces:
        return {"traceEvents": [], "displayTimeUnit": "ms"}
    origin = min(t.start_ns for t in traces)
    pids: dict[str, int] = {}
    tids: dict[tuple[int, str, int], int] = {}
    events: list[dict[str, Any]] = []

    def pid_for(name: str) -> int:
        if name not in pids:
            pids[name] = len(pids) + 1
            events.append(
                {
                    "ph": "M",
                    "name": "process_name",
                    "pid": pids[name],
                    "tid": 0,
                    "args": {"name": name},
                }
            )
        return pids[name]

    def tid_for(pid: int, trace: Trace, lane: int, label: str) -> int:
        key = (pid, trace.trace_id, lane)
        if key not in tids:
            tids[key] = len(tids) + 1
            events.append(
                {
                    "ph": "M",
                    "name": "thread_name",
                    "pid": pid,
                    "tid": tids[key],
                    "args": {"name": label},
                }
            )
        return tids[key]

    for trace in traces:
        by_instance: dict[str, list[SpanRecord]] = {}
        for sp in trace.spans:
            by_instance.setdefault(instance_label(sp), []).append(sp)
        short = trace.trace_id[:8]
        for inst, spans in by_instance.items():
            pid = pid_for(inst)
            for sp, lane in zip(spans, _lanes(spans), strict=True):
                tid = tid_for(
                    pid, trace, lane, f"trace {short}" + (f" lane {lane}" if lane else "")
                )
                events.append(
                    {
                        "ph": "X",
                        "name": sp.name,
                        "cat": inst,
                        "ts": _us(sp.start_ns, origin),
                        "dur": max(sp.duration_ns, 0) / 1e3,
                        "pid": pid,
                        "tid": tid,
                        "args": _args(sp),
                    }
                )
                for ev in sp.events:
                    events.append(
                        {
                            "ph": "i",
                            "s": "t",
                            "name": ev.name,
                            "pid": pid,
                            "tid": tid,
                            "ts": _us(ev.time_ns, origin),
                            "args": dict(ev.attributes),
                        }
                    )
        path = paths.get(trace.trace_id)
        if path is not None:
            pid = pid_for(CRITICAL_PATH_PROCESS)
            tid = tid_for(pid, trace, 0, f"trace {short}")
            for seg in path.segments:
                name = (
                    seg.name.value
                    if seg.name is not Seg.UNKNOWN
                    else ("unknown: " + " + ".join(c.value for c in seg.covers))
                )
                events.append(
                    {
                        "ph": "X",
                        "name": name,
                        "cat": "critical path",
                        "ts": _us(min(seg.start_ns, seg.end_ns), origin),
                        "dur": abs(seg.duration_ns) / 1e3,
                        "pid": pid,
                        "tid": tid,
                        "args": {
                            "duration_ms": seg.duration_ns / 1e6,
                            "negative": seg.negative,
                            "error": seg.error,
                        },
                    }
                )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def dumps(traces: Iterable[Trace], paths: Mapping[str, CriticalPath | None] | None = None) -> str:
    return json.dumps(chrome_trace(traces, paths), separators=(",", ":"), default=str)

"""One sweep point's traces, cut out of its stack's trace files, and their TTFT decomposition.

A stack runs many points and every process appends its spans to one
``traces-<service>-<pid>.jsonl`` file in the stack's folder. Before a point the sweep notes
each file's size (``sizes``); after it, once every process has exported its last spans
(``wait_quiet``: no file grew for a while, bounded), the bytes in between are that point's
spans (``copy_slice``: whole lines only, into the point's own folder, which the dashboard opens
as a run). ``decomposition`` reads that folder with ``telemetry.traces`` and turns each trace
into its critical path with ``telemetry.critical_path`` (the dashboard's model), then takes the
median of every segment over the point's requests.

No processes; reads and copies files, and ``wait_quiet`` polls the clock.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from telemetry.critical_path import Seg, critical_path
from telemetry.traces import RunFolderError, read_run, trace_files


def sizes(folder: Path) -> dict[str, int]:
    """Bytes in each trace file of ``folder`` now."""
    out = {}
    for path in trace_files(folder):
        try:
            out[path.name] = path.stat().st_size
        except OSError:
            continue  # removed meanwhile: nothing to slice
    return out


def wait_quiet(folder: Path, quiet_s: float = 1.5, timeout_s: float = 15.0) -> dict[str, int]:
    """The files' sizes once none has grown for ``quiet_s`` (every process exports within
    500 ms of a span's end), or as they are at ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last, since = sizes(folder), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.25)
        now = sizes(folder)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            break
    return last


def copy_slice(folder: Path, before: dict[str, int], after: dict[str, int], dest: Path) -> int:
    """Copy each file's bytes from ``before`` to ``after`` (whole lines) to ``dest`` under the
    same name; returns how many lines (export batches) were copied."""
    dest.mkdir(parents=True, exist_ok=True)
    lines = 0
    for name, end in after.items():
        start = before.get(name, 0)
        if end <= start:
            continue
        with (folder / name).open("rb") as f:
            f.seek(start)
            chunk = f.read(end - start)
        chunk = chunk[: chunk.rfind(b"\n") + 1]  # a line still being written stays out
        if chunk:
            (dest / name).write_bytes(chunk)
            lines += chunk.count(b"\n")
    return lines


def decomposition(folder: Path) -> dict[str, Any]:
    """Median ms of each critical-path segment over the requests in ``folder`` that got a
    first token, with their median TTFT and count; {} when the folder has no traces (a plain
    vLLM server or tracing off). Medians of segments do not add up to the median TTFT."""
    try:
        run = read_run(folder)
    except RunFolderError:
        return {}
    per_request: list[dict[Seg, int]] = []
    ttfts: list[float] = []
    modes: set[str] = set()
    for trace in run.traces:
        path = critical_path(trace)
        if path is None or path.ttft_ns is None:
            continue
        ttfts.append(path.ttft_ns / 1e6)
        modes.add(path.mode)
        per_request.append(path.durations_ns())
    if not ttfts:
        return {}
    # A segment missing from a request counts 0 for it (e.g. an unknown one).
    names = [s for s in Seg if any(s in d for d in per_request)]
    return {
        "requests": len(ttfts),
        "mode": ",".join(sorted(modes)),
        "ttft_ms": statistics.median(ttfts),
        "segments_ms": {
            s.value: statistics.median(d.get(s, 0) / 1e6 for d in per_request) for s in names
        },
        "problems": len(run.problems),
    }

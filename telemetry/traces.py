"""Reading a run folder's OTLP JSON-lines files back into traces.

Owns: finding ``traces-*.jsonl`` files (``telemetry.setup`` writes one per process), reading
them line by line through ``telemetry.otlp_json``, and a fingerprint for caches. A run that is
still being written may end in a partial line: that line is counted and reported, not raised,
so the dashboard can show a live run.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from telemetry.otlp_json import (
    OtlpFormatError,
    SpanRecord,
    Trace,
    group_traces,
    parse_traces_data,
    shared_span_ids,
)
from telemetry.schema import Resource

TRACE_FILE_GLOB = "traces-*.jsonl"  # the name telemetry.setup gives each process's file


class RunFolderError(FileNotFoundError):
    """The folder is missing or holds no trace files."""


@dataclass(frozen=True)
class RunTraces:
    """What one run folder holds."""

    traces: tuple[Trace, ...]
    files: tuple[Path, ...]
    problems: tuple[str, ...]  # unreadable lines, one message each (file:line: why)

    def trace(self, trace_id: str) -> Trace | None:
        for t in self.traces:
            if t.trace_id == trace_id:
                return t
        return None


def trace_files(folder: str | os.PathLike[str]) -> list[Path]:
    return sorted(Path(folder).glob(TRACE_FILE_GLOB))


def fingerprint(folder: str | os.PathLike[str]) -> tuple[tuple[str, int, int], ...]:
    """(name, size, mtime) of every trace file: changes whenever a process appends spans."""
    out = []
    for f in trace_files(folder):
        st = f.stat()
        out.append((f.name, st.st_size, st.st_mtime_ns))
    return tuple(out)


def read_file(path: Path, problems: list[str]) -> list[SpanRecord]:
    spans: list[SpanRecord] = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                spans.extend(parse_traces_data(json.loads(line)))
            except json.JSONDecodeError as e:
                # the last line of a file still being written is legitimately partial
                problems.append(f"{path.name}:{lineno}: not JSON ({e.msg}); skipped")
            except OtlpFormatError as e:
                problems.append(f"{path.name}:{lineno}: not OTLP TracesData ({e}); skipped")
    return spans


def read_run(folder: str | os.PathLike[str]) -> RunTraces:
    """Every trace of a run folder (its ``traces-*.jsonl`` files, not sub-folders)."""
    path = Path(folder)
    if not path.is_dir():
        raise RunFolderError(f"run folder {path} does not exist")
    files = trace_files(path)
    if not files:
        raise RunFolderError(f"no {TRACE_FILE_GLOB} files in {path}")
    problems: list[str] = []
    spans = [sp for f in files for sp in read_file(f, problems)]
    traces = group_traces(spans)
    shared = [t for t in traces if shared_span_ids(t)]
    if shared:
        ids = sum(len(shared_span_ids(t)) for t in shared)
        problems.append(
            f"{ids} span id(s) are carried by different spans in {len(shared)} trace(s): "
            "the processes' id generators were seeded alike (e.g. by a seeded "
            "`random`); parent links to those ids are ambiguous"
        )
    return RunTraces(tuple(traces), tuple(files), tuple(problems))


def find_runs(root: str | os.PathLike[str], max_depth: int = 3) -> list[Path]:
    """Folders under ``root`` (itself included) that hold trace files, newest first."""
    root = Path(root)
    found: list[Path] = []
    if not root.is_dir():
        return found
    for dirpath, dirnames, _ in os.walk(root):
        depth = len(Path(dirpath).relative_to(root).parts)
        if depth >= max_depth:
            dirnames[:] = []
        if trace_files(dirpath):
            found.append(Path(dirpath))
    found.sort(key=lambda p: max(f.stat().st_mtime_ns for f in trace_files(p)), reverse=True)
    return found


def instance_label(span: SpanRecord) -> str:
    """The process a span came from, for people: service, engine, host and TP rank when
    known."""
    parts = [span.service]
    for key in (Resource.ENGINE_ID, Resource.HOST_ADDR):
        if value := span.resource.get(key.value):
            parts.append(str(value))
    rank = span.attr(Resource.TP_RANK.value)
    if rank is not None:
        parts.append(f"tp{rank}")
    return " ".join(parts)

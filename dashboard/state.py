"""Where the dashboard's data comes from, and the caches and links around it.

Owns: the ``Source`` of a view (a run folder or a Jaeger URL), its defaults (query parameters
first, then ``streamlit run dashboard/app.py -- --run-dir DIR``, then ``PUSHKV_RUN_DIR`` /
``PUSHKV_JAEGER_URL``, then ``runs/latest``), the cached loaders (keyed on the trace files'
sizes and mtimes, so a growing run reloads and an unchanged one does not), a trace asked for
by id that Jaeger's look-back window left out, and shareable links.
Loading is cached with ``st.cache_resource``: frames are shared, never copied per rerun, so
views must not mutate them.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlencode

import streamlit as st

from dashboard.data import RunData, analyse, load_jaeger, load_run_folder
from telemetry import perfetto
from telemetry.jaeger import JaegerClient
from telemetry.schema import Service
from telemetry.traces import find_runs, fingerprint

ENV_RUN_DIR = "PUSHKV_RUN_DIR"
ENV_JAEGER_URL = "PUSHKV_JAEGER_URL"
DEFAULT_RUN_DIR = "runs/latest"  # telemetry.setup's default
RUN, JAEGER = "run folder", "Jaeger"


@dataclass(frozen=True)
class Source:
    kind: str  # RUN or JAEGER
    location: str  # folder path or Jaeger base URL
    service: str = Service.ROUTER.value
    lookback_min: float = 60.0
    limit: int = 1000


def cli_run_dir(argv: Sequence[str]) -> str | None:
    """``--run-dir DIR`` after streamlit's ``--`` (what ``dashboard.launch`` passes)."""
    for i, a in enumerate(argv):
        if a == "--run-dir" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--run-dir="):
            return a.split("=", 1)[1]
    return None


def default_source(
    query: Mapping[str, str], environ: Mapping[str, str], argv: Sequence[str], prefix: str = ""
) -> Source:
    """The source a fresh page shows (pure, so it can be tested without Streamlit)."""
    jaeger_q, run_q = query.get(f"{prefix}jaeger"), query.get(f"{prefix}run")
    service = query.get("service") or Service.ROUTER.value
    lookback = float(query.get("lookback") or 60)
    if jaeger_q and not run_q:
        return Source(JAEGER, jaeger_q, service, lookback)
    run = run_q or cli_run_dir(argv) or environ.get(ENV_RUN_DIR)
    if run:
        return Source(RUN, run)
    if environ.get(ENV_JAEGER_URL):
        return Source(JAEGER, environ[ENV_JAEGER_URL], service, lookback)
    if Path(DEFAULT_RUN_DIR).is_dir():
        return Source(RUN, DEFAULT_RUN_DIR)
    found = find_runs("runs")
    return Source(RUN, str(found[0]) if found else DEFAULT_RUN_DIR)


def initial_source(prefix: str = "") -> Source:
    return default_source(st.query_params.to_dict(), os.environ, sys.argv, prefix)


@st.cache_resource(max_entries=16, show_spinner="Reading the run's trace files")
def _load_folder(folder: str, fp: tuple[tuple[str, int, int], ...]) -> RunData:
    """``fp`` (the files' sizes and mtimes) is only part of the cache key."""
    return load_run_folder(folder)


@st.cache_resource(ttl=30, max_entries=8, show_spinner="Asking Jaeger")
def _load_jaeger(url: str, service: str, lookback_min: float, limit: int) -> RunData:
    return load_jaeger(url, service, lookback_min, limit)


def load(source: Source) -> RunData:
    """Raises ``RunFolderError`` / ``JaegerError`` with a message fit for the page."""
    if source.kind == JAEGER:
        return _load_jaeger(source.location, source.service, source.lookback_min, source.limit)
    return _load_folder(source.location, fingerprint(source.location))


# A bare trace id, or a W3C traceparent / traceresponse header (version-id-span-flags).
_TRACE_ID = re.compile(r"(?:[0-9a-f]{2}-)?([0-9a-f]{32})(?:-[0-9a-f]{16}-[0-9a-f]{2})?")


def trace_id_of(text: str | None) -> str | None:
    """The trace id in what a user pasted (the router's ``traceresponse`` header, a
    ``traceparent`` or the 32 hex digits alone), lower case; None if there is none."""
    m = _TRACE_ID.fullmatch((text or "").strip().lower())
    return m[1] if m and m[1] != "0" * 32 else None


@st.cache_resource(ttl=30, max_entries=8, show_spinner="Asking Jaeger for the trace")
def _with_jaeger_trace(_run: RunData, label: str, url: str, trace_id: str) -> RunData:
    """``_run`` is not hashed: ``label`` and the id key the cache."""
    found = JaegerClient(url).get_trace(trace_id)
    if found is None:
        return _run
    return analyse(label, [*_run.traces.values(), found], _run.problems)


def with_trace(run: RunData, source: Source, trace_id: str | None) -> RunData:
    """``run``, plus the trace ``trace_id`` when Jaeger has it but the look-back window (or
    the cap) left it out: a link to one request opens it whatever its age."""
    if source.kind != JAEGER or not trace_id or trace_id in run.traces:
        return run
    return _with_jaeger_trace(run, run.label, source.location, trace_id)


def clear_caches() -> None:
    _load_folder.clear()
    _load_jaeger.clear()
    _with_jaeger_trace.clear()


def run_export(run: RunData) -> str:
    """Chrome/Perfetto JSON of a whole run (kept with the loaded run: made once)."""
    return run.chrome_trace


def trace_export(run: RunData, trace_id: str) -> str:
    return perfetto.dumps([run.traces[trace_id]], {trace_id: run.paths.get(trace_id)})


def known_runs(current: str) -> list[str]:
    """Run folders to offer: the current one, its siblings (a sweep's other configurations
    sit next to it), then those found under ``runs/``."""
    out = [current]
    siblings = find_runs(Path(current).parent, max_depth=1) if Path(current).parent.is_dir() else []
    for p in [*siblings, *find_runs("runs")]:
        if str(p) not in out:
            out.append(str(p))
    return out


def share_link(params: Mapping[str, str]) -> str:
    """A link to this view (absolute when Streamlit knows the page URL)."""
    query = urlencode({k: v for k, v in params.items() if v})
    base = (st.context.url or "").split("?", 1)[0]  # None without a browser (AppTest)
    return f"{base}?{query}"

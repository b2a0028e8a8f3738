"""pushkv's critical-path dashboard: ``streamlit run dashboard/app.py [-- --run-dir DIR]``.

Owns: the page (source in the sidebar, one view at a time) and writing the query parameters
that make every view shareable. Data, caching and figures live in ``dashboard.data``,
``dashboard.state`` and ``dashboard.views``.
"""

from __future__ import annotations

import streamlit as st

from dashboard.state import (
    clear_caches,
    initial_source,
    load,
    run_export,
    trace_id_of,
    with_trace,
)
from dashboard.views import chart, compare, decomposition, requests, routing
from dashboard.views.source import source_params, source_picker
from telemetry.jaeger import JaegerError
from telemetry.traces import RunFolderError

VIEWS = {
    "requests": ("Requests", requests.render),
    "decomposition": ("TTFT decomposition", decomposition.render),
    "routing": ("Routing", routing.render),
    "compare": ("Compare runs", compare.render),
}


def _open_pasted_trace() -> None:
    """The sidebar's box: a trace id (or a response's ``traceresponse``) opens that request
    in the requests view, once per new value (a row clicked later wins)."""
    pasted = st.sidebar.text_input(
        "Open a trace id",
        key="open_trace",
        placeholder="trace id or traceresponse header",
        help="From a response's traceresponse header (00-<trace id>-<span id>-01), the "
        "pushkv_trace_id of a stream's last event, or a Grafana exemplar",
    )
    trace_id = trace_id_of(pasted)
    if pasted.strip() and trace_id is None:
        st.sidebar.error("Not a trace id: 32 hex digits, or 00-<trace id>-<span id>-<flags>.")
    if trace_id and st.session_state.get("_opened_trace") != trace_id:
        st.session_state["_opened_trace"] = trace_id
        st.query_params["view"] = "requests"
        st.query_params[requests.TRACE_KEY] = trace_id
        st.session_state["view"] = "requests"
        st.session_state.pop(requests.TRACE_KEY, None)  # the view reads the link's trace again


def main() -> None:
    st.set_page_config(page_title="pushkv · TTFT critical path", layout="wide")
    st.sidebar.title("pushkv · TTFT")
    chart.preload(st.sidebar)
    source = source_picker(st.sidebar, "", initial_source())
    if st.sidebar.button("Reload", key="reload"):
        clear_caches()
    _open_pasted_trace()
    names = list(VIEWS)
    wanted = st.query_params.get("view", names[0])
    view = st.sidebar.radio(
        "View",
        names,
        index=names.index(wanted) if wanted in names else 0,
        format_func=lambda v: VIEWS[v][0],
        key="view",
    )
    params = {"view": view, **source_params(source)}
    try:
        run = load(source)
    except (RunFolderError, JaegerError) as e:
        st.query_params.from_dict(params)
        st.error(str(e))
        st.stop()
    if view == "requests":
        try:
            run = with_trace(run, source, trace_id_of(st.query_params.get(requests.TRACE_KEY)))
        except JaegerError as e:
            st.warning(f"Could not ask Jaeger for that trace: {e}")
    st.sidebar.download_button(
        "Export run (Perfetto JSON)",
        data=lambda: run_export(run),
        file_name="pushkv-run.perfetto.json",
        mime="application/json",
        key="export_run",
        on_click="ignore",
        help="Open in ui.perfetto.dev or chrome://tracing",
    )
    st.sidebar.caption(f"{len(run.traces)} traces from `{run.label}`")
    VIEWS[view][1](run, params)
    st.query_params.from_dict(params)


main()

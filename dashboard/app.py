"""pushkv's critical-path dashboard: ``streamlit run dashboard/app.py [-- --run-dir DIR]``.

Owns: the page (source in the sidebar, one view at a time) and writing the query parameters
that make every view shareable. Data, caching and figures live in ``dashboard.data``,
``dashboard.state`` and ``dashboard.views``.
"""

from __future__ import annotations

import streamlit as st

from dashboard.state import clear_caches, initial_source, load, run_export
from dashboard.views import chart, compare, decomposition, requests
from dashboard.views.source import source_params, source_picker
from telemetry.jaeger import JaegerError
from telemetry.traces import RunFolderError

VIEWS = {
    "requests": ("Requests", requests.render),
    "decomposition": ("TTFT decomposition", decomposition.render),
    "compare": ("Compare runs", compare.render),
}


def main() -> None:
    st.set_page_config(page_title="pushkv · TTFT critical path", layout="wide")
    st.sidebar.title("pushkv · TTFT")
    chart.preload(st.sidebar)
    source = source_picker(st.sidebar, "", initial_source())
    if st.sidebar.button("Reload", key="reload"):
        clear_caches()
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

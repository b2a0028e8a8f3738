"""Requests view: the sortable, filterable request table (failed and slow first) and the
selected request's waterfall, segments, link and Perfetto export."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from dashboard.data import OK, RunData
from dashboard.state import share_link, trace_export, trace_id_of
from dashboard.views import chart, kv
from dashboard.views.waterfall import row_labels, waterfall_figure
from telemetry.critical_path import CriticalPath, Seg

TABLE_KEY = "requests_table"
TRACE_KEY = "trace"


def _summary(run: RunData) -> None:
    df = run.requests
    ok = df[df["outcome"] == OK]
    cols = st.columns(5)
    cols[0].metric("Requests", len(df))
    cols[1].metric("Failed", int((df["outcome"] != OK).sum()))
    cols[2].metric("TTFT p50 (ms)", f"{ok['ttft_ms'].median():.2f}" if len(ok) else "-")
    cols[3].metric("TTFT p99 (ms)", f"{ok['ttft_ms'].quantile(0.99):.2f}" if len(ok) else "-")
    cols[4].metric(
        "TPOT mean (ms)", f"{ok['tpot_ms'].mean():.2f}" if ok["tpot_ms"].notna().any() else "-"
    )
    if run.not_requests:
        st.caption(
            f"{run.not_requests} trace(s) without a router request span (probes, stray "
            "spans) are not requests and are not listed; the run export includes them."
        )
    if run.problems:
        with st.expander(f"{len(run.problems)} unreadable line(s) skipped"):
            st.code("\n".join(run.problems[:50]))


FILTER_KEYS = ("f_outcome", "f_mode", "f_ttft", "f_text")


def _filters(df: pd.DataFrame, label: str) -> pd.DataFrame:
    if st.session_state.get("_filters_for") != label:  # another source: its own outcomes/modes
        for k in FILTER_KEYS:
            st.session_state.pop(k, None)
        st.session_state["_filters_for"] = label
    c1, c2, c3, c4 = st.columns([2, 2, 1, 2])
    outcomes = sorted(df["outcome"].unique())
    modes = sorted(df["mode"].unique())
    pick_outcomes = c1.multiselect("Outcome", outcomes, default=outcomes, key="f_outcome")
    pick_modes = c2.multiselect("Mode", modes, default=modes, key="f_mode")
    min_ttft = c3.number_input("TTFT ≥ (ms)", min_value=0.0, value=0.0, key="f_ttft")
    text = c4.text_input("Request or trace id contains", key="f_text").strip().lower()
    keep = df["outcome"].isin(pick_outcomes) & df["mode"].isin(pick_modes)
    if min_ttft > 0:
        keep &= df["ttft_ms"].fillna(float("inf")) >= min_ttft
    if text:
        keep &= df["request_id"].str.lower().str.contains(text, regex=False) | df[
            "trace_id"
        ].str.contains(text, regex=False)
    return df[keep].reset_index(drop=True)


def _initial_trace(run: RunData, options: list[str]) -> str:
    """From the link (``trace=`` or ``req=``), else the first request needing attention."""
    q = st.query_params
    wanted = trace_id_of(q.get(TRACE_KEY))
    if wanted in options:
        return str(wanted)
    if q.get(TRACE_KEY):
        why = (
            "its traces have no router request span"
            if wanted in run.traces
            else "it is not among the traces loaded (sampled out, or another source)"
        )
        st.warning(f"Trace `{q[TRACE_KEY]}` is not a request of `{run.label}`: {why}.")
    if q.get("req"):
        hit = run.requests.loc[run.requests["request_id"] == q["req"], "trace_id"]
        if len(hit):
            return str(hit.iloc[0])
    return options[0]


# Milliseconds to the microsecond, shares to a tenth of a percent (not raw floats).
SEGMENT_COLUMNS = {
    "start_ms": st.column_config.NumberColumn("start ms", format="%.3f"),
    "ms": st.column_config.NumberColumn("ms", format="%.3f"),
    "share_%": st.column_config.NumberColumn("share", format="%.1f %%"),
}


def _segment_table(path: CriticalPath) -> pd.DataFrame:
    total = path.total_ns or 1
    return pd.DataFrame(
        [
            {
                "segment": s.name.value
                if s.name is not Seg.UNKNOWN
                else "unknown: " + " + ".join(c.value for c in s.covers),
                "start_ms": (s.start_ns - path.start_ns) / 1e6,
                "ms": s.duration_ns / 1e6,
                "share_%": 100 * s.duration_ns / total,
                "negative": s.negative,
                "error": s.error or "",
            }
            for s in path.segments
        ]
    )


def _detail(run: RunData, trace_id: str, params: dict[str, str]) -> None:
    trace, path = run.traces[trace_id], run.paths.get(trace_id)
    row = run.requests.loc[run.requests["trace_id"] == trace_id].iloc[0]
    ttft = f"{row['ttft_ms']:.2f} ms" if pd.notna(row["ttft_ms"]) else "no first token"
    st.subheader(f"Critical path: {row['request_id']} · {ttft} · {row['outcome']}")
    if pd.notna(row.get("client_ttft_ms")):
        st.caption(
            f"The client saw a TTFT of {row['client_ttft_ms']:.2f} ms: "
            f"{row['unaccounted_ms']:.2f} ms outside this trace (before the router's server "
            "read the request, or after it sent the first chunk)."
        )
    if path is None:
        st.warning("This trace has no router request span, so its TTFT cannot be decomposed.")
    else:
        for a in path.anomalies:
            st.warning(a)
        if path.ttft_ns is None:
            st.info("No first token reached the client: the segments run to the request's end.")
        elif pd.notna(row["stream"]) and not bool(row["stream"]):
            st.info(
                "Not streamed: the first chunk is the whole answer, so 'stream back' holds "
                "the decode of every token after the first."
            )
    chart.show(waterfall_figure(trace, path), key="waterfall")
    if path is not None:
        c1, c2 = st.columns([3, 2])
        c1.dataframe(
            _segment_table(path),
            hide_index=True,
            key="segments",
            column_config=SEGMENT_COLUMNS,
        )
        extra = [f"model: {path.model} (mode {path.mode})"]
        if path.rendezvous_first:
            extra.append(f"rendezvous: {path.rendezvous_first} arrived first")
        if path.critical_tp_rank is not None:
            extra.append(f"critical P rank: tp{path.critical_tp_rank}")
        extra += [f"{m.label} at {(m.time_ns - path.start_ns) / 1e6:.3f} ms" for m in path.marks]
        c2.markdown("\n".join(f"- {e}" for e in extra))
    kv.request_table(run, trace_id)
    with st.expander("Span attributes"):
        labels = row_labels(trace)
        if st.session_state.get("span_pick", 0) >= len(labels):  # kept from a larger trace
            st.session_state["span_pick"] = 0
        pick = st.selectbox(
            "Span", range(len(labels)), format_func=lambda i: labels[i][0], key="span_pick"
        )
        sp = labels[pick][1]
        st.json(
            {
                "name": sp.name,
                "span_id": sp.span_id,
                "parent_span_id": sp.parent_span_id,
                "status": sp.status.name,
                "status_message": sp.status_message,
                "attributes": dict(sp.attributes),
                "resource": dict(sp.resource),
                "events": [
                    {"name": e.name, "time_ns": e.time_ns, **e.attributes} for e in sp.events
                ],
            }
        )
    c1, c2 = st.columns([3, 1])
    link = share_link({**params, TRACE_KEY: trace_id})
    # a markdown link, not st.code: that would load a large syntax highlighter on first visit
    c1.markdown(f"Link to this request: [`{link}`]({link})")
    c2.download_button(
        "Export trace (Perfetto JSON)",
        data=lambda: trace_export(run, trace_id),
        file_name=f"pushkv-{trace_id}.perfetto.json",
        mime="application/json",
        key="export_trace",
        on_click="ignore",
    )


def render(run: RunData, params: dict[str, str]) -> None:
    _summary(run)
    if run.requests.empty:
        st.info("No requests in this source.")
        return
    shown = _filters(run.requests, run.label)
    st.caption(
        f"{len(shown)} of {len(run.requests)} requests · failed and slowest first · "
        "click a column to sort, a row to open it"
    )
    event = st.dataframe(
        shown,
        key=TABLE_KEY,
        on_select="rerun",
        selection_mode="single-row",
        hide_index=True,
        column_config={
            "ttft_ms": st.column_config.NumberColumn("TTFT ms", format="%.2f"),
            "client_ttft_ms": st.column_config.NumberColumn("client TTFT ms", format="%.2f"),
            "unaccounted_ms": st.column_config.NumberColumn("unaccounted ms", format="%.2f"),
            "tpot_ms": st.column_config.NumberColumn("TPOT ms", format="%.2f"),
            "unknown_ms": st.column_config.NumberColumn("unknown ms", format="%.2f"),
            "start_s": st.column_config.NumberColumn("start s", format="%.3f"),
        },
    )
    options = run.requests["trace_id"].tolist()
    rows = event.selection.rows if event is not None else []
    if rows and rows[0] < len(shown):
        picked = str(shown.iloc[rows[0]]["trace_id"])
        if st.session_state.get("_picked_row") != picked:  # a new click wins over the box
            st.session_state["_picked_row"] = picked
            st.session_state[TRACE_KEY] = picked
    if st.session_state.get(TRACE_KEY) not in options:
        st.session_state[TRACE_KEY] = _initial_trace(run, options)
    labels = run.requests.set_index("trace_id")[["request_id", "ttft_ms", "outcome"]].to_dict(
        "index"
    )

    def fmt(tid: str) -> str:
        r = labels[tid]
        ttft = f"{r['ttft_ms']:.2f} ms" if pd.notna(r["ttft_ms"]) else "-"
        return f"{r['request_id']} · {ttft} · {r['outcome']} · {tid[:8]}"

    trace_id = st.selectbox("Request", options, format_func=fmt, key=TRACE_KEY)
    params[TRACE_KEY] = trace_id
    _detail(run, trace_id, params)

"""The KV transfer tables: a request's WRITEs with their KV geometry (requests view) and two
runs' bytes per token side by side (comparison view)."""

from __future__ import annotations

import streamlit as st

from dashboard.data import RunData
from dashboard.transfers import compare_kv, geometry_label

REQUEST_COLUMNS = {
    "trace_id": None,
    "bytes_per_token": st.column_config.NumberColumn("bytes/token", format="%d"),
    "head_size": st.column_config.NumberColumn("head size", format="%d"),
    "block_tokens": st.column_config.NumberColumn("block tokens", format="%d"),
    "write_ms": st.column_config.NumberColumn("WRITE ms", format="%.3f"),
    "gbps": st.column_config.NumberColumn("WRITE GB/s", format="%.2f"),
}


def request_table(run: RunData, trace_id: str) -> None:
    """The selected request's P WRITEs, one row per rank, with the KV geometry behind them."""
    rows = run.transfers[run.transfers["trace_id"] == trace_id]
    if rows.empty:
        return
    st.markdown("**KV transfer** (per P rank: the geometry each token's KV has, what moved)")
    st.dataframe(rows, hide_index=True, key="kv_transfer", column_config=REQUEST_COLUMNS)


def compare_table(a: RunData, b: RunData) -> None:
    """Median per request of KV bytes per token, bytes, descriptors and WRITE GB/s, A and B."""
    if a.transfers.empty and b.transfers.empty:
        return
    st.markdown("**KV transfers** (medians per request)")
    st.caption(f"A: {geometry_label(a.transfers)}  \nB: {geometry_label(b.transfers)}")
    rows = compare_kv(a.transfers, b.transfers)
    st.dataframe(
        rows.style.format("{:,.2f}", subset=["A", "B", "B / A"], na_rep="-"),
        hide_index=True,
        key="compare_kv",
    )

"""The dashboard's KV transfers: what each P rank's WRITE moved and the KV geometry behind it.

Owns: ``transfer_frame`` (one row per P ``write`` span: geometry, descriptors, bytes, GB/s),
``per_request`` (a request's transfer summed over the P ranks that wrote), and
``compare_kv`` (two runs' bytes per token, bytes, descriptors and WRITE GB/s side by side),
so a user sees why one model's transfers cost more than another's. Pure (no Streamlit).
"""

from __future__ import annotations

from collections.abc import Iterable

import pandas as pd

from telemetry.otlp_json import Trace
from telemetry.schema import Attr, Span

# one row per P rank's WRITE, in display order
COLUMNS = [
    "trace_id",
    "engine",
    "tp_rank",
    "dtype",
    "layers",
    "kv_heads",
    "head_size",
    "bytes_per_token",
    "block_tokens",
    "descriptors",
    "bytes",
    "write_ms",
    "gbps",
    "path",
    "ok",
]
_NUMERIC = ["layers", "head_size", "bytes_per_token", "block_tokens", "descriptors", "bytes"]


def _heads(form: object, heads: object) -> str:
    """MLA's one latent reads "latent", not as a model with one KV head."""
    if form == "latent":
        return "latent"
    return "" if heads is None else str(heads)


def transfer_frame(traces: Iterable[Trace]) -> pd.DataFrame:
    """One row per P ``write`` span, with the ``pushkv.kv.*`` geometry its rank carries
    (empty cells in traces from before those attributes)."""
    rows = [
        {
            "trace_id": t.trace_id,
            "engine": sp.attr(Attr.ENGINE_ID.value),
            "tp_rank": sp.attr(Attr.TP_RANK.value),
            "dtype": sp.attr(Attr.KV_DTYPE.value),
            "layers": sp.attr(Attr.KV_LAYERS.value),
            "kv_heads": _heads(sp.attr(Attr.KV_FORM.value), sp.attr(Attr.KV_HEADS.value)),
            "head_size": sp.attr(Attr.KV_HEAD_SIZE.value),
            "bytes_per_token": sp.attr(Attr.KV_BYTES_PER_TOKEN.value),
            "block_tokens": sp.attr(Attr.KV_BLOCK_TOKENS.value),
            "descriptors": sp.attr(Attr.DESCRIPTORS.value),
            "bytes": sp.attr(Attr.BYTES.value),
            "write_ms": sp.duration_ns / 1e6,
            "gbps": sp.attr(Attr.GBPS.value),
            "path": sp.attr(Attr.XFER_PATH.value),
            "ok": not sp.is_error,
        }
        for t in traces
        for sp in t.named(Span.WRITE.value)
    ]
    df = pd.DataFrame(rows, columns=COLUMNS)
    for col in [*_NUMERIC, "gbps"]:
        df[col] = pd.to_numeric(df[col], errors="coerce")
    return df


def per_request(transfers: pd.DataFrame) -> pd.DataFrame:
    """A request's transfer, its P ranks' successful WRITEs summed: KV bytes per token (the
    ranks' geometry), bytes and descriptors moved, and GB/s over the slowest rank's WRITE."""
    ok = transfers[transfers["ok"]]
    if ok.empty:
        return pd.DataFrame(columns=["trace_id", "bytes_per_token", "bytes", "descriptors", "gbps"])
    out = ok.groupby("trace_id").agg(
        bytes_per_token=("bytes_per_token", lambda s: s.sum(min_count=1)),
        bytes=("bytes", "sum"),
        descriptors=("descriptors", "sum"),
        write_ms=("write_ms", "max"),
    )
    out["gbps"] = out["bytes"] / out["write_ms"].where(out["write_ms"] > 0) / 1e6
    return out.drop(columns="write_ms").reset_index()


def geometry_label(transfers: pd.DataFrame) -> str:
    """The run's KV geometry in one line per distinct (dtype, layers, heads, head size,
    block), e.g. ``bfloat16 · 8 layers · 8 heads x 64 · blocks of 16``."""
    cols = ["dtype", "layers", "kv_heads", "head_size", "block_tokens"]
    known = transfers.dropna(subset=["bytes_per_token"])
    if known.empty:
        return "no KV geometry on the WRITE spans (traces from before pushkv.kv.*)"
    labels = []
    for dtype, layers, heads, size, block in known[cols].drop_duplicates().itertuples(index=False):
        per = "latent" if heads == "latent" else f"{heads} heads"
        width = f" x {int(size)}" if pd.notna(size) else ""
        labels.append(
            f"{dtype or '?'} · {int(layers)} layers · {per}{width} · blocks of {int(block)}"
        )
    return "; ".join(labels)


def compare_kv(a: pd.DataFrame, b: pd.DataFrame) -> pd.DataFrame:
    """Two runs' transfers (``transfer_frame``): medians per request of KV bytes per token,
    bytes and descriptors moved, and WRITE GB/s, with B / A."""
    ra, rb = per_request(a), per_request(b)
    stats = [
        ("KV bytes per token (P ranks summed)", "bytes_per_token"),
        ("bytes per request", "bytes"),
        ("descriptors per request", "descriptors"),
        ("WRITE GB/s", "gbps"),
    ]
    df = pd.DataFrame(
        [(label, ra[col].median(), rb[col].median()) for label, col in stats],
        columns=["median", "A", "B"],
    ).astype({"A": float, "B": float})
    df["B / A"] = df["B"] / df["A"]
    return df

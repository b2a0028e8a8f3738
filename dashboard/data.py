"""The dashboard's data: traces -> critical paths -> pandas frames. Pure (no Streamlit).

Owns: ``RunData`` (one loaded source), the request table's columns and their fallbacks, the
"needs attention" order (failed first, then slowest), prompt-length and load buckets, and the
long per-segment frame the decomposition and comparison views aggregate. Caching lives in
``dashboard.state``; the views only read these frames.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import cached_property
from pathlib import Path
from urllib.parse import urlsplit

import pandas as pd

from dashboard.transfers import transfer_frame
from telemetry import perfetto
from telemetry.critical_path import CriticalPath, Seg, critical_path
from telemetry.jaeger import JaegerClient
from telemetry.otlp_json import Trace
from telemetry.schema import Attr, Event, Outcome, Resource, Service, Span
from telemetry.traces import read_run

OK = Outcome.OK.value
# A run folder may hold the TTFT each request's client saw ({request id: ms}; `pushkv bench`
# writes it): the request table then shows it next to the trace's, and what no span saw.
CLIENT_TTFTS_FILE = "client_ttfts.json"
CLIENT_COLUMNS = ["client_ttft_ms", "unaccounted_ms"]
# request-table columns, in display order
COLUMNS = [
    "flag",
    "request_id",
    "ttft_ms",
    "tpot_ms",
    "input_tokens",
    "output_tokens",
    "mode",
    "prefill",
    "decode",
    "stream",
    "outcome",
    "reason",
    "load",
    "largest_segment",
    "unknown_ms",
    "start_s",
    "trace_id",
]


@dataclass(frozen=True)
class RunData:
    label: str  # what the source was (folder or Jaeger URL), for titles and comparisons
    traces: dict[str, Trace]
    paths: dict[str, CriticalPath | None]
    requests: pd.DataFrame  # one row per trace, attention order, columns COLUMNS
    segments: pd.DataFrame  # long: trace_id, segment, ms (requests with a TTFT only)
    problems: tuple[str, ...]
    not_requests: int = 0  # traces without a router request span (probes, stray spans): not listed

    @cached_property
    def transfers(self) -> pd.DataFrame:
        """One row per P rank's WRITE with its KV geometry (``dashboard.transfers``)."""
        return transfer_frame(self.traces.values())

    @cached_property
    def chrome_trace(self) -> str:
        """The whole run as Chrome/Perfetto JSON, made once per loaded run (on first ask)."""
        return perfetto.dumps(self.traces.values(), self.paths)


def _num(v: object) -> float | None:
    try:
        return float(v) if v is not None else None  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


def served_by(t: Trace, url_attr: Attr, role: str) -> str:
    """Which instance served a request's leg: the host:port the router sent it to (its
    request span), else the address the engine's spans advertise; "" if neither (e.g. P of
    a degraded request)."""
    req = t.first(Span.REQUEST.value)
    url = req.attr(url_attr.value) if req else None
    if url:
        return urlsplit(str(url)).netloc or str(url)
    for sp in t.spans:
        if sp.resource.get(Resource.ROLE.value) == role and sp.resource.get(
            Resource.HOST_ADDR.value
        ):
            return str(sp.resource[Resource.HOST_ADDR.value])
    return ""


def _row(t: Trace, path: CriticalPath | None) -> dict[str, object]:
    req = t.first(Span.REQUEST.value)
    a = req.attributes if req else {}
    chunk = req.event(Event.FIRST_CHUNK.value) if req else None
    ttft = _num(a.get(Attr.TTFT_MS.value))
    if ttft is None and path is not None and path.ttft_ns is not None:
        ttft = path.ttft_ns / 1e6
    out_tokens = _num(a.get(Attr.OUTPUT_TOKENS.value))
    tpot = _num(a.get(Attr.TPOT_MS.value))
    if tpot is None and req and chunk and out_tokens and out_tokens > 1:
        tpot = (req.end_ns - chunk.time_ns) / 1e6 / (out_tokens - 1)  # router-side fallback
    prompt = _num(a.get(Attr.INPUT_TOKENS.value))
    if prompt is None:
        prefill = t.first(Span.PREFILL.value)
        prompt = _num(prefill.attr(Attr.PROMPT_TOKENS.value)) if prefill else None
    outcome = a.get(Attr.OUTCOME.value)
    if outcome is None:
        outcome = (
            "incomplete"
            if req is None
            else "error"
            if req.is_error
            else OK
            if chunk
            else "no first token"
        )
    errors = [sp for sp in t.spans if sp.is_error]
    reason = (req.attr(Attr.REASON.value) if req and req.is_error else None) or next(
        (sp.attr(Attr.REASON.value) or sp.status_message for sp in errors), None
    )
    largest = unknown = None
    if path is not None:
        known = [s for s in path.segments if s.name is not Seg.UNKNOWN]
        largest = max(known, key=lambda s: s.duration_ns).name.value if known else None
        unknown = sum(s.duration_ns for s in path.segments if s.name is Seg.UNKNOWN) / 1e6
    return {
        "request_id": str(a.get(Attr.REQUEST_ID.value) or t.trace_id[:16]),
        "ttft_ms": ttft,
        "tpot_ms": tpot,
        "input_tokens": prompt,
        "output_tokens": out_tokens,
        "mode": str(a.get(Attr.MODE.value) or (path.mode if path else "unknown")),
        "prefill": served_by(t, Attr.PREFILL_URL, "prefill"),
        "decode": served_by(t, Attr.DECODE_URL, "decode"),
        "stream": a.get(Attr.STREAM.value),  # not streamed: the first chunk is the whole answer
        "outcome": str(outcome),
        "reason": str(reason) if reason else "",
        "largest_segment": largest or "",
        "unknown_ms": unknown,
        "anomalies": len(path.anomalies) if path else 0,
        "start_ns": req.start_ns if req else t.start_ns,
        "end_ns": req.end_ns if req else t.end_ns,
        "trace_id": t.trace_id,
    }


def in_flight_at_arrival(starts: list[int], ends: list[int]) -> list[int]:
    """Requests in flight when each one arrived (itself included): the load it met."""
    s, e = sorted(starts), sorted(ends)
    return [bisect.bisect_right(s, x) - bisect.bisect_right(e, x) for x in starts]


def attention_order(df: pd.DataFrame) -> pd.DataFrame:
    """Failed first, then slowest TTFT first; requests without a TTFT sort as slow."""
    key = pd.DataFrame({"failed": df["outcome"] != OK, "ttft": df["ttft_ms"].fillna(float("inf"))})
    return df.loc[key.sort_values(["failed", "ttft"], ascending=[False, False]).index].reset_index(
        drop=True
    )


def _flags(df: pd.DataFrame) -> pd.Series:
    slow_at = (
        df.loc[df["outcome"] == OK, "ttft_ms"].quantile(0.95)
        if (df["outcome"] == OK).any()
        else None
    )
    flags = []
    for outcome, ttft, anomalies in zip(df["outcome"], df["ttft_ms"], df["anomalies"], strict=True):
        if outcome != OK:
            flags.append("failed")
        elif slow_at is not None and ttft is not None and ttft >= slow_at and len(df) >= 5:
            flags.append("slow")
        elif anomalies:
            flags.append("anomaly")
        else:
            flags.append("")
    return pd.Series(flags, index=df.index, dtype="object")


def is_request(t: Trace) -> bool:
    return t.first(Span.REQUEST.value) is not None


def request_frame(traces: list[Trace], paths: dict[str, CriticalPath | None]) -> pd.DataFrame:
    """One row per request (a trace with the router's request span)."""
    rows = [_row(t, paths.get(t.trace_id)) for t in traces if is_request(t)]
    df = pd.DataFrame(rows, columns=[*COLUMNS[1:], "anomalies", "start_ns", "end_ns"])
    if df.empty:
        return pd.DataFrame(columns=COLUMNS)
    df["load"] = in_flight_at_arrival(df["start_ns"].tolist(), df["end_ns"].tolist())
    df["start_s"] = (df["start_ns"] - df["start_ns"].min()) / 1e9
    for col in ("ttft_ms", "tpot_ms", "input_tokens", "output_tokens", "unknown_ms"):
        df[col] = pd.to_numeric(df[col], errors="coerce")
    df["flag"] = _flags(df)
    return attention_order(df)[COLUMNS]


def segment_frame(paths: dict[str, CriticalPath | None]) -> pd.DataFrame:
    """Long form: one row per (request with a TTFT, segment name), in ms."""
    rows = [
        (tid, name.value, ns / 1e6)
        for tid, p in paths.items()
        if p is not None and p.ttft_ns is not None
        for name, ns in p.durations_ns().items()
    ]
    return pd.DataFrame(rows, columns=["trace_id", "segment", "ms"])


def with_client_ttfts(requests: pd.DataFrame, client: Mapping[str, float]) -> pd.DataFrame:
    """The request table with the client's TTFT and the time no span saw (client - trace),
    right after the trace's TTFT."""
    out = requests.copy()
    out["client_ttft_ms"] = pd.to_numeric(out["request_id"].map(client), errors="coerce")
    out["unaccounted_ms"] = out["client_ttft_ms"] - out["ttft_ms"]
    at = COLUMNS.index("ttft_ms") + 1
    return out[[*COLUMNS[:at], *CLIENT_COLUMNS, *COLUMNS[at:]]]


def analyse(
    label: str,
    traces: list[Trace],
    problems: tuple[str, ...] = (),
    client_ttfts: Mapping[str, float] | None = None,
) -> RunData:
    paths = {t.trace_id: critical_path(t) for t in traces}
    requests = request_frame(traces, paths)
    if client_ttfts:
        requests = with_client_ttfts(requests, client_ttfts)
    return RunData(
        label,
        {t.trace_id: t for t in traces},
        paths,
        requests,
        segment_frame(paths),
        problems,
        sum(1 for t in traces if not is_request(t)),
    )


def load_run_folder(folder: str | Path) -> RunData:
    run = read_run(folder)
    client = Path(folder) / CLIENT_TTFTS_FILE
    try:
        client_ttfts = json.loads(client.read_text()) if client.is_file() else None
    except (OSError, ValueError) as exc:
        return analyse(
            str(folder), list(run.traces), (*run.problems, f"{client}: unreadable ({exc})")
        )
    if not isinstance(client_ttfts, dict):
        client_ttfts = None
    return analyse(str(folder), list(run.traces), run.problems, client_ttfts)


def load_jaeger(
    url: str, service: str = Service.ROUTER.value, lookback_min: float = 60, limit: int = 1000
) -> RunData:
    now = datetime.now(UTC)
    traces = JaegerClient(url).find_traces(
        service, now - timedelta(minutes=lookback_min), now, limit=limit
    )
    return analyse(f"{url} ({service}, last {lookback_min:g} min)", traces)


def pow2_bucket(n: float | None, floor: int = 1) -> str:
    """``65-128`` style label of the power-of-two bin holding ``n`` (sortable by its start)."""
    if n is None or pd.isna(n):
        return "unknown"
    hi = floor
    while hi < n:
        hi *= 2
    lo = hi // 2 + 1 if hi > floor else 1
    return f"{lo}-{hi}" if lo != hi else f"{hi}"


def bucket_sort_key(label: str) -> float:
    return float(label.split("-")[0]) if label[0].isdigit() else float("inf")


def decomposition(run: RunData, by: str) -> pd.DataFrame:
    """Mean ms of every segment per bucket of ``by`` ("input_tokens" or "load"), with counts.
    Means, not medians, so a bar's stack adds up to the bucket's mean TTFT."""
    if run.segments.empty:
        return pd.DataFrame(columns=["bucket", "segment", "ms", "requests"])
    buckets = run.requests.set_index("trace_id")[by].map(
        lambda v: pow2_bucket(v, 16 if by == "input_tokens" else 1)
    )
    seg = run.segments.assign(bucket=run.segments["trace_id"].map(buckets))
    wide = seg.pivot_table(
        index=["bucket", "trace_id"], columns="segment", values="ms", aggfunc="sum", fill_value=0.0
    )
    means = wide.groupby(level="bucket").mean()
    counts = wide.groupby(level="bucket").size()
    long = means.reset_index().melt(id_vars="bucket", var_name="segment", value_name="ms")
    long["requests"] = long["bucket"].map(counts)
    order = {s.value: i for i, s in enumerate(Seg)}
    long["_b"] = long["bucket"].map(bucket_sort_key)
    long["_s"] = long["segment"].map(lambda s: order.get(s, len(order)))
    return long.sort_values(["_b", "_s"]).drop(columns=["_b", "_s"]).reset_index(drop=True)


def percentiles(run: RunData) -> pd.DataFrame:
    """p50/p90/p99/mean of TTFT and of every segment (requests with a TTFT)."""
    qs = {"p50": 0.5, "p90": 0.9, "p99": 0.99}
    ok = run.requests.dropna(subset=["ttft_ms"])
    rows = {"TTFT": ok["ttft_ms"]}
    if not run.segments.empty:
        wide = run.segments.pivot_table(
            index="trace_id", columns="segment", values="ms", aggfunc="sum", fill_value=0.0
        )
        for s in Seg:
            if s.value in wide.columns:
                rows[s.value] = wide[s.value]
    out = pd.DataFrame(
        {
            name: {
                **{k: col.quantile(q) for k, q in qs.items()},
                "mean": col.mean(),
                "requests": int(col.count()),
            }
            for name, col in rows.items()
        }
    ).T
    out.index.name = "ms"
    return out

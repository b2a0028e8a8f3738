"""The routing view's data: where the router sent each request, why, and what it cost. Pure.

Owns: ``Kind`` (what kind of choice sent a request to its D), ``choice_kind`` (read from the
request span's route attributes), ``route_frame`` (one row per request: the instances, the
policy and both reasons, what P pushed and what D held), ``by_instance`` (per P or D: share of
the requests, kinds of choice, TTFT percentiles) and ``by_kind`` (per kind: TTFT and pushed
blocks, so prefix hits and new prefixes can be compared).

The router writes the choice of a request's last attempt on its request span
(``connector/router/tracing.py``: ``routed``); P's spans say what it pushed
(``prepare_descriptors``: blocks; ``write``: bytes), D's ``first_token`` how many prompt tokens
it did not receive from P (its own prefix cache, and any it computed).
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from typing import Any

import pandas as pd

from dashboard.data import OK, RunData
from telemetry.otlp_json import Trace
from telemetry.schema import Attr, RoutePolicy, Span

# In a prefix choice's reason, a holder of the prefix passed over for its load
# (connector/router/chooser.py: "[i] holds N but cost C > bound B").
PASSED_OVER = "> bound"
NO_INSTANCE = "(none)"  # P of a request D served alone
COLUMNS = [
    "request_id",
    "kind",
    "policy",
    "prefill",
    "decode",
    "prefix_blocks",
    "pushed_blocks",
    "pushed_bytes",
    "d_local_tokens",
    "ttft_ms",
    "outcome",
    "decode_reason",
    "prefill_reason",
    "start_s",
    "trace_id",
]


class Kind(str, Enum):
    """Why a request went to its D, in classes an operator compares."""

    PREFIX_HIT = "prefix hit"  # the D holding part of the prompt (prefix_blocks > 0)
    HOLDER_BUSY = "prefix holder over bound"  # a holder too loaded: rendezvous among the rest
    NEW_PREFIX = "new prefix"  # held nowhere: rendezvous on its first block
    SHORT_PROMPT = "prompt under one block"  # prefix policy, by engine-load
    ENGINE_LOAD = "engine-load"
    LEAST_LOAD = "least-load"
    DEGRADED = "degraded (no P)"  # no P usable: D computed the prompt
    D_ALONE = "D alone"  # a request one transfer cannot carry (n > 1, a list of prompts...)
    NOT_ROUTED = "not routed"  # no D could take it
    UNRECORDED = "policy not recorded"  # traces from a router before --policy


def _int(v: object) -> int | None:
    try:
        return int(v) if v is not None and v != "" else None  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return None


def choice_kind(attrs: Mapping[str, Any]) -> Kind:
    """The kind of choice a request span's attributes record."""
    if not attrs.get(Attr.DECODE_URL.value):
        return Kind.NOT_ROUTED
    if attrs.get(Attr.DEGRADED.value) is True:
        return Kind.DEGRADED
    if not attrs.get(Attr.PREFILL_URL.value):
        return Kind.D_ALONE
    policy = attrs.get(Attr.ROUTE_POLICY.value)
    if policy == RoutePolicy.PREFIX.value:
        blocks = _int(attrs.get(Attr.ROUTE_PREFIX_BLOCKS.value))
        if blocks is None:
            return Kind.SHORT_PROMPT
        if blocks > 0:
            return Kind.PREFIX_HIT
        reason = str(attrs.get(Attr.ROUTE_REASON.value) or "")
        return Kind.HOLDER_BUSY if PASSED_OVER in reason else Kind.NEW_PREFIX
    if policy == RoutePolicy.ENGINE_LOAD.value:
        return Kind.ENGINE_LOAD
    if policy == RoutePolicy.LEAST_LOAD.value:
        return Kind.LEAST_LOAD
    return Kind.UNRECORDED


def pushed(t: Trace) -> tuple[int | None, int | None]:
    """(blocks, bytes) P pushed for the request: per transfer (one per attempt), the blocks
    of its largest rank (every rank writes its share of the same blocks) and the bytes of
    its WRITEs that succeeded, summed over ranks; None without P's spans."""
    blocks: dict[str, int] = {}
    for sp in t.named(Span.PREPARE_DESCRIPTORS.value):
        n = _int(sp.attr(Attr.BLOCKS.value))
        if n is not None:
            tid = str(sp.attr(Attr.TRANSFER_ID.value, ""))
            blocks[tid] = max(blocks.get(tid, 0), n)
    writes = [
        _int(sp.attr(Attr.BYTES.value)) for sp in t.named(Span.WRITE.value) if not sp.is_error
    ]
    ok = [n for n in writes if n is not None]
    return (sum(blocks.values()) if blocks else None, sum(ok) if ok else None)


def d_local_tokens(t: Trace) -> int | None:
    """Prompt tokens D did not receive from P (its prefix cache, any it computed): the last
    attempt's."""
    spans = t.named(Span.FIRST_TOKEN.value)
    return _int(spans[-1].attr(Attr.LOCAL_TOKENS.value)) if spans else None


def choice_attrs(t: Trace) -> dict[str, Any]:
    """The request span's attributes over its last ``route`` span's: traces from routers
    that put the reason on the route span only still read."""
    routes = t.named(Span.ROUTE.value)
    req = t.first(Span.REQUEST.value)
    return {**(routes[-1].attributes if routes else {}), **(req.attributes if req else {})}


def _row(t: Trace) -> dict[str, object]:
    a = choice_attrs(t)
    blocks, nbytes = pushed(t)
    return {
        "trace_id": t.trace_id,
        "kind": choice_kind(a).value,
        "policy": str(a.get(Attr.ROUTE_POLICY.value) or ""),
        "prefix_blocks": _int(a.get(Attr.ROUTE_PREFIX_BLOCKS.value)),
        "pushed_blocks": blocks,
        "pushed_bytes": nbytes,
        "d_local_tokens": d_local_tokens(t),
        "decode_reason": str(a.get(Attr.ROUTE_REASON.value) or ""),
        "prefill_reason": str(a.get(Attr.ROUTE_PREFILL_REASON.value) or ""),
    }


def route_frame(run: RunData) -> pd.DataFrame:
    """One row per request of ``run`` (its request table's), in arrival order."""
    req = run.requests
    if req.empty:
        return pd.DataFrame(columns=COLUMNS)
    spans = pd.DataFrame([_row(run.traces[tid]) for tid in req["trace_id"]])
    df = req[["trace_id", "request_id", "prefill", "decode", "ttft_ms", "outcome", "start_s"]]
    df = df.merge(spans, on="trace_id")
    df["prefill"] = df["prefill"].replace("", NO_INSTANCE)
    for col in ("prefix_blocks", "pushed_blocks", "pushed_bytes", "d_local_tokens"):
        df[col] = pd.to_numeric(df[col], errors="coerce")
    return df.sort_values("start_s", kind="stable").reset_index(drop=True)[COLUMNS]


def _ttft_stats(ok: pd.Series) -> dict[str, float]:
    return {
        "ttft_p50": ok.quantile(0.5),
        "ttft_p90": ok.quantile(0.9),
        "ttft_p99": ok.quantile(0.99),
        "ttft_mean": ok.mean(),
    }


def by_instance(routes: pd.DataFrame, role: str) -> pd.DataFrame:
    """Per instance of ``role`` ("prefill" or "decode"): requests, their share of the run,
    failed ones, TTFT percentiles of the ok ones (ms), mean pushed blocks, and how many
    requests each kind of choice sent there (one column per kind seen)."""
    if routes.empty:
        return pd.DataFrame()
    rows = {}
    for name, g in routes.groupby(role, sort=True):
        ok = g.loc[g["outcome"] == OK, "ttft_ms"].dropna()
        rows[name] = {
            "requests": len(g),
            "share_%": 100 * len(g) / len(routes),
            "failed": int((g["outcome"] != OK).sum()),
            **_ttft_stats(ok),
            "pushed_blocks_mean": g["pushed_blocks"].mean(),
        }
    out = pd.DataFrame.from_dict(rows, orient="index")
    kinds = pd.crosstab(routes[role], routes["kind"])
    out = out.join(kinds[[k.value for k in Kind if k.value in kinds.columns]])
    out.index.name = role
    return out


def by_kind(routes: pd.DataFrame) -> pd.DataFrame:
    """Per kind of choice (``Kind`` order): requests, TTFT percentiles of the ok ones (ms),
    and the mean of what P pushed and D held: under ``--policy prefix``, prefix hits
    pushing fewer blocks and reaching a first token sooner than new prefixes is the payoff."""
    if routes.empty:
        return pd.DataFrame()
    rows = {}
    for kind in Kind:
        g = routes[routes["kind"] == kind.value]
        if g.empty:
            continue
        ok = g.loc[g["outcome"] == OK, "ttft_ms"].dropna()
        rows[kind.value] = {
            "requests": len(g),
            **_ttft_stats(ok),
            "prefix_blocks_mean": g["prefix_blocks"].mean(),
            "pushed_blocks_mean": g["pushed_blocks"].mean(),
            "pushed_bytes_mean": g["pushed_bytes"].mean(),
            "d_local_tokens_mean": g["d_local_tokens"].mean(),
        }
    out = pd.DataFrame.from_dict(rows, orient="index")
    out.index.name = "kind"
    return out

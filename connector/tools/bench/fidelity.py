"""Whether each request's trace accounts for the TTFT its client saw (docs/benchmarks.md).

Owns: matching ``vllm bench serve``'s saved per-request TTFTs to the router's request spans
by request id (the client sends ``<prefix><index>`` as ``X-Request-Id``; the router records
it as ``pushkv.request_id``), and ``Fidelity``: how many requests have a trace whose TTFT
(root span start -> ``first_chunk`` event) is within ``2 % + 2 ms`` of the client's, and the
distribution of the unaccounted time (client minus trace).

Pure: takes the bench JSON and parsed traces; no I/O.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from telemetry.otlp_json import Trace
from telemetry.schema import Attr, Event, Span

REL_TOLERANCE = 0.02
ABS_TOLERANCE_MS = 2.0


def within(client_ms: float, trace_ms: float) -> bool:
    """The issue's criterion: the trace accounts for the client's TTFT within 2 % + 2 ms."""
    return abs(client_ms - trace_ms) <= REL_TOLERANCE * client_ms + ABS_TOLERANCE_MS


@dataclass(frozen=True)
class Fidelity:
    """One ``vllm bench serve`` run's requests against their traces. ``gaps_ms``: client TTFT
    minus trace TTFT per matched request, in request order (positive: time no span saw)."""

    requests: int  # requests the client timed (a TTFT and no error)
    matched: int  # of those, with a router request span carrying a first chunk
    within: int  # of those, accounted for within the tolerance
    gaps_ms: tuple[float, ...] = field(default=(), repr=False)

    @property
    def share(self) -> float | None:
        """Accounted requests over timed requests (an unmatched request counts against)."""
        return self.within / self.requests if self.requests else None

    def gap_quantiles(self) -> dict[str, float]:
        if not self.gaps_ms:
            return {}
        g = sorted(self.gaps_ms)

        def q(p: float) -> float:
            return g[min(len(g) - 1, int(p * len(g)))]

        return {
            "p50": statistics.median(g),
            "p90": q(0.9),
            "p99": q(0.99),
            "max": g[-1],
            "min": g[0],
        }

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["gaps_ms"] = [round(g, 3) for g in self.gaps_ms]
        out["share"] = self.share
        out["gap_ms"] = self.gap_quantiles()
        return out

    def summary(self) -> str:
        return describe(self.to_json())

    @classmethod
    def pooled(cls, cells: Iterable[Mapping[str, Any]]) -> Fidelity:
        """Several runs' checks (``to_json`` dicts) as one: their requests pooled."""
        cells = [c for c in cells if c]
        return cls(
            sum(c["requests"] for c in cells),
            sum(c["matched"] for c in cells),
            sum(c["within"] for c in cells),
            tuple(g for c in cells for g in c["gaps_ms"]),
        )


def describe(f: Mapping[str, Any]) -> str:
    """One line for a ``Fidelity.to_json`` dict."""
    if not f.get("requests"):
        return "no timed requests"
    q = f.get("gap_ms") or {}
    gaps = (
        f"; unaccounted ms p50 {q['p50']:.1f}, p90 {q['p90']:.1f}, max {q['max']:.1f}" if q else ""
    )
    return (
        f"{f['within']}/{f['requests']} ({f['within'] / f['requests']:.0%}) within 2 % + 2 ms"
        f" ({f['matched']} traced){gaps}"
    )


def trace_ttfts_ms(traces: Iterable[Trace]) -> dict[str, float]:
    """Request id -> the trace's TTFT (root span start -> first chunk), for every router
    request span that has both."""
    out: dict[str, float] = {}
    for t in traces:
        for req in t.named(Span.REQUEST.value):
            rid = req.attr(Attr.REQUEST_ID.value)
            chunk = req.event(Event.FIRST_CHUNK.value)
            if isinstance(rid, str) and chunk is not None:
                out[rid] = (chunk.time_ns - req.start_ns) / 1e6
    return out


def client_ttfts_ms(bench: Mapping[str, Any], prefix: str) -> dict[str, float]:
    """Request id -> the TTFT the client saw (ms), for the requests it timed."""
    ttfts = bench.get("ttfts") or []
    errors = bench.get("errors") or [""] * len(ttfts)
    return {
        f"{prefix}{i}": t * 1e3
        for i, (t, err) in enumerate(zip(ttfts, errors, strict=False))
        if not err and t and t > 0
    }


def check(bench: Mapping[str, Any], prefix: str, traces: Sequence[Trace]) -> Fidelity:
    """``bench``: a ``vllm bench serve --save-detailed`` result (``ttfts`` in seconds and
    ``errors`` in request order); ``prefix``: its ``--request-id-prefix``."""
    by_id = trace_ttfts_ms(traces)
    client = client_ttfts_ms(bench, prefix)
    matched = ok = 0
    gaps: list[float] = []
    for rid, client_ms in client.items():
        trace_ms = by_id.get(rid)
        if trace_ms is None:
            continue
        matched += 1
        gaps.append(client_ms - trace_ms)
        ok += within(client_ms, trace_ms)
    return Fidelity(len(client), matched, ok, tuple(gaps))

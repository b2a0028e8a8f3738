"""The routing view's data (dashboard/routing.py) on synthetic traces: the kind of each choice,
what P pushed, and the per-instance and per-kind tables. The reasons come from the router's
own Chooser, so a change of its wording that the dashboard relies on fails here."""

from __future__ import annotations

from collections.abc import Mapping

import pandas as pd
import pytest

from connector.router import affinity
from connector.router.chooser import Choice, Chooser, Policy
from connector.router.policy import BackendLoad, Health, Signals
from dashboard.data import analyse
from dashboard.routing import (
    COLUMNS,
    NO_INSTANCE,
    Kind,
    by_instance,
    by_kind,
    choice_kind,
    route_frame,
)
from telemetry.otlp_json import SpanEvent, SpanRecord, StatusCode, Trace
from telemetry.schema import Attr, Event, Resource, Span

D0, D1, P0 = "http://10.0.0.4:8200", "http://10.0.0.5:8200", "http://10.0.0.2:8100"
NOW = 50.0


def _backends() -> list[BackendLoad]:
    return [
        BackendLoad(i, health=Health.HEALTHY, key=url, signals=Signals(0, 0, 0.0, NOW))
        for i, url in enumerate((D0, D1))
    ]


def _hashes(text: str) -> tuple[int, ...]:
    return affinity.block_hashes(text, 8)


def attrs_of(c: Choice, policy: Policy, **extra: object) -> dict[str, object]:
    """The request span's route attributes for a D choice, as relay.py and tracing.py write
    them (a prefill URL: P took its leg)."""
    a: dict[str, object] = {
        Attr.DECODE_URL.value: c.load.key,
        Attr.PREFILL_URL.value: P0,
        Attr.ROUTE_POLICY.value: policy.value,
        Attr.ROUTE_REASON.value: c.reason,
        Attr.DEGRADED.value: False,
    }
    if c.prefix_blocks is not None:
        a[Attr.ROUTE_PREFIX_BLOCKS.value] = c.prefix_blocks
    return {**a, **extra}


def test_each_kind_of_choice_is_read_from_the_attributes() -> None:
    ds = _backends()
    prefix = Chooser(Policy.PREFIX, max_imbalance=1.0)
    prompt = _hashes("a shared system prompt, long enough")
    new = prefix.choose("decode", ds, prompt, NOW)
    assert new is not None
    hit = prefix.choose("decode", ds, prompt, NOW)
    assert hit is not None and hit.prefix_blocks
    new.load.signals = Signals(3, 0, 0.0, NOW)  # the holder is now past the bound
    busy = prefix.choose("decode", ds, prompt, NOW)
    assert busy is not None and busy.load is not new.load
    short = prefix.choose("decode", ds, (), NOW)
    engine = Chooser(Policy.ENGINE_LOAD).choose("decode", ds, (), NOW)
    least = Chooser(Policy.LEAST_LOAD).choose("decode", ds, (), NOW)
    assert short is not None and engine is not None and least is not None
    expected = [
        (attrs_of(new, Policy.PREFIX), Kind.NEW_PREFIX),
        (attrs_of(hit, Policy.PREFIX), Kind.PREFIX_HIT),
        (attrs_of(busy, Policy.PREFIX), Kind.HOLDER_BUSY),
        (attrs_of(short, Policy.PREFIX), Kind.SHORT_PROMPT),
        (attrs_of(engine, Policy.ENGINE_LOAD), Kind.ENGINE_LOAD),
        (attrs_of(least, Policy.LEAST_LOAD), Kind.LEAST_LOAD),
        (attrs_of(hit, Policy.PREFIX, **{Attr.DEGRADED.value: True}), Kind.DEGRADED),
        (attrs_of(hit, Policy.PREFIX, **{Attr.PREFILL_URL.value: ""}), Kind.D_ALONE),
        ({Attr.ROUTE_POLICY.value: "prefix"}, Kind.NOT_ROUTED),
        ({Attr.DECODE_URL.value: D0, Attr.PREFILL_URL.value: P0}, Kind.UNRECORDED),
    ]
    assert [choice_kind(a) for a, _ in expected] == [k for _, k in expected]


def _span(
    trace_id: str,
    n: int,
    name: Span,
    start: int,
    end: int,
    attrs: Mapping[str, object],
    *,
    error: bool = False,
    events: tuple[SpanEvent, ...] = (),
    resource: Mapping[str, object] | None = None,
) -> SpanRecord:
    return SpanRecord(
        trace_id,
        f"{n:016x}",
        None,
        name.value,
        1,
        start,
        end,
        StatusCode.ERROR if error else StatusCode.UNSET,
        "",
        attrs,
        events,
        resource or {},
    )


def request(
    n: int,
    route: Mapping[str, object],
    ttft_ms: float | None,
    *,
    pushes: tuple[tuple[str, int, int, bool], ...] = (),
    local_tokens: int | None = None,
    on_route_span: bool = False,
) -> Trace:
    """A request arriving at ``n`` ms: its root span (``route`` attributes, or only URLs
    there and the rest on a ``route`` span), per pushed rank (transfer id, blocks, bytes,
    WRITE failed) P's prepare_descriptors and write spans, and D's first_token."""
    tid = f"{n:032x}"
    t0 = n * 1_000_000
    ok = ttft_ms is not None
    chunk = (SpanEvent(Event.FIRST_CHUNK.value, t0 + int((ttft_ms or 0) * 1e6), {}),)
    urls = {k: v for k, v in route.items() if k in (Attr.DECODE_URL.value, Attr.PREFILL_URL.value)}
    root = {
        **(urls if on_route_span else route),
        Attr.REQUEST_ID.value: f"cmpl-{n}",
        Attr.OUTCOME.value: "ok" if ok else "http_502",
        **({Attr.TTFT_MS.value: ttft_ms} if ok else {}),
    }
    spans = [
        _span(
            tid,
            1,
            Span.REQUEST,
            t0,
            t0 + 50_000_000,
            root,
            error=not ok,
            events=chunk if ok else (),
        )
    ]
    if on_route_span:
        spans.append(_span(tid, 2, Span.ROUTE, t0, t0 + 1000, route))
    for i, (xfer, blocks, nbytes, failed) in enumerate(pushes):
        p = {Resource.ROLE.value: "prefill", Resource.TP_RANK.value: i}
        common = {Attr.TRANSFER_ID.value: xfer}
        spans.append(
            _span(
                tid,
                10 + i,
                Span.PREPARE_DESCRIPTORS,
                t0,
                t0 + 1,
                {**common, Attr.BLOCKS.value: blocks},
                resource=p,
            )
        )
        spans.append(
            _span(
                tid,
                20 + i,
                Span.WRITE,
                t0 + 1,
                t0 + 2,
                {**common, Attr.BYTES.value: nbytes},
                error=failed,
                resource=p,
            )
        )
    if local_tokens is not None:
        spans.append(
            _span(
                tid, 30, Span.FIRST_TOKEN, t0 + 2, t0 + 3, {Attr.LOCAL_TOKENS.value: local_tokens}
            )
        )
    return Trace(tid, tuple(spans))


def _run() -> pd.DataFrame:
    ds = _backends()
    ch = Chooser(Policy.PREFIX)
    prompt = _hashes("x" * 80)  # 10 blocks
    new = ch.choose("decode", ds, prompt, NOW)
    hit = ch.choose("decode", ds, prompt, NOW)
    other = ch.choose("decode", ds, _hashes("y" * 80), NOW)
    assert new is not None and hit is not None and other is not None
    assert hit.load is new.load and hit.prefix_blocks == 10
    on_new, on_hit = attrs_of(new, Policy.PREFIX), attrs_of(hit, Policy.PREFIX)
    traces = [
        # P with TP 2: each rank writes its half of the same 10 blocks
        request(
            1, on_new, 80.0, pushes=(("x1", 10, 500, False), ("x1", 10, 500, False)), local_tokens=0
        ),
        # a hit: P pushes only the suffix's block; D held 144 tokens
        request(2, on_hit, 20.0, pushes=(("x2", 1, 100, False),), local_tokens=144),
        # two attempts: the first transfer's WRITE failed (its bytes do not count)
        request(
            3,
            on_hit,
            40.0,
            pushes=(("x3", 2, 200, True), ("x4", 1, 100, False)),
            on_route_span=True,
        ),
        # failed: no TTFT
        request(4, attrs_of(other, Policy.PREFIX), None),
        # D alone: no P
        request(5, attrs_of(other, Policy.PREFIX, **{Attr.PREFILL_URL.value: ""}), 60.0),
    ]
    return route_frame(analyse("synthetic", traces))


def test_route_frame_reads_kind_instances_and_what_p_pushed() -> None:
    df = _run()
    assert list(df.columns) == COLUMNS
    assert df["request_id"].tolist() == [f"cmpl-{n}" for n in range(1, 6)]  # arrival order
    assert df["kind"].tolist() == [
        Kind.NEW_PREFIX.value,
        Kind.PREFIX_HIT.value,
        Kind.PREFIX_HIT.value,  # its reason only on the route span: still read
        Kind.NEW_PREFIX.value,
        Kind.D_ALONE.value,
    ]
    assert df["prefill"].tolist() == ["10.0.0.2:8100"] * 4 + [NO_INSTANCE]
    assert df["pushed_blocks"].tolist()[:3] == [10, 1, 3]  # max over ranks, sum over transfers
    assert df["pushed_bytes"].tolist()[:3] == [1000, 100, 100]  # a failed WRITE is left out
    assert df["pushed_blocks"].iloc[3:].isna().all()
    assert df["d_local_tokens"].tolist()[:2] == [0, 144]
    assert df["prefix_blocks"].tolist()[:3] == [0, 10, 10]
    assert df["decode_reason"].iloc[1].startswith("prefix: holds 10 of 10 blocks")
    assert (df["policy"] == "prefix").all()


def test_per_instance_and_per_kind_tables() -> None:
    df = _run()
    d = by_instance(df, "decode")
    hit_d = df.loc[1, "decode"]
    assert d["requests"].sum() == 5 and d["share_%"].sum() == pytest.approx(100.0)
    assert d.at[hit_d, Kind.PREFIX_HIT.value] == 2
    assert d["failed"].sum() == 1
    hit_ttfts = df.loc[(df["decode"] == hit_d) & (df["outcome"] == "ok"), "ttft_ms"]
    assert d.at[hit_d, "ttft_p50"] == pytest.approx(hit_ttfts.median())
    p = by_instance(df, "prefill")
    assert p.at[NO_INSTANCE, Kind.D_ALONE.value] == 1
    k = by_kind(df)
    assert list(k.index) == [Kind.PREFIX_HIT.value, Kind.NEW_PREFIX.value, Kind.D_ALONE.value]
    assert k.at[Kind.PREFIX_HIT.value, "pushed_blocks_mean"] == pytest.approx(2.0)  # (1 + 3) / 2
    assert k.at[Kind.NEW_PREFIX.value, "pushed_blocks_mean"] == pytest.approx(10.0)
    assert k.at[Kind.PREFIX_HIT.value, "ttft_p50"] == pytest.approx(30.0)  # 20 and 40
    assert k.at[Kind.NEW_PREFIX.value, "ttft_p50"] == pytest.approx(80.0)  # the failed one has none
    assert k.at[Kind.NEW_PREFIX.value, "requests"] == 2


def test_an_empty_run_gives_empty_tables() -> None:
    df = route_frame(analyse("empty", []))
    assert df.empty and list(df.columns) == COLUMNS
    assert by_instance(df, "decode").empty and by_kind(df).empty


def test_every_kind_has_a_colour() -> None:
    from dashboard.views.routing import KIND_COLORS

    assert set(KIND_COLORS) == {k.value for k in Kind}

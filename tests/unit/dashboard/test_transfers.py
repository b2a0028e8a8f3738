"""The dashboard's KV transfers (dashboard/transfers.py) from synthetic P write spans: one
row per rank with its geometry, a request's ranks summed, and two models compared."""

from __future__ import annotations

import pytest

from dashboard.data import load_run_folder
from dashboard.transfers import COLUMNS, compare_kv, geometry_label, per_request, transfer_frame
from telemetry.otlp_json import SpanRecord, StatusCode, Trace
from telemetry.schema import Attr, Span
from tests.fixtures.traces import HERE

MS = 1_000_000
LLAMA = {  # 8 bf16 heads of 64 over 8 layers, split over 2 P ranks
    Attr.KV_LAYERS.value: 8,
    Attr.KV_FORM.value: "heads",
    Attr.KV_HEADS.value: 4,
    Attr.KV_HEAD_SIZE.value: 64,
    Attr.KV_DTYPE.value: "bfloat16",
    Attr.KV_BYTES_PER_TOKEN.value: 8 * 4 * 2 * 64 * 2,
    Attr.KV_BLOCK_TOKENS.value: 16,
}
MLA_FP8 = {  # DeepSeek's 576-wide latent in fp8 over 3 layers, one P rank
    Attr.KV_LAYERS.value: 3,
    Attr.KV_FORM.value: "latent",
    Attr.KV_HEADS.value: 1,
    Attr.KV_HEAD_SIZE.value: 576,
    Attr.KV_DTYPE.value: "fp8",
    Attr.KV_BYTES_PER_TOKEN.value: 3 * 576,
    Attr.KV_BLOCK_TOKENS.value: 16,
}


def write(
    trace_id: str, rank: int, kv: dict, nbytes: int, ms: float, error: bool = False
) -> SpanRecord:
    attrs = {
        **kv,
        Attr.TP_RANK.value: rank,
        Attr.ENGINE_ID.value: "prefill-0",
        Attr.BYTES.value: nbytes,
        Attr.DESCRIPTORS.value: 10 + rank,
        Attr.GBPS.value: None if error else nbytes / (ms * MS),
    }
    return SpanRecord(
        trace_id,
        f"{rank:016x}",
        None,
        Span.WRITE.value,
        1,
        0,
        int(ms * MS),
        StatusCode.ERROR if error else StatusCode.UNSET,
        "",
        {k: v for k, v in attrs.items() if v is not None},
        (),
        {},
    )


def llama_request(trace_id: str, tokens: int, ms: tuple[float, float]) -> Trace:
    per_rank = tokens * LLAMA[Attr.KV_BYTES_PER_TOKEN.value]
    return Trace(trace_id, (write(trace_id, 0, LLAMA, per_rank, ms[0]),
                            write(trace_id, 1, LLAMA, per_rank, ms[1])))  # fmt: skip


def test_one_row_per_rank_with_its_geometry_and_the_latent_named() -> None:
    mla = Trace("m", (write("m", 0, MLA_FP8, 64 * 1728, 0.5),))
    df = transfer_frame([llama_request("a", 64, (1.0, 2.0)), mla])
    assert list(df.columns) == COLUMNS and len(df) == 3
    assert df.loc[df["trace_id"] == "a", "kv_heads"].tolist() == ["4", "4"]
    row = df[df["trace_id"] == "m"].iloc[0]
    assert (row["kv_heads"], row["dtype"], row["head_size"]) == ("latent", "fp8", 576)
    assert row["bytes_per_token"] == 1728 and row["write_ms"] == pytest.approx(0.5)


def test_a_request_sums_its_ranks_bytes_per_token_and_divides_by_the_slowest_write() -> None:
    one = per_request(transfer_frame([llama_request("a", 64, (1.0, 2.0))])).iloc[0]
    assert one["bytes_per_token"] == 2 * 8192  # both ranks' halves of the heads
    assert one["bytes"] == 2 * 64 * 8192 and one["descriptors"] == 10 + 11
    # the ranks write side by side: the request's rate is its bytes over the slower WRITE
    assert one["gbps"] == pytest.approx(2 * 64 * 8192 / (2.0 * MS))


def test_a_failed_write_counts_in_no_sum() -> None:
    t = Trace("f", (write("f", 0, LLAMA, 100, 1.0), write("f", 1, LLAMA, 50, 1.0, error=True)))
    df = transfer_frame([t])
    assert df["ok"].tolist() == [True, False] and df["gbps"].isna().tolist() == [False, True]
    assert per_request(df).iloc[0]["bytes"] == 100


def test_traces_from_before_the_geometry_show_empty_cells_and_say_so() -> None:
    bare = Trace("o", (write("o", 0, {}, 4096, 1.0),))
    df = transfer_frame([bare])
    assert df["bytes_per_token"].isna().all() and df.iloc[0]["kv_heads"] == ""
    assert (
        per_request(df).iloc[0]["bytes_per_token"] != per_request(df).iloc[0]["bytes_per_token"]
    )  # NaN: a sum of nothing known is not 0
    assert "before pushkv.kv" in geometry_label(df)
    assert per_request(transfer_frame([])).empty


def test_two_models_compare_by_bytes_per_token() -> None:
    a = transfer_frame([llama_request(f"a{i}", 64 * (i + 1), (1.0, 1.0)) for i in range(3)])
    b = transfer_frame([Trace(f"m{i}", (write(f"m{i}", 0, MLA_FP8, 1728, 0.5),)) for i in range(3)])
    rows = compare_kv(a, b).set_index("median")
    bpt = rows.loc["KV bytes per token (P ranks summed)"]
    assert (bpt["A"], bpt["B"]) == (16384, 1728)
    assert bpt["B / A"] == pytest.approx(1728 / 16384)
    assert rows.loc["bytes per request", "A"] == 2 * 128 * 8192  # median of 64, 128, 192 tokens
    assert geometry_label(a) == "bfloat16 · 8 layers · 4 heads x 64 · blocks of 16"
    assert geometry_label(b) == "fp8 · 3 layers · latent x 576 · blocks of 16"


def test_the_generated_push_runs_carry_the_modelled_geometry() -> None:
    for run, ranks in (("gen-push", 1), ("gen-push-tp2", 2)):
        df = load_run_folder(HERE / run).transfers
        assert len(df) and df["bytes_per_token"].notna().all(), run
        assert set(per_request(df)["bytes_per_token"]) == {16384}, run  # ranks sum to the model
        assert set(df["kv_heads"]) == {str(8 // ranks)}, run
    assert load_run_folder(HERE / "gen-pull").transfers.empty  # pull: no P spans

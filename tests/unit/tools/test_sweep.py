"""``pushkv bench --sweep`` without servers: the plan, point files and resuming, the time
bound, trace slices and their decomposition, the report and the figures."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from connector.tools.bench import (
    plots,
    sweep,
    sweep_args,
    sweep_points,
    sweep_report,
    sweep_rounds,
    sweep_run,
    sweep_setup,
    trace_slices,
)
from connector.tools.bench.sweep_points import Point, SweepPlan
from connector.tools.bench.vllm_bench import RunFailure
from dashboard import sweeps
from telemetry.critical_path import Seg
from tests.docs.commands import ROOT

FIXTURES = ROOT / "tests" / "fixtures" / "traces"


def _bench(n: int, ttft: float, failed: int = 0) -> dict[str, Any]:
    return {
        "completed": n - failed,
        "failed": failed,
        "errors": ["boom"] * failed,
        "median_ttft_ms": ttft,
        "p90_ttft_ms": ttft * 1.5,
        "mean_tpot_ms": 8.0,
        "request_throughput": 2.0,
        "duration": 10.0,
    }


def test_plan_sizes_points_by_rate_and_gives_each_point_its_own_seed() -> None:
    plan = SweepPlan((128, 2048), (1.0, 8.0), point_s=10.0, min_prompts=12, max_prompts=40)
    assert [p.name for p in plan.points()] == ["in128-r1", "in128-r8", "in2048-r1", "in2048-r8"]
    assert plan.num_prompts(Point(128, 1.0)) == 12  # clamped up
    assert plan.num_prompts(Point(128, 8.0)) == 40  # clamped down
    seeds = [plan.seed_of(p) for p in plan.points()]
    assert len(set(seeds)) == 4 and plan.seed not in seeds  # never the warm-up's or another's
    assert plan.limit_s(Point(128, 1.0)) > 12 / 1.0  # room for every arrival
    assert plan.max_model_len() == 2048 + 32 + 64


def test_the_vllm_router_configurations_are_selectable_with_any_plan() -> None:
    args = sweep_args.parse_args(
        ["--smoke", "--configs", "push", "push-vr", "vllm-push-vr", "--rates", "2"]
    )
    assert args.configs == ["push", "push-vr", "vllm-push-vr"]
    assert [p.name for p in sweep_args.make_plan(args).points()] == ["in256-r2"]
    with pytest.raises(SystemExit):  # argparse: not a configuration
        sweep_args.parse_args(["--configs", "push-vllm-router"])


def test_a_point_is_ok_only_when_every_request_completed(tmp_path: Path) -> None:
    plan = SweepPlan((128,), (2.0,), point_s=1.0, min_prompts=12)
    point = Point(128, 2.0)
    partial = sweep_points.point_record("push", point, plan, _bench(12, 50.0, failed=2))
    assert not partial["ok"] and partial["reason"] == "10/12 requests completed"
    assert partial["errors"] == ["boom"]
    sweep_points.write_point(tmp_path, partial)
    assert not sweep_points.is_done(tmp_path, "push", point)  # a resumed sweep tries again
    whole = sweep_points.point_record("push", point, plan, _bench(12, 50.0))
    sweep_points.write_point(tmp_path, whole)
    assert sweep_points.is_done(tmp_path, "push", point)
    none = sweep_points.point_record("push", point, plan, None, "vllm bench serve hung")
    assert not none["ok"] and none["metrics"] == {} and none["reason"].endswith("hung")


def _fake_sweep(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ttft: dict[str, float]
) -> list[tuple[str, str]]:
    """Run sweep.main with stacks and points faked; returns the points run, in order."""
    ran: list[tuple[str, str]] = []

    class FakeStack:
        url = "http://127.0.0.1:1"

        def stop(self, timeout_s: float = 0) -> None: ...
        def ports(self) -> dict[str, int]:
            return {}

        def group_leaders(self) -> list[int]:
            return []

    def fake_start(name: str, setup: sweep_setup.Setup, cfg_dir: Path, log: Any) -> FakeStack:
        cfg_dir.mkdir(parents=True, exist_ok=True)
        return FakeStack()

    def fake_point(
        name: str,
        setup: sweep_setup.Setup,
        stack: Any,
        point: Point,
        limit_s: float,
        budget_cut: bool = False,
    ) -> tuple[dict[str, Any], RunFailure | None]:
        ran.append((name, point.name))
        n = setup.plan.num_prompts(point)
        record = sweep_points.point_record(name, point, setup.plan, _bench(n, ttft[name]))
        sweep_points.write_point(setup.run_dir, record)
        return record, None

    monkeypatch.setattr(sweep_run, "_start", fake_start)
    monkeypatch.setattr(sweep_run, "_warm_up", lambda *a: None)
    monkeypatch.setattr(trace_slices, "wait_quiet", lambda *a, **k: {})
    monkeypatch.setattr(sweep_run, "run_point", fake_point)
    monkeypatch.setattr(sweep, "resolve_model", lambda name: (tmp_path / name, {}))
    monkeypatch.setattr(plots, "write_figures", lambda run_dir, data, png=True: [])  # tested below
    return ran


def test_a_resumed_sweep_runs_only_the_points_without_results(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ran = _fake_sweep(tmp_path, monkeypatch, {"single": 20.0, "push": 30.0})
    args = ["--smoke", "--lengths", "64", "256", "--run-dir", str(tmp_path / "run")]
    assert sweep.main(args) == 0
    assert len(ran) == 8 and ran[0] == ("single", "in64-r2")
    data = json.loads((tmp_path / "run" / "sweep.json").read_text())
    assert len(data["points"]) == 8 and data["plan"]["lengths"] == [64, 256]
    report = (tmp_path / "run" / "report.md").read_text()
    assert "| 64 | 2 | push | 12/12 | 30.0 | 45.0 | 10.0 |" in report  # gap to single
    (tmp_path / "run" / "push" / "in256-r4.json").unlink()
    ran.clear()
    assert sweep.main(args) == 0
    assert ran == [("push", "in256-r4")]


def test_each_stack_publishes_its_points_and_the_png_is_drawn_once_at_the_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_sweep(tmp_path, monkeypatch, {"single": 20.0, "push": 30.0})
    drawn: list[tuple[int, bool]] = []

    def figures(run_dir: Path, data: dict[str, Any], png: bool = True) -> list[str]:
        drawn.append((len(data["points"]), png))
        return []

    monkeypatch.setattr(plots, "write_figures", figures)
    assert sweep.main(["--smoke", "--run-dir", str(tmp_path / "run")]) == 0
    assert drawn == [(2, False), (4, True)]  # after single's 2 points; at the end, all 4


def test_interleave_runs_each_point_on_every_stack_back_to_back_alternating_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ran = _fake_sweep(tmp_path, monkeypatch, {"push-ft": 30.0, "push-ft-notrace": 29.0})
    configs = ["--configs", "push-ft", "push-ft-notrace"]
    lengths = ["--lengths", "64", "256"]
    args = ["--smoke", *configs, *lengths, "--interleave", "--run-dir", str(tmp_path / "run")]
    assert sweep.main(args) == 0
    a, b = "push-ft", "push-ft-notrace"
    assert ran == [
        (a, "in64-r2"),
        (b, "in64-r2"),
        (b, "in64-r4"),
        (a, "in64-r4"),
        (a, "in256-r2"),
        (b, "in256-r2"),
        (b, "in256-r4"),
        (a, "in256-r4"),
    ]
    data = json.loads((tmp_path / "run" / "sweep.json").read_text())
    assert data["interleaved"] is True
    report = (tmp_path / "run" / "report.md").read_text()
    assert "- push-ft, 64 tokens, 2 req/s: TTFT p50 30.0 / 29.0 ms (+3.4%)" in report


def test_the_sweep_stops_starting_points_at_its_time_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ran = _fake_sweep(tmp_path, monkeypatch, {"single": 20.0, "push": 30.0})
    clock = iter(range(0, 10_000, 10))
    monkeypatch.setattr(sweep_run, "now", lambda: float(next(clock)))
    # 2 minutes: the first stack starts, and its points each take 10 s of the fake clock
    # while one needs about 26 s (arrivals + 20 s): some run, the rest are left.
    code = sweep.main(["--smoke", "--run-dir", str(tmp_path / "run"), "--max-minutes", "2"])
    assert code == 1  # not every point done
    assert 0 < len(ran) < 8
    left = [p for p in sweep_args.make_plan(sweep_args.parse_args(["--smoke"])).points()]
    assert not all(sweep_points.is_done(tmp_path / "run", "push", p) for p in left)


@pytest.mark.parametrize("budget_cut", [False, True])
def test_a_run_killed_at_the_sweeps_time_budget_is_cut_not_hung(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, budget_cut: bool
) -> None:
    def killed(cmd: Any, log_path: Path, limit_s: float, zygote: Any = None) -> RunFailure:
        return RunFailure(f"vllm bench serve hung: still running after {limit_s:.0f} s", True)

    monkeypatch.setattr(sweep_run, "run_bench_serve", killed)
    monkeypatch.setattr(trace_slices, "wait_quiet", lambda *a, **k: {})
    plan = sweep_args.make_plan(sweep_args.parse_args(["--smoke"]))
    setup = sweep_setup.Setup(plan, tmp_path / "m", (), False, tmp_path / "run", 0.0)
    stack: Any = type("S", (), {"url": "http://127.0.0.1:1"})()
    point = next(iter(plan.points()))
    record, failure = sweep_run.run_point("push", setup, stack, point, 31.0, budget_cut)
    assert failure is not None and failure.hung is not budget_cut
    cut = "cut after 31 s by the sweep's --max-minutes"
    assert (cut in record["reason"]) is budget_cut, record["reason"]


def test_a_slice_is_whole_lines_written_between_two_marks(tmp_path: Path) -> None:
    src = tmp_path / "stack"
    src.mkdir()
    f = src / "traces-pushkv-router-1.jsonl"
    f.write_text('{"a": 1}\n')
    before = trace_slices.sizes(src)
    f.write_text('{"a": 1}\n{"b": 2}\n{"c": ')  # the last line still being written
    n = trace_slices.copy_slice(src, before, trace_slices.sizes(src), tmp_path / "point")
    assert n == 1
    assert (tmp_path / "point" / f.name).read_text() == '{"b": 2}\n'
    assert trace_slices.wait_quiet(src, quiet_s=0.3, timeout_s=2.0) == trace_slices.sizes(src)


def test_decomposition_takes_each_segments_median_over_a_points_requests(tmp_path: Path) -> None:
    dest = tmp_path / "point"
    shutil.copytree(FIXTURES / "gen-push", dest)
    dec = trace_slices.decomposition(dest)
    assert dec["requests"] > 0 and dec["mode"] == "push"
    assert Seg.WRITE.value in dec["segments_ms"] and Seg.D_STEP.value in dec["segments_ms"]
    assert all(v >= 0 for v in dec["segments_ms"].values())
    assert trace_slices.decomposition(tmp_path / "nothing-here") == {}


def test_rerender_recomputes_decompositions_from_the_points_traces(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sweep run before a change of the critical-path model gets the new one's
    decompositions (and report) without running a point again."""
    monkeypatch.setattr(plots, "write_figures", lambda run_dir, data, png=True: [])  # tested below
    plan = SweepPlan((128,), (1.0,), point_s=1.0, min_prompts=4)
    (point,) = plan.points()
    sweep_points.write_point(
        tmp_path, sweep_points.point_record("push-ft", point, plan, _bench(4, 70.0))
    )
    shutil.copytree(FIXTURES / "real-push-ft", tmp_path / "push-ft" / point.name)
    meta = {"argv": ["pushkv", "bench", "--sweep"], "git_commit": "abc", "configs": ["push-ft"]}
    sweep_points.write_sweep(tmp_path, meta, [])
    assert sweep.main(["--rerender", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "sweep.json").read_text())
    (rec,) = data["points"]
    assert rec["decomposition"]["requests"] == 6
    assert Seg.P_ANSWER.value in rec["decomposition"]["segments_ms"]
    assert data["git_commit"] == "abc" and data["rerendered_at"]
    assert "re-rendered at commit" in (tmp_path / "report.md").read_text()


def _records() -> list[dict[str, Any]]:
    plan = SweepPlan((128, 512), (1.0, 2.0), point_s=1.0, min_prompts=4)
    out = []
    for config, base in (("single", 10.0), ("push", 25.0)):
        for p in plan.points():
            rec = sweep_points.point_record(config, p, plan, _bench(4, base * p.rate))
            if config == "push":
                rec["decomposition"] = {
                    "requests": 4,
                    "mode": "push",
                    "ttft_ms": base,
                    "segments_ms": {Seg.P_PREFILL.value: 11.0, Seg.WRITE.value: 1.7},
                }
            out.append(rec)
    return out


def test_the_report_shows_the_gap_to_single_and_each_points_decomposition() -> None:
    text = sweep_report.markdown({"configs": ["single", "push"], "points": _records()})
    assert "| 512 | 2 | push | 4/4 | 50.0 | 75.0 | 30.0 |" in text
    assert (
        "### 128 tokens in" in text
        and "| req/s | config | traced | TTFT p50 ms | P prefill |" in text
    )
    assert "8 of 8 points completed every request" in text
    assert "Tracing's cost" not in text  # no push-notrace in this sweep
    notrace = [dict(r, config="push-notrace") for r in _records() if r["config"] == "push"]
    for r in notrace:
        r["metrics"] = {**r["metrics"], "median_ttft_ms": r["metrics"]["median_ttft_ms"] / 1.25}
    text = sweep_report.markdown(
        {"configs": ["push", "push-notrace"], "points": _records() + notrace}
    )
    assert "- push, 128 tokens, 1 req/s: TTFT p50 25.0 / 20.0 ms (+25.0%)" in text


def test_the_figure_has_a_panel_per_length_and_a_line_per_configuration() -> None:
    df = sweeps.points_frame({"a": {"points": _records()}})
    fig = sweeps.figure(df)
    titles = [a.text for a in fig.layout.annotations]
    assert titles == ["128 tokens in", "512 tokens in"]
    assert [t.name for t in fig.data if t.showlegend] == ["single", "push"]
    ordered = sweeps.points_frame(
        {"a": {"points": _records()[::-1], "configs": ["single", "push"]}}
    )
    assert list(dict.fromkeys(ordered["config"])) == ["single", "push"]  # the legend's order
    assert len(fig.data) == 2 * 2 * len(sweeps.ROWS)  # configs x lengths x rows
    two = sweeps.figure(
        sweeps.points_frame({"a": {"points": _records()}, "b": {"points": _records()}})
    )
    assert {t.line.dash for t in two.data} == {"solid", "dash"}  # one dash style per run


def test_figures_are_written_as_html_and_png_where_kaleido_works(tmp_path: Path) -> None:
    lines = plots.write_figures(tmp_path, {"points": _records(), "plan": {"output_len": 32}})
    assert (tmp_path / plots.HTML).stat().st_size > 100_000  # plotly.js inside: opens offline
    try:
        import kaleido  # noqa: F401
    except ImportError:
        assert any(line.startswith("PNG skipped") for line in lines)
        return
    assert (tmp_path / plots.PNG).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", lines


def test_sweeps_are_found_by_their_sweep_json(tmp_path: Path) -> None:
    for name in ("runs/sweep-a", "runs/sweep-b", "runs/bench-c"):
        (tmp_path / name / "push").mkdir(parents=True)
    for name in ("sweep-a", "sweep-b"):
        sweep_points.write_sweep(tmp_path / "runs" / name, {}, _records())
    found = sweeps.find_sweeps(tmp_path / "runs")
    assert sorted(p.name for p in found) == ["sweep-a", "sweep-b"]
    assert len(sweeps.load_sweep(found[0])["points"]) == 8


def test_gpus_put_p_d_and_single_each_on_their_own_devices(tmp_path: Path) -> None:
    """``--gpus 0 1``: P sees GPU 0, D GPU 1, the single instance P's, each with CUDA graphs
    (what users run on a GPU); without it the environment is left alone (every server sees
    every GPU) and vLLM's CPU build runs eager."""
    args = sweep_args.parse_args(["--gpus", "0", "1"])
    setup = sweep_setup.Setup(
        sweep_args.make_plan(args), tmp_path / "m", (), False, tmp_path, 0.0, gpus=tuple(args.gpus)
    )
    pair = sweep_run._make("push", setup, tmp_path / "push")
    assert pair.prefill.env["CUDA_VISIBLE_DEVICES"] == "0"  # type: ignore[attr-defined]
    assert pair.decode.env["CUDA_VISIBLE_DEVICES"] == "1"  # type: ignore[attr-defined]
    assert pair.decode.kv_transfer_config["kv_buffer_device"] == "cuda"  # type: ignore[attr-defined]
    single = sweep_run._make(sweep_run.SINGLE, setup, tmp_path / "single")
    assert single.server.env["CUDA_VISIBLE_DEVICES"] == "0"  # type: ignore[attr-defined]
    for server in (pair.prefill, pair.decode, single.server):  # type: ignore[attr-defined]
        assert "--enforce-eager" not in server.command()
    plain = sweep_run._make(
        "push",
        sweep_setup.Setup(setup.plan, setup.model, (), False, tmp_path, 0.0),
        tmp_path / "p2",
    )
    assert "CUDA_VISIBLE_DEVICES" not in plain.prefill.env  # type: ignore[attr-defined]
    assert plain.prefill.kv_transfer_config["kv_buffer_device"] == "cpu"  # type: ignore[attr-defined]
    assert "--enforce-eager" in plain.prefill.command()  # type: ignore[attr-defined]


def test_dtype_auto_is_float32_only_on_a_cpu_without_native_bf16(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On an AVX2-only CPU vLLM's bf16 GEMMs crawl (python -m bench.cpu_dtype), so the sweep
    runs float32 there, and sizes each server's KV cache for 4-byte KV."""
    assert sweep_setup.cpu_has_native_bf16("flags : fpu avx2 avx512f avx512_bf16")
    assert sweep_setup.cpu_has_native_bf16("flags : fpu avx2 amx_bf16 amx_tile")
    assert not sweep_setup.cpu_has_native_bf16("flags : fpu sse avx2 fma")
    monkeypatch.setattr(sweep_setup, "cpu_has_native_bf16", lambda: False)
    assert sweep_setup.resolve_dtype("auto", None) == "float32"
    assert sweep_setup.resolve_dtype("auto", ("0", "1")) == "bfloat16"  # a GPU host
    assert sweep_setup.resolve_dtype("bfloat16", None) == "bfloat16"
    monkeypatch.setattr(sweep_setup, "cpu_has_native_bf16", lambda: True)
    assert sweep_setup.resolve_dtype("auto", None) == "bfloat16"
    plan = sweep_args.make_plan(sweep_args.parse_args(["--lengths", "2048"]))
    geometry = {
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "hidden_size": 256,
    }
    bf16, fp32 = (sweep_setup.server_args(plan, geometry, None, d) for d in ("bfloat16", "float32"))
    size = {
        a: int(x[x.index("--kv-cache-memory-bytes") + 1]) for a, x in (("b", bf16), ("f", fp32))
    }
    assert size["f"] == 2 * size["b"]
    assert fp32[fp32.index("--dtype") + 1] == "float32"


def test_an_mla_models_kv_cache_is_sized_by_its_latent() -> None:
    """DeepSeek-V3 caches one latent of 576 per layer, not K and V of its 16 heads: sized as
    heads, a TP-8 rank's KV for 16 requests of 2144 tokens would be 60 GB, not 2.4 GB."""
    plan = sweep_args.make_plan(sweep_args.parse_args(["--lengths", "2048"]))
    config = {
        "model_type": "deepseek_v3",
        "num_hidden_layers": 61,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "hidden_size": 7168,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
    }
    args = sweep_setup.server_args(plan, config, None)
    kv = int(args[args.index("--kv-cache-memory-bytes") + 1])
    assert kv == 61 * 576 * 2 * plan.max_model_len() * sweep_setup.KV_ROOM_REQUESTS


def test_rounds_pair_each_traced_configuration_with_its_twin_round_by_round(
    tmp_path: Path,
) -> None:
    """Round i of push-ft pairs with round i of push-ft-notrace (one drifting box): the
    change is taken within each round, then its median and range over the rounds."""
    plan = SweepPlan((128,), (1.0,), point_s=1.0, min_prompts=4)
    (point,) = plan.points()
    dirs = []
    for i, (on, off) in enumerate(((30.0, 29.0), (60.0, 60.0), (20.0, 19.0))):
        d = tmp_path / f"r{i}"
        d.mkdir()
        recs = [
            sweep_points.point_record(c, point, plan, _bench(4, ttft))
            for c, ttft in (("single", 25.0), ("push-ft", on), ("push-ft-notrace", off))
        ]
        configs = ["single", "push-ft", "push-ft-notrace"]
        meta = {"configs": configs, "argv": ["pushkv"], "interleaved": True}
        sweep_points.write_sweep(d, meta, recs)
        dirs.append(d)
    out = tmp_path / "rounds.md"
    assert sweep.main(["--rounds", *map(str, dirs), "--rounds-out", str(out)]) == 0
    text = out.read_text()
    # 30/29 - 1 = +3.4 %, 0 %, 20/19 - 1 = +5.3 %: median +3.4 %, though the medians of the
    # raw TTFTs (30 vs 29) would say the same only by luck.
    assert "| 128 @ 1 | +3.4% [+0.0% to +5.3%] | +0.0% [+0.0% to +0.0%] |" in text
    assert "| 128 @ 1 | push-ft | 30.0 [20.0 to 60.0] |" in text
    assert text.count("(interleaved)") == 3
    # push-ft - single per round: 5, 35, -5 ms.
    assert "| 128 @ 1 | 5.0 [-5.0 to 35.0] | 4.0 [-6.0 to 35.0] |" in text


def test_rounds_pair_requests_by_index_across_configurations(tmp_path: Path) -> None:
    """Request i of two configurations had the same prompt and arrival offset: TTFT and
    TPOT (from latency, TTFT and output length) are compared request by request."""
    point = Point(128, 2.0)
    d = tmp_path / "r1"
    for config, ttfts in (
        ("push-ft", [0.100, 0.110, 0.090, 0.200]),
        ("push-ft-notrace", [0.100, 0.100, 0.100, 0.100]),
    ):
        f = sweep_points.bench_file(d, config, point)
        f.parent.mkdir(parents=True, exist_ok=True)
        # 9 output tokens, 8 ms apart: TPOT 8 ms for every request.
        body = {"ttfts": ttfts, "latencies": [t + 0.064 for t in ttfts], "output_lens": [9] * 4}
        f.write_text(json.dumps(body))
    pairs = sweep_rounds.request_pairs([d], "push-ft", "push-ft-notrace", point)
    assert [round(a[0] / b[0] - 1, 3) for a, b in pairs] == [0.0, 0.1, -0.1, 1.0]
    assert all(abs(a[1] - 8.0) < 1e-9 and abs(b[1] - 8.0) < 1e-9 for a, b in pairs)
    failed = {"ttfts": [0.1, 0.0], "latencies": [0.2, 0.0], "output_lens": [9, 0]}
    assert sweep_rounds.per_request(failed) == [(100.0, 12.5), None]

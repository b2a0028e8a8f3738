"""The comparison view's sweep figure (dashboard/views/sweep_compare.py), through AppTest."""

from __future__ import annotations

import shutil
from pathlib import Path

from connector.tools.bench import sweep_points
from connector.tools.bench.sweep_points import SweepPlan
from dashboard.views import sweep_compare
from tests.fixtures.traces import HERE
from tests.unit.dashboard.test_app import chart, run_app


def _sweep(folder: Path, ttft: float) -> Path:
    plan = SweepPlan((128, 512), (1.0, 2.0), point_s=1.0, min_prompts=4)
    records = []
    for config in ("single", "push"):
        for p in plan.points():
            bench = {"completed": 4, "median_ttft_ms": ttft * p.rate, "mean_tpot_ms": 8.0}
            records.append(sweep_points.point_record(config, p, plan, bench))
    folder.mkdir(parents=True)
    sweep_points.write_sweep(folder, {}, records)
    return folder


def test_compare_view_draws_the_sweep_figure_of_two_runs(tmp_path: Path) -> None:
    a, b = _sweep(tmp_path / "sweep-a", 20.0), _sweep(tmp_path / "sweep-b", 30.0)
    point = a / "push" / "in128-r1"  # a point's traces: the sweep holding them is offered
    shutil.copytree(HERE / "gen-push", point)
    at = run_app(run=str(point), b_run=str(HERE / "gen-pull"), view="compare", sweeps=f"{b}")
    fig = chart(at, "sweep_figure")
    assert {tr["name"] for tr in fig["data"]} == {"single", "push"}  # one run: plain names
    assert str(a) in at.multiselect(key="sweeps").options
    at.multiselect(key="sweeps").set_value([str(a), str(b)]).run()
    assert not at.exception
    fig = chart(at, "sweep_figure")
    names = {tr["name"] for tr in fig["data"]}
    assert names == {f"{c} ({r})" for c in ("single", "push") for r in ("sweep-a", "sweep-b")}
    assert at.query_params["sweeps"] == f"{a};{b}"


def test_the_sweeps_offered_hold_the_compared_runs_or_lie_under_runs(tmp_path: Path) -> None:
    a = _sweep(tmp_path / "x" / "sweep-a", 20.0)
    b = _sweep(tmp_path / "runs" / "sweep-b", 30.0)
    point = a / "push" / "in128-r1"
    point.mkdir(parents=True)
    got = sweep_compare.candidates([str(point), str(HERE / "gen-pull")], str(tmp_path / "runs"))
    assert got == [str(a), str(b)]
    assert sweep_compare.candidates([str(HERE / "gen-pull")], str(tmp_path / "none")) == []

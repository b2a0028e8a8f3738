"""The 1 x 2 smoke sweep (``pushkv bench --sweep --smoke``, also ``make bench-smoke``): real
vLLM servers, the single instance and pushkv, one input length x two request rates on the
tiny model. Checks that every point completed all its requests, that each push point's
traces were cut out and decomposed, and that the figures were written.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from connector.tools.bench import plots, sweep_args, sweep_points
from connector.tools.bench.single import SINGLE

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

SMOKE_LIMIT_S = 540.0


def test_smoke_sweep_completes_every_point_and_draws_its_figure(tmp_path: Path) -> None:
    run_dir = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "connector.cli", "bench", "--sweep", "--smoke"]
    t0 = time.monotonic()
    done = subprocess.run(
        [*cmd, "--run-dir", str(run_dir)],
        env={**os.environ, "COLUMNS": "120"},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=SMOKE_LIMIT_S,
    )
    print(f"\n[sweep] smoke sweep took {time.monotonic() - t0:.0f} s\n{done.stdout[-3000:]}")
    assert done.returncode == 0, f"exit {done.returncode}:\n{done.stdout[-4000:]}{done.stderr}"
    data = json.loads((run_dir / sweep_points.SWEEP_FILE).read_text())
    points = {(p["config"], p["point"]): p for p in data["points"]}
    plan = sweep_args.make_plan(sweep_args.parse_args(["--smoke"]))
    for config in sweep_args.SMOKE_CONFIGS:
        for point in plan.points():
            p = points[config, point.name]
            assert p["ok"] and p["completed"] == p["num_prompts"] == plan.num_prompts(point), p
            assert p["metrics"]["median_ttft_ms"] > 0 and p["metrics"]["mean_tpot_ms"] > 0
            dec = p["decomposition"]
            if config == SINGLE:
                assert dec == {}, "a plain vLLM instance writes no pushkv spans"
                continue
            # every request of the point traced, and only the point's own requests
            assert dec["requests"] == p["num_prompts"], dec
            assert dec["mode"] == "push" and "WRITE" in dec["segments_ms"], dec
            traces = sweep_points.traces_dir(run_dir, config, point)
            assert list(traces.glob("traces-*.jsonl")), f"no traces in {traces}"
    assert (run_dir / plots.HTML).stat().st_size > 100_000
    if importlib.util.find_spec("kaleido") is not None:
        assert (run_dir / plots.PNG).read_bytes()[:4] == b"\x89PNG"
    report = (run_dir / "report.md").read_text()
    n = len(sweep_args.SMOKE_CONFIGS) * len(plan.points())
    assert f"{n} of {n} points completed every request" in report

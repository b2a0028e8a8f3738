"""The waterfall figure, the source defaults and the launch command."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from dashboard.launch import command
from dashboard.state import (
    ENV_JAEGER_URL,
    ENV_RUN_DIR,
    JAEGER,
    RUN,
    cli_run_dir,
    default_source,
    trace_id_of,
)
from dashboard.views.waterfall import PATH_ROW, waterfall_figure
from telemetry.critical_path import critical_path
from telemetry.perfetto import chrome_trace
from telemetry.traces import read_run
from tests.fixtures.traces import run_dirs, run_ids


@pytest.mark.parametrize("run_dir", run_dirs(), ids=run_ids())
def test_waterfall_has_a_row_per_span_and_highlights_the_path(run_dir: Path) -> None:
    for t in read_run(run_dir).traces:
        path = critical_path(t)
        fig = json.loads(waterfall_figure(t, path).to_json())
        span_bars = [
            tr for tr in fig["data"] if tr["type"] == "bar" and tr["name"] != "critical path"
        ]
        ids = [i for tr in span_bars for i in tr["customdata"]]
        assert sorted(ids) == sorted(sp.span_id for sp in t.spans)
        rows = [y for tr in span_bars for y in tr["y"]]
        assert len(set(rows)) == len(rows), "one row per span"
        opaque = {
            i
            for tr in span_bars
            for i, o in zip(tr["customdata"], tr["marker"]["opacity"], strict=True)
            if o == 1.0
        }
        if path is None:  # not a request (a probe's spans): drawn, nothing highlighted
            assert not opaque and all(tr["name"] != "critical path" for tr in fig["data"])
            continue
        assert opaque == {sp.span_id for sp in t.spans if path.on_path(sp)}
        (crit,) = [tr for tr in fig["data"] if tr["name"] == "critical path"]
        assert set(crit["y"]) == {PATH_ROW} and len(crit["x"]) == len(path.segments)
        assert sum(crit["x"]) == pytest.approx(sum(abs(s.duration_ns) for s in path.segments) / 1e6)


def test_default_source_precedence(tmp_path: Path) -> None:
    env = {ENV_RUN_DIR: "env-run", ENV_JAEGER_URL: "http://j:16686"}
    assert default_source({"run": "q-run"}, env, []).location == "q-run"
    assert default_source({"jaeger": "http://q:1"}, env, []).kind == JAEGER
    assert default_source({}, env, ["app.py", "--run-dir", "cli-run"]).location == "cli-run"
    assert default_source({}, env, []).location == "env-run"
    only_jaeger = default_source({}, {ENV_JAEGER_URL: "http://j:16686"}, [])
    assert (only_jaeger.kind, only_jaeger.location) == (JAEGER, "http://j:16686")
    assert default_source({"b_run": "other"}, {}, [], prefix="b_").location == "other"
    assert default_source({}, {}, []).kind == RUN


def test_cli_run_dir_forms() -> None:
    assert cli_run_dir(["--run-dir", "a"]) == "a" and cli_run_dir(["--run-dir=b"]) == "b"
    assert cli_run_dir(["-q", "tests"]) is None


def test_launch_command_serves_the_run_on_loopback(tmp_path: Path) -> None:
    cmd = command(tmp_path, port=8599)
    assert cmd[:4] == [sys.executable, "-m", "streamlit", "run"]
    assert Path(cmd[4]).name == "app.py" and Path(cmd[4]).is_file()
    opts = dict(zip(cmd[5:-3:2], cmd[6:-3:2], strict=True))
    assert opts["--server.address"] == "127.0.0.1" and opts["--server.port"] == "8599"
    assert opts["--server.headless"] == "true"
    assert cmd[-3:] == ["--", "--run-dir", str(tmp_path.resolve())]


def test_trace_export_is_chrome_trace_json() -> None:
    t = read_run(run_dirs()[0]).traces[0]
    doc = chrome_trace([t], {t.trace_id: critical_path(t)})
    assert doc["displayTimeUnit"] == "ms" and all(
        {"ph", "pid"} <= set(e) for e in doc["traceEvents"]
    )
    json.dumps(doc)


def test_waterfall_leaves_room_for_whole_span_labels() -> None:
    t = next(
        t
        for d in run_dirs()
        for t in read_run(d).traces
        if any(sp.name.endswith("rendezvous_wait") for sp in t.spans)
    )
    fig = json.loads(waterfall_figure(t, critical_path(t)).to_json())
    labels = [y for tr in fig["data"] if tr["type"] == "bar" for y in tr["y"]]
    longest = max(len(label) for label in labels)
    assert any("rendezvous_wait" in label for label in labels)
    assert fig["layout"]["yaxis"]["automargin"] is True
    assert fig["layout"]["margin"]["l"] >= 7 * longest, "labels would be clipped"


def test_no_deploy_button_however_the_dashboard_is_started(tmp_path: Path) -> None:
    import tomllib

    cmd = command(tmp_path)
    assert cmd[cmd.index("--client.toolbarMode") + 1] == "minimal"
    root = Path(__file__).resolve().parents[3]
    cfg = tomllib.loads((root / ".streamlit" / "config.toml").read_text())
    assert cfg["client"]["toolbarMode"] == "minimal"
    assert '"--client.toolbarMode", "minimal"' in (root / "Dockerfile").read_text()


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("4bf92f3577b34da6a3ce929d0e0e4736", "4bf92f3577b34da6a3ce929d0e0e4736"),
        (
            " 00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01\n",
            "4bf92f3577b34da6a3ce929d0e0e4736",
        ),
        (
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00",
            "4bf92f3577b34da6a3ce929d0e0e4736",
        ),
        ("0" * 32, None),
        ("4bf92f3577b34da6a3ce929d0e0e473", None),
        ("cmpl-00042", None),
        ("", None),
        (None, None),
    ],
)
def test_trace_id_of_takes_an_id_or_a_traceresponse(text: str | None, want: str | None) -> None:
    assert trace_id_of(text) == want

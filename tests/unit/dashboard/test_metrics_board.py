"""compose.yaml's `metrics` profile (Prometheus, Grafana: pinned, health-checked, loopback
only) and the Grafana board: valid JSON whose PromQL names only metrics that exist, those of
telemetry/schema.py and vLLM's own."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from telemetry.schema import EXEMPLAR_TRACE_ID, METRICS, Metric
from tests.unit.dashboard.test_compose import COMPOSE, ROOT, _compose_cmd

BOARD = ROOT / "compose" / "grafana" / "dashboards" / "pushkv.json"
PROMETHEUS = ROOT / "compose" / "prometheus.yml"
# A metric name in PromQL: a word with a colon or an underscore that is not a function,
# a label, a keyword or a Grafana variable.
_NAME = re.compile(r"(?<![\w:$\"{=])([a-zA-Z_:][a-zA-Z0-9_:]*)(?=\s*[\[{)]|\s*$)")
_NOT_METRICS = {"le", "by", "without", "on", "ignoring", "group_left", "group_right"}


def _exprs() -> list[str]:
    board = json.loads(BOARD.read_text())
    return [t["expr"] for p in board["panels"] for t in p.get("targets", [])]


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (label lists of by() are skipped)."""
    expr = re.sub(r"\b(by|without)\s*\([^)]*\)", "", expr)  # grouping labels
    expr = re.sub(r"\{[^}]*\}", "{}", expr)  # matchers' labels and values
    expr = re.sub(r"\[[^\]]*\]", "[]", expr)  # ranges
    return {m for m in _NAME.findall(expr) if m not in _NOT_METRICS and not m.isdigit()}


def _exposed() -> set[str]:
    """Every series name pushkv's metrics are exposed under."""
    out: set[str] = set()
    for metric, (kind, _, _) in METRICS.items():
        name = metric.value
        if kind == "histogram":
            out |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
        else:
            out.add(name)
    return out


def _vllm_names() -> set[str]:
    """vLLM's own metric names, read from its source (not imported: cheap)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vLLM is not installed")
    loggers = Path(next(iter(spec.submodule_search_locations))) / "v1" / "metrics" / "loggers.py"
    names = set(re.findall(r'name="(vllm:[a-z0-9_:]+)"', loggers.read_text()))
    return names | {f"{n}_{s}" for n in names for s in ("bucket", "sum", "count", "total")}


def test_metric_names_of_the_extractor() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (le, first) (rate(vllm:pushkv_x_bucket{a="b"}[5m])))'
        " / sum(pushkv_router_y) + max by (job) (vllm:num_requests_running)"
    )
    assert metric_names(expr) == {
        "vllm:pushkv_x_bucket",
        "pushkv_router_y",
        "vllm:num_requests_running",
    }


def test_every_query_of_the_board_names_metrics_that_exist() -> None:
    exprs = _exprs()
    assert len(exprs) >= 20
    known = _exposed() | _vllm_names()
    unknown = {(n, e) for e in exprs for n in metric_names(e) if n not in known}
    assert not unknown, f"the board queries metrics nobody exposes: {sorted(unknown)}"
    used = {n for e in exprs for n in metric_names(e)}
    pushkv = {n for n in used if "pushkv" in n}
    assert any(n.startswith("vllm:pushkv_") for n in pushkv) and any(
        n.startswith("pushkv_router_") for n in pushkv
    )
    for e in exprs:
        assert e.count("(") == e.count(")") and e.count("{") == e.count("}"), e


def test_the_board_is_a_provisionable_grafana_dashboard() -> None:
    board = json.loads(BOARD.read_text())
    assert board["uid"] and board["title"] and board["panels"]
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    for p in board["panels"]:
        assert {"x", "y", "w", "h"} <= set(p["gridPos"])
        for t in p.get("targets", []):
            assert t["datasource"]["uid"] == "prometheus"
    urls = [link["url"] for link in board["links"]]
    assert any(":8501" in u for u in urls) and any(":16686" in u for u in urls)
    provisioning = ROOT / "compose" / "grafana" / "provisioning"
    ds = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())
    assert ds["datasources"][0]["uid"] == "prometheus"
    assert ds["datasources"][0]["url"] == "http://127.0.0.1:9090"


def test_latency_panels_show_exemplars_that_link_to_the_request() -> None:
    board = json.loads(BOARD.read_text())
    latency = (Metric.ROUTER_TTFT.value, Metric.ROUTER_E2E.value)
    with_exemplars = {
        m
        for p in board["panels"]
        for t in p.get("targets", [])
        if t.get("exemplar")
        for m in latency
        if m in t["expr"]
    }
    assert with_exemplars == set(latency), "TTFT and end-to-end panels show exemplars"
    provisioning = ROOT / "compose" / "grafana" / "provisioning" / "datasources"
    (ds,) = yaml.safe_load((provisioning / "prometheus.yml").read_text())["datasources"]
    links = ds["jsonData"]["exemplarTraceIdDestinations"]
    assert {d["name"] for d in links} == {EXEMPLAR_TRACE_ID}, "the router's exemplar label"
    # `$$` survives Grafana's environment expansion of provisioning files as one `$`
    urls = {d["url"] for d in links}
    assert urls == {
        "http://127.0.0.1:8501/?trace=$${__value.raw}",  # dashboard.views.requests' link
        "http://127.0.0.1:16686/trace/$${__value.raw}",
    }
    prom = yaml.safe_load(COMPOSE.read_text())["services"]["prometheus"]
    assert "--enable-feature=exemplar-storage" in prom["command"]


def test_prometheus_scrapes_p_d_and_the_router() -> None:
    cfg = yaml.safe_load(PROMETHEUS.read_text())
    targets = {
        job["job_name"]: [t for sc in job["static_configs"] for t in sc["targets"]]
        for job in cfg["scrape_configs"]
    }
    assert targets == {
        "pushkv-prefill": ["127.0.0.1:8100"],
        "pushkv-decode": ["127.0.0.1:8200"],
        "pushkv-router": ["127.0.0.1:8000"],
    }


def _check_metrics_profile(services: dict) -> None:
    prom, graf = services["prometheus"], services["grafana"]
    for svc in (prom, graf):
        assert svc["profiles"] == ["metrics"]
        assert re.search(r":v?\d+\.\d+\.\d+$", svc["image"]), f"not pinned: {svc['image']}"
        assert svc["healthcheck"]["test"]
        assert svc["network_mode"] == "host" and not svc.get("ports")
    assert "--web.listen-address=127.0.0.1:9090" in prom["command"]
    env = graf["environment"]
    assert env["GF_SERVER_HTTP_ADDR"] == "127.0.0.1"
    assert graf["depends_on"]["prometheus"]["condition"] == "service_healthy"


def test_the_metrics_profile_is_pinned_health_checked_and_on_loopback() -> None:
    _check_metrics_profile(yaml.safe_load(COMPOSE.read_text())["services"])


def test_docker_compose_config_validates_with_the_metrics_profile() -> None:
    cmd = _compose_cmd()
    assert cmd is not None
    out = subprocess.run(
        [*cmd, "-f", str(COMPOSE), "--profile", "metrics", "config", "--format", "json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    services = json.loads(out.stdout)["services"]
    assert {"jaeger", "dashboard", "prometheus", "grafana"} <= set(services)
    _check_metrics_profile(services)


def board_queries(rate_interval: str = "1m") -> list[str]:
    """The board's PromQL as Prometheus gets it (Grafana's variables filled in)."""
    return [e.replace("$__rate_interval", rate_interval) for e in _exprs()]


def _promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.skip("no promtool (Debian's prometheus package; scripts/install.sh installs it)")
    return found


def test_promtool_parses_every_query_and_the_scrape_config(tmp_path: Path) -> None:
    promtool = _promtool()
    rules = {
        "groups": [
            {
                "name": "board",
                "rules": [
                    {"record": f"board:query_{i}", "expr": e} for i, e in enumerate(board_queries())
                ],
            }
        ]
    }
    path = tmp_path / "board-rules.yml"
    path.write_text(yaml.safe_dump(rules))
    checked = subprocess.run(
        [promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    config = subprocess.run(
        [promtool, "check", "config", "--syntax-only", str(PROMETHEUS)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert config.returncode == 0, config.stdout + config.stderr

"""The OpenTelemetry Collector's config (compose/otel-collector.yaml), checked without the
collector (its image is not reachable from CI): every pipeline names defined components, the
tail-sampling policies keep failed and slow requests whole and name attributes spelled in
``telemetry.schema``, the ``${env:...}`` knobs resolve to values of the right type, and
compose.yaml and the Kubernetes ConfigMap both run this same text.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml

from telemetry.schema import Attr

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "compose" / "otel-collector.yaml"
K8S = ROOT / "deploy" / "k8s" / "base" / "otel-collector.yaml"
COMPOSE = ROOT / "compose.yaml"
EXPORT_DELAY_S = 0.5  # telemetry.setup's BatchSpanProcessor schedule delay
ENV_REF = re.compile(r"\$\{env:(\w+)(?::-([^}]*))?\}")
KNOBS = {
    "PUSHKV_TRACE_SAMPLE_PERCENT",
    "PUSHKV_SLOW_TTFT_MS",
    "PUSHKV_SLOW_REQUEST_MS",
    "PUSHKV_TRACE_DECISION_WAIT",
    "PUSHKV_JAEGER_OTLP",
}


def resolve(node: Any, env: Mapping[str, str]) -> Any:
    """The collector's ``${env:NAME:-default}`` expansion: a value that is one reference
    takes the YAML type of what it expands to; a reference inside a string stays a string."""
    if isinstance(node, dict):
        return {k: resolve(v, env) for k, v in node.items()}
    if isinstance(node, list):
        return [resolve(v, env) for v in node]
    if not isinstance(node, str):
        return node

    def sub(m: re.Match[str]) -> str:
        value = env.get(m[1], m[2])
        assert value is not None, f"{m[1]} is unset and has no default"
        return value

    whole = ENV_REF.fullmatch(node)
    return yaml.safe_load(sub(whole)) if whole else ENV_REF.sub(sub, node)


def load(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    return resolve(yaml.safe_load(CONFIG.read_text()), env or {})


def policies(cfg: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {p["type"]: p for p in cfg["processors"]["tail_sampling"]["policies"]}


def duration_s(text: str) -> float:
    units = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m|h)", text)
    assert m, f"not a Go duration: {text!r}"
    return timedelta(seconds=float(m[1]) * units[m[2]]).total_seconds()


def test_every_pipeline_names_defined_components() -> None:
    cfg = load()
    service = cfg["service"]
    assert set(service["extensions"]) <= set(cfg["extensions"])
    for name, pipe in service["pipelines"].items():
        assert name.split("/")[0] == "traces"
        for kind in ("receivers", "processors", "exporters"):
            missing = set(pipe[kind]) - set(cfg[kind])
            assert not missing, f"pipeline {name}: undefined {kind} {missing}"
    (traces,) = service["pipelines"].values()
    # memory_limiter first (it refuses before anything is held), batch after the decision
    assert traces["processors"] == ["memory_limiter", "tail_sampling", "batch"]
    pipes = service["pipelines"].values()
    for kind in ("receivers", "processors", "exporters"):
        unused = set(cfg[kind]) - {c for p in pipes for c in p[kind]}
        assert not unused, f"{kind} defined but not used: {unused}"
    assert set(cfg["extensions"]) == set(service["extensions"])


def test_failed_and_slow_requests_are_kept_whole_and_the_rest_sampled() -> None:
    by_type = policies(load())
    assert by_type["status_code"]["status_code"]["status_codes"] == ["ERROR"]
    reason = by_type["string_attribute"]["string_attribute"]
    assert reason["key"] == Attr.REASON.value and reason["enabled_regex_matching"]
    assert all(re.fullmatch(v, "lease_expired") for v in reason["values"])
    assert not any(re.fullmatch(v, "") for v in reason["values"]), "any reason, not an empty one"
    (slow_ttft,) = by_type["ottl_condition"]["ottl_condition"]["span"]
    # numeric_attribute reads integers only; pushkv.ttft_ms is a float, so OTTL compares it
    assert slow_ttft == f'attributes["{Attr.TTFT_MS.value}"] > 1000'
    assert by_type["latency"]["latency"]["threshold_ms"] == 10_000
    assert by_type["probabilistic"]["probabilistic"]["sampling_percentage"] == 10
    assert set(by_type) == {
        "status_code",
        "string_attribute",
        "ottl_condition",
        "latency",
        "probabilistic",
    }, "policies are ORed: a new one widens what is kept"


def test_every_attribute_a_policy_names_is_in_the_schema() -> None:
    text = CONFIG.read_text()
    named = set(re.findall(r"key:\s*([\w.]+)", text)) | set(
        re.findall(r'attributes\["([^"]+)"\]', text)
    )
    assert named and named <= {a.value for a in Attr}, named - {a.value for a in Attr}


def test_the_knobs_resolve_to_values_of_the_right_type() -> None:
    cfg = load(
        {
            "PUSHKV_TRACE_SAMPLE_PERCENT": "2.5",
            "PUSHKV_SLOW_TTFT_MS": "250",
            "PUSHKV_SLOW_REQUEST_MS": "5000",
            "PUSHKV_TRACE_DECISION_WAIT": "45s",
            "PUSHKV_JAEGER_OTLP": "tracing:4317",
        }
    )
    by_type = policies(cfg)
    assert by_type["probabilistic"]["probabilistic"]["sampling_percentage"] == 2.5
    assert by_type["latency"]["latency"]["threshold_ms"] == 5000
    assert by_type["ottl_condition"]["ottl_condition"]["span"][0].endswith("> 250")
    assert cfg["processors"]["tail_sampling"]["decision_wait"] == "45s"
    assert cfg["exporters"]["otlp"]["endpoint"] == "tracing:4317"
    refs = {m[1] for m in ENV_REF.finditer(CONFIG.read_text())}
    assert refs == KNOBS


def test_decision_wait_covers_a_requests_spans_from_three_processes() -> None:
    tail = load()["processors"]["tail_sampling"]
    wait_s = duration_s(tail["decision_wait"])
    slow_s = policies(load())["latency"]["latency"]["threshold_ms"] / 1000
    # the slowest request the latency policy judges must be whole by then: its root span
    # (the router's, last to end) plus P's and D's export delay
    assert wait_s >= slow_s + 2 * EXPORT_DELAY_S + 1, (wait_s, slow_s)
    assert tail["num_traces"] >= wait_s * tail["expected_new_traces_per_sec"]
    cache = tail["decision_cache"]
    assert cache["sampled_cache_size"] >= tail["num_traces"], "late spans follow the decision"


def _compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def test_compose_puts_the_collector_between_the_processes_and_jaeger() -> None:
    services = _compose()["services"]
    col, jaeger = services["otel-collector"], services["jaeger"]
    image, _, tag = col["image"].partition(":")
    assert image == "otel/opentelemetry-collector-contrib" and re.fullmatch(r"\d+\.\d+\.\d+", tag)
    (mount,) = col["volumes"]
    source, target, mode = mount.split(":")
    assert (ROOT / source).resolve() == CONFIG and mode == "ro"
    assert col["command"] == [f"--config={target}"]
    published = {p.split(":")[1]: p.split(":")[0] for p in col["ports"]}
    assert published.keys() >= {"4317", "4318"}, "OTLP from P, D and the router lands here"
    assert set(published.values()) == {"127.0.0.1"}
    assert not any(p.split(":")[1] in ("4317", "4318") for p in jaeger["ports"]), (
        "Jaeger's OTLP is not published: nothing bypasses the sampler"
    )
    host = load()["exporters"]["otlp"]["endpoint"].split(":")[0]
    assert host == "jaeger" and host in services
    assert col["depends_on"]["jaeger"]["condition"] == "service_healthy"
    assert set(col["environment"]) <= KNOBS


def test_the_kubernetes_collector_runs_the_same_config() -> None:
    docs = [d for d in yaml.safe_load_all(K8S.read_text()) if d]
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap"]
    (deploy,) = [d for d in docs if d["kind"] == "Deployment"]
    assert yaml.safe_load(cm["data"]["config.yaml"]) == yaml.safe_load(CONFIG.read_text())
    (c,) = deploy["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in c["env"]}
    assert set(env) <= KNOBS
    cfg = resolve(yaml.safe_load(cm["data"]["config.yaml"]), env)
    assert cfg["exporters"]["otlp"]["endpoint"] == "pushkv-jaeger:4317"
    assert _compose()["services"]["otel-collector"]["image"] == c["image"], "one pinned version"


@pytest.mark.parametrize("value", ["", "${env:X}", "a ${env:X:-1} b"])
def test_resolve_follows_the_collectors_rules(value: str) -> None:
    if value == "${env:X}":
        with pytest.raises(AssertionError):
            resolve(value, {})
        assert resolve(value, {"X": "12"}) == 12
    else:
        assert resolve(value, {}) == value.replace("${env:X:-1}", "1")

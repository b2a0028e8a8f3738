"""deploy/k8s: every manifest valid against Kubernetes' schemas (``kubernetes-validate``,
no cluster), every kustomization complete, and what P, D and the router are given accepted
by pushkv's own parsers: the connector's ``kv_connector_extra_config`` and the router's flags.

Where ``kubectl kustomize`` or ``kustomize`` runs, the base and each overlay are built and
their output is checked; otherwise each file is checked as written.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from connector.config import parse_config
from connector.router.config import parse_args
from tests.unit.test_otel_collector import resolve

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="the test extra's kubernetes-validate is not installed"
)

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
KUBERNETES = "1.33.0"  # the schema version the manifests are checked against
TREES = sorted(p.parent for p in K8S.rglob("kustomization.yaml"))
SECRET = b"0123456789abcdef-test-secret"


def _kustomize() -> list[str] | None:
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    return None


def _docs(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


def _kustomization(tree: Path) -> dict[str, Any]:
    return yaml.safe_load((tree / "kustomization.yaml").read_text())


def _raw(tree: Path) -> list[dict[str, Any]]:
    return [d for r in _kustomization(tree)["resources"] for d in _docs((tree / r).read_text())]


def build(tree: Path) -> list[dict[str, Any]]:
    """The tree's resources as kustomize renders them; the base's files as written where
    kustomize is missing (the base has no patches), an overlay skipped."""
    cmd = _kustomize()
    if cmd is None:
        if tree.name != "base":
            pytest.skip("neither kustomize nor kubectl is installed to build the overlays")
        return _raw(tree)
    out = subprocess.run([*cmd, str(tree)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return _docs(out.stdout)


def _name(tree: Path) -> str:
    return tree.relative_to(K8S).as_posix()


def _one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def _containers(docs: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet"):
            for c in d["spec"]["template"]["spec"]["containers"]:
                yield d, c


def _expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion of a container's args."""
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), arg)


def _secret_file(workload: dict[str, Any], container: dict[str, Any]) -> str:
    """The path at which ``container`` sees the shared secret (Secret pushkv-auth)."""
    volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
    for mount in container["volumeMounts"]:
        secret = volumes[mount["name"]].get("secret")
        if secret and secret["secretName"] == "pushkv-auth":
            (item,) = [i for i in secret["items"] if i["key"] == "secret"]
            return f"{mount['mountPath']}/{item['path']}"
    raise AssertionError(f"{container['name']} does not mount the Secret pushkv-auth")


def test_every_kustomization_lists_only_what_exists() -> None:
    assert [_name(t) for t in TREES] == ["base", "overlays/2p2d", "overlays/prefill-tp2"]
    for tree in TREES:
        for res in _kustomization(tree)["resources"]:
            path = tree / res
            assert path.is_file() or (path / "kustomization.yaml").is_file(), f"{tree}: {res}"
    listed = set(_kustomization(K8S / "base")["resources"])
    on_disk = {p.name for p in (K8S / "base").glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk, "a manifest in base/ is not in its kustomization, or the reverse"


@pytest.mark.parametrize("tree", TREES, ids=_name)
def test_manifests_are_valid_kubernetes(tree: Path) -> None:
    docs = build(tree)
    assert len(docs) >= 15
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, KUBERNETES, strict=True)
        except kubernetes_validate.ValidationError as exc:
            raise AssertionError(f"{doc['kind']}/{doc['metadata']['name']}: {exc}") from None


def test_the_files_are_valid_as_written() -> None:
    # What a user applying one file with `kubectl apply -f` gets: the same check, no kustomize.
    for doc in _raw(K8S / "base"):
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)


@pytest.mark.parametrize("tree", TREES, ids=_name)
def test_engines_get_a_config_pushkv_accepts(tree: Path, tmp_path: Path) -> None:
    docs = build(tree)
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET)
    for role, name in (("kv_producer", "pushkv-prefill"), ("kv_consumer", "pushkv-decode")):
        sts = _one(docs, "StatefulSet", name)
        (c,) = sts["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e.get("value") for e in c["env"]}
        fields = {
            e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"]
            for e in c["env"]
            if "valueFrom" in e and "fieldRef" in e["valueFrom"]
        }
        assert fields == {"POD_NAME": "metadata.name", "POD_IP": "status.podIP"}
        env |= {"POD_NAME": f"{name}-0", "POD_IP": "10.1.2.3"}
        args = [_expand(a, env) for a in c["args"]]
        ktc = json.loads(args[args.index("--kv-transfer-config") + 1])
        assert ktc["kv_connector"] == "PushConnector" and ktc["kv_role"] == role
        assert ktc["engine_id"] == f"{name}-0"  # unique per pod
        assert (ktc.get("kv_load_failure_policy") == "recompute") == (role == "kv_consumer")
        extra = ktc["kv_connector_extra_config"]
        assert extra["side_channel_host"] == "10.1.2.3"  # the pod's IP, never 0.0.0.0
        assert extra["auth_secret_file"] == _secret_file(sts, c)
        cfg = parse_config({**extra, "auth_secret_file": str(secret)})
        assert cfg.authenticated
        # Each rank's side channel and doorbell port is declared; one GPU per rank.
        tp = int(env["TP_SIZE"])
        ports = {(p["containerPort"], p.get("protocol", "TCP")) for p in c["ports"]}
        for r in range(tp):
            assert {(cfg.side_channel_port + r, "TCP"), (cfg.side_channel_port + r, "UDP")} <= ports
        for bound in ("requests", "limits"):
            assert c["resources"][bound]["nvidia.com/gpu"] == str(tp)
    if tree.name == "prefill-tp2":
        p = _one(docs, "StatefulSet", "pushkv-prefill")["spec"]["template"]["spec"]
        assert {e["name"]: e.get("value") for e in p["containers"][0]["env"]}["TP_SIZE"] == "2"


@pytest.mark.parametrize("tree", TREES, ids=_name)
def test_the_router_knows_every_engine(tree: Path, tmp_path: Path) -> None:
    docs = build(tree)
    router = _one(docs, "Deployment", "pushkv-router")
    (c,) = router["spec"]["template"]["spec"]["containers"]
    assert c["command"] == ["pushkv", "router"]
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET)
    args = [a.replace(_secret_file(router, c), str(secret)) for a in c["args"]]
    cfg = parse_args(args)
    assert cfg.auth_secret == SECRET  # it signs P's coordinates with the engines' secret
    for urls, name in ((cfg.prefill_urls, "pushkv-prefill"), (cfg.decode_urls, "pushkv-decode")):
        sts = _one(docs, "StatefulSet", name)
        want = [f"http://{name}-{i}.{name}:8000" for i in range(sts["spec"]["replicas"])]
        assert list(urls) == want, "one URL per pod, through the headless Service"
        assert _one(docs, "Service", name)["spec"]["clusterIP"] == "None"


@pytest.mark.parametrize("tree", TREES, ids=_name)
def test_probes_and_the_trace_path(tree: Path) -> None:
    docs = build(tree)
    for workload, c in _containers(docs):
        where = f"{workload['metadata']['name']}/{c['name']}"
        assert "readinessProbe" in c and "livenessProbe" in c, f"{where}: probes"
        assert "requests" in c.get("resources", {}), f"{where}: resource requests"
        env = {e["name"]: e.get("value") for e in c.get("env", [])}
        if c["image"].startswith("pushkv-server"):  # P, D, the router: spans to the collector
            assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://pushkv-otel-collector:4318"
    cm = _one(docs, "ConfigMap", "pushkv-otel-collector")
    (col,) = _one(docs, "Deployment", "pushkv-otel-collector")["spec"]["template"]["spec"][
        "containers"
    ]
    env = {e["name"]: e["value"] for e in col["env"]}
    collector = resolve(yaml.safe_load(cm["data"]["config.yaml"]), env)  # the ${env:...} knobs
    assert collector["exporters"]["otlp"]["endpoint"] == "pushkv-jaeger:4317"
    ports = {p["port"] for p in _one(docs, "Service", "pushkv-jaeger")["spec"]["ports"]}
    assert 4317 in ports
    dash = _one(docs, "Deployment", "pushkv-dashboard")["spec"]["template"]["spec"]
    assert {"name": "PUSHKV_JAEGER_URL", "value": "http://pushkv-jaeger:16686"} in dash[
        "containers"
    ][0]["env"]


def test_the_server_image_recipe_installs_pushkv_with_nixl() -> None:
    text = (ROOT / "deploy" / "Dockerfile.server").read_text()
    assert "FROM ${VLLM_IMAGE}" in text and "'.[nixl]'" in text
    images = {i["name"] for i in _kustomization(K8S / "base")["images"]}
    assert images == {"pushkv-server", "pushkv-dashboard"}

"""The benchmark harness's pure parts: CPU lists, server pinning, open-loop arrivals,
aggregation."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from bench import aggregate
from connector.config import parse_config
from connector.tools import vllm_router
from connector.tools.bench.stacks import CONFIGS, make_stack, require_fronts
from connector.tools.bench.vllm_bench import Workload, bench_command
from connector.tools.pdstack import GPU_IPC_GET, GPU_UCX_TLS, GPU_UCX_TLS_ENV, PdStack, cpu_set
from connector.tools.stack import ServerError, VllmServer


def test_cpu_lists_parse_like_vllms_omp_bind() -> None:
    assert cpu_set("0") == {0}
    assert cpu_set("0-3") == {0, 1, 2, 3}
    assert cpu_set("0,2-3") == {0, 2, 3}
    for bad in ("", "a", "1-", "0;1"):
        with pytest.raises(ValueError):
            cpu_set(bad)


class _AffinityProbe(VllmServer):
    def command(self) -> list[str]:  # a child that reports its CPU mask, not vLLM
        return [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"]


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux CPU masks")
def test_a_pinned_server_starts_inside_its_cpu_mask(tmp_path: Path) -> None:
    cpu = min(os.sched_getaffinity(0))
    server = _AffinityProbe(
        tmp_path, port=1, log_path=tmp_path / "probe.log", cpu_affinity=frozenset({cpu})
    )
    server.start()
    try:
        assert server._proc is not None
        assert server._proc.wait(timeout=30) == 0
        assert server.log.read_text().splitlines()[-1] == f"[{cpu}]"
    finally:
        server.stop()  # closes the log; kills the child if it did not exit


def test_open_loop_rate_reaches_measured_runs_but_not_the_warm_up(tmp_path: Path) -> None:
    w = Workload(request_rate=12.5)
    measured = bench_command("http://x", tmp_path, w, 16, 128, 0, tmp_path / "c16.json")
    warmup = bench_command("http://x", tmp_path, w, 4, 8, 0, None)
    assert measured[measured.index("--request-rate") + 1] == "12.5"
    assert "--max-concurrency" in measured  # the level's cap still holds
    assert "--request-rate" not in warmup
    assert "--request-rate" not in bench_command(
        "http://x", tmp_path, Workload(), 4, 8, 0, tmp_path / "c4.json"
    )


def _run(folder: Path, rate: float | None, ttft: float) -> Path:
    folder.mkdir()
    result = {
        "config": "push",
        "concurrency": 16,
        "ok": True,
        "reason": "",
        "metrics": {
            "median_ttft_ms": ttft,
            "p90_ttft_ms": ttft,
            "mean_tpot_ms": 5.0,
            "median_e2el_ms": 300.0,
            "request_throughput": 9.9,
        },
    }
    (folder / "results.json").write_text(
        json.dumps({"workload": {"request_rate": rate}, "results": [result]})
    )
    return folder


def test_aggregate_never_mixes_closed_and_open_loop_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = [
        _run(tmp_path / "a", None, 100.0),
        _run(tmp_path / "b", 10.0, 300.0),
        _run(tmp_path / "c", None, 200.0),
    ]
    assert aggregate.main([str(r) for r in runs]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert [(r[2], r[3], r[4]) for r in rows] == [("closed", "2", "150.0"), ("10/s", "1", "300.0")]


def test_aggregate_names_a_folder_without_results(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert aggregate.main([str(tmp_path / "nowhere")]) == 2
    assert "no results.json in" in capsys.readouterr().err


def test_repeats_rotate_the_order_and_report_the_medians(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from connector.tools.bench import serve_bench, serve_run
    from connector.tools.bench.level_result import LevelResult

    calls: list[tuple[str, str]] = []
    ttft = {"push": iter([60.0, 80.0, 70.0]), "vllm-push-noprog": iter([120.0, 100.0, 110.0])}

    def fake_run_config(config, model, run_dir, workload, log, pin_servers):  # noqa: ANN001
        calls.append((run_dir.name, config.name))
        result = LevelResult(
            config.name,
            16,
            8,
            True,
            metrics={"median_ttft_ms": next(ttft[config.name]), "mean_tpot_ms": 8.0},
        )
        return serve_run.ConfigRun([result], 1.0, {})

    monkeypatch.setattr(serve_bench, "run_config", fake_run_config)
    monkeypatch.setattr(serve_bench, "make_tiny_model", lambda: tmp_path / "model")
    code = serve_bench.main(
        [
            "--configs",
            "push",
            "vllm-push-noprog",
            "--levels",
            "16:8",
            "--repeats",
            "3",
            "--no-wait",
            "--run-dir",
            str(tmp_path / "run"),
        ]
    )
    assert code == 0
    assert calls == [
        ("round-1", "push"),
        ("round-1", "vllm-push-noprog"),
        ("round-2", "vllm-push-noprog"),
        ("round-2", "push"),
        ("round-3", "push"),
        ("round-3", "vllm-push-noprog"),
    ]
    top = json.loads((tmp_path / "run" / "results.json").read_text())
    assert {r["config"]: r["metrics"]["median_ttft_ms"] for r in top["results"]} == {
        "push": 70.0,
        "vllm-push-noprog": 110.0,
    }
    assert top["rounds"] == ["round-1", "round-2", "round-3"]
    assert (tmp_path / "run" / "round-2" / "report.md").is_file()
    report = (tmp_path / "run" / "report.md").read_text()
    assert "median over 3 rounds" in report and "in 3 of 3 rounds" in report
    # --rerender rebuilds each round, then the medians, from the saved files alone.
    (tmp_path / "run" / "report.md").unlink()
    assert serve_bench.main(["--rerender", str(tmp_path / "run")]) == 0
    assert "median over 3 rounds" in (tmp_path / "run" / "report.md").read_text()


def test_sealed_config_shares_a_secret_file_never_an_argv(tmp_path: Path) -> None:
    """push-sealed: P, D and the router read one 0600 secret file; no command line holds
    the secret itself."""
    stack = make_stack(CONFIGS["push-sealed"], tmp_path / "model", tmp_path)
    secret_file = tmp_path / "push-sealed.secret"
    secret = secret_file.read_text()
    assert len(secret) >= 32 and secret_file.stat().st_mode & 0o777 == 0o600
    for server in (stack.prefill, stack.decode):
        assert server.kv_transfer_config is not None
        extra = server.kv_transfer_config["kv_connector_extra_config"]
        assert extra["auth_secret_file"] == str(secret_file)
        assert secret not in " ".join(server.command())
    router = stack.router.command()
    assert router[router.index("--auth-secret-file") + 1] == str(secret_file)
    assert secret not in " ".join(router)
    plain = make_stack(CONFIGS["push"], tmp_path / "model", tmp_path / "plain")
    assert "--auth-secret-file" not in plain.router.command()


def test_first_token_config_reaches_the_router(tmp_path: Path) -> None:
    router = make_stack(CONFIGS["push-ft"], tmp_path / "model", tmp_path).router.command()
    assert router[router.index("--first-token") + 1] == "prefill"
    plain = make_stack(CONFIGS["push"], tmp_path / "model", tmp_path / "plain")
    assert "--first-token" not in plain.router.command()


def test_nometrics_config_turns_the_connectors_metrics_off(tmp_path: Path) -> None:
    stack = make_stack(CONFIGS["push-nometrics"], tmp_path / "model", tmp_path)
    for server in (stack.prefill, stack.decode):
        assert server.kv_transfer_config is not None
        extra = server.kv_transfer_config["kv_connector_extra_config"]
        assert parse_config(extra).metrics is False


@pytest.mark.parametrize("name", ["vllm-push-noprog", "vllm-pull-noprog", "vllm-push-keepcpu"])
def test_module_path_override_reaches_both_servers(name: str, tmp_path: Path) -> None:
    """The progress-off and keep-CPU configurations load vLLM's classes from our module
    (a HostStack refactor once dropped the override: the sweep's noprog stacks ran vLLM's
    defaults and failed their marker check); plain vLLM configurations load none."""
    config = CONFIGS[name]
    stack = make_stack(config, tmp_path / "m", tmp_path)
    for server in (stack.prefill, stack.decode):
        assert server.kv_transfer_config is not None
        assert server.kv_transfer_config["kv_connector_module_path"] == config.module_path
        assert server.kv_transfer_config["kv_connector"] == config.connector_name
    plain = make_stack(CONFIGS["vllm-pull"], tmp_path / "m", tmp_path / "plain")
    assert plain.prefill.kv_transfer_config is not None
    assert "kv_connector_module_path" not in plain.prefill.kv_transfer_config


def test_a_gpu_stack_gives_ucx_the_cuda_transports_unless_told_otherwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU host each server gets UCX's CUDA transports, cuda_ipc's GET included;
    PUSHKV_GPU_UCX_TLS replaces the list (the GPU sweep's pull diagnosis)."""
    monkeypatch.delenv(GPU_UCX_TLS_ENV, raising=False)
    monkeypatch.delenv(GPU_IPC_GET, raising=False)
    stack = make_stack(CONFIGS["vllm-pull"], tmp_path / "m", tmp_path / "a", gpus=("0", "0"))
    assert stack.decode.env["UCX_TLS"] == GPU_UCX_TLS
    # cuda_ipc's GET on for the pull's READ, unless the caller says otherwise
    assert stack.decode.env[GPU_IPC_GET] == stack.prefill.env[GPU_IPC_GET] == "on"
    monkeypatch.setenv(GPU_IPC_GET, "auto")
    stack = make_stack(CONFIGS["vllm-pull"], tmp_path / "m", tmp_path / "c", gpus=("0", "0"))
    assert stack.decode.env[GPU_IPC_GET] == "auto"
    monkeypatch.setenv(GPU_UCX_TLS_ENV, "sm,self,cuda_copy,cuda_ipc")
    stack = make_stack(CONFIGS["vllm-pull"], tmp_path / "m", tmp_path / "b", gpus=("0", "0"))
    assert stack.prefill.env["UCX_TLS"] == "sm,self,cuda_copy,cuda_ipc"
    assert stack.decode.env["UCX_TLS"] == "sm,self,cuda_copy,cuda_ipc"


@pytest.mark.parametrize(
    ("name", "connector", "traced"),
    [("push-vr", "PushConnector", True), ("vllm-push-vr", "NixlPushConnector", False)],
)
def test_vr_configs_put_vllm_router_in_front_of_p_and_d(
    name: str, connector: str, traced: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The *-vr stacks start P, D and vllm-router (NIXL P/D mode, in front of that P and D)
    and never pushkv's router; clients reach vllm-router; only pushkv's engines trace."""
    monkeypatch.setattr(vllm_router, "vllm_router_installed", lambda: True)
    stack = make_stack(CONFIGS[name], tmp_path / "m", tmp_path)
    front = stack.vllm_router
    assert front is not None and stack.url == front.url
    assert stack._stack.services == [stack.prefill, stack.decode, front]
    cmd = front.command()
    assert cmd[cmd.index("-m") + 1] == "vllm_router.launch_router"
    assert "--vllm-pd-disaggregation" in cmd and cmd[cmd.index("--kv-connector") + 1] == "nixl"
    assert cmd[cmd.index("--prefill") + 1] == stack.prefill.url
    assert cmd[cmd.index("--decode") + 1] == stack.decode.url
    ports = stack.ports()
    assert ports["router"] == front.port and ports["router-metrics"] == front.prometheus_port
    assert len(set(ports.values())) == len(ports), ports
    for server in (stack.prefill, stack.decode):
        assert server.kv_transfer_config is not None
        assert server.kv_transfer_config["kv_connector"] == connector
        assert ("PUSHKV_RUN_DIR" in server.env) is traced
        assert (server.env.get("OTEL_SDK_DISABLED") == "true") is not traced
    plain = make_stack(CONFIGS["push"], tmp_path / "m", tmp_path / "plain")
    assert plain.vllm_router is None and plain.url == plain.router.url


def test_vr_configs_need_vllm_router_installed_and_say_so_before_anything_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(vllm_router, "vllm_router_installed", lambda: False)
    require_fronts(["single", "push", "vllm-push"])  # none needs it
    with pytest.raises(SystemExit, match=r"configuration push-vr needs vllm-router.*pip install"):
        require_fronts(["single", "push", "push-vr"])
    with pytest.raises(ServerError, match="vllm-push-vr needs vllm-router"):
        make_stack(CONFIGS["vllm-push-vr"], tmp_path / "m", tmp_path)


def test_each_side_gets_its_own_tensor_parallel_size(tmp_path: Path) -> None:
    """A P at TP 2 into a D at TP 1 (the MLA e2e's stacks): only P's command line asks for
    two ranks, and vLLM's push router is told P's TP size."""
    stack = PdStack(tmp_path / "m", tmp_path, "NixlPushConnector", prefill_cpus="0|1", prefill_tp=2)
    p, d, router = stack.prefill.command(), stack.decode.command(), stack.router.command()
    assert p[p.index("--tensor-parallel-size") + 1] == "2"
    assert "--tensor-parallel-size" not in d
    assert router[router.index("--prefill-tp-size") + 1] == "2"

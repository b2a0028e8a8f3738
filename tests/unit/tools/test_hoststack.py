"""HostStack's servers as configured, without starting anything: each binds and advertises
its host's address, runs inside its namespace with UCX on its veth, at its TP size."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from connector.config import parse_config
from connector.core.errors import ConfigError
from connector.tools.hoststack import LOOPBACK, HostStack, Instance
from connector.tools.netbed import Host
from connector.tools.pdstack import cpu_set

HOST = Host("pkv-test-0", "10.213.9.2")


def _stack(tmp_path: Path) -> HostStack:
    return HostStack(Path("/models/tiny"), tmp_path, tracing=False)


def test_a_server_on_a_host_binds_and_advertises_its_address(tmp_path: Path) -> None:
    s = _stack(tmp_path)._server(
        "decode", 1, Instance("1", extra_config={"grace_s": 2.0}), HOST, 8200
    )
    cmd = s.command()
    assert cmd[:4] == ["ip", "netns", "exec", HOST.netns]
    assert cmd[cmd.index("--host") + 1] == HOST.addr and s.url == f"http://{HOST.addr}:8200"
    ktc = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
    assert (ktc["engine_id"], ktc["kv_role"]) == ("decode-1", "kv_consumer")
    cfg = parse_config(ktc["kv_connector_extra_config"])  # a config pushkv accepts
    assert (cfg.side_channel_host, cfg.grace_s) == (HOST.addr, 2.0)
    env = s.child_env()
    assert (env["UCX_TLS"], env["UCX_NET_DEVICES"]) == ("tcp", HOST.ifname)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1" and "--tensor-parallel-size" not in cmd


def test_a_server_on_loopback_at_tp_2(tmp_path: Path) -> None:
    s = _stack(tmp_path)._server("prefill", 0, Instance("0|1", tp=2), None, 8100)
    cmd = s.command()
    assert cmd[0] != "ip" and cmd[cmd.index("--host") + 1] == LOOPBACK
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "2"
    assert s.child_env()["UCX_NET_DEVICES"] == "lo"  # the default: loopback UCX


def test_a_server_with_pipeline_stages_and_its_own_flags(tmp_path: Path) -> None:
    inst = Instance("0|1", pp=2, args=("--compilation-config", "{}"), eager=False)
    cmd = _stack(tmp_path)._server("prefill", 0, inst, None, 8100).command()
    assert cmd[cmd.index("--pipeline-parallel-size") + 1] == "2"
    assert "--tensor-parallel-size" not in cmd and "--enforce-eager" not in cmd
    assert cmd[-2:] == ["--compilation-config", "{}"]


def test_a_bad_knob_fails_before_anything_starts(tmp_path: Path) -> None:
    bad = Instance("0", extra_config={"receive_timeout_s": 5.0})  # below write_timeout_s
    with pytest.raises(ConfigError, match="write_timeout_s must be shorter"):
        _stack(tmp_path)._server("decode", 0, bad, HOST, 8200)


def test_an_instance_needs_one_cpu_list_per_rank() -> None:
    with pytest.raises(ValueError, match="2 TP ranks need 2 CPU lists"):
        Instance("0", tp=2)
    with pytest.raises(ValueError, match="1 TP ranks x 2 stages need 2 CPU lists"):
        Instance("0", pp=2)
    assert cpu_set("0|1") == frozenset({0, 1})

"""``connector.tools.netbed``: hosts that reach each other only over their bridge, and a bed
that leaves nothing behind. Needs root (skipped otherwise, with the reason); no NIXL."""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
from collections.abc import Callable
from multiprocessing.connection import Connection

import pytest

from connector.tools import netbed
from connector.tools.netbed import InHost, NetBed, Unavailable

pytestmark = [pytest.mark.netns, pytest.mark.timeout(60)]

SERVE = """
import socket, sys
with socket.create_server((sys.argv[1], 0)) as s:
    print(s.getsockname()[1], flush=True)
    c, peer = s.accept()
    c.sendall(peer[0].encode())
"""
DIAL = """
import socket, sys
print(socket.create_connection((sys.argv[1], int(sys.argv[2])), 5).recv(64).decode())
"""


@pytest.fixture
def bed(netbed: Callable[[int], NetBed]) -> NetBed:
    return netbed(3)


def _report(conn: Connection) -> None:
    conn.send((sorted(os.listdir("/sys/class/net")), os.environ.get("UCX_NET_DEVICES")))


def test_hosts_talk_over_the_bridge_only(bed: NetBed) -> None:
    a, b, _ = bed.hosts
    server = subprocess.Popen(
        a.argv([sys.executable, "-c", SERVE, a.addr]), stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None
        port = server.stdout.readline().strip()
        assert port, "the server in host a did not start"
        dial = [sys.executable, "-c", DIAL, a.addr, port]
        # Not from the root namespace's loopback: a's address exists only inside a.
        local = subprocess.run(
            [sys.executable, "-c", DIAL, "127.0.0.1", port], capture_output=True, timeout=20
        )
        assert b"127.0.0.1" not in local.stdout, "a answered on the root namespace's loopback"
        seen = subprocess.run(b.argv(dial), capture_output=True, text=True, timeout=20)
        assert seen.stdout.strip() == b.addr, seen.stderr  # a saw b's own address
    finally:
        server.kill()
        server.wait(10)


def test_a_python_child_runs_inside_a_host(bed: NetBed) -> None:
    host = bed.hosts[1]
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=InHost(host, _report, host.ucx_env()), args=(child,), daemon=True)
    proc.start()
    try:
        assert parent.poll(30), f"no report from the child (exitcode={proc.exitcode})"
        devices, ucx = parent.recv()
    finally:
        proc.kill()
        proc.join(10)
    assert devices == ["eth0", "lo"] and ucx == "eth0"


def test_close_removes_everything_even_after_a_failure() -> None:
    made = NetBed(2)
    with pytest.raises(ZeroDivisionError):
        try:
            with made:
                assert len(made.leftovers()) == 5  # 2 namespaces, 2 veths, the bridge
                _ = 1 / 0
        except Unavailable as exc:
            pytest.skip(str(exc))
    assert made.leftovers() == []
    made.close()  # idempotent


def test_a_dead_runners_bed_is_swept(bed: NetBed) -> None:
    dead = subprocess.Popen(["true"])  # a pid that has exited
    dead.wait()
    name = f"pkv-{dead.pid:x}g00-0"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        assert name in netbed.sweep_stale()
        assert (
            name
            not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        )
        assert bed.leftovers()  # a live owner's bed is left alone
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def test_unavailable_without_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netbed.os, "geteuid", lambda: 1000)
    with pytest.raises(Unavailable, match="root"), NetBed(1):
        pass

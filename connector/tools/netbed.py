"""Several simulated hosts on one machine: network namespaces on a private bridge.

Owns: ``NetBed`` (N namespaces, each with a veth pair into one bridge in the root namespace
and its own address in a private 10.213.x.0/24 that never leaves the machine; removes what it
created, by name, on close, at exit, or, after a crash, on the next bed's set-up), ``Host``
(one namespace: address, interface, UCX environment, argv prefix) and ``InHost`` (a
picklable wrapper that runs a ``multiprocessing`` target inside a host). Needs root and
iproute2's ``ip``; ``Unavailable`` says why not. Nothing here imports NIXL or vLLM.
"""

from __future__ import annotations

import atexit
import ctypes
import fcntl
import itertools
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

SUBNET = "10.213"  # 10.213.<k>.0/24, k free on this machine; the bridge is .1, hosts .2 up
LOCK = "/run/lock/pushkv-netbed.lock"  # one bed chooses its subnet at a time
_PREFIX = "pkv"  # every name starts so; then the owner's pid in hex, "g", a counter
_OWNED = re.compile(rf"^{_PREFIX}-?([0-9a-f]+)g")
_beds = itertools.count()

CLONE_NEWNS, CLONE_NEWNET = 0x00020000, 0x40000000
MS_REC, MS_SLAVE, MNT_DETACH = 0x4000, 0x80000, 2


class Unavailable(RuntimeError):
    """Namespaces cannot be created here (not root, no ``ip``, no CAP_NET_ADMIN)."""


@dataclass(frozen=True)
class Host:
    """One simulated host: a network namespace with one interface on the bed's bridge."""

    netns: str
    addr: str
    ifname: str = "eth0"

    def ucx_env(self) -> dict[str, str]:
        """UCX over TCP on this host's interface only (no shared memory across hosts)."""
        return {"UCX_TLS": "tcp", "UCX_NET_DEVICES": self.ifname}

    def argv(self, cmd: Sequence[str]) -> list[str]:
        """``cmd`` run inside this host (``ip netns exec`` also remounts /sys for it)."""
        return ["ip", "netns", "exec", self.netns, *cmd]

    def enter(self) -> None:
        """Move this (fresh, single-threaded) process into the host, as ``ip netns exec``
        does: the network namespace, and a private /sys showing its interfaces (UCX lists
        devices from /sys/class/net)."""
        libc = ctypes.CDLL(None, use_errno=True)

        def check(rc: int, what: str) -> None:
            if rc != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"{what} for {self.netns}: {os.strerror(err)}")

        fd = os.open(f"/run/netns/{self.netns}", os.O_RDONLY)
        try:
            check(libc.setns(fd, CLONE_NEWNET), "setns")
        finally:
            os.close(fd)
        check(libc.unshare(CLONE_NEWNS), "unshare")
        check(libc.mount(b"none", b"/", None, MS_REC | MS_SLAVE, None), "mount --make-rslave /")
        check(libc.umount2(b"/sys", MNT_DETACH), "umount /sys")
        check(libc.mount(self.netns.encode(), b"/sys", b"sysfs", 0, None), "mount sysfs")


@dataclass(frozen=True)
class InHost:
    """``target(*args)`` inside ``host`` with ``env`` set: a ``multiprocessing`` target for a
    spawned child (``RankProcess(spec, target=InHost(host, rank_main, host.ucx_env()))``)."""

    host: Host
    target: Callable[..., Any]
    env: dict[str, str] = field(default_factory=dict)

    def __call__(self, *args: Any) -> Any:
        self.host.enter()
        os.environ.update(self.env)
        return self.target(*args)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        msg = f"ip {' '.join(args)}: {proc.stderr.strip()}"
        if "Operation not permitted" in proc.stderr or "Permission denied" in proc.stderr:
            raise Unavailable(f"cannot create network namespaces here ({msg})")
        raise RuntimeError(msg)
    return proc


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale() -> list[str]:
    """Remove namespaces and links that beds of processes no longer alive left behind (a
    test runner killed by its timeout runs no atexit); returns their names."""
    names = [line.split()[0] for line in _ip("netns", "list").stdout.splitlines() if line]
    links = _ip("-o", "link", "show").stdout.splitlines()
    names += [line.split(":")[1].strip().split("@")[0] for line in links]
    stale = [n for n in names if (m := _OWNED.match(n)) and not _alive(int(m.group(1), 16))]
    for name in stale:
        if "-" in name:
            _ip("netns", "del", name, check=False)
        else:
            _ip("link", "del", name, check=False)
    return stale


class NetBed:
    """``n`` hosts on one bridge; the root namespace (the router, the test) reaches them
    all at the bridge's address. Use as a context manager; ``close`` is idempotent."""

    def __init__(self, n: int) -> None:
        if not 1 <= n <= 99:
            raise ValueError("1 to 99 hosts")
        self.n = n
        token = f"{os.getpid():x}g{next(_beds) % 256:02x}"
        self.bridge = f"{_PREFIX}{token}"
        self._veths = [f"{_PREFIX}{token}h{i}" for i in range(n)]
        self._netns = [f"{_PREFIX}-{token}-{i}" for i in range(n)]
        self.hosts: list[Host] = []
        self.gateway = ""
        self._closed = True

    def __enter__(self) -> NetBed:
        if os.geteuid() != 0:
            raise Unavailable("network namespaces need root (CAP_NET_ADMIN, CAP_SYS_ADMIN)")
        if shutil.which("ip") is None:
            raise Unavailable("iproute2's `ip` is not installed")
        self._closed = False
        atexit.register(self.close)
        try:
            os.makedirs(os.path.dirname(LOCK), exist_ok=True)
            with open(LOCK, "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # released when the bridge holds its subnet
                sweep_stale()
                net = self._free_subnet()
                self.gateway = f"{net}.1"
                _ip("link", "add", self.bridge, "type", "bridge")
                _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
                _ip("link", "set", self.bridge, "up")
            for i, (ns, veth) in enumerate(zip(self._netns, self._veths, strict=True)):
                host = Host(ns, f"{net}.{2 + i}")
                _ip("netns", "add", ns)
                _ip("link", "add", veth, "type", "veth", "peer", "name", host.ifname, "netns", ns)
                _ip("link", "set", veth, "master", self.bridge, "up")
                _ip("-n", ns, "addr", "add", f"{host.addr}/24", "dev", host.ifname)
                _ip("-n", ns, "link", "set", host.ifname, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                self.hosts.append(host)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def _free_subnet() -> str:
        used = set(re.findall(rf"inet {re.escape(SUBNET)}\.(\d+)\.", _ip("-4", "addr").stdout))
        for k in range(1, 255):
            if str(k) not in used:
                return f"{SUBNET}.{k}"
        raise RuntimeError(f"no free {SUBNET}.x.0/24 on this machine")

    def cut(self, host: Host) -> None:
        """Unplug ``host`` from the bridge (its processes live on, unreachable)."""
        _ip("link", "set", self._veths[self.hosts.index(host)], "down")

    def remove(self, host: Host) -> None:
        """Tear ``host`` down: its namespace and its interfaces (kill its processes first)."""
        i = self.hosts.index(host)
        _ip("netns", "del", self._netns[i], check=False)
        _ip("link", "del", self._veths[i], check=False)

    def close(self) -> None:
        """Remove every namespace and link this bed created, by name."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        for ns, veth in zip(self._netns, self._veths, strict=True):
            _ip("netns", "del", ns, check=False)
            _ip("link", "del", veth, check=False)  # gone with its peer, unless half made
        _ip("link", "del", self.bridge, check=False)

    def link_bytes(self, host: Host) -> int:
        """Bytes through ``host``'s link so far, both ways (its veth's counters)."""
        stats = f"/sys/class/net/{self._veths[self.hosts.index(host)]}/statistics"
        return sum(int(open(f"{stats}/{d}_bytes").read()) for d in ("rx", "tx"))

    def leftovers(self) -> list[str]:
        """Names of this bed's that still exist (empty after ``close``)."""
        present = set(_ip("netns", "list").stdout.split())
        present |= {
            ln.split(":")[1].strip().split("@")[0] for ln in _ip("-o", "link").stdout.splitlines()
        }
        return sorted(present & {*self._netns, *self._veths, self.bridge})

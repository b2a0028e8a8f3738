"""Picking a free port for a server that some other process will bind later.

Owns: ``free_port`` and ``port_is_free``. Binding port 0 returns a port from the kernel's
ephemeral range, where any outgoing connection's automatic bind may take it before the
server binds: seen as vLLM's NIXL handshake listener dying with "Address already in
use" and its engine hanging for the whole start-up timeout. So ports are drawn below that
range (where no automatic bind goes), checked bindable for TCP and UDP alike (pushkv's
doorbell opens UDP on its side-channel port number), and never handed out twice by one
process.

Pure standard library: imported by the vLLM plugin's worker side, the stacks and the tests.
"""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path

FLOOR = 20000  # below: well-known and registered services more often listen
_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_handed: set[int] = set()
_lock = threading.Lock()
_rng = random.SystemRandom()


def ephemeral_range() -> tuple[int, int]:
    """The kernel's automatic-bind range (Linux default 32768-60999)."""
    try:
        lo, hi = (int(x) for x in _RANGE_FILE.read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def _bindable(port: int, host: str, kind: int = socket.SOCK_STREAM) -> bool:
    with socket.socket(socket.AF_INET, kind) as s:
        if kind == socket.SOCK_STREAM:  # as uvicorn binds: TIME_WAIT leftovers don't count
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """True if nothing accepts TCP connections on ``port`` and a server could bind it again
    (TIME_WAIT leftovers do not count as busy)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        if s.connect_ex((host, port)) == 0:
            return False
    return _bindable(port, host)


def _kernel_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def free_port(host: str = "127.0.0.1", attempts: int = 200) -> int:
    """A TCP and UDP port free on ``host`` now, outside the ephemeral range, not returned
    before by this process. Falls back to a kernel-chosen port when the range leaves no
    room below it (a tuned host) or every attempt found its port taken."""
    lo, _ = ephemeral_range()
    with _lock:
        if lo - FLOOR >= 1000:
            for _ in range(attempts):
                port = _rng.randrange(FLOOR, lo)
                if (
                    port not in _handed
                    and _bindable(port, host)
                    and _bindable(port, host, socket.SOCK_DGRAM)
                ):
                    _handed.add(port)
                    return port
        while (port := _kernel_port(host)) in _handed:
            pass
        _handed.add(port)
        return port

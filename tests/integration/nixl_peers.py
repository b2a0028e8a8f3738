"""A NIXL peer in a child process, driven over a Pipe (integration tests, bench).

Owns: ``peer_main`` (the child's entry: one ``NixlTransport`` plus one zeroed DRAM buffer,
serving commands) and ``PeerProcess`` (the parent's handle: start, call, kill by PID).
Must not import nixl at module level: the parent imports this before deciding to skip.

The child keeps calling ``get_notifs`` between commands: with NIXL's progress thread off,
a process that does not call NIXL makes no UCX progress (a target over tcp, where RMA is
emulated by active messages, would stall the initiator's WRITE).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import numpy as np


def peer_main(conn: Connection, name: str, port: int, nbytes: int) -> None:
    from connector.transport.nixl import NixlTransport

    t = NixlTransport(name, listen_port=port)
    buf = np.zeros(nbytes, dtype=np.uint8)
    t.register_memory([(buf.ctypes.data, buf.nbytes)])
    seen: list[tuple[str, bytes]] = []
    echo_prefix: bytes | None = None
    conn.send(("ready", {"addr": int(buf.ctypes.data), "pid": os.getpid()}))

    def pump() -> None:
        for sender, msg in t.get_notifs():
            if echo_prefix is not None and msg.startswith(echo_prefix):
                t.send_notif(sender, b"PONG" + msg[len(echo_prefix) :])
            else:
                seen.append((sender, msg))

    def wait_notifs(count: int, timeout_s: float) -> list[tuple[str, bytes]]:
        deadline = time.monotonic() + timeout_s
        while len(seen) < count and time.monotonic() < deadline:
            pump()
        out = seen[:]  # everything seen so far (at least ``count`` unless timed out)
        seen.clear()
        return out

    def write(
        peer: str, src: list[list[int]], dst: list[list[int]], notif: bytes, timeout_s: float
    ) -> float:
        h = t.write(peer, np.array(src, dtype=np.uint64), np.array(dst, dtype=np.uint64), notif)
        deadline = time.monotonic() + timeout_s
        try:
            while not t.poll_write(h):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"write to {peer} not DONE after {timeout_s}s")
            return (time.time_ns() - h.posted_ns) / 1e9
        finally:
            t.release(h)

    def fill(seed: int) -> None:
        buf[:] = np.random.default_rng(seed).integers(1, 256, buf.size, dtype=np.uint8)

    def set_echo(prefix: bytes | None) -> None:
        nonlocal echo_prefix
        echo_prefix = prefix

    def die_in(delay_s: float) -> None:
        # SIGKILL ourselves from a timer: lands while the parent is inside a long post
        # (CMA writes complete inside transfer(), which may hold the parent's GIL).
        threading.Timer(delay_s, os.kill, (os.getpid(), signal.SIGKILL)).start()

    commands: dict[str, Any] = {
        "die_in": die_in,
        "connect": t.connect,
        "send_notif": t.send_notif,
        "wait_notifs": wait_notifs,
        "read": lambda off, n: bytes(buf[off : off + n]),
        "fill": fill,
        "write": write,
        "echo": set_echo,
        "remove_peer": t.remove_peer,
    }
    try:
        while True:
            if not conn.poll(0.0005):
                pump()
                continue
            cmd, args = conn.recv()
            if cmd == "exit":
                conn.send(("ok", None))
                return
            try:
                conn.send(("ok", commands[cmd](*args)))
            except Exception as exc:  # report every failure to the parent, keep serving
                conn.send(("err", type(exc).__name__, f"{exc}\n{traceback.format_exc()}"))
    finally:
        t.close()


class PeerError(Exception):
    """A command failed in the child; ``kind`` is the child's exception class name."""

    def __init__(self, kind: str, text: str) -> None:
        super().__init__(f"{kind}: {text}")
        self.kind = kind


class PeerProcess:
    """Parent-side handle of one ``peer_main`` child."""

    def __init__(self, name: str, port: int, nbytes: int = 1 << 20) -> None:
        ctx = mp.get_context("spawn")
        self.name, self.port, self.nbytes = name, port, nbytes
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=peer_main,
            args=(child, name, port, nbytes),
            name=f"nixl-peer-{name}",
            daemon=True,
        )
        self.proc.start()
        child.close()
        self.addr = 0

    def wait_ready(self, timeout_s: float = 60.0) -> PeerProcess:
        if not self._conn.poll(timeout_s):
            raise TimeoutError(
                f"peer {self.name} not ready after {timeout_s}s "
                f"(alive={self.proc.is_alive()}, rc={self.proc.exitcode})"
            )
        tag, info = self._conn.recv()
        assert tag == "ready", tag
        self.addr = info["addr"]
        return self

    def call(
        self,
        cmd: str,
        *args: Any,
        timeout_s: float = 30.0,
        pump: Callable[[], object] | None = None,
    ) -> Any:
        """Run ``cmd`` in the child. ``pump`` is called while we wait: a local transport
        must keep driving UCX progress, or what it queued (notifications sent before the
        endpoint was wired up) never leaves this process."""
        self._conn.send((cmd, args))
        deadline = time.monotonic() + timeout_s
        while not self._conn.poll(0.0005 if pump else max(0.0, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise TimeoutError(f"peer {self.name}: {cmd} gave no answer in {timeout_s}s")
            if pump is not None:
                pump()
        reply = self._conn.recv()
        if reply[0] == "err":
            raise PeerError(reply[1], reply[2])
        return reply[1]

    def kill(self, join_timeout_s: float = 10.0) -> None:
        """SIGKILL this child by its PID (never by name) and reap it."""
        if self.proc.pid is not None and self.proc.exitcode is None:
            self.proc.kill()
        self.proc.join(join_timeout_s)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ask the child to exit cleanly; kill it if it does not."""
        try:
            if self.proc.is_alive():
                self.call("exit", timeout_s=timeout_s)
            self.proc.join(timeout_s)
        except (OSError, EOFError, TimeoutError, PeerError):
            pass  # it is killed below either way
        finally:
            self.kill()
            self._conn.close()

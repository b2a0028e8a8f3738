"""P and D ranks as real processes with synthetic KV caches in DRAM, on loopback NIXL.

Owns the parent-side handle that drives one rank's child process over a pipe
(``RankProcess``) and D's ``Expected`` for a transfer between synthetic ranks. The rank's
description and KV cache are ``rank_spec``'s, the child's main ``rank_child``'s (both named
here for callers). Used by ``pushkv demo``, the transport benchmark and the integration
tests. No vLLM. Children are started with ``spawn`` and stopped by PID.
"""

from __future__ import annotations

import logging
import time
from multiprocessing import get_context
from typing import Any

import numpy as np

from connector.core import events as ev
from connector.tools.rank_child import RankCounters, rank_main
from connector.tools.rank_spec import RankSpec, Role, VllmKV

__all__ = [
    "RankCounters",
    "RankProcess",
    "RankSpec",
    "Role",
    "VllmKV",
    "expected_event",
    "rank_main",
]

logger = logging.getLogger(__name__)


class RankProcess:
    """Parent-side handle of one rank's process."""

    def __init__(self, spec: RankSpec, start_timeout_s: float = 120.0, target: Any = None) -> None:
        """``target``: the child's main (``rank_main``; ``pushkv_testing.worker_ranks`` runs
        the worker role instead). Its "ready" reply's extra fields land in ``hello``."""
        ctx = get_context("spawn")
        self.spec = spec
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=target or rank_main, args=(child, spec), name=spec.agent, daemon=True
        )
        self.proc.start()
        child.close()
        self.hello = self._reply("ready", start_timeout_s)[2:]
        self.sent: list[str] = []
        self.received: list[Any] = []
        self.reports: list[Any] = []

    @property
    def pid(self) -> int:
        assert self.proc.pid is not None
        return self.proc.pid

    def _reply(self, want: str, timeout_s: float) -> tuple:
        if not self._conn.poll(timeout_s):
            raise TimeoutError(
                f"{self.spec.agent}: no {want!r} reply within {timeout_s}s "
                f"(alive={self.proc.is_alive()}, exitcode={self.proc.exitcode})"
            )
        msg = self._conn.recv()
        if msg[0] != want:
            raise RuntimeError(f"{self.spec.agent}: expected {want!r}, got {msg!r}")
        return msg

    def call(self, *cmd: Any, timeout_s: float = 10.0) -> tuple:
        self._conn.send(cmd)
        return self._reply("ok", timeout_s)[1:]

    def submit(self, event: Any) -> None:
        self.call("submit", event)

    def take(self) -> None:
        sent, received, reports = self.call("take")
        self.sent += sent
        self.received += received
        self.reports = reports

    def wait(self, what: str, pred: Any, timeout_s: float) -> None:
        """Poll until ``pred(self)`` holds; TimeoutError naming ``what`` otherwise."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.take()
            if pred(self):
                return
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"{self.spec.agent}: {what} not seen within {timeout_s}s; "
                    f"sent={self.sent} received={self.received}"
                )
            time.sleep(0.005)  # pacing of the poll loop, not synchronisation

    def prefill(self, done: ev.PrefillDone, seed: int, sleep_cycles: int = 0) -> None:
        """P with ``kv_layout``: write fresh KV into the blocks (on the GPU, after a device
        sleep), then submit ``done`` with the step's CUDA event as its ready check."""
        self.call("prefill", done, seed, sleep_cycles)

    def read(self) -> np.ndarray:
        return self.call("read")[0]

    def block_sums(self, block_ids: list[int]) -> np.ndarray:
        return self.call("block_sums", block_ids, timeout_s=120)[0]

    def cpu_seconds(self) -> float:
        return self.call("cpu")[0]

    def counters(self) -> RankCounters:
        return self.call("counters")[0]

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop cleanly if possible; kill by PID otherwise. Idempotent."""
        if self.proc.is_alive():
            try:
                self._conn.send(("stop",))
                self._reply("stopped", timeout_s)
            except (OSError, EOFError, TimeoutError, RuntimeError) as exc:
                # Stuck, dead or confused: kill() below ends it either way.
                logger.debug("%s did not stop cleanly (%r); killing it", self.spec.agent, exc)
        self.kill()

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)


def expected_event(
    tid: str,
    p_specs: list[RankSpec],
    d_spec: RankSpec,
    d_blocks: tuple[int, ...],
    num_tokens: int,
    first_token: int = 0,
) -> ev.Expected:
    """D's Expected for a transfer from the P engine ``p_specs`` into ``d_spec``."""
    from connector.transfer.topology import Topology

    topo = Topology(d_spec.num_kv_heads, len(p_specs))
    sources = tuple(
        ev.Source(p, p_specs[p].addr) for p in topo.sources(d_spec.rank, d_spec.tp_size)
    )
    return ev.Expected(tid, f"dreq-{tid}", sources, (d_blocks,), first_token, num_tokens)

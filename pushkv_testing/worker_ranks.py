"""The plugin's worker role without vLLM: ``WorkerSide`` in a P and a D process on KV laid
out as vLLM's attention backends hand it over, driven by the step plans the scheduler role
would send.

Owns: ``worker_main`` (the child: ``WorkerSide.register_kv_caches`` on
``connector.tools.loopback.VllmKV``'s views, then ``bind`` / a "forward" that writes the KV
on the GPU stream / ``after_forward`` / ``take_results`` per command) and ``WorkerRank`` (the
parent's handle). Everything below the worker role is the product's: the KV description,
the path driver and IPC offer, the transfer thread, NIXL, the CUDA event that says a step's
KV is computed. Used by tests/integration/test_vllm_kv_push.py (on the GPU machine, where
vLLM cannot be installed, and on CPU in CI). Children are started with ``spawn`` and stopped
by PID.
"""

from __future__ import annotations

import os
from multiprocessing.connection import Connection
from typing import Any

from connector.tools.loopback import RankProcess, RankSpec, VllmKV


def worker_main(conn: Connection, spec: RankSpec) -> None:
    from connector.config import PushkvConfig
    from connector.kv_params import DecodeLeg, PrefillLeg
    from connector.metadata import StagedPrefill, StagedRegistration, StepPlan
    from connector.worker_side import WorkerSide

    kv = VllmKV(spec)
    cfg = PushkvConfig(
        side_channel_port=spec.port,
        doorbells=spec.doorbell,
        xfer_paths=spec.xfer_paths,  # type: ignore[arg-type]
    )
    worker = WorkerSide(
        cfg,
        spec.engine_id,
        is_producer=spec.role == "P",
        is_consumer=spec.role == "D",
        tp_rank=spec.rank,
        tp_size=spec.tp_size,
        num_kv_heads=spec.num_kv_heads,
        logical_block_size=spec.block_size,
        group_of={},
    )
    worker.register_kv_caches(kv.views)
    hs = worker.handshake()
    assert hs is not None
    conn.send(("ready", os.getpid(), hs.agent, hs.host, hs.port))
    try:
        while True:
            cmd, *args = conn.recv()
            if cmd == "stop":
                break
            if cmd == "register":  # D: (tid, blocks, num_tokens, leg as a dict)
                tid, blocks, n, leg = args
                reg = StagedRegistration(tid, f"d-{tid}", (tuple(blocks),), 0, n, DecodeLeg(**leg))
                worker.bind(StepPlan(registrations=[reg]))
                worker.clear()
                conn.send(("ok",))
            elif cmd == "prefill":  # P: (tid, blocks, num_tokens, seed, sleep_cycles)
                tid, blocks, n, seed, cycles = args
                leg = PrefillLeg(do_remote_decode=True, transfer_id=tid)
                worker.bind(
                    StepPlan(prefills=[StagedPrefill(tid, f"p-{tid}", (tuple(blocks),), n, leg)])
                )
                _forward(kv, list(blocks), seed, cycles)
                worker.after_forward()  # records the step's CUDA event, as in vLLM
                worker.clear()
                conn.send(("ok",))
            elif cmd == "take":
                sent, received, failed = worker.take_results()
                conn.send(("ok", sorted(sent), sorted(received), sorted(failed)))
            elif cmd == "block_sums":
                conn.send(("ok", kv.block_sums(list(args[0]))))
            elif cmd == "counters":
                thread = worker.thread
                assert thread is not None
                endpoint = thread.sender or thread.receiver
                assert endpoint is not None
                conn.send(("ok", {**thread.counters, **endpoint.counters}))
            else:
                conn.send(("error", f"unknown command {cmd!r}"))
    finally:
        worker.shutdown()
        conn.send(("stopped",))


def _forward(kv: VllmKV, block_ids: list[int], seed: int, cycles: int) -> None:
    """The step's forward: on CUDA a device sleep, then the KV written on the current
    stream; ``after_forward`` records its event right after, as the model runner would."""
    if kv.raw.device.type == "cuda" and cycles:
        import torch

        torch.cuda._sleep(cycles)
    kv.fill(block_ids, seed)


class WorkerRank(RankProcess):
    """Parent-side handle of one worker-role process."""

    def __init__(self, spec: RankSpec, start_timeout_s: float = 120.0) -> None:
        super().__init__(spec, start_timeout_s, target=worker_main)
        self.agent, self.host, self.port = self.hello
        self.failed: list[str] = []

    def decode_leg(self, transfer_id: str) -> dict[str, Any]:
        """A D leg naming this P worker, as the router builds it."""
        return {
            "do_remote_prefill": True,
            "transfer_id": transfer_id,
            "remote_engine_id": self.spec.engine_id,
            "remote_host": self.host,
            "remote_port": self.port,
            "remote_tp_size": self.spec.tp_size,
            "remote_agents": (self.agent,),
        }

    def register(self, tid: str, blocks: tuple[int, ...], n: int, leg: dict[str, Any]) -> None:
        self.call("register", tid, blocks, n, leg)

    def prefill_step(
        self, tid: str, blocks: tuple[int, ...], n: int, seed: int, sleep_cycles: int = 0
    ) -> None:
        self.call("prefill", tid, blocks, n, seed, sleep_cycles)

    def take(self) -> None:
        sent, received, failed = self.call("take")
        self.sent += sent
        self.received += received
        self.failed += failed

"""``pushkv demo --transport``: push KV between a real P process and a real D process over NIXL.

Transport only, no vLLM (``pushkv demo`` without the flag runs the model; see demo.py).
Owns: the transport demo's workload and its report. Synthetic KV caches shaped like the project's
tiny test model (2 KV heads, head_dim 64, bf16, K|V packed), DRAM on loopback.
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

from connector.core import events as ev
from connector.tools.loopback import RankProcess, RankSpec, expected_event
from connector.transport.ports import free_port


def run_transport_demo(
    prompt_tokens: tuple[int, ...] = (256, 1024, 4096),
    repeats: int = 10,
    num_layers: int = 8,
    block_size: int = 32,
) -> list[dict]:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    shape: dict[str, Any] = dict(
        num_layers=num_layers,
        num_blocks=1024,
        block_size=block_size,
        num_kv_heads=2,
        token_bytes=2 * 64 * 2,
    )
    with console.status("starting a P and a D process (NIXL agents on loopback)..."):
        p = RankProcess(RankSpec("P", "prefill", 0, 1, free_port(), **shape))
        d = RankProcess(RankSpec("D", "decode", 0, 1, free_port(), **shape))
    rows = []
    rng = random.Random(0)
    try:
        for n in prompt_tokens:
            nblocks = -(-n // block_size)
            for i in range(repeats + 1):  # the first round connects the agents: not counted
                tid = f"demo-{n}-{i}"
                d_blocks = tuple(rng.sample(range(1024), nblocks))  # scattered, as after churn
                p_blocks = tuple(range(nblocks))
                d.submit(expected_event(tid, [p.spec], d.spec, d_blocks, n))
                p.submit(ev.PrefillDone(tid, f"req-{tid}", (p_blocks,), n))
                d.wait(tid, lambda r, tid=tid: any(x.transfer_id == tid for x in r.received), 30)
                p.wait(tid, lambda r, tid=tid: f"req-{tid}" in r.sent, 30)
            reports = {r.transfer_id: r for r in p.reports}
            got = {x.transfer_id: x for x in d.received}
            samples = [
                (reports[f"demo-{n}-{i}"], got[f"demo-{n}-{i}"]) for i in range(1, repeats + 1)
            ]
            assert all(r.ok and x.ok for r, x in samples), "a demo transfer failed"
            write_ms = statistics.median((r.done_ns - r.posted_ns) / 1e6 for r, _ in samples)
            e2e_ms = statistics.median((x.at_ns - r.issued_ns) / 1e6 for r, x in samples)
            prep_ms = statistics.median((r.prepared_ns - r.issued_ns) / 1e6 for r, _ in samples)
            r0 = samples[0][0]
            rows.append(
                dict(
                    tokens=n,
                    mib=r0.bytes_total / 2**20,
                    blocks=r0.blocks,
                    descriptors=r0.descriptors,
                    prep_ms=prep_ms,
                    write_ms=write_ms,
                    e2e_ms=e2e_ms,
                    gbps=r0.bytes_total / (e2e_ms * 1e6),
                )
            )
    finally:
        p.stop()
        d.stop()
    table = Table(title=f"pushkv: P→D push over NIXL/UCX loopback, median of {repeats}")
    for col in ("tokens", "MiB", "blocks", "descs", "prep ms", "WRITE ms", "to D ms", "GB/s"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            str(r["tokens"]),
            f"{r['mib']:.1f}",
            str(r["blocks"]),
            str(r["descriptors"]),
            f"{r['prep_ms']:.3f}",
            f"{r['write_ms']:.3f}",
            f"{r['e2e_ms']:.3f}",
            f"{r['gbps']:.2f}",
        )
    console.print(table)
    return rows


if __name__ == "__main__":
    t0 = time.monotonic()
    run_transport_demo()
    print(f"done in {time.monotonic() - t0:.1f}s")

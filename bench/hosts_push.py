"""One P rank pushing into one D rank: on loopback, and across two simulated hosts.

Run (as root, for the hosts case): python -m bench.hosts_push [--mib 64] [--reps 5]
Cases: loopback with UCX's defaults here (tcp,sm,self: shared memory wins), loopback over
TCP only, and P and D in network namespaces of their own (``connector.tools.netbed``), UCX
over TCP on their veths: what the side channel, doorbells and WRITE cost when they cross
an interface. Each rep submits P's prefill first, then D's registration, and times the
registration until D has the transfer (register, WRITE, done); printed: median and min
over the reps after the first, and the first (which includes connecting). Real NIXL and
transfer threads, synthetic KV in DRAM, no vLLM.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from connector.core import events as ev
from connector.tools.loopback import RankProcess, RankSpec, expected_event, rank_main
from connector.tools.netbed import Host, InHost, NetBed, Unavailable
from connector.transport.ports import free_port


def push(p: RankProcess, d: RankProcess, tid: str, blocks: tuple[int, ...]) -> float:
    tokens = len(blocks) * p.spec.block_size
    p.submit(ev.PrefillDone(tid, f"preq-{tid}", (blocks,), tokens))
    t0 = time.monotonic()
    d.submit(expected_event(tid, [p.spec], d.spec, blocks, tokens))
    d.wait(f"{tid} received", lambda r: any(x.transfer_id == tid for x in r.received), 60)
    took = time.monotonic() - t0
    (got,) = [x for x in d.received if x.transfer_id == tid]
    assert got.ok, got
    p.wait(f"{tid} freed on P", lambda r: f"preq-{tid}" in r.sent, 30)
    return took


def case(name: str, mib: int, reps: int, hosts: list[Host] | None = None) -> None:
    blocks = mib * 2  # 8 layers x 4 heads x 32 tokens x 512 B = 512 KiB per block
    shape = dict(num_layers=8, num_blocks=blocks, block_size=32, token_bytes=512)
    ranks: list[RankProcess] = []
    try:
        for i, (role, engine) in enumerate((("P", "prefill"), ("D", "decode"))):
            host = hosts[i] if hosts else None
            addr = host.addr if host else "127.0.0.1"
            spec = RankSpec(role, engine, 0, 1, free_port(), host=addr, **shape)  # type: ignore[arg-type]
            target = InHost(host, rank_main, host.ucx_env()) if host else None
            ranks.append(RankProcess(spec, target=target))
        p, d = ranks
        times = [push(p, d, f"{name}-{i}", tuple(range(blocks))) for i in range(reps + 1)]
        rest = times[1:]
        print(
            f"{name:<28} {mib} MiB: median {statistics.median(rest) * 1e3:.0f} ms, "
            f"min {min(rest) * 1e3:.0f} ms over {reps}; first {times[0] * 1e3:.0f} ms",
            flush=True,
        )
    finally:
        for r in ranks:
            r.stop()


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.hosts_push", description=__doc__)
    ap.add_argument("--mib", type=int, default=64, help="KV per transfer, MiB")
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    os.environ.setdefault("UCX_NET_DEVICES", "lo")  # children inherit it at spawn
    os.environ["UCX_TLS"] = "tcp,sm,self"
    case("loopback-tcp.sm.self", a.mib, a.reps)
    os.environ["UCX_TLS"] = "tcp"
    case("loopback-tcp", a.mib, a.reps)
    try:
        with NetBed(2) as bed:
            case("two-hosts-tcp-on-veth", a.mib, a.reps, bed.hosts)
    except Unavailable as exc:
        print(f"two hosts: skipped ({exc})")


if __name__ == "__main__":
    main()

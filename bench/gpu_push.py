"""Push KV between a P and a D process through pushkv's own transfer path (Sender,
Receiver, transfer thread, NixlTransport) and time it, on CPU (DRAM) or GPU (VRAM).

Run: python -m bench.gpu_push --device cuda:0 [--d-device cuda:1] [--tokens 1024,4096,16384]
     [--no-doorbell] [--kv-layout BLHNC] [--paths direct,ipc,auto] [--d-block-size 32]
     [--json out.jsonl]
The KV is shaped like one TP rank of a Llama-3-8B-class model (32 layers, 8 KV heads;
``--layers 64 --kv-heads 1``: one rank of Qwen3-32B at TP8,
head_dim 128, bf16, K|V packed per token, 16-token blocks). For every size it moves a
prompt whose D blocks are contiguous, then one whose D blocks are scattered (random ids,
as in a busy server), checks every moved block by checksum, and prints: descriptors
after merging, P's descriptor prep, WRITE post -> DONE, P ready -> D counted, GB/s.
``--kv-layout`` lays the KV out as vLLM's views of that KVCacheLayout do (BLHNC: a block
of all layers is one page); ``--paths`` runs one P/D pair per ``xfer_paths`` value and
names the path each transfer took (``direct`` or ``ipc``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
from pathlib import Path

from connector.core import events as ev
from connector.tools.loopback import RankProcess, RankSpec, expected_event
from connector.transport.ports import free_port


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--d-device", default=None)
    ap.add_argument("--tokens", default="1024,4096,16384")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=1100)
    ap.add_argument("--kv-heads", type=int, default=8, help="1: a Qwen3-32B TP8 rank")
    ap.add_argument("--d-block-size", type=int, default=16, help="D's block size (P: 16)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--kv-layout", default=None, help="a vLLM KVCacheLayout, e.g. BLHNC")
    ap.add_argument("--paths", default="auto", help="xfer_paths values, one P/D pair each")
    ap.add_argument(
        "--no-doorbell",
        action="store_true",
        help="poll every millisecond instead of sleeping until the peer rings",
    )
    args = ap.parse_args()
    cuda = args.device != "cpu"
    os.environ.setdefault("UCX_TLS", "tcp,sm,self,cuda_copy,cuda_ipc" if cuda else "tcp,sm,self")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    shape = dict(
        num_layers=args.layers,
        num_blocks=args.blocks,
        block_size=16,
        num_kv_heads=args.kv_heads,
        token_bytes=2 * 128 * 2,
        doorbell=not args.no_doorbell,
    )
    rows: list[dict] = []
    for mode in args.paths.split(","):
        extra = dict(kv_layout=args.kv_layout, xfer_paths=mode) if args.kv_layout else {}
        run_pair(args, {**shape, **extra}, mode, rows)
    print(
        "\n| paths | path | tokens | D blocks | MiB | descriptors | prep ms | WRITE ms "
        "| P ready → D counted ms | GB/s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['paths']} | {r['path']} | {r['tokens']} | {r['layout']} | {r['mib']:.0f} | "
            f"{r['descriptors']} | {r['prep_ms']:.2f} | {r['write_ms']:.2f} | "
            f"{r['e2e_ms']:.2f} | {r['gbps']:.1f} |"
        )
    if args.json:
        out = Path(args.json)
        if out.suffix == ".jsonl":
            out.write_text("".join(json.dumps(r) + "\n" for r in rows))
        else:
            out.write_text(json.dumps(rows, indent=1))
    return 0


def run_pair(args: argparse.Namespace, shape: dict, mode: str, rows: list[dict]) -> None:
    """One P/D pair: every token count, contiguous then scattered D blocks."""
    dev = args.device
    p = RankProcess(RankSpec("P", "prefill", 0, 1, free_port(), device=dev, **shape), 120)
    d_shape = {**shape, "block_size": args.d_block_size}
    d = RankProcess(
        RankSpec("D", "decode", 0, 1, free_port(), device=args.d_device or dev, **d_shape), 120
    )
    rng = random.Random(0)
    try:
        for n in [int(x) for x in args.tokens.split(",")]:
            nb, d_nb = n // 16, n // args.d_block_size
            for layout in ("contiguous", "scattered"):
                samples = []
                for i in range(args.reps + 1):  # round 0 connects and warms up
                    tid = f"{layout}-{n}-{i}"
                    p_blocks = tuple(range(nb))
                    d_blocks = (
                        tuple(range(args.blocks - d_nb, args.blocks))
                        if layout == "contiguous"
                        else tuple(rng.sample(range(args.blocks), d_nb))
                    )
                    d.submit(expected_event(tid, [p.spec], d.spec, d_blocks, n))
                    p.submit(ev.PrefillDone(tid, f"req-{tid}", (p_blocks,), n))
                    d.wait(tid, lambda r, t=tid: any(x.transfer_id == t for x in r.received), 120)
                    p.wait(tid, lambda r, t=tid: f"req-{t}" in r.sent, 120)
                    got = next(x for x in d.received if x.transfer_id == tid)
                    rep = next((r for r in p.reports if r.transfer_id == tid), None)
                    if rep is None or not (got.ok and rep.ok):
                        raise SystemExit(
                            f"{tid} failed: D {got}, P {rep} (CPU KV needs one block size)"
                        )
                    if i == 1:  # verify one transfer per case
                        ps, ds = p.block_sums(list(p_blocks)), d.block_sums(list(d_blocks))
                        if nb != d_nb:  # other block sizes: compare each layer's total
                            ps, ds = ps.sum(axis=1), ds.sum(axis=1)
                        assert (ps == ds).all(), f"{tid}: moved blocks differ"
                    if i:
                        samples.append((rep, got))
                mid = lambda f, samples=samples: statistics.median(f(r, g) for r, g in samples)  # noqa: E731
                r0 = samples[0][0]
                e2e = mid(lambda r, g: (g.at_ns - r.issued_ns) / 1e6)
                rows.append(
                    dict(
                        paths=mode,
                        path=r0.path,
                        kv_layout=args.kv_layout or "synthetic",
                        p_block_size=16,
                        d_block_size=args.d_block_size,
                        tokens=n,
                        layout=layout,
                        mib=r0.bytes_total / 2**20,
                        descriptors=r0.descriptors,
                        prep_ms=mid(lambda r, g: (r.prepared_ns - r.issued_ns) / 1e6),
                        write_ms=mid(lambda r, g: (r.done_ns - r.posted_ns) / 1e6),
                        e2e_ms=e2e,
                        gbps=r0.bytes_total / (e2e * 1e6),
                    )
                )
                print(json.dumps(rows[-1]), flush=True)
    finally:
        p.stop()
        d.stop()


if __name__ == "__main__":
    sys.exit(main())

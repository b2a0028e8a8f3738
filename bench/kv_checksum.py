"""What KV integrity (``kv_checksum_every``) costs on this CPU: P's digest of a transfer
and D's check of its blocks, in ms and ms per MiB, against copying the same pieces (a
lower bound of a WRITE's time between two processes on one host).

Run: python -m bench.kv_checksum [--tokens 1024] [--repeats 5]. Real buffers in DRAM, the
planner's own pieces, ``connector.transfer.integrity`` as the transfer thread calls it.
"""

from __future__ import annotations

import argparse
import ctypes
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from connector.core import events as ev
from connector.core.heads import head_range
from connector.core.layout import KVLayout, Region
from connector.core.plan import Pieces, plan_transfer
from connector.transfer.integrity import Check, source_digest, verify

TOKEN_BYTES = 2 * 128 * 2  # packed K|V, head_size 128, bf16
NUM_KV_HEADS = 8
LAYERS = 24


@dataclass(frozen=True)
class Shape:
    name: str
    p_block: int = 16
    d_block: int = 16
    p_order: str = "HND"
    d_order: str = "HND"
    d_tp: int = 1  # D rank 0 of this TP receives; P has TP 1 (all heads)


SHAPES = [
    Shape("HND same, scattered ids"),
    Shape("HND TP1 -> TP2", d_tp=2),  # P writes half its heads into D rank 0
    Shape("NHD TP1 -> TP2", p_order="NHD", d_order="NHD", d_tp=2),
    Shape("HND Bs16 -> Bd32", d_block=32),
]


def _layout(buf: np.ndarray, block: int, heads: tuple[int, int], order: str) -> KVLayout:
    stride = (heads[1] - heads[0]) * block * TOKEN_BYTES
    per_layer = buf.size // LAYERS // stride * stride
    regions = tuple(
        Region(
            layer=i, group=0, part=0, base_addr=buf.ctypes.data + i * per_layer, block_stride=stride
        )
        for i in range(LAYERS)
    )
    return KVLayout(
        block_size=block,
        num_blocks=per_layer // stride,
        heads=heads,
        token_bytes=TOKEN_BYTES,
        order=order,  # type: ignore[arg-type]
        regions=regions,
    )


def _best(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3  # the least disturbed run on a shared host


def _copy(pieces: Pieces) -> None:
    for s, d, n in zip(
        pieces.src.tolist(), pieces.dst.tolist(), pieces.length.tolist(), strict=True
    ):
        ctypes.memmove(d, s, n)


def run(shape: Shape, tokens: int, repeats: int) -> dict[str, float]:
    rng = np.random.default_rng(0)
    p_blocks_n, d_blocks_n = -(-tokens // shape.p_block), -(-tokens // shape.d_block)
    d_heads = head_range(0, shape.d_tp, NUM_KV_HEADS)
    p_size = LAYERS * 2 * p_blocks_n * NUM_KV_HEADS * shape.p_block * TOKEN_BYTES
    d_size = LAYERS * 2 * d_blocks_n * (d_heads[1] - d_heads[0]) * shape.d_block * TOKEN_BYTES
    p_buf = rng.integers(0, 256, p_size, dtype=np.uint8)
    d_buf = np.zeros(d_size, dtype=np.uint8)
    src = _layout(p_buf, shape.p_block, (0, NUM_KV_HEADS), shape.p_order)
    dst = _layout(d_buf, shape.d_block, d_heads, shape.d_order)
    sb = (tuple(rng.permutation(src.num_blocks)[:p_blocks_n].tolist()),)
    db = (tuple(rng.permutation(dst.num_blocks)[:d_blocks_n].tolist()),)
    heads = d_heads  # P at TP 1 holds every head D rank 0 holds
    pieces = plan_transfer(src, sb, dst, db, first_token=0, num_tokens=tokens, heads=heads)
    copy_ms = _best(lambda: _copy(pieces), repeats)
    digest = source_digest(src, pieces, heads)
    exp = ev.Expected("t", "r", (), db, 0, tokens)
    assert verify(dst, exp, digest) is Check.OK
    mib = pieces.bytes_total / (1 << 20)
    p_ms = _best(lambda: source_digest(src, pieces, heads), repeats)
    d_ms = _best(lambda: verify(dst, exp, digest), repeats)
    return {"mib": mib, "pieces": pieces.count, "copy": copy_ms, "p": p_ms, "d": d_ms}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    print(
        f"{LAYERS} layers, {NUM_KV_HEADS} KV heads, {TOKEN_BYTES} B per token and head, "
        f"{args.tokens} tokens, best of {args.repeats}"
    )
    print(
        f"{'shape':28} {'MiB':>7} {'pieces':>7} {'copy ms':>8} {'P ms':>7} {'D ms':>7} "
        f"{'P ms/MiB':>9} {'D ms/MiB':>9} {'P/copy':>7}"
    )
    for shape in SHAPES:
        r = run(shape, args.tokens, args.repeats)
        print(
            f"{shape.name:28} {r['mib']:7.1f} {r['pieces']:7d} {r['copy']:8.2f} {r['p']:7.2f} "
            f"{r['d']:7.2f} {r['p'] / r['mib']:9.3f} {r['d'] / r['mib']:9.3f} "
            f"{r['p'] / r['copy']:7.2f}"
        )


if __name__ == "__main__":
    main()

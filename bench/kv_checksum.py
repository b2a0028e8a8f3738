"""What KV integrity (``kv_checksum_every``) costs: P's digest of a transfer and D's check
of its blocks, in ms and ms per MiB, against writing the same bytes.

Run: python -m bench.kv_checksum [--device cpu|cuda[:N]] [--tokens 1024[,16384]]
[--repeats 5] [--link-gbps 25]. The planner's own pieces over real buffers, digests by
``connector.transfer.integrity`` as the transfer thread calls them (wall time, the device
synchronised: what the thread waits).
- ``cpu``: buffers in DRAM; CRC-32 (both sides in host memory) and wsum64 (what P sends
  where D's KV is in GPU memory), against copying the pieces with ``memmove`` (a lower
  bound of a WRITE between two processes on one host).
- ``cuda``: buffers in GPU memory (``mem_type`` VRAM), wsum64 on the device, against the
  same pieces copied scattered on that GPU (torch ``index_select``/``index_copy_``: the
  IPC path's write without its Triton kernel) and one contiguous copy of as many bytes (the
  floor of any write on that GPU), both timed with CUDA events. ``--link-gbps``: also the
  digest against a WRITE of those bytes at that rate (a network's; derived, not measured).
Needs numpy and torch only (no NIXL, no vLLM).
"""

from __future__ import annotations

import argparse
import ctypes
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from connector.core import events as ev
from connector.core import messages as m
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


@dataclass(frozen=True)
class Memory:
    """A benchmark buffer: its address, size and where it lives."""

    addr: int
    size: int
    mem_type: str = "DRAM"
    device_id: int = 0


def _layout(buf: Memory, block: int, heads: tuple[int, int], order: str) -> KVLayout:
    stride = (heads[1] - heads[0]) * block * TOKEN_BYTES
    per_layer = buf.size // LAYERS // stride * stride
    regions = tuple(
        Region(layer=i, group=0, part=0, base_addr=buf.addr + i * per_layer, block_stride=stride)
        for i in range(LAYERS)
    )
    return KVLayout(
        block_size=block,
        num_blocks=per_layer // stride,
        heads=heads,
        token_bytes=TOKEN_BYTES,
        order=order,  # type: ignore[arg-type]
        regions=regions,
        device_id=buf.device_id,
        mem_type=buf.mem_type,  # type: ignore[arg-type]
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


def _buffers(device: str, p_size: int, d_size: int, rng: np.random.Generator) -> tuple:
    """P's buffer (random bytes) and D's (zeros), as ``Memory`` and the objects that own them."""
    if device == "cpu":
        p_buf = rng.integers(0, 256, p_size, dtype=np.uint8)
        d_buf = np.zeros(d_size, dtype=np.uint8)
        return Memory(p_buf.ctypes.data, p_size), Memory(d_buf.ctypes.data, d_size), (p_buf, d_buf)
    import torch

    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(0)
    p_t = torch.randint(0, 256, (p_size,), dtype=torch.uint8, device=dev, generator=gen)
    d_t = torch.zeros(d_size, dtype=torch.uint8, device=dev)
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    return (
        Memory(p_t.data_ptr(), p_size, "VRAM", idx),
        Memory(d_t.data_ptr(), d_size, "VRAM", idx),
        (p_t, d_t),
    )


def _device_writes(pieces: Pieces, p: Memory, d: Memory, owners: tuple, repeats: int) -> tuple:
    """(scattered, contiguous) device copy of the pieces' bytes, best of ``repeats``, in ms;
    checks that the scattered copy put P's bytes where the planner says."""
    import torch

    p_t, d_t = owners
    rel_s, rel_d, n = pieces.src - p.addr, pieces.dst - d.addr, pieces.length
    g = int(np.bitwise_or.reduce(np.concatenate([rel_s, rel_d, n]))) | 4096
    unit = g & -g  # rows of this many bytes tile every piece on both sides
    reps = n // unit
    offs = np.arange(int(reps.sum())) - np.repeat(np.cumsum(reps) - reps, reps)
    s_idx = torch.from_numpy(np.repeat(rel_s // unit, reps) + offs).to(p_t.device)
    d_idx = torch.from_numpy(np.repeat(rel_d // unit, reps) + offs).to(d_t.device)
    s_rows = p_t[: p_t.numel() // unit * unit].view(-1, unit)
    d_rows = d_t[: d_t.numel() // unit * unit].view(-1, unit)
    flat_src = torch.empty(pieces.bytes_total, dtype=torch.uint8, device=p_t.device)
    flat_dst = torch.empty_like(flat_src)

    def timed(fn: Callable[[], object]) -> float:
        best = math.inf
        for _ in range(repeats):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            best = min(best, a.elapsed_time(b))
        return best

    scattered = timed(lambda: d_rows.index_copy_(0, d_idx, s_rows.index_select(0, s_idx)))
    contiguous = timed(lambda: flat_dst.copy_(flat_src))
    assert torch.equal(d_rows[d_idx[-1]], s_rows[s_idx[-1]])
    return scattered, contiguous


def _digest_times(
    src: KVLayout,
    dst: KVLayout,
    pieces: Pieces,
    heads: tuple[int, int],
    exp: ev.Expected,
    d_kind: str,
    digest: m.KvDigest,
    repeats: int,
) -> tuple[float, float]:
    """P's digest and D's check of one transfer, best of ``repeats``, in ms."""
    p_ms = _best(lambda: source_digest(src, pieces, heads, d_kind), repeats)
    return p_ms, _best(lambda: verify(dst, exp, digest), repeats)


def run(shape: Shape, tokens: int, repeats: int, device: str = "cpu") -> dict[str, float]:
    rng = np.random.default_rng(0)
    p_blocks_n, d_blocks_n = -(-tokens // shape.p_block), -(-tokens // shape.d_block)
    d_heads = head_range(0, shape.d_tp, NUM_KV_HEADS)
    p_size = LAYERS * 2 * p_blocks_n * NUM_KV_HEADS * shape.p_block * TOKEN_BYTES
    d_size = LAYERS * 2 * d_blocks_n * (d_heads[1] - d_heads[0]) * shape.d_block * TOKEN_BYTES
    p_mem, d_mem, owners = _buffers(device, p_size, d_size, rng)
    src = _layout(p_mem, shape.p_block, (0, NUM_KV_HEADS), shape.p_order)
    dst = _layout(d_mem, shape.d_block, d_heads, shape.d_order)
    sb = (tuple(rng.permutation(src.num_blocks)[:p_blocks_n].tolist()),)
    db = (tuple(rng.permutation(dst.num_blocks)[:d_blocks_n].tolist()),)
    heads = d_heads  # P at TP 1 holds every head D rank 0 holds
    pieces = plan_transfer(src, sb, dst, db, first_token=0, num_tokens=tokens, heads=heads)
    out: dict[str, float] = {"mib": pieces.bytes_total / (1 << 20), "pieces": pieces.count}
    if device == "cpu":
        out["copy"] = _best(lambda: _copy(pieces), repeats)
    else:
        out["copy"], out["flat"] = _device_writes(pieces, p_mem, d_mem, owners, repeats)
    exp = ev.Expected("t", "r", (), db, 0, tokens)
    # On CPU both algorithms (D in host memory: crc32; in GPU memory: wsum64); on a GPU,
    # wsum64 by torch's ops and by the Triton kernel (connector/transfer/gpu/wsum_kernel.py).
    runs = (
        [("DRAM", ""), ("VRAM", "")] if device == "cpu" else [("VRAM", "torch"), ("VRAM", "triton")]
    )
    for d_kind, backend in runs:
        if backend:
            os.environ["PUSHKV_WSUM_BACKEND"] = backend  # read at each digest
        digest = source_digest(src, pieces, heads, d_kind)
        assert digest is not None and verify(dst, exp, digest) is Check.OK, digest
        p_ms, d_ms = _digest_times(src, dst, pieces, heads, exp, d_kind, digest, repeats)
        name = f"{digest.algo}/{backend}" if backend else digest.algo
        out[f"{name} P"], out[f"{name} D"] = p_ms, d_ms
        out[f"{name} value"] = float(digest.value % (1 << 52))  # the backends must agree
    os.environ.pop("PUSHKV_WSUM_BACKEND", None)
    if device != "cpu":
        assert out["wsum64/torch value"] == out["wsum64/triton value"], "backends disagree"
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", help="cpu, or cuda / cuda:N")
    ap.add_argument("--tokens", default=None, help="comma list (default 1024; cuda 1024,16384)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--link-gbps", type=float, default=0.0, help="also: vs a WRITE at this rate")
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    tokens = [int(t) for t in (args.tokens or ("1024,16384" if cuda else "1024")).split(",")]
    where = "DRAM"
    if cuda:
        import torch

        where = (
            f"{torch.cuda.get_device_name(torch.device(args.device))}, torch {torch.__version__}"
        )
    print(
        f"{LAYERS} layers, {NUM_KV_HEADS} KV heads, {TOKEN_BYTES} B per token and head, "
        f"best of {args.repeats}, {where}"
    )
    write = "scattered device copy (torch); flat: one contiguous copy" if cuda else "memmove"
    print(f"copy: {write}; P: digest of the source; D: check of its blocks; ms wall")
    for n in tokens:
        print(f"\n{n} tokens")
        rows = [
            (shape, run(shape, n, args.repeats, "cuda" if args.device == "cuda" else args.device))
            for shape in SHAPES
        ]
        algos = [k[:-2] for k in rows[0][1] if k.endswith(" P")]
        for algo in algos:
            head = f"{'shape':28} {'MiB':>7} {'pieces':>7} {'copy ms':>8}"
            head += f" {'flat ms':>8}" if cuda else ""
            head += (
                f" {algo + ' P ms':>12} {'D ms':>7} {'P ms/MiB':>9} {'D ms/MiB':>9} {'P/copy':>7}"
            )
            head += f" {'P/flat':>7}" if cuda else ""
            head += f" {'P/link':>7}" if args.link_gbps else ""
            print(head)
            for shape, r in rows:
                p, d = r[f"{algo} P"], r[f"{algo} D"]
                line = f"{shape.name:28} {r['mib']:7.1f} {int(r['pieces']):7d} {r['copy']:8.2f}"
                line += f" {r['flat']:8.2f}" if cuda else ""
                line += f" {p:12.2f} {d:7.2f} {p / r['mib']:9.3f} {d / r['mib']:9.3f}"
                line += f" {p / r['copy']:7.2f}"
                line += f" {p / r['flat']:7.2f}" if cuda else ""
                if args.link_gbps:
                    link_ms = r["mib"] * (1 << 20) / (args.link_gbps * 1e9) * 1e3
                    line += f" {p / link_ms:7.3f}"
                print(line)


if __name__ == "__main__":
    main()

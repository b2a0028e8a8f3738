"""WRITE latency/throughput and notification round trip of NixlTransport, two processes.

Run: python -m bench.transport_bench [--device cuda] [--sizes 1,4,16,64,256] [--reps 10]
The test process is the initiator; a spawned child is the target: it holds the
destination buffer and echoes every ``PING:<n>`` notification back as ``PONG:<n>``.
Cases per size: one contiguous descriptor, and scattered pieces (default 16 and 64 KiB)
whose destinations are a fixed random permutation, so NIXL cannot merge them.
Reported: post -> DONE (median, min), GB/s at the min, descriptor prep time, and the
round trips of a standalone notification and of a 4 KiB WRITE whose notification is
echoed. DRAM uses numpy buffers; ``--device cuda`` uses torch CUDA tensors (VRAM).

Owns nothing the connector imports. Uses connector.transport.nixl, numpy, torch only for
--device cuda, rich if installed. Loopback only: UCX_NET_DEVICES=lo by default.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

MIB = 1 << 20
KIB = 1 << 10


def set_ucx_env(device: str, tls: str | None) -> None:
    """Loopback-only defaults, set before any agent (or child) exists."""
    if tls:
        os.environ["UCX_TLS"] = tls
    elif device == "cuda":
        os.environ.setdefault("UCX_TLS", "tcp,sm,self,cuda_copy,cuda_ipc")
    else:
        os.environ.setdefault("UCX_TLS", "tcp,sm,self")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")


def alloc(nbytes: int, device: str, gpu: int) -> tuple[Any, int]:
    """A zeroed buffer and its address; CUDA is initialised before the agent exists."""
    if device == "cuda":
        import torch

        torch.cuda.set_device(gpu)
        buf = torch.zeros(nbytes, dtype=torch.uint8, device=f"cuda:{gpu}")
        torch.cuda.synchronize()
        return buf, int(buf.data_ptr())
    arr = np.zeros(nbytes, dtype=np.uint8)
    return arr, int(arr.ctypes.data)


def checksum(buf: Any, nbytes: int, device: str) -> int:
    if device == "cuda":
        return int(buf[:nbytes].to(dtype=__import__("torch").int64).sum().item())
    return int(buf[:nbytes].astype(np.int64).sum())


def target_main(conn: Connection, port: int, nbytes: int, device: str, gpu: int) -> None:
    from connector.transport.nixl import NixlTransport

    buf, addr = alloc(nbytes, device, gpu)
    t = NixlTransport("bench-target", listen_port=port)
    t.register_memory([(addr, nbytes)], "VRAM" if device == "cuda" else "DRAM", gpu)
    conn.send(addr)
    try:
        while True:
            for sender, msg in t.get_notifs():
                if msg.startswith(b"PING:"):
                    t.send_notif(sender, b"PONG:" + msg[5:])
            if conn.poll(0):
                cmd, arg = conn.recv()
                if cmd == "exit":
                    return
                if cmd == "checksum":
                    conn.send(checksum(buf, arg, device))
    finally:
        t.close()


def free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rows(base: int, order: np.ndarray, piece: int, devid: int) -> np.ndarray:
    out = np.empty((order.size, 3), dtype=np.uint64)
    out[:, 0] = base + order.astype(np.uint64) * piece
    out[:, 1] = piece
    out[:, 2] = devid
    return out


def time_write(
    t: Any, src: np.ndarray, dst: np.ndarray, mem: str, notif: bytes, timeout_s: float = 60.0
) -> tuple[float, float]:
    """(prep seconds, post -> DONE seconds) of one WRITE. ``posted_ns`` is taken right
    before NIXL's transfer(), so prep = descriptor lists + initialize_xfer."""
    start_ns = time.time_ns()
    h = t.write("bench-target", src, dst, notif, src_mem=mem, dst_mem=mem)
    deadline = time.monotonic() + timeout_s
    while not t.poll_write(h):
        if time.monotonic() > deadline:
            raise TimeoutError("WRITE not DONE in time")
    done_ns = time.time_ns()
    t.release(h)
    return (h.posted_ns - start_ns) / 1e9, (done_ns - h.posted_ns) / 1e9


def wait_pong(t: Any, n: int, timeout_s: float = 10.0, handle: Any = None) -> None:
    """Wait for ``PONG:<n>``, polling ``handle`` meanwhile: NIXL sends a WRITE's
    notification when the initiator sees the WRITE complete in check_xfer_state (or at
    once, if transfer() finished it), so get_notifs alone would wait forever."""
    want = b"PONG:%d" % n
    deadline = time.monotonic() + timeout_s
    while True:
        if handle is not None and t.poll_write(handle):
            handle = None
        if any(m == want for _, m in t.get_notifs()):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {want!r} within {timeout_s}s")


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    from connector.transport.nixl import NixlTransport

    sizes = [int(s) * MIB for s in args.sizes.split(",")]
    piece_sizes = [int(p) * KIB for p in args.pieces.split(",") if p]
    max_bytes = max(sizes)
    mem = "VRAM" if args.device == "cuda" else "DRAM"
    tgt_gpu = args.target_gpu if args.target_gpu is not None else args.gpu
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    port = free_port()
    proc = ctx.Process(
        target=target_main, args=(child, port, max_bytes, args.device, tgt_gpu), daemon=True
    )
    proc.start()
    results: list[dict[str, Any]] = []
    t = None
    try:
        src_buf, src_addr = alloc(max_bytes, args.device, args.gpu)
        if args.device == "cuda":
            src_buf.random_(1, 255)
        else:
            src_buf[:] = np.random.default_rng(0).integers(1, 256, max_bytes, dtype=np.uint8)
        t = NixlTransport("bench-initiator", listen_port=free_port())
        t.register_memory([(src_addr, max_bytes)], mem, args.gpu)
        if not parent.poll(120):
            raise TimeoutError("target did not start")
        dst_addr = parent.recv()
        t.connect("bench-target", "127.0.0.1", port, timeout_s=30)
        for _ in range(1000):  # wire the endpoint up before timing anything
            t.progress()

        # Sanity: one contiguous MiB lands intact.
        check = min(MIB, max_bytes)
        one = np.array([[src_addr, check, args.gpu]], dtype=np.uint64)
        time_write(t, one, np.array([[dst_addr, check, tgt_gpu]], dtype=np.uint64), mem, b"")
        parent.send(("checksum", check))
        if parent.recv() != checksum(src_buf, check, args.device):
            raise RuntimeError("verification of the first MiB failed")

        rng = np.random.default_rng(1)
        for size in sizes:
            cases = [("contiguous", size)] + [
                (f"scattered {p // KIB} KiB", p) for p in piece_sizes if p <= size
            ]
            for label, piece in cases:
                n = size // piece
                src = rows(src_addr, np.arange(n), piece, args.gpu)
                dst = rows(dst_addr, rng.permutation(n), piece, tgt_gpu)
                for _ in range(args.warmup):
                    time_write(t, src, dst, mem, b"W")
                preps, posts = [], []
                for _ in range(args.reps):
                    prep, post = time_write(t, src, dst, mem, b"W")
                    preps.append(prep)
                    posts.append(post)
                results.append(
                    {
                        "kind": "write",
                        "case": label,
                        "bytes": size,
                        "descs": n,
                        "median_ms": statistics.median(posts) * 1e3,
                        "min_ms": min(posts) * 1e3,
                        "gbps": size / min(posts) / 1e9,
                        "prep_ms": statistics.median(preps) * 1e3,
                    }
                )
                print(
                    f"  {size // MIB:>4} MiB {label:<18} {n:>6} descs  median "
                    f"{results[-1]['median_ms']:.3f} ms",
                    file=sys.stderr,
                    flush=True,
                )

        results.extend(round_trips(t, src_addr, dst_addr, mem, args))
    finally:
        if proc.is_alive():
            parent.send(("exit", None))
            proc.join(10)
        if proc.exitcode is None:
            proc.kill()  # by PID
            proc.join(10)
        if t is not None:
            t.close()
    return results


def round_trips(
    t: Any, src_addr: int, dst_addr: int, mem: str, args: argparse.Namespace
) -> list[dict[str, Any]]:
    tgt_gpu = args.target_gpu if args.target_gpu is not None else args.gpu
    notif_rtt, write_rtt = [], []
    src = np.array([[src_addr, 4 * KIB, args.gpu]], dtype=np.uint64)
    dst = np.array([[dst_addr, 4 * KIB, tgt_gpu]], dtype=np.uint64)
    for i in range(args.warmup + args.ping_reps):
        t0 = time.perf_counter()
        t.send_notif("bench-target", b"PING:%d" % i)
        wait_pong(t, i)
        if i >= args.warmup:
            notif_rtt.append(time.perf_counter() - t0)
    for i in range(args.warmup + args.ping_reps):
        n = 1_000_000 + i
        t0 = time.perf_counter()
        h = t.write("bench-target", src, dst, b"PING:%d" % n, src_mem=mem, dst_mem=mem)
        wait_pong(t, n, handle=h)
        while not t.poll_write(h):
            pass
        t.release(h)
        if i >= args.warmup:
            write_rtt.append(time.perf_counter() - t0)
    out = []
    for label, xs in (
        ("send_notif -> PONG", notif_rtt),
        ("4 KiB WRITE -> notif -> PONG", write_rtt),
    ):
        out.append(
            {
                "kind": "rtt",
                "case": label,
                "median_us": statistics.median(xs) * 1e6,
                "min_us": min(xs) * 1e6,
                "reps": len(xs),
            }
        )
    return out


def render(results: list[dict[str, Any]], title: str) -> None:
    writes = [r for r in results if r["kind"] == "write"]
    rtts = [r for r in results if r["kind"] == "rtt"]
    head = ["size", "layout", "descs", "median ms", "min ms", "GB/s (min)", "prep ms"]
    body = [
        [
            f"{r['bytes'] // MIB} MiB",
            r["case"],
            str(r["descs"]),
            f"{r['median_ms']:.3f}",
            f"{r['min_ms']:.3f}",
            f"{r['gbps']:.2f}",
            f"{r['prep_ms']:.3f}",
        ]
        for r in writes
    ]
    head2 = ["round trip", "median us", "min us", "reps"]
    body2 = [
        [r["case"], f"{r['median_us']:.1f}", f"{r['min_us']:.1f}", str(r["reps"])] for r in rtts
    ]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        for h, b in ((head, body), (head2, body2)):
            print(" | ".join(h))
            for row in b:
                print(" | ".join(row))
        return
    console = Console()
    for h, b, name in ((head, body, title), (head2, body2, "notification round trips")):
        table = Table(title=name)
        for col in h:
            table.add_column(
                col, no_wrap=True, justify="left" if col in ("layout", "round trip") else "right"
            )
        for row in b:
            table.add_row(*row)
        console.print(table)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--gpu", type=int, default=0, help="initiator CUDA device")
    ap.add_argument("--target-gpu", type=int, default=None, help="target CUDA device")
    ap.add_argument("--sizes", default="1,4,16,64,256", help="MiB, comma separated")
    ap.add_argument("--pieces", default="16,64", help="scattered piece sizes, KiB")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--ping-reps", type=int, default=200)
    ap.add_argument("--ucx-tls", default=None, help="override UCX_TLS")
    ap.add_argument("--json", default=None, help="also write results to this file")
    args = ap.parse_args(argv)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("--device cuda: torch.cuda is not available", file=sys.stderr)
            return 2
    set_ucx_env(args.device, args.ucx_tls)
    results = run(args)
    title = (
        f"NIXL WRITE, {'VRAM' if args.device == 'cuda' else 'DRAM'}, "
        f"UCX_TLS={os.environ['UCX_TLS']}, median of {args.reps}"
    )
    render(results, title)
    if args.json:
        Path(args.json).write_text(json.dumps({"title": title, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

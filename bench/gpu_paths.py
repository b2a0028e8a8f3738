"""Direct, staged and IPC transfer paths for one request's KV, P and D in two processes.

Over 400 lines, one job: one benchmark whose three paths share the rank processes and checks.

Run: python -m bench.gpu_paths --device cuda:0 [--models qwen3-32b-tp8,llama-8b-tp1]
     [--tokens 1024,4096,16384] [--patterns contiguous,scattered,allocator] [--out X.jsonl]
CPU smoke run: python -m bench.gpu_paths --device cpu --models tiny --tokens 256,1024

KV shaped like one TP rank of Qwen3-32B at TP8 (64 layers, 1 KV head, head_dim 128, bf16,
K and V in separate regions: 4 KiB rows) or Llama-8B at TP1 (32 layers, 8 KV heads, K|V
packed: 64 KiB rows), 16-token blocks on both sides. Block ids: contiguous, uniformly
scattered (a random permutation on each side), or taken from a simulated allocator after a
serving trace. Paths, each timed from P's start to D's "KV ready" (CLOCK_MONOTONIC is one
clock for both processes) and verified by per-row checksums of D's blocks against P's:
- ``direct``: pushkv's planner (``plan_transfer``) + ``NixlTransport.write``, notification;
- ``staged``: ``connector.transfer.gpu.staged`` (Triton gather on P, one WRITE per layer
  chunk into D's staging slots, scatter on D's own stream, slot credits);
- ``ipc``: ``connector.transfer.gpu.ipc``: D's KV mapped into P's process through CUDA IPC
  (handles from torch's ``_share_cuda_``), one scattered -> scattered kernel, then a NIXL
  notification once its event has fired;
- ``devcopy``: the same bytes as one contiguous device copy in P (the limit).
Also READ (D pulls from P) on the direct path for contiguous ids at 4k tokens.
Prints one JSON line per case and a table; ``--out`` writes the JSON lines.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from collections import deque
from multiprocessing import get_context
from typing import Any

import msgspec
import numpy as np

from bench.gpu_shapes import BLOCK, MODELS, Model

RUN_ROUNDS = 600.0  # seconds a worker waits on one command


# -- block ids ---------------------------------------------------------------------


def allocator_ids(num_blocks: int, need: int, seed: int) -> list[int]:
    """Blocks a vLLM-like allocator hands a request after a serving trace: a FIFO free
    queue, requests of lognormal length, freed in reverse order to the tail."""
    rng = random.Random(seed)
    free = deque(range(num_blocks))
    live: list[list[int]] = []
    for _ in range(4000):
        n = max(1, min(num_blocks // 4, int(rng.lognormvariate(math.log(60), 1.0))))
        if n <= len(free):
            live.append([free.popleft() for _ in range(n)])
        while live and (len(free) < num_blocks // 3 or rng.random() < 0.45):
            free.extend(reversed(live.pop(rng.randrange(len(live)))))
    while len(free) < need:
        free.extend(reversed(live.pop(rng.randrange(len(live)))))
    return [free.popleft() for _ in range(need)]


def block_ids(pattern: str, num_blocks: int, need: int, side: int, seed: int) -> list[int]:
    if pattern == "contiguous":
        return list(range(need)) if side == 0 else list(range(num_blocks - need, num_blocks))
    if pattern == "scattered":
        return random.Random(seed * 2 + side).sample(range(num_blocks), need)
    return allocator_ids(num_blocks, need, seed * 2 + side)


# -- worker processes ----------------------------------------------------------------


class Worker:
    """P or D: KV cache, NIXL transport, staging pool, run on command."""

    def __init__(self, role: str, a: dict[str, Any], peer_conn: Any) -> None:
        import torch

        from connector.core.heads import HeadRange
        from connector.core.layout import KVLayout, Region
        from connector.transfer.gpu.ipc import export_rows
        from connector.transfer.gpu.lanes import Lane
        from connector.transfer.gpu.rows import RowTable
        from connector.transfer.gpu.staged import StagingBuffer
        from connector.transfer.staging import SlotPool
        from connector.transport.nixl import NixlTransport

        self.torch, self.role, self.a, self.peer_conn = torch, role, a, peer_conn
        self.model = m = MODELS[a["model"]]
        self.dev = torch.device(a["device"])
        self.cuda = self.dev.type == "cuda"
        if self.cuda:
            torch.cuda.set_device(self.dev)
        nb, shape = a["num_blocks"], (m.regions, a["num_blocks"], m.row_bytes)
        if role == "P":
            g = torch.Generator(device=self.dev).manual_seed(7)
            self.kv = torch.randint(1, 256, shape, dtype=torch.uint8, device=self.dev, generator=g)
        else:
            self.kv = torch.zeros(shape, dtype=torch.uint8, device=self.dev)
        # D's export first: on CPU, sharing moves the memory (no address may be taken before)
        self.ipc = export_rows(RowTable.of(list(self.kv.unbind(0)))) if role == "D" else None
        self.rows = RowTable.of(list(self.kv.unbind(0)))
        self.layout = KVLayout(
            block_size=BLOCK,
            num_blocks=nb,
            heads=(0, m.heads),
            token_bytes=m.token_bytes,
            order="HND",
            regions=tuple(
                Region(layer=r, group=0, part=0, base_addr=a, block_stride=m.row_bytes)
                for r, a in enumerate(self.rows.addrs())
            ),
            mem_type="VRAM" if self.cuda else "DRAM",
            device_id=int(self.dev.index or 0) if self.cuda else 0,
        )
        self.heads: HeadRange = (0, m.heads)
        self.pools = [SlotPool(n, mib * 2**20) for n, mib in a["pools"]]
        self.stagings = [StagingBuffer(pool, self.dev) for pool in self.pools]
        self.lane = Lane(self.dev)
        self.t = NixlTransport(role, listen_port=a["ports"][role])
        self.t.register_memory(
            [(self.kv.data_ptr(), self.kv.numel())], self.layout.mem_type, self.layout.device_id
        )
        for staging in self.stagings:
            staging.register(self.t)
        self.peer = "D" if role == "P" else "P"
        self.peer_rows: Any = None
        self.scratch: Any = None

    def connect(self) -> dict[str, Any]:
        self.t.connect(self.peer, "127.0.0.1", self.a["ports"][self.peer], timeout_s=60)
        ipc = msgspec.msgpack.encode(self.ipc) if self.ipc is not None else None
        return {"layout": self.layout, "staging": [s.remote() for s in self.stagings], "ipc": ipc}

    def ipc_import(self, wire: bytes) -> bool:
        """P: map D's KV rows from D's IpcExport (as a peer would receive it)."""
        from connector.transfer.gpu.ipc import IpcExport, import_rows

        self.peer_rows = import_rows(msgspec.msgpack.decode(wire, type=IpcExport))
        return True

    def ids(self, ids: list[int]) -> Any:
        return self.torch.tensor(ids, dtype=self.torch.int64, device=self.dev)

    def chunks(self, case: dict[str, Any]) -> list[Any]:
        """The staged path's chunk plan for ``case``: P and D derive the same one."""
        from connector.transfer.staging import plan_chunks

        return plan_chunks(
            self.model.regions,
            len(case["p_ids"]),
            self.model.row_bytes,
            self.pools[case["pool"]].slot_bytes,
            case["min_chunks"],
        )

    def sums(self, ids: list[int]) -> np.ndarray:
        """(regions, blocks, 2) int64: sum and position-weighted sum of each row's words."""
        torch = self.torch
        t = self.ids(ids)
        words = self.model.row_bytes // 8
        w = torch.arange(1, words + 1, dtype=torch.int64, device=self.dev)
        out = []
        for r in range(self.model.regions):
            x = self.kv[r].index_select(0, t).view(torch.int64)
            out.append(torch.stack((x.sum(1), (x * w).sum(1)), dim=1))
        return torch.stack(out).cpu().numpy()

    def poison(self, ids: list[int]) -> None:
        self.kv.index_fill_(1, self.ids(ids), 0)
        self.sync()

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize(self.dev)

    def notifs(self, want: bytes) -> tuple[list[bytes], bool]:
        got, hit = [], False
        for _, raw in self.t.get_notifs():
            if raw == want:
                hit = True
            else:
                got.append(raw)
        return got, hit


def run_p(w: Worker, case: dict[str, Any]) -> dict[str, Any]:
    from connector.core.plan import plan_transfer
    from connector.transfer.gpu.ipc import IpcPush
    from connector.transfer.gpu.staged import StagedPush
    from connector.transfer.staging import StagedSend, decode_notif

    path, tid = case["path"], case["tid"]
    p_ids, d_ids = w.ids(case["p_ids"]), w.ids(case["d_ids"])
    out: dict[str, Any] = {}
    w.sync()
    t0 = time.monotonic_ns()
    out["t0_ns"] = t0
    if path == "direct":
        pieces = plan_transfer(
            w.layout,
            [case["p_ids"]],
            case["d_layout"],
            [case["d_ids"]],
            first_token=0,
            num_tokens=case["tokens"],
            heads=w.heads,
        )
        src, dst = pieces.as_descs(w.layout.device_id, case["d_layout"].device_id)
        t1 = time.monotonic_ns()
        h = w.t.write(
            "D", src, dst, tid.encode(), src_mem=w.layout.mem_type, dst_mem=w.layout.mem_type
        )
        t2 = time.monotonic_ns()
        while not w.t.poll_write(h):
            pass
        t3 = time.monotonic_ns()
        w.t.release(h)
        out.update(
            descriptors=pieces.count,
            prep_ms=(t1 - t0) / 1e6,
            post_ms=(t2 - t1) / 1e6,
            write_ms=(t3 - t1) / 1e6,
        )
    elif path == "staged":
        chunks = w.chunks(case)
        push = StagedPush(
            w.t,
            "D",
            tid,
            w.rows,
            p_ids,
            StagedSend(chunks, w.pools[case["pool"]], case["d_slots"]),
            w.stagings[case["pool"]],
            case["d_staging"][case["pool"]],
            w.lane,
        )
        while not push.pump():
            for _, raw in w.t.get_notifs():
                msg = decode_notif(raw)
                if msg.transfer_id == tid:  # a late credit of an earlier run is dropped
                    push.on_notif(msg)  # type: ignore[arg-type]
        w.lane.synchronize()
        out.update(
            descriptors=len(chunks),
            gather_ms=push.gather_times.device_ms(),
            write_ms=(push.write_times.last_done_ns - push.write_times.first_post_ns) / 1e6,
            chunks=len(chunks),
        )
    elif path == "ipc":
        push = IpcPush(w.t, "D", w.rows, p_ids, w.peer_rows, d_ids, w.lane, tid.encode())
        while not push.pump():
            pass
        out.update(descriptors=0, kernel_ms=push.device_ms())
    elif path == "devcopy":
        n = case["bytes"]
        if w.scratch is None or w.scratch.numel() < n:
            w.scratch = w.torch.empty(n, dtype=w.torch.uint8, device=w.dev)
        flat = w.kv.view(-1)
        begin = w.lane.record()
        with w.lane.active():
            w.scratch[:n].copy_(flat[:n])
        end = w.lane.record()
        end.wait()
        ok = bool(w.torch.equal(w.scratch[:n], flat[:n]))
        out.update(descriptors=1, copy_ms=begin.elapsed_ms(end), copy_ok=ok)
    elif path == "read":  # D pulls; P only drives progress until D says it is done
        while tid.encode() not in [raw for _, raw in w.t.get_notifs()]:
            pass
    out["p_done_ns"] = time.monotonic_ns()
    return out


def run_d(w: Worker, case: dict[str, Any]) -> dict[str, Any]:
    """D's part of one case: wait for the KV (and scatter it, on the staged path)."""
    from connector.transfer.gpu.staged import StagedLand
    from connector.transfer.staging import StagedRecv, decode_notif

    path, tid = case["path"], case["tid"].encode()
    out: dict[str, Any] = {}
    deadline = time.monotonic() + case.get("timeout_s", 120)
    if path == "read":
        from connector.core.plan import plan_transfer

        pieces = plan_transfer(
            case["p_layout"],
            [case["p_ids"]],
            w.layout,
            [case["d_ids"]],
            first_token=0,
            num_tokens=case["tokens"],
            heads=w.heads,
        )
        src, dst = pieces.as_descs(w.layout.device_id)
        agent = w.t._live_agent()  # READ is not part of the Transport protocol: NIXL directly
        w.peer_conn.send("armed")
        t0 = time.monotonic_ns()
        local = agent.get_xfer_descs(dst, w.layout.mem_type)
        remote = agent.get_xfer_descs(src, w.layout.mem_type)
        x = agent.initialize_xfer("READ", local, remote, "P")
        state = agent.transfer(x)
        while state != "DONE":
            if state == "ERR" or time.monotonic() > deadline:
                raise RuntimeError(f"READ {state}")
            state = agent.check_xfer_state(x)
        t1 = time.monotonic_ns()
        x.release()
        w.t.send_notif("P", tid)  # P drives progress until then (tcp emulates RMA)
        return {
            "t0_ns": t0,
            "ready_ns": t1,
            "descriptors": pieces.count,
            "write_ms": (t1 - t0) / 1e6,
        }
    if path == "staged":
        chunks = w.chunks(case)
        land = StagedLand(
            w.t,
            "P",
            case["tid"],
            w.rows,
            w.ids(case["d_ids"]),
            StagedRecv(chunks, case["d_slots"]),
            w.stagings[case["pool"]],
            w.lane,
        )
        w.peer_conn.send("armed")
        while not land.pump():
            for _, raw in w.t.get_notifs():
                msg = decode_notif(raw)
                if msg.transfer_id == case["tid"]:
                    land.on_notif(msg)  # type: ignore[arg-type]
            if time.monotonic() > deadline:
                raise TimeoutError("staged: D not ready")
        out["ready_ns"] = land.ready_ns
        out["scatter_ms"] = land.scatter_times.device_ms()
        return out
    w.peer_conn.send("armed")
    if path == "devcopy":
        return {"ready_ns": 0}
    while True:
        _, hit = w.notifs(tid)
        if hit:
            out["ready_ns"] = time.monotonic_ns()
            return out
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path}: no notification")


def worker_main(role: str, conn: Any, peer_conn: Any, a: dict[str, Any]) -> None:
    os.environ.update(a["env"])
    try:
        w = Worker(role, a, peer_conn)
        conn.send(("ok", None))
    except Exception as exc:  # report to the parent instead of dying silently
        conn.send(("error", repr(exc)))
        return
    while True:
        cmd, arg = conn.recv()
        if cmd == "stop":
            w.t.close()
            conn.send(("ok", None))
            return
        try:
            fn = {
                "connect": lambda _: w.connect(),
                "ipc_import": w.ipc_import,
                "sums": w.sums,
                "poison": w.poison,
                "reserve": lambda k: w.pools[k].acquire_many(w.pools[k].num_slots),
                "release": lambda ks: [w.pools[ks[0]].release(s) for s in ks[1]],
                "run": (lambda c: run_p(w, c)) if role == "P" else (lambda c: run_d(w, c)),
            }[cmd]
            conn.send(("ok", fn(arg)))
        except Exception as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


class Handle:
    def __init__(self, ctx: Any, role: str, peer_conn: Any, a: dict[str, Any]) -> None:
        self.role = role
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=worker_main, args=(role, child, peer_conn, a), daemon=True)
        self.proc.start()

    def send(self, cmd: str, arg: Any = None) -> None:
        self.conn.send((cmd, arg))

    def recv(self, timeout_s: float = RUN_ROUNDS) -> Any:
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"{self.role}: no answer in {timeout_s}s")
        status, val = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"{self.role}: {val}")
        return val

    def call(self, cmd: str, arg: Any = None) -> Any:
        self.send(cmd, arg)
        return self.recv()

    def stop(self) -> None:
        try:
            self.call("stop")
        except (RuntimeError, TimeoutError, OSError, EOFError):
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


# -- the parent ----------------------------------------------------------------------


def median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else 0.0


def one_case(p: Handle, d: Handle, case: dict[str, Any], d_pipe: Any, reps: int) -> dict[str, Any]:
    """Warm-up plus ``reps`` runs of one (pattern, path); every run verified."""
    want = case["p_sums"]
    runs, ok = [], True
    for i in range(reps + 1):
        if case["path"] != "devcopy":
            d.call("poison", case["d_ids"])
        c = dict(case, tid=f"{case['tid']}-{i}")
        d.send("run", c)
        assert d_pipe.recv() == "armed"
        r_p = p.call("run", c)
        r_d = d.recv()
        if case["path"] != "devcopy":
            ok = ok and bool(np.array_equal(d.call("sums", case["d_ids"]), want))
        else:
            ok = ok and r_p["copy_ok"]
        if i:
            runs.append((r_p, r_d))
    row: dict[str, Any] = {"bytes_ok": ok}
    rp0, rd0 = runs[0]
    row["descriptors"] = rp0.get("descriptors", rd0.get("descriptors", 0))
    if case["path"] == "devcopy":
        total = [r["copy_ms"] for r, _ in runs]
    else:
        start = (lambda rp, rd: rd) if case["path"] == "read" else (lambda rp, rd: rp)
        total = [(rd["ready_ns"] - start(rp, rd)["t0_ns"]) / 1e6 for rp, rd in runs]
    row["total_ms"] = median(total)
    for key in ("prep_ms", "post_ms", "write_ms", "gather_ms", "kernel_ms"):
        vals = [r[key] for r, _ in runs if key in r] or [rd[key] for _, rd in runs if key in rd]
        if vals:
            row[key] = median(vals)
    sc = [rd["scatter_ms"] for _, rd in runs if "scatter_ms" in rd]
    if sc:
        row["scatter_ms"] = median(sc)
    row["gbps"] = case["bytes"] / (row["total_ms"] * 1e6) if row["total_ms"] else 0.0
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--models", default="qwen3-32b-tp8,llama-8b-tp1")
    ap.add_argument("--tokens", default="1024,4096,16384")
    ap.add_argument("--patterns", default="contiguous,scattered,allocator")
    ap.add_argument("--paths", default="devcopy,direct,staged,ipc")
    ap.add_argument("--num-blocks", type=int, default=4096)
    ap.add_argument("--pools", default="4x64", help="staging pools, SLOTSxMIB, comma-separated")
    ap.add_argument("--min-chunks", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--read-tokens", type=int, default=4096, help="0: no READ case")
    ap.add_argument("--kernels", action="store_true", help="first time the copy kernels alone")
    ap.add_argument("--out", default=None)
    ap.add_argument("--case-timeout-s", type=float, default=120.0)
    args = ap.parse_args()
    cuda = args.device != "cpu"
    machine = {"host": platform.node(), "device": args.device, "argv": sys.argv}
    if cuda:
        import torch

        machine["gpu"] = torch.cuda.get_device_name(args.device)
    print(json.dumps({"machine": machine}), flush=True)
    rows: list[dict[str, Any]] = []
    outf = open(args.out, "w") if args.out else None  # noqa: SIM115

    def emit(row: dict[str, Any]) -> None:
        rows.append(row)
        print(json.dumps(row), flush=True)
        if outf:
            outf.write(json.dumps(row) + "\n")
            outf.flush()

    if args.kernels:
        from bench.gpu_kernels import sweep

        for mname in args.models.split(","):
            for row in sweep(MODELS[mname], args.device, args.num_blocks, args.tokens):
                print(json.dumps(row), flush=True)
                if outf:
                    outf.write(json.dumps(row) + "\n")
    for mname in args.models.split(",") if args.paths else []:
        run_model(MODELS[mname], args, emit)
    if outf:
        outf.close()
    print_table(rows)
    return 0 if all(r.get("bytes_ok") for r in rows) else 1


def run_model(model: Model, args: argparse.Namespace, emit: Any) -> None:
    """Every (tokens, pattern, path) of one model between a fresh P and D process."""
    from connector.core.xfer_path import Locality, choose_path
    from connector.transport.ports import free_port

    cuda = args.device != "cpu"
    mem = "VRAM" if cuda else "DRAM"
    pools = [tuple(int(x) for x in p.split("x")) for p in args.pools.split(",")]
    env = {
        "UCX_TLS": os.environ.get(
            "UCX_TLS", "tcp,sm,self,cuda_copy,cuda_ipc" if cuda else "tcp,sm,self"
        ),
        "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo"),
    }
    a = dict(
        model=model.name,
        device=args.device,
        num_blocks=args.num_blocks,
        pools=pools,
        ports={"P": free_port(), "D": free_port()},
        env=env,
    )
    ctx = get_context("spawn")
    pd_p, pd_d = ctx.Pipe()
    p, d = Handle(ctx, "P", pd_p, a), Handle(ctx, "D", pd_d, a)
    try:
        p.recv(), d.recv()
        p.send("connect"), d.send("connect")
        p_info, d_info = p.recv(), d.recv()
        if "ipc" in args.paths:
            p.call("ipc_import", d_info["ipc"])
        d_pipe = pd_p  # D's "armed" arrives on P's end of the pair; P never reads it again
        cases = [
            (n, pat, path, k)
            for n in map(int, args.tokens.split(","))
            for pat in args.patterns.split(",")
            for path in args.paths.split(",")
            for k in (range(len(pools)) if path == "staged" else [0])
        ]
        if args.read_tokens:
            cases.append((args.read_tokens, "contiguous", "read", 0))
        for n, pat, path, k in cases:
            nb = n // BLOCK
            p_ids = block_ids(pat, args.num_blocks, nb, 0, n)
            d_ids = block_ids(pat, args.num_blocks, nb, 1, n)
            nbytes = nb * model.regions * model.row_bytes
            case = dict(
                path=path,
                tid=f"{model.name}-{n}-{pat}-{path}-{k}",
                tokens=n,
                p_ids=p_ids,
                d_ids=d_ids,
                bytes=nbytes,
                d_layout=d_info["layout"],
                p_layout=p_info["layout"],
                d_staging=d_info["staging"],
                min_chunks=args.min_chunks,
                timeout_s=args.case_timeout_s,
                pool=k,
                p_sums=p.call("sums", p_ids),
            )
            if path == "staged":
                case["d_slots"] = d.call("reserve", k)
            slow = path == "direct" and pat != "contiguous" and n > 4096
            reps = 2 if slow or path == "read" else args.reps
            row = dict(model=model.name, tokens=n, layout=pat, path=path, bytes=nbytes)
            try:
                row.update(one_case(p, d, case, d_pipe, reps))
            except (RuntimeError, TimeoutError) as exc:  # the pair may be out of step: stop
                emit(dict(row, error=str(exc)[:300], bytes_ok=False, gbps=0.0))
                return
            if path == "staged":
                d.call("release", (k, case["d_slots"]))
                slots, mib = pools[k]
                row["pool"] = f"{slots}x{mib}MiB"
                row["staging_bytes"] = 2 * slots * mib * 2**20  # P's pool + D's pool
            if path == "direct":
                ch = choose_path(
                    row.get("descriptors", 0),
                    nbytes,
                    src_mem=mem,
                    dst_mem=mem,
                    locality=Locality.SAME_GPU,
                )
                row["chooser"] = ch.path.value
            emit(row)
    finally:
        p.stop()
        d.stop()


def print_table(rows: list[dict[str, Any]]) -> None:
    cols = (
        "model",
        "tokens",
        "layout",
        "path",
        "pool",
        "descriptors",
        "total_ms",
        "gbps",
        "prep_ms",
        "write_ms",
        "gather_ms",
        "scatter_ms",
        "kernel_ms",
        "bytes_ok",
    )
    print("\n| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        cells = [f"{r[c]:.3g}" if isinstance(r.get(c), float) else str(r.get(c, "")) for c in cols]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    sys.exit(main())

"""pushkv's transfer cost for the KV of each GPU model (issue #33): bytes per token,
descriptors, descriptor prep and WRITE time, through pushkv's own transfer path (Sender,
Receiver, transfer thread, NixlTransport) between a P and a D process. No vLLM.

    python -m bench.gpu_model_cost --device cuda:0 --out $OUT/model_cost.json
    python -m bench.gpu_model_cost --device cpu --tokens 64,128 --paths auto

Each model of ``bench.gpu_model.GPU_MODELS`` (one TP rank's KV) is laid out as vLLM 0.26
hands it to pushkv on a GPU: a page per (layer, block) (LBHNC: vLLM 0.26's HND, what pushkv
asks for there, ``connector.kv_tensors.LEGACY_LAYOUT``), K|V packed per head in
[blocks, heads, tokens, 2 * head_dim] views; MLA's latent in [blocks, tokens, 576] views
(``connector.tools.kv_caches``). One P/D pair per (model, ``xfer_paths`` value), every
pair started at once; per token count and block pattern (contiguous; scattered:
random ids on both sides, as in a busy server) a warm-up and ``--reps`` transfers, P
writing fresh KV into its blocks before each (``RankProcess.prefill``) and every transfer's
blocks compared by checksum on both sides. Prints a markdown table (also written beside
``--out`` as .md); ``--out`` gets every row as JSON. Exit 1 if a row failed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.gpu_model import GPU_MODELS
from connector.core import events as ev
from connector.tools.loopback import RankProcess, RankSpec, expected_event
from connector.tools.tinyfamilies import is_mla, mla_latent_width
from connector.tools.tinymodel import kv_bytes_per_token
from connector.transport.ports import free_port

KV_LAYOUT = "LBHNC"
DTYPE, DTYPE_BYTES = "bfloat16", 2
BLOCK_SIZE = 16  # FLASH_ATTN's blocks in the GPU runs (docs/benchmarks.md)
# vLLM's CUDA platform sets 64-token blocks for FlashMLA, its MLA backend on Hopper.
MLA_BLOCK_SIZE = 64
PATTERNS = ("contiguous", "scattered")


@dataclass(frozen=True)
class Geometry:
    """One TP rank's KV of a model, as ``RankSpec`` builds it."""

    model: str
    layers: int
    heads: int  # KV heads on the rank; MLA's latent is one
    token_bytes: int  # one (token, head) entry: K|V of a head, or the latent
    latent: bool
    block_size: int

    @property
    def bytes_per_token(self) -> int:
        return self.layers * self.heads * self.token_bytes


def geometry(model: str, block_size: int = 0) -> Geometry:
    """``model``'s KV from its config in ``GPU_MODELS``; ``block_size`` 0: vLLM's default."""
    arch = GPU_MODELS[model]
    layers = arch["num_hidden_layers"]
    if is_mla(arch):
        width = mla_latent_width(arch) * DTYPE_BYTES
        g = Geometry(model, layers, 1, width, True, block_size or MLA_BLOCK_SIZE)
    else:
        kv = 2 * arch["head_dim"] * DTYPE_BYTES
        g = Geometry(
            model, layers, arch["num_key_value_heads"], kv, False, block_size or BLOCK_SIZE
        )
    if g.bytes_per_token != kv_bytes_per_token(arch, DTYPE_BYTES):
        raise ValueError(f"{model}: {g} disagrees with kv_bytes_per_token")
    return g


def rank_specs(
    g: Geometry, device: str, mode: str, num_blocks: int, kv_layout: str
) -> tuple[RankSpec, RankSpec]:
    """P's and D's rank for ``g``, ``mode`` their ``xfer_paths``."""
    shape: dict[str, Any] = dict(
        num_layers=g.layers,
        num_blocks=num_blocks,
        block_size=g.block_size,
        num_kv_heads=g.heads,
        token_bytes=g.token_bytes,
        kv_layout=kv_layout,
        latent=g.latent,
        dtype=DTYPE,
        xfer_paths=mode,
        device=device,
    )
    name = f"{g.model}-{mode}"
    return (
        RankSpec("P", f"p-{name}", 0, 1, free_port(), **shape),
        RankSpec("D", f"d-{name}", 0, 1, free_port(), **shape),
    )


def start_all(specs: list[RankSpec], timeout_s: float) -> list[RankProcess | Exception]:
    """Every rank started at once (each start is mostly imports and CUDA's)."""

    def start(spec: RankSpec) -> RankProcess | Exception:
        try:
            return RankProcess(spec, timeout_s)
        except Exception as exc:  # reported in the rows; the other pairs still run
            return exc

    with ThreadPoolExecutor(len(specs)) as pool:
        return list(pool.map(start, specs))


class Blocks:
    """P's and D's block ids for one transfer of ``nb`` blocks."""

    def __init__(self, num_blocks: int, seed: int = 0) -> None:
        self.num_blocks, self._rng = num_blocks, random.Random(seed)

    def __call__(self, pattern: str, nb: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        if pattern == "contiguous":
            return tuple(range(nb)), tuple(range(self.num_blocks - nb, self.num_blocks))
        ids = range(self.num_blocks)
        return tuple(self._rng.sample(ids, nb)), tuple(self._rng.sample(ids, nb))


def push_once(
    p: RankProcess, d: RankProcess, tid: str, ids: tuple[tuple[int, ...], ...], n: int, seed: int
) -> tuple[Any, Any, bool]:
    """One transfer of ``n`` tokens: (P's WriteReport, D's Received, checksums equal)."""
    p_blocks, d_blocks = ids
    d.submit(expected_event(tid, [p.spec], d.spec, d_blocks, n))
    p.prefill(ev.PrefillDone(tid, f"req-{tid}", (p_blocks,), n), seed)
    d.wait(tid, lambda r: any(x.transfer_id == tid for x in r.received), 120)
    p.wait(tid, lambda r: f"req-{tid}" in r.sent, 120)
    got = next(x for x in d.received if x.transfer_id == tid)
    rep = next((r for r in p.reports if r.transfer_id == tid), None)
    if rep is None or not (got.ok and rep.ok):
        raise RuntimeError(f"{tid} failed: D {got}, P {rep}")
    same = bool((p.block_sums(list(p_blocks)) == d.block_sums(list(d_blocks))).all())
    return rep, got, same


def measure(
    p: RankProcess, d: RankProcess, g: Geometry, mode: str, args: argparse.Namespace
) -> list[dict[str, Any]]:
    """Every (tokens, pattern) case of one pair, one row each."""
    rows: list[dict[str, Any]] = []
    blocks, seed = Blocks(p.spec.num_blocks), 0
    for n in args.token_counts:
        for pattern in args.pattern_list:
            samples: list[tuple[Any, Any]] = []
            same = True
            for i in range(args.reps + 1):  # round 0 connects and warms up
                seed += 1
                ids = blocks(pattern, n // g.block_size)
                rep, got, ok = push_once(p, d, f"{mode}-{pattern}-{n}-{i}", ids, n, seed)
                same = same and ok
                if i:
                    samples.append((rep, got))
            rows.append(row(g, mode, n, pattern, samples, same))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def row(
    g: Geometry, mode: str, n: int, pattern: str, samples: list[tuple[Any, Any]], same: bool
) -> dict[str, Any]:
    """One case's row: sizes from the first sample, times the median of all."""

    def mid(f: Any) -> float:
        return float(statistics.median(f(r, x) for r, x in samples))

    r0 = samples[0][0]
    write_ms = mid(lambda r, x: (r.done_ns - r.posted_ns) / 1e6)
    copy = [r.stage_ms["copy"] for r, _ in samples if "copy" in r.stage_ms]
    return dict(
        model=g.model,
        paths=mode,
        path=",".join(sorted({r.path for r, _ in samples})),
        tokens=n,
        pattern=pattern,
        block_size=g.block_size,
        bytes_per_token=r0.bytes_total / n,
        model_bytes_per_token=g.bytes_per_token,
        mib=r0.bytes_total / 2**20,
        descriptors=int(mid(lambda r, x: r.descriptors)),
        rows=r0.blocks * r0.regions,
        prep_ms=mid(lambda r, x: (r.prepared_ns - r.issued_ns) / 1e6),
        write_ms=write_ms,
        copy_ms=float(statistics.median(copy)) if copy else None,
        e2e_ms=mid(lambda r, x: (x.at_ns - r.issued_ns) / 1e6),
        gbps=r0.bytes_total / (write_ms * 1e6) if write_ms else 0.0,
        reps=len(samples),
        checksums_ok=same,
    )


def run_all(geoms: list[Geometry], args: argparse.Namespace) -> list[dict[str, Any]]:
    """One pair per (model, ``xfer_paths`` value), all started together (a start is mostly
    imports and CUDA's set-up; idle ranks sleep), measured one after another."""
    pairs = []
    for g in geoms:
        num_blocks = max(args.token_counts) // g.block_size * 5 // 4 + 1  # room to scatter
        pairs += [
            (g, m, rank_specs(g, args.device, m, num_blocks, args.kv_layout)) for m in args.modes
        ]
    t0 = time.monotonic()
    procs = start_all([s for _, _, pair in pairs for s in pair], args.start_timeout_s)
    print(f"# {len(procs)} ranks up in {time.monotonic() - t0:.1f} s", flush=True)
    rows: list[dict[str, Any]] = []
    try:
        for k, (g, mode, _) in enumerate(pairs):
            p, d = procs[2 * k], procs[2 * k + 1]
            try:
                for proc in (p, d):
                    if isinstance(proc, Exception):
                        raise proc
                assert isinstance(p, RankProcess) and isinstance(d, RankProcess)
                rows += measure(p, d, g, mode, args)
            except Exception as exc:  # the pair may be out of step: its rows end here
                err = dict(model=g.model, paths=mode, error=f"{type(exc).__name__}: {exc}"[:300])
                rows.append({**err, "checksums_ok": False})
                print(json.dumps(rows[-1]), flush=True)
    finally:
        with ThreadPoolExecutor(len(procs)) as pool:  # each stop waits for its transport
            list(pool.map(lambda x: x.stop(), [x for x in procs if isinstance(x, RankProcess)]))
    return rows


COLUMNS = (
    ("model", "model"),
    ("paths", "xfer_paths"),
    ("path", "path"),
    ("tokens", "tokens"),
    ("pattern", "blocks"),
    ("bytes_per_token", "B/token"),
    ("mib", "MiB"),
    ("descriptors", "descriptors"),
    ("rows", "block x layer rows"),
    ("prep_ms", "prep ms"),
    ("write_ms", "WRITE ms"),
    ("gbps", "GB/s in the WRITE"),
    ("e2e_ms", "P ready → D counted ms"),
    ("checksums_ok", "checksums"),
)


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(h for _, h in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['paths']} | error: {r['error']} |")
            continue
        cells = []
        for key, _ in COLUMNS:
            v = r[key]
            cells.append(f"{v:.1f}" if key == "mib" else _cell(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _cell(v: Any) -> str:
    if isinstance(v, bool):
        return "ok" if v else "DIFFER"
    if isinstance(v, float):  # three significant digits, never an exponent
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


def machine(device: str) -> dict[str, Any]:
    out: dict[str, Any] = {
        "host": platform.node(),
        "device": device,
        "commit": os.environ.get("PUSHKV_COMMIT", ""),
        "argv": sys.argv,
    }
    if device != "cpu":
        import torch

        out["gpu"] = torch.cuda.get_device_name(device)
        out["torch"] = torch.__version__
    return out


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_model_cost", description=__doc__)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda:N (P and D share it)")
    ap.add_argument("--models", default=",".join(GPU_MODELS))
    ap.add_argument("--tokens", default="4096,16384")
    ap.add_argument("--paths", default="direct,ipc,auto", help="xfer_paths values")
    ap.add_argument("--patterns", default=",".join(PATTERNS))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--block-size", type=int, default=0, help="0: 16, MLA 64")
    ap.add_argument("--kv-layout", default=KV_LAYOUT, help="a vLLM KVCacheLayout (0.32: BLHNC)")
    ap.add_argument("--start-timeout-s", type=float, default=180.0)
    ap.add_argument("--out", type=Path, default=None, help="JSON; the table beside it as .md")
    args = ap.parse_args(argv)
    args.token_counts = [int(x) for x in args.tokens.split(",")]
    args.modes = args.paths.split(",")
    args.pattern_list = args.patterns.split(",")
    if set(args.pattern_list) - set(PATTERNS):
        ap.error(f"--patterns: {PATTERNS}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    geoms = [geometry(m, args.block_size) for m in args.models.split(",")]
    for g in geoms:
        if any(n % g.block_size for n in args.token_counts):
            raise SystemExit(f"{g.model}: --tokens must be whole {g.block_size}-token blocks")
    cuda = args.device != "cpu"
    os.environ.setdefault("UCX_TLS", "tcp,sm,self,cuda_copy,cuda_ipc" if cuda else "tcp,sm,self")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    info = machine(args.device)
    print(json.dumps({"machine": info}), flush=True)
    rows = run_all(geoms, args)
    md = table(rows)
    print("\n" + md)
    if args.out:
        args.out.write_text(json.dumps({"machine": info, "rows": rows}, indent=1) + "\n")
        args.out.with_suffix(".md").write_text(md)
    return 0 if rows and all(r["checksums_ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

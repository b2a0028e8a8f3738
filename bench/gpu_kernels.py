"""The block-row copy kernels alone, in one process: launch shapes against the torch
fallback and a plain contiguous copy of the same bytes.

Run: python -m bench.gpu_kernels --device cuda:0 [--models ...] [--tokens 1024,16384]
(also from ``python -m bench.gpu_paths --kernels``). For every model shape and size, with
scattered block ids on both sides: ``copy`` (scattered -> scattered, the IPC path),
``gather`` (-> a dense staging buffer) and ``scatter`` (the mirror), each checked bytewise
once and timed by CUDA events around back-to-back launches (device time per launch).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Callable, Iterator
from typing import Any

TUNES = [(1024, 1, 4), (512, 4, 4), (1024, 2, 8), (2048, 1, 8), (256, 8, 4)]
LAUNCHES = 10


def _time_ms(torch: Any, fn: Callable[[], None]) -> float:
    fn()
    fn()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    begin.record()
    for _ in range(LAUNCHES):
        fn()
    end.record()
    end.synchronize()
    return float(begin.elapsed_time(end)) / LAUNCHES


def sweep(model: Any, device: str, num_blocks: int, tokens_csv: str) -> Iterator[dict[str, Any]]:
    import torch

    from connector.transfer.gpu.rows import RowTable

    dev = torch.device(device)
    shape = (model.regions, num_blocks, model.row_bytes)
    src = torch.randint(1, 256, shape, dtype=torch.uint8, device=dev)
    dst = torch.zeros_like(src)
    tables = RowTable.of(list(src.unbind(0))), RowTable.of(list(dst.unbind(0)))
    for n in map(int, tokens_csv.split(",")):
        yield from _one_size(torch, model, src, dst, tables, n)
        torch.cuda.empty_cache()


def _one_size(
    torch: Any, model: Any, src: Any, dst: Any, tables: tuple[Any, Any], n: int
) -> Iterator[dict[str, Any]]:
    from connector.transfer.gpu import rows as R
    from connector.transfer.gpu.kernels import Tune

    s_rows, d_rows = tables
    nb, num_blocks, dev = n // 16, src.shape[1], src.device
    rng = random.Random(n)
    s_ids = torch.tensor(rng.sample(range(num_blocks), nb), dtype=torch.int64, device=dev)
    d_ids = torch.tensor(rng.sample(range(num_blocks), nb), dtype=torch.int64, device=dev)
    nbytes = model.regions * nb * model.row_bytes
    stage = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    flat = src.view(-1)
    ms = _time_ms(torch, lambda: stage.copy_(flat[:nbytes]))
    base = dict(kind="kernel", model=model.name, tokens=n, layout="scattered", bytes=nbytes)
    gbps = nbytes / (ms * 1e6)
    yield dict(base, layout="contiguous", op="devcopy", tune="-", ms=ms, gbps=gbps, ok=True)
    want = src[:, s_ids]
    for backend, tune in [("triton", Tune(*t)) for t in TUNES] + [("torch", None)]:
        label = f"{tune.block_words}/{tune.rows}/{tune.num_warps}" if tune else "torch"
        ops: dict[str, Callable[[], None]] = {
            "copy": lambda b=backend, t=tune: R.copy_rows(
                s_rows, s_ids, d_rows, d_ids, backend=b, tune=t
            ),
            "gather": lambda b=backend, t=tune: R.gather(s_rows, s_ids, stage, backend=b, tune=t),
            "scatter": lambda b=backend, t=tune: R.scatter(stage, d_rows, d_ids, backend=b, tune=t),
        }
        for op, fn in ops.items():
            dst.zero_()
            if op == "gather":
                stage.zero_()
            if op == "scatter":
                stage.copy_(want.reshape(-1))
            fn()
            torch.cuda.synchronize()
            got = stage.view(want.shape) if op == "gather" else dst[:, d_ids]
            ok = bool(torch.equal(got, want))
            ms = _time_ms(torch, fn)
            yield dict(base, op=op, tune=label, ms=ms, gbps=nbytes / (ms * 1e6), ok=ok)


def main() -> int:
    from bench.gpu_shapes import MODELS

    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--models", default="qwen3-32b-tp8,llama-8b-tp1")
    ap.add_argument("--tokens", default="1024,16384")
    ap.add_argument("--num-blocks", type=int, default=4096)
    args = ap.parse_args()
    ok = True
    for m in args.models.split(","):
        for row in sweep(MODELS[m], args.device, args.num_blocks, args.tokens):
            ok = ok and row["ok"]
            print(json.dumps(row), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

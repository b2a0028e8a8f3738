"""How fast this CPU multiplies matrices in bf16 and in fp32, one thread, as a vLLM engine
pinned to one core would: why ``pushkv bench --sweep --dtype auto`` picks float32 on a CPU
without native bf16 (AVX2 only), where bf16 GEMMs fall back to a slow path.

Run: python -m bench.cpu_dtype [--tokens 2048] [--hidden 256] [--out 1024] [--repeats 5]
"""

from __future__ import annotations

import argparse
import time

import torch

from connector.tools.bench.sweep_setup import cpu_has_native_bf16


def gflops(dtype: torch.dtype, tokens: int, hidden: int, out: int, repeats: int) -> float:
    a, b = torch.randn(tokens, hidden, dtype=dtype), torch.randn(hidden, out, dtype=dtype)
    a @ b  # first call: kernel selection, caches
    t0 = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * tokens * hidden * out * repeats / (time.perf_counter() - t0) / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--out", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(1)
    print(f"native bf16 (avx512_bf16 or amx_bf16): {cpu_has_native_bf16()}")
    for dtype in (torch.bfloat16, torch.float32):
        rate = gflops(dtype, args.tokens, args.hidden, args.out, args.repeats)
        print(
            f"{str(dtype):16s} [{args.tokens}x{args.hidden}] @ [{args.hidden}x{args.out}]: "
            f"{rate:8.1f} GFLOP/s"
        )


if __name__ == "__main__":
    main()

"""The KV shapes the GPU benchmarks move: one TP rank of a model, in 16-token blocks.

Owns ``Model`` and ``MODELS``, shared by ``bench.gpu_paths`` and ``bench.gpu_kernels`` (each
imports them from here, so neither imports the other).
"""

from __future__ import annotations

from dataclasses import dataclass

BLOCK = 16


@dataclass(frozen=True)
class Model:
    name: str
    regions: int  # layers x parts
    heads: int
    token_bytes: int  # bytes of one (token, head) entry in a region

    @property
    def row_bytes(self) -> int:
        return BLOCK * self.heads * self.token_bytes


MODELS = {
    "qwen3-32b-tp8": Model("qwen3-32b-tp8", 64 * 2, 1, 128 * 2),
    "llama-8b-tp1": Model("llama-8b-tp1", 32, 8, 2 * 128 * 2),
    "tiny": Model("tiny", 8, 2, 32),
}

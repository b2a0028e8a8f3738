"""Random-weight models with real KV geometry, made on a GPU machine (no weights can be
brought there): the tiny models' local tokenizer and config writer
(connector/tools/tinymodel.py) with a real model's shape, and seeded weights drawn on the GPU
with the same scales, so that greedy output depends on the whole prompt.

    python -m bench.gpu_model llama8b /tmp/models      # prints the model's directory

Models (``GPU_MODELS``): ``llama8b`` is Llama-3.1-8B's geometry (32 layers, 32 query and 8 KV
heads of 128, MLP 14336: 128 KiB of KV per token, 16 GB of weights); ``qwen32b-tp8`` is one
TP-8 rank of Qwen3-32B as the KV sees it (64 layers, 8 query heads and 1 KV head of 128,
hidden 5120, MLP 25600/8: 32 KiB per token) in Llama form. The tokenizer has 4096 tokens.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from connector.tools.tinymodel import ARCH, kv_bytes_per_token, weight_specs, write_model_meta

GPU_MODELS: dict[str, dict[str, Any]] = {
    "llama8b": {
        **ARCH,
        "num_hidden_layers": 32,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 32768,
        "rope_theta": 500000.0,
    },
    "qwen32b-tp8": {
        **ARCH,
        "num_hidden_layers": 64,
        "hidden_size": 5120,
        "intermediate_size": 3200,
        "num_attention_heads": 8,
        "num_key_value_heads": 1,
        "head_dim": 128,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
    },
}


def make_gpu_model(name: str, root: Path, seed: int = 0, device: str = "cuda") -> Path:
    """``root/name``, built unless it holds weights already."""
    import torch
    from safetensors.torch import save_file

    arch = GPU_MODELS[name]
    out = root / name
    weights = out / "model.safetensors"
    if weights.exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    write_model_meta(out, arch)
    gen = torch.Generator(device=device).manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for tname, shape, scale, fan_in in weight_specs(arch):
        if scale is None:
            t = torch.ones(shape, dtype=torch.bfloat16, device=device)
        else:
            t = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
            t = (t * (scale / fan_in**0.5)).to(torch.bfloat16)
        tensors[tname] = t.cpu()
    tmp = weights.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.rename(weights)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_model", description=__doc__)
    p.add_argument("model", choices=sorted(GPU_MODELS))
    p.add_argument("root", type=Path)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    t0 = time.monotonic()
    out = make_gpu_model(args.model, args.root, args.seed)
    kib = kv_bytes_per_token(GPU_MODELS[args.model]) / 1024
    print(f"# {args.model}: {kib:.0f} KiB of KV per token, ready in {time.monotonic() - t0:.1f} s")
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

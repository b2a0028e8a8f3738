"""Random-weight models with real KV geometry, made on a GPU machine (no weights can be
brought there): the tiny models' local tokenizer and config writer
(connector/tools/tinymodel.py) with a real model's shape, and seeded weights drawn on the GPU
with the same scales, so that greedy output depends on the whole prompt.

    python -m bench.gpu_model llama8b /tmp/models      # prints the model's directory
    python -m bench.gpu_model dsv3-tp8 /tmp/models     # DeepSeek-V3's MLA KV, one TP-8 rank

Models (``GPU_MODELS``): ``llama8b`` is Llama-3.1-8B's geometry (32 layers, 32 query and 8 KV
heads of 128, MLP 14336: 128 KiB of KV per token, 14 GB of weights with this vocabulary);
``qwen32b-tp8`` is one TP-8 rank of Qwen3-32B as the KV sees it (64 layers, 8 query heads and
1 KV head of 128, hidden 5120, MLP 25600/8: 32 KiB per token) in Llama form; ``dsv3-tp8`` is
one TP-8 rank of DeepSeek-V3 (``DeepseekV3ForCausalLM``: MLA with its latent of 512 + 64 in
61 layers, 70,272 bytes of KV per token, 16 of its 128 heads, its router and yarn rope,
experts shrunk to 32 of width 32: 7.5 GB of weights). The tokenizer has 4096 tokens.
"""

from __future__ import annotations

import argparse
import math
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
    # The KV (latent), attention and dense layers are DeepSeek-V3's, per TP-8 rank where vLLM
    # splits them (heads, dense MLP 18432/8); the MoE keeps its router (8 experts from 4 of 8
    # groups, sigmoid scores with a bias, 2.5x) but has 32 experts of width 32 instead of 256
    # of 2048 (256 per rank), so the weights fit beside a second server on one GPU.
    "dsv3-tp8": {
        "model_type": "deepseek_v3",
        "num_hidden_layers": 61,
        "hidden_size": 7168,
        "intermediate_size": 2304,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        "first_k_dense_replace": 3,
        "moe_layer_freq": 1,
        "n_routed_experts": 32,
        "moe_intermediate_size": 32,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "n_group": 8,
        "topk_group": 4,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "num_nextn_predict_layers": 0,  # no MTP layer (vLLM uses one only for speculation)
        "max_position_embeddings": 163840,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
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
    arch = GPU_MODELS[args.model]
    kv = kv_bytes_per_token(arch)
    gb = sum(math.prod(shape) for _, shape, _, _ in weight_specs(arch)) * 2 / 1e9
    print(
        f"# {args.model}: {kv} B ({kv / 1024:.1f} KiB) of KV per token, {gb:.2f} GB of "
        f"weights, ready in {time.monotonic() - t0:.1f} s"
    )
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

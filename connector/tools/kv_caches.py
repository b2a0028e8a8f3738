"""KV cache tensors laid out exactly as vLLM 0.32 hands them to ``register_kv_caches``.

Owns: ``vllm_kv_caches``: one flat byte buffer viewed per layer as logical
[B, H, N, C] (C = K|V of one head and token; MLA: one latent, each layer's view
[B, N, C] as vLLM 0.26 hands it), with the strides ``KVCacheLayout`` gives
(``vllm/v1/kv_cache_interface.py``: ``compute_layout_strides``, ``create_kv_cache_views``;
``tests/unit/test_kv_tensors.py`` checks the strides against vLLM's own function where vLLM
is installed). For tests and benches of the GPU path where vLLM cannot run (the GPU machine
has none). Imports torch only.
"""

from __future__ import annotations

from typing import Any

import torch

# KVCacheLayout's members: the physical order of the logical axes [L, B, H, N, C].
LAYOUTS: dict[str, tuple[int, ...]] = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}


def layout_strides(shape: tuple[int, ...], layout: str) -> tuple[int, ...]:
    """Byte strides in logical [L, B, H, N, C] order for a dense buffer (no padding)."""
    strides, current = [0] * 5, 1
    for dim in reversed(LAYOUTS[layout]):
        strides[dim] = current
        current *= shape[dim]
    return tuple(strides)


def vllm_kv_caches(
    num_layers: int,
    num_blocks: int,
    num_heads: int,
    block_size: int,
    head_size: int,
    dtype: torch.dtype = torch.bfloat16,
    layout: str = "LBHNC",
    device: str | torch.device = "cpu",
    latent: bool = False,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """(the raw uint8 buffer, {layer name: [B, H, N, 2 * head_size] view of ``dtype``});
    ``latent``: MLA's KV, one latent of ``head_size`` elements per token and layer (one
    "head", no K/V split), viewed [B, N, head_size] per layer."""
    if latent and num_heads != 1:
        raise ValueError(f"an MLA latent is one head per token, not {num_heads}")
    elt = torch.empty(0, dtype=dtype).element_size()
    content = head_size if latent else 2 * head_size
    shape = (num_layers, num_blocks, num_heads, block_size, content * elt)
    total = 1
    for n in shape:
        total *= n
    raw = torch.zeros(total, dtype=torch.uint8, device=device)
    view_5d = torch.as_strided(raw, shape, layout_strides(shape, layout))
    per_layer = [view_5d[i][:, 0] if latent else view_5d[i] for i in range(num_layers)]
    views = {f"model.layers.{i}.self_attn.attn": t.view(dtype) for i, t in enumerate(per_layer)}
    return raw, views

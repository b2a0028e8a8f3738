"""bench/gpu_model.py's ``dsv3-tp8``: DeepSeek-V3's KV geometry exactly, HF DeepSeek-V3 weight
names and shapes of one TP-8 rank, a router vLLM 0.26's CUDA kernel takes, weights small
enough for two servers on one GPU. No torch, no vLLM."""

from __future__ import annotations

import math
from typing import Any

from bench.gpu_model import GPU_MODELS
from connector.tools.tinyfamilies import ARCH_MLA, deepseek_config, is_mla, mla_latent_width
from connector.tools.tinymodel import VOCAB_SIZE, kv_bytes_per_token, weight_specs

ARCH = GPU_MODELS["dsv3-tp8"]
# deepseek-ai/DeepSeek-V3's config.json: what its KV and attention weights are made of.
DSV3 = {
    "num_hidden_layers": 61,
    "hidden_size": 7168,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "num_attention_heads": 128,
    "intermediate_size": 18432,
    "first_k_dense_replace": 3,
}
TP = 8
# Two servers at --gpu-memory-utilization 0.35 of an 80 GB H100 (28 GB each) hold this and
# the KV (8 GiB in bench.gpu_serve_check) with room for activations and CUDA graphs.
WEIGHT_BOUND_BYTES = 8 * 10**9


def _config() -> dict[str, Any]:
    return deepseek_config(ARCH, {"bos_token_id": 0, "eos_token_id": 1}, VOCAB_SIZE)


def _shapes(arch: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    return {name: shape for name, shape, _, _ in weight_specs(arch)}


def test_dsv3_tp8_has_deepseek_v3s_kv_geometry() -> None:
    cfg = _config()
    assert cfg["architectures"] == ["DeepseekV3ForCausalLM"] and is_mla(cfg)
    per_rank = {**DSV3, "num_attention_heads": 128 // TP, "intermediate_size": 18432 // TP}
    assert {k: cfg[k] for k in DSV3} == per_rank
    assert mla_latent_width(cfg) == 576
    assert kv_bytes_per_token(cfg) == 61 * 576 * 2 == 70_272  # bf16, every TP rank the same


def test_dsv3_tp8_keeps_deepseek_v3s_router_and_rope() -> None:
    """The arch's router wins over DeepSeek-V2's defaults in the config vLLM reads."""
    cfg = _config()
    assert (cfg["topk_method"], cfg["scoring_func"], cfg["norm_topk_prob"]) == (
        "noaux_tc",
        "sigmoid",
        True,
    )
    assert (cfg["n_group"], cfg["topk_group"], cfg["num_experts_per_tok"]) == (8, 4, 8)
    assert cfg["routed_scaling_factor"] == 2.5
    assert cfg["rope_parameters"]["rope_type"] == "yarn" and cfg["rope_parameters"]["factor"] == 40
    assert cfg["rope_parameters"]["rope_theta"] == 10000.0


def test_dsv3_tp8_router_fits_vllm_026s_fused_grouped_topk() -> None:
    """The checks of vLLM 0.26's ``grouped_topk`` CUDA op (csrc/moe/grouped_topk_kernels.cu),
    which DeepSeek-V3's router takes on a GPU, and the two experts per group its group score
    (the sum of a group's top two) needs."""
    experts, groups = ARCH["n_routed_experts"], ARCH["n_group"]
    top_k, top_groups = ARCH["num_experts_per_tok"], ARCH["topk_group"]
    assert experts % groups == 0 and experts // groups >= 2
    assert groups <= 32 and top_k <= 32 and top_groups <= groups
    assert top_k <= top_groups * (experts // groups)


def test_dsv3_tp8_weights_are_named_and_shaped_as_vllms_deepseek_v3_loads_them() -> None:
    """HF DeepSeek-V3 names: q in two halves (vLLM fuses q_a_proj with kv_a_proj_with_mqa),
    three dense layers, then MoE layers with the router's score bias (``noaux_tc``)."""
    shapes = _shapes(ARCH)
    h, heads = 7168, 128 // TP
    a = "model.layers.60.self_attn."
    assert {k: v for k, v in shapes.items() if k.startswith(a)} == {
        a + "q_a_proj.weight": (1536, h),
        a + "q_a_layernorm.weight": (1536,),
        a + "q_b_proj.weight": (heads * (128 + 64), 1536),
        a + "kv_a_proj_with_mqa.weight": (512 + 64, h),
        a + "kv_a_layernorm.weight": (512,),
        a + "kv_b_proj.weight": (heads * (128 + 128), 512),
        a + "o_proj.weight": (h, heads * 128),
    }
    assert shapes["model.layers.2.mlp.down_proj.weight"] == (h, 18432 // TP)
    assert "model.layers.2.mlp.gate.weight" not in shapes
    experts = ARCH["n_routed_experts"]
    assert shapes["model.layers.3.mlp.gate.weight"] == (experts, h)
    assert shapes["model.layers.3.mlp.gate.e_score_correction_bias"] == (experts,)
    assert f"model.layers.60.mlp.experts.{experts - 1}.down_proj.weight" in shapes
    assert "model.layers.60.mlp.shared_experts.up_proj.weight" in shapes
    moe_layers = sum(k.endswith("mlp.gate.weight") for k in shapes)
    assert moe_layers == 61 - 3
    # DeepSeek-V2's form (tiny-mla) keeps one q_proj and a router without a bias.
    tiny = _shapes(ARCH_MLA)
    assert "model.layers.1.self_attn.q_proj.weight" in tiny
    assert not any("q_a_proj" in k or "e_score_correction_bias" in k for k in tiny)


def test_dsv3_tp8_weights_fit_two_servers_on_one_gpu() -> None:
    total = sum(math.prod(shape) for shape in _shapes(ARCH).values()) * 2  # bf16
    attention = sum(
        math.prod(shape) for name, shape in _shapes(ARCH).items() if ".self_attn." in name
    )
    assert total < WEIGHT_BOUND_BYTES
    assert attention * 2 > total / 2  # most of it is DeepSeek-V3's own attention

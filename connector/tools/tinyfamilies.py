"""The tiny models that are not plain Llama: a DeepSeek-V2-style MLA + MoE model (``tiny-mla``).

Owns: its config and weight names (HF DeepSeek-V2/V3 naming, which vLLM's
``DeepseekV2ForCausalLM`` and ``DeepseekV3ForCausalLM`` load). ``connector.tools.tinymodel``
owns the tokenizer, the cache and the writing, and calls these for an arch whose
``model_type`` is ``deepseek_v2`` or ``deepseek_v3``; an arch may carry DeepSeek-V3's parts
(``q_lora_rank``, the ``noaux_tc`` router with its score bias, a ``rope_scaling``), as
bench/gpu_model.py's ``dsv3-tp8`` does. (The sliding-window model ``tiny-swa`` is a Llama with
``layer_types``: no code of its own.)

Geometry: vLLM's CPU MLA decode kernel compiles only for a latent of 576 (kv_lora_rank 512 +
qk_rope_head_dim 64) and blocks of 16 tokens (vllm/v1/attention/backends/mla/cpu_mla.py), so
the latent is DeepSeek-V3's real one (1152 bytes per token and layer in bf16) while the rest
stays small. Layer 0 is dense, the others MoE (4 routed experts, 2 per token, 1 shared).

Pure: numpy-free config dicts and weight specs; imports nothing of vLLM or torch.
"""

from __future__ import annotations

from typing import Any

ARCH_MLA: dict[str, Any] = {
    "model_type": "deepseek_v2",
    "num_hidden_layers": 3,
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 64,
    "v_head_dim": 64,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
}

# DeepSeek-V2's router (softmax scores, greedy top-k), for an arch that names none.
ROUTER_V2: dict[str, Any] = {
    "topk_method": "greedy",
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": False,
    "scoring_func": "softmax",
    "routed_scaling_factor": 1.0,
}
ARCHITECTURES = {"deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}

WeightSpec = tuple[str, tuple[int, ...], float | None, int]


def is_mla(arch: dict[str, Any]) -> bool:
    return arch.get("model_type") in ARCHITECTURES


def mla_latent_width(arch: dict[str, Any]) -> int:
    """Elements of one token's latent KV per layer (one "head", the same on every TP rank)."""
    return int(arch["kv_lora_rank"] + arch["qk_rope_head_dim"])


def deepseek_config(arch: dict[str, Any], ids: dict[str, int], vocab: int) -> dict[str, Any]:
    """The config.json; the arch's router settings win over ``ROUTER_V2``, its
    ``rope_scaling`` (HF's keys, e.g. DeepSeek-V3's yarn) goes into ``rope_parameters``."""
    scaling = arch.get("rope_scaling")
    return {
        **ROUTER_V2,
        **arch,
        "architectures": [ARCHITECTURES[arch["model_type"]]],
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": arch["rope_theta"],
            **(scaling or {}),
        },
        "rope_scaling": None,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "vocab_size": vocab,
        **ids,
        "torch_dtype": "bfloat16",
        "dtype": "bfloat16",
        "use_cache": True,
    }


def deepseek_weight_specs(
    arch: dict[str, Any], scales: dict[str, float], vocab: int
) -> list[WeightSpec]:
    """Every weight in HF DeepSeek-V2/V3 naming, in the order drawn (as
    ``tinymodel.weight_specs``): q (both halves of a low-rank q) and the latent's
    up-projection get the Llama model's q/k scales, so attention is as selective; the router
    and experts the MLP's."""
    h, heads = arch["hidden_size"], arch["num_attention_heads"]
    lora, rope = arch["kv_lora_rank"], arch["qk_rope_head_dim"]
    nope, vdim = arch["qk_nope_head_dim"], arch["v_head_dim"]
    q_rank, q_out = arch.get("q_lora_rank"), heads * (nope + rope)
    specs: list[WeightSpec] = [("model.embed_tokens.weight", (vocab, h), scales["embed"], 1)]
    for i in range(arch["num_hidden_layers"]):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        if q_rank is None:
            q: list[WeightSpec] = [(a + "q_proj.weight", (q_out, h), scales["q"], h)]
        else:
            q = [
                (a + "q_a_proj.weight", (q_rank, h), scales["q"], h),
                (a + "q_a_layernorm.weight", (q_rank,), None, 1),
                (a + "q_b_proj.weight", (q_out, q_rank), scales["q"], q_rank),
            ]
        specs += [
            (p + "input_layernorm.weight", (h,), None, 1),
            *q,
            (a + "kv_a_proj_with_mqa.weight", (lora + rope, h), scales["k"], h),
            (a + "kv_a_layernorm.weight", (lora,), None, 1),
            (a + "kv_b_proj.weight", (heads * (nope + vdim), lora), scales["k"], lora),
            (a + "o_proj.weight", (h, heads * vdim), scales["o"], heads * vdim),
            (p + "post_attention_layernorm.weight", (h,), None, 1),
        ]
        if i < arch["first_k_dense_replace"]:
            specs += _mlp(p + "mlp.", h, arch["intermediate_size"], scales)
            continue
        ffn = arch["moe_intermediate_size"]
        specs.append((p + "mlp.gate.weight", (arch["n_routed_experts"], h), scales["gate"], h))
        if arch.get("topk_method") == "noaux_tc":
            # The bias V3's router adds to the scores to choose experts; the same for every
            # expert (ones), so the scores alone choose.
            specs.append(
                (p + "mlp.gate.e_score_correction_bias", (arch["n_routed_experts"],), None, 1)
            )
        for e in range(arch["n_routed_experts"]):
            specs += _mlp(f"{p}mlp.experts.{e}.", h, ffn, scales)
        specs += _mlp(p + "mlp.shared_experts.", h, ffn * arch["n_shared_experts"], scales)
    specs += [
        ("model.norm.weight", (h,), None, 1),
        ("lm_head.weight", (vocab, h), scales["lm_head"], h),
    ]
    return specs


def _mlp(p: str, h: int, ffn: int, scales: dict[str, float]) -> list[WeightSpec]:
    return [
        (p + "gate_proj.weight", (ffn, h), scales["gate"], h),
        (p + "up_proj.weight", (ffn, h), scales["up"], h),
        (p + "down_proj.weight", (h, ffn), scales["down"], ffn),
    ]

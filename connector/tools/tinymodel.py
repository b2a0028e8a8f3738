"""A tiny random Llama that vLLM and transformers can load, built locally with no download.

Owns: the tiny models' specs (config, seeded weights; the tokenizer is tinytokenizer.py's),
their on-disk cache and the ``python -m connector.tools.tinymodel`` CLI. Models by name
(``MODELS``): ``tiny`` (1 KiB of KV per token) and ``tiny-kv``, the same kind of small compute
with a real model's KV geometry (8 layers, 8 KV heads of 128: 32 KiB per token in bf16, as
Llama-8B's; a 2k-token prompt is 64 MiB), so that a CPU benchmark moves as many bytes per token
as a real deployment. The weights are seeded random numbers, scaled so that attention matters:
greedy output depends on the whole prompt, which is what the end-to-end KV-equality tests need
(vLLM's ``--load-format dummy`` gives near-constant weights whose output depends on the last
token only, so equal outputs would prove nothing about the KV).

Must not import vLLM, torch, transformers or anything of the project but tinyfamilies.py (the
non-Llama configs and weight names: ``tiny-mla``, MLA + MoE) and tinytokenizer.py: it runs in CI
setup and in the test process. Needs only numpy and ``tokenizers``; safetensors is written by
hand.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from connector.tools.tinyfamilies import (
    ARCH_MLA,
    deepseek_config,
    deepseek_weight_specs,
    is_mla,
    mla_latent_width,
)
from connector.tools.tinytokenizer import (
    BOS_TOKEN,
    CORPUS_SEED,
    EOS_TOKEN,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    VOCAB_SIZE,
    train_tokenizer,
)

# Bump when anything below changes what is written: the cache key includes it.
FORMAT_VERSION = 1

# Plain role markers are enough for /v1/chat/completions; BOS comes from the template
# because vLLM renders chat prompts with add_special_tokens=False.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

ARCH: dict[str, Any] = {
    "num_hidden_layers": 2,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
}

# tiny-kv: KV as heavy as Llama-8B's per token; the hidden size and MLP stay small, so the
# compute per token grows far less than the KV (8 query heads: one per KV head).
ARCH_KV: dict[str, Any] = {
    **ARCH,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 4096,
}
# tiny-swa: Gemma-3/Mistral-style local+global layers (vLLM's Llama reads ``layer_types``):
# a 32-token window on layers 0 and 2, full attention on 1 and 3.
ARCH_SWA: dict[str, Any] = {
    **ARCH,
    "num_hidden_layers": 4,
    "sliding_window": 32,
    "layer_types": ["sliding_attention", "full_attention"] * 2,
}
MODELS: dict[str, dict[str, Any]] = {
    "tiny": ARCH,
    "tiny-kv": ARCH_KV,
    "tiny-mla": ARCH_MLA,  # DeepSeek-V2-style MLA + MoE (tinyfamilies.py)
    "tiny-swa": ARCH_SWA,
}
DEFAULT_MODEL = "tiny"


def kv_bytes_per_token(arch: dict[str, Any], dtype_bytes: int = 2) -> int:
    """K and V of every layer for one token (bf16: 2 bytes, what the servers run); an MLA
    model's one latent per layer."""
    if is_mla(arch):
        return arch["num_hidden_layers"] * mla_latent_width(arch) * dtype_bytes
    return (
        2 * arch["num_hidden_layers"] * arch["num_key_value_heads"] * arch["head_dim"] * dtype_bytes
    )


# Weight scales, as multiples of 1/sqrt(fan_in). Why these: with tiny init (0.02, or what
# --load-format dummy gives) the output depends on the last token only; with plain
# variance-preserving scales the last token's residual path still decides about a third of
# first greedy tokens alone. Larger q/k make attention selective (content-dependent), a larger
# o_proj makes what attention gathers outweigh the token's own embedding, and a larger lm_head
# gives confident, diverse greedy picks: prompts that share their last tokens still get
# different first tokens, which the KV-equality tests need.
SCALES: dict[str, float] = {
    "embed": 1.0,
    "q": 2.0,
    "k": 2.0,
    "v": 1.0,
    "o": 2.0,
    "gate": 1.0,
    "up": 1.0,
    "down": 1.0,
    "lm_head": 4.0,
}


def _config(arch: dict[str, Any], bos_id: int, eos_id: int, pad_id: int) -> dict[str, Any]:
    if is_mla(arch):
        ids = {"bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": pad_id}
        return deepseek_config(arch, ids, VOCAB_SIZE)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **arch,
        # transformers 5 reads rope_parameters; older readers (and vLLM) accept rope_theta.
        "rope_parameters": {"rope_type": "default", "rope_theta": arch["rope_theta"]},
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "vocab_size": VOCAB_SIZE,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "torch_dtype": "bfloat16",
        "dtype": "bfloat16",
        "use_cache": True,
    }


def _cache_key(seed: int, name: str = DEFAULT_MODEL) -> str:
    spec = {
        "format": FORMAT_VERSION,
        "arch": MODELS[name],
        "scales": SCALES,
        "vocab": VOCAB_SIZE,
        "corpus_seed": CORPUS_SEED,
        "chat_template": CHAT_TEMPLATE,
    }
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
    return f"{name}-llama-seed{seed}-{digest}"


def make_tiny_model(root: Path | None = None, *, seed: int = 0, name: str = DEFAULT_MODEL) -> Path:
    """The directory of the tiny model ``name`` (a key of ``MODELS``) for ``seed`` under
    ``root``, building it if absent.

    Idempotent and safe to call from several processes at once: the model is built in a
    temporary directory beside the final one and renamed into place; a loser of the race
    discards its copy. The default root is ``$PUSHKV_MODEL_CACHE`` or ``~/.cache/pushkv/models``.
    """
    if root is None:
        env_root = os.environ.get("PUSHKV_MODEL_CACHE")
        root = Path(env_root) if env_root else Path.home() / ".cache" / "pushkv" / "models"
    if name not in MODELS:
        raise ValueError(f"unknown tiny model {name!r}; known: {sorted(MODELS)}")
    root = Path(root).expanduser()
    final = root / _cache_key(seed, name)
    if final.is_dir():  # only ever created by the rename below, so it is complete
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it 0700; the cache is meant to be shared
        _build(tmp, seed, MODELS[name])
        try:
            os.rename(tmp, final)  # atomic on one filesystem; fails if final now exists
        except OSError:
            if not final.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _build(out: Path, seed: int, arch: dict[str, Any]) -> None:
    write_model_meta(out, arch)
    _write_safetensors(out / "model.safetensors", _weights(seed, arch))


def write_model_meta(out: Path, arch: dict[str, Any]) -> None:
    """Everything of a model directory but its weights: the local tokenizer, its config and
    the model's config for ``arch`` (bench/gpu_model.py writes GPU-sized weights beside it)."""
    tokenizer = train_tokenizer()
    vocab = tokenizer.get_vocab()
    if len(vocab) != VOCAB_SIZE:
        raise RuntimeError(f"tokenizer has {len(vocab)} tokens, expected {VOCAB_SIZE}")
    bos_id, eos_id, pad_id = (vocab[t] for t in SPECIAL_TOKENS)
    tokenizer.save(str(out / "tokenizer.json"))
    _write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS_TOKEN,
            "eos_token": EOS_TOKEN,
            "pad_token": PAD_TOKEN,
            "add_bos_token": True,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": arch["max_position_embeddings"],
            "chat_template": CHAT_TEMPLATE,
        },
    )
    _write_json(
        out / "special_tokens_map.json",
        {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN},
    )
    _write_json(out / "config.json", _config(arch, bos_id, eos_id, pad_id))
    _write_json(
        out / "generation_config.json",
        {
            "bos_token_id": bos_id,
            "eos_token_id": eos_id,
            "pad_token_id": pad_id,
            "do_sample": False,
        },
    )


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


# --- weights -------------------------------------------------------------------------------


def weight_specs(arch: dict[str, Any]) -> list[tuple[str, tuple[int, ...], float | None, int]]:
    """Every weight in HF Llama naming, in the order drawn: (name, shape, scale, fan_in);
    scale None is a norm's ones, else the std is scale / sqrt(fan_in) (``SCALES``)."""
    if is_mla(arch):
        return deepseek_weight_specs(arch, SCALES, VOCAB_SIZE)
    h, ffn = arch["hidden_size"], arch["intermediate_size"]
    q_out = arch["num_attention_heads"] * arch["head_dim"]
    kv_out = arch["num_key_value_heads"] * arch["head_dim"]
    specs: list[tuple[str, tuple[int, ...], float | None, int]] = [
        ("model.embed_tokens.weight", (VOCAB_SIZE, h), SCALES["embed"], 1)
    ]
    for i in range(arch["num_hidden_layers"]):
        p = f"model.layers.{i}."
        specs += [
            (p + "input_layernorm.weight", (h,), None, 1),
            (p + "self_attn.q_proj.weight", (q_out, h), SCALES["q"], h),
            (p + "self_attn.k_proj.weight", (kv_out, h), SCALES["k"], h),
            (p + "self_attn.v_proj.weight", (kv_out, h), SCALES["v"], h),
            (p + "self_attn.o_proj.weight", (h, q_out), SCALES["o"], q_out),
            (p + "post_attention_layernorm.weight", (h,), None, 1),
            (p + "mlp.gate_proj.weight", (ffn, h), SCALES["gate"], h),
            (p + "mlp.up_proj.weight", (ffn, h), SCALES["up"], h),
            (p + "mlp.down_proj.weight", (h, ffn), SCALES["down"], ffn),
        ]
    specs += [
        ("model.norm.weight", (h,), None, 1),
        ("lm_head.weight", (VOCAB_SIZE, h), SCALES["lm_head"], h),
    ]
    return specs


def _weights(seed: int, arch: dict[str, Any]) -> dict[str, np.ndarray]:
    """Seeded float32 weights in HF Llama naming, drawn in a fixed order."""
    rng = np.random.Generator(np.random.PCG64(seed))
    w: dict[str, np.ndarray] = {}
    for name, shape, scale, fan_in in weight_specs(arch):
        if scale is None:
            w[name] = np.ones(shape, np.float32)
        else:
            draw = rng.standard_normal(shape, dtype=np.float32)
            w[name] = (draw * (scale / np.sqrt(fan_in))).astype(np.float32)
    return w


def _to_bf16_bytes(a: np.ndarray) -> bytes:
    """float32 -> bfloat16 with round-to-nearest-even (no NaNs occur here)."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    rounded = (u + (((u >> 16) & 1) + 0x7FFF)) >> 16
    return rounded.astype("<u2").tobytes()


def _write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """The safetensors format by hand (8-byte header size, JSON header, raw data), so that
    bf16 needs neither torch nor ml_dtypes."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    blobs, offset = [], 0
    for name in sorted(tensors):
        blob = _to_bf16_bytes(tensors[name])
        header[name] = {
            "dtype": "BF16",
            "shape": list(tensors[name].shape),
            "data_offsets": [offset, offset + len(blob)],
        }
        blobs.append(blob)
        offset += len(blob)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for blob in blobs:
            f.write(blob)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m connector.tools.tinymodel",
        description="Build (or find) the tiny test model; print its path.",
    )
    parser.add_argument(
        "--root",
        type=Path,
        default=None,
        help="cache root (default: $PUSHKV_MODEL_CACHE or ~/.cache/pushkv/models)",
    )
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default: 0)")
    parser.add_argument(
        "--model",
        choices=list(MODELS),
        default=DEFAULT_MODEL,
        help="tiny: 1 KiB of KV per token; tiny-kv: 32 KiB, a real model's KV geometry; "
        "tiny-mla: DeepSeek-V2-style MLA + MoE; tiny-swa: sliding-window + full layers",
    )
    args = parser.parse_args(argv)
    print(make_tiny_model(args.root, seed=args.seed, name=args.model))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

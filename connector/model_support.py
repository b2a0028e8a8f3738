"""Which models' KV pushkv can push, decided at start-up from vLLM's KV cache groups.

Owns: ``check_kv_cache_groups`` (refuse a model feature pushkv cannot push, naming it) and
``kv_heads_of`` (the KV "heads" the TP split works on: MLA's latent is one head, the same on
every rank). docs/models.md has the table of features, with the test behind each row.

Reads vLLM's ``KVCacheSpec`` objects by class name only (no vLLM import), so one rule serves
vLLM 0.26 and 0.32+.

Why refuse sliding windows. With vLLM's hybrid KV cache manager on, a sliding-window
layer's group keeps only the blocks its window still needs: P frees the blocks behind the
window as the prompt is computed and D allocates none there, so P's and D's block tables of
that group are no longer the same token positions block for block, which is how pushkv
pairs them. Without it (``--disable-hybrid-kv-cache-manager``) vLLM treats a model that
mixes sliding-window and full attention layers as all full attention (every layer keeps the
whole prompt; the windowed compute is unchanged), which pushkv pushes like any model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from connector.core.errors import ConfigError


class UnsupportedModel(ConfigError):
    """The model has a KV feature pushkv does not push; the message names it."""


# KV cache specs pushkv pushes: one shape for every layer, every block of a prompt kept.
PUSHED = frozenset({"FullAttentionSpec", "MLAAttentionSpec"})

_NO_HMA = (
    "if the model also has full-attention layers, start P and D with "
    "--disable-hybrid-kv-cache-manager: vLLM then keeps every layer's KV for the whole "
    "prompt (more memory, same outputs) and pushkv pushes it"
)
# spec class name -> (the model feature, what the user can do)
FEATURES: dict[str, tuple[str, str]] = {
    "SlidingWindowSpec": ("sliding-window attention layers", _NO_HMA),
    "SlidingWindowMLASpec": ("sliding-window MLA layers", _NO_HMA),
    "RSWASpec": ("sliding-window attention layers", _NO_HMA),
    "CircularBufferSpec": ("sliding-window attention layers (a circular KV buffer)", _NO_HMA),
    "ChunkedLocalAttentionSpec": ("chunked local attention layers (Llama-4 style)", _NO_HMA),
    "MambaSpec": (
        "Mamba / linear-attention state layers (hybrid models: Jamba, Qwen3-Next, ...)",
        "serve it without P/D disaggregation",
    ),
    "CrossAttentionSpec": ("encoder-decoder cross-attention", "serve it without P/D"),
    "EncoderOnlyAttentionSpec": ("encoder-only attention", "serve it without P/D"),
    "UniformTypeKVCacheSpecs": (
        "attention layers whose KV shapes differ (e.g. per-layer head counts or sizes)",
        "serve it without P/D disaggregation",
    ),
}


def is_latent_kv(model_config: Any) -> bool:
    """MLA's KV: one latent vector per token and layer, not K and V per head. Only the model
    says so: vLLM 0.26 hands the latent as [blocks, tokens, latent], 0.32 as [blocks, 1,
    tokens, latent] like a one-head K|V cache."""
    return bool(getattr(model_config, "use_mla", False))


def kv_heads_of(model_config: Any) -> int:
    """KV heads of the model across all ranks, as the TP split sees them: MLA's latent KV
    is one head replicated on every TP rank (vLLM's ``get_num_kv_heads`` gives 1 for MLA;
    ``get_total_num_kv_heads`` would give the query heads' count)."""
    if is_latent_kv(model_config):
        return 1
    return int(model_config.get_total_num_kv_heads())


def check_kv_cache_groups(groups: Sequence[Any]) -> None:
    """Raise ``UnsupportedModel`` naming the feature unless every KV cache group holds
    full-attention (or MLA) layers: each ``group`` has ``kv_cache_spec`` and ``layer_names``
    (vLLM's ``KVCacheGroupSpec``)."""
    for g, group in enumerate(groups):
        kind = type(group.kv_cache_spec).__name__
        if kind in PUSHED:
            continue
        feature, advice = FEATURES.get(kind, (f"KV cache spec {kind}", "serve it without P/D"))
        names = list(getattr(group, "layer_names", ()))
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        window = getattr(group.kv_cache_spec, "sliding_window", None)
        raise UnsupportedModel(
            f"pushkv does not push {feature}"
            + (f" (window {window} tokens)" if window else "")
            + f": vLLM's KV cache group {g} ({kind}) holds {shown or 'no layers'}; {advice}"
        )

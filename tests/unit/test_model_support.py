"""Start-up refusals of model features pushkv cannot push (connector/model_support.py): each
names the feature, the group and its layers, and what to do; full attention and MLA pass.

Built on vLLM's own KVCacheSpec classes where vLLM is installed (so a renamed class shows
here), else on stand-ins of the same names.
"""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace
from typing import Any

import pytest

from connector.model_support import FEATURES, PUSHED, UnsupportedModel, check_kv_cache_groups

HAS_VLLM = importlib.util.find_spec("vllm") is not None
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(5)]


def spec(kind: str, **fields: Any) -> Any:
    return type(kind, (), fields)()


def group(kv_spec: Any, layers: list[str]) -> Any:
    return SimpleNamespace(kv_cache_spec=kv_spec, layer_names=layers)


def test_full_attention_and_mla_groups_pass() -> None:
    check_kv_cache_groups([group(spec("FullAttentionSpec"), LAYERS)])
    check_kv_cache_groups([group(spec("MLAAttentionSpec"), LAYERS)])
    check_kv_cache_groups([])  # vLLM 0.26 gives no groups: register_kv_caches checks


def test_a_sliding_window_group_is_refused_naming_the_feature_window_and_layers() -> None:
    groups = [
        group(spec("FullAttentionSpec"), LAYERS[1::2]),
        group(spec("SlidingWindowSpec", sliding_window=32), LAYERS[0::2]),
    ]
    with pytest.raises(UnsupportedModel) as err:
        check_kv_cache_groups(groups)
    msg = str(err.value)
    assert msg.startswith("pushkv does not push sliding-window attention layers (window 32")
    assert "group 1 (SlidingWindowSpec)" in msg
    assert "model.layers.0.self_attn.attn, model.layers.2.self_attn.attn" in msg
    assert "--disable-hybrid-kv-cache-manager" in msg


@pytest.mark.parametrize(
    ("kind", "words"),
    [
        ("MambaSpec", "Mamba / linear-attention state layers"),
        ("ChunkedLocalAttentionSpec", "chunked local attention"),
        ("UniformTypeKVCacheSpecs", "KV shapes differ"),
        ("CrossAttentionSpec", "cross-attention"),
        ("SomeFutureSpec", "KV cache spec SomeFutureSpec"),  # unknown: refused, not guessed
    ],
)
def test_other_features_are_refused_by_name(kind: str, words: str) -> None:
    with pytest.raises(UnsupportedModel, match=words):
        check_kv_cache_groups([group(spec(kind), LAYERS)])


def test_more_than_three_layers_are_counted_not_listed() -> None:
    with pytest.raises(UnsupportedModel, match=r"layers\.2\.self_attn\.attn and 2 more"):
        check_kv_cache_groups([group(spec("MambaSpec"), LAYERS)])


@pytest.mark.skipif(not HAS_VLLM, reason="vLLM not installed")
def test_the_names_are_vllms_spec_classes() -> None:
    import torch
    from vllm.v1 import kv_cache_interface as kci

    for name in PUSHED | set(FEATURES):
        assert hasattr(kci, name), f"vLLM has no {name}: update connector/model_support.py"
    swa = kci.SlidingWindowSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, sliding_window=32
    )
    with pytest.raises(UnsupportedModel, match="window 32 tokens"):
        check_kv_cache_groups([group(swa, LAYERS[:2])])
    full = kci.FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    mla = kci.MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    check_kv_cache_groups([group(full, LAYERS), group(mla, LAYERS)])

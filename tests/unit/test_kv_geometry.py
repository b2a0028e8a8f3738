"""A rank's KV geometry (connector/core/geometry.py) from the layouts vLLM's KV views give
(``describe_kv_caches``): per-head and MLA, bf16 and fp8, every readable KVCacheLayout, a TP
slice of the heads, and layouts with K and V in regions of their own."""

from __future__ import annotations

import msgspec
import pytest
import torch

from connector.config import PushkvConfig
from connector.core.geometry import KVGeometry, kv_geometry
from connector.core.layout import KVLayout, Region
from connector.kv_tensors import describe_kv_caches
from connector.tools.kv_caches import vllm_kv_caches
from connector.transfer.spans import geometry_attributes
from connector.worker_side import WorkerSide
from telemetry.schema import Attr

L, B, H, N, D = 3, 5, 4, 16, 8
LATENT = 576  # DeepSeek-V2/V3: kv_lora_rank 512 + qk_rope_head_dim 64


def mla_views(dtype: torch.dtype, shape: tuple[int, ...] = (B, N, -1)) -> dict[str, torch.Tensor]:
    """vLLM's MLA KV, one view per layer (fp8 lives in uint8 tensors): [B, N, latent] on
    vLLM 0.26, [B, 1, N, latent] on 0.32 (``create_kv_cache_views``: [B, H, N, C], H = 1)."""
    elt = torch.empty(0, dtype=dtype).element_size()
    raw = torch.zeros(L * B * N * LATENT * elt, dtype=torch.uint8)
    per = B * N * LATENT * elt
    return {
        f"model.layers.{i}.self_attn.attn": raw[i * per : (i + 1) * per].view(dtype).view(shape)
        for i in range(L)
    }


def worker(latent: bool, heads: int) -> WorkerSide:
    """A P rank's worker as the plugin makes it (nothing started)."""
    return WorkerSide(PushkvConfig(), "prefill", True, False, 0, 1, heads, N, {}, latent=latent)


@pytest.mark.parametrize("order", ["LBHNC", "LBNHC", "BLHNC", "BLNHC"])
def test_per_head_bf16_counts_k_and_v_of_every_layer_and_head(order: str) -> None:
    _, views = vllm_kv_caches(L, B, H, N, D, dtype=torch.bfloat16, layout=order)
    g = worker(latent=False, heads=H).geometry(describe_kv_caches(views, {}, (0, H)))
    assert g == KVGeometry(
        layers=L,
        form="heads",
        heads=H,
        head_size=D,
        dtype="bfloat16",
        bytes_per_token=L * H * 2 * D * 2,  # layers x heads x (K, V) x D x 2 bytes
        block_tokens=N,
    )


@pytest.mark.parametrize("cache_dtype", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_fp8_halves_bf16s_bytes_per_token_at_the_same_head_size(cache_dtype: str) -> None:
    _, views = vllm_kv_caches(L, B, H, N, D, dtype=torch.uint8)  # vLLM's fp8 KV tensors
    g = kv_geometry(describe_kv_caches(views, {}, (0, H), cache_dtype=cache_dtype))
    _, bf16 = vllm_kv_caches(L, B, H, N, D, dtype=torch.bfloat16)
    ref = kv_geometry(describe_kv_caches(bf16, {}, (0, H)))
    assert (g.dtype, g.head_size, g.heads) == (cache_dtype, D, H)
    assert 2 * g.bytes_per_token == ref.bytes_per_token == L * H * 2 * D * 2


def test_a_tp_rank_counts_only_its_own_heads() -> None:
    _, views = vllm_kv_caches(L, B, H // 2, N, D)
    g = kv_geometry(describe_kv_caches(views, {}, (H // 2, H)))
    assert (g.heads, g.head_size, g.bytes_per_token) == (H // 2, D, L * (H // 2) * 2 * D * 2)


@pytest.mark.parametrize("shape", [(B, N, -1), (B, 1, N, -1)], ids=["vllm-0.26", "vllm-0.32"])
@pytest.mark.parametrize(
    ("dtype", "cache_dtype", "elt"), [(torch.bfloat16, "auto", 2), (torch.uint8, "fp8", 1)]
)
def test_mla_is_one_latent_per_token_and_layer(
    dtype: torch.dtype, cache_dtype: str, elt: int, shape: tuple[int, ...]
) -> None:
    """The worker takes the form from the model, not the views' shape: vLLM 0.32's 4-D
    latent looks like a one-head K|V cache (read from the shape, it was 'heads' of 288)."""
    views = mla_views(dtype, shape)
    lay = describe_kv_caches(views, {}, (0, 1), cache_dtype=cache_dtype)
    g = worker(latent=True, heads=1).geometry(lay)
    assert (g.form, g.heads, g.head_size, g.layers) == ("latent", 1, LATENT, L)
    assert g.bytes_per_token == L * LATENT * elt  # no separate V: the latent is all
    assert g.dtype == ("bfloat16" if cache_dtype == "auto" else cache_dtype)


def test_k_and_v_in_regions_of_their_own_give_the_same_geometry_as_packed() -> None:
    packed = KVLayout(
        block_size=N,
        num_blocks=B,
        heads=(0, H),
        token_bytes=2 * D * 2,
        order="HND",
        regions=tuple(
            Region(layer=i, group=0, part=0, base_addr=i << 20, block_stride=H * N * 4 * D)
            for i in range(L)
        ),
        dtype="float16",
    )
    split = msgspec.structs.replace(
        packed,
        token_bytes=D * 2,
        regions=tuple(
            Region(
                layer=i, group=0, part=p, base_addr=(2 * i + p) << 20, block_stride=H * N * 2 * D
            )
            for i in range(L)
            for p in (0, 1)
        ),
    )
    split.validate()
    assert kv_geometry(split) == kv_geometry(packed)
    assert kv_geometry(packed).head_size == D


def test_an_unknown_or_unnamed_dtype_leaves_the_head_size_unknown_but_not_the_bytes() -> None:
    _, views = vllm_kv_caches(L, B, H, N, D)
    lay = describe_kv_caches(views, {}, (0, H))
    for name in ("", "fp8_ds_mla"):
        g = kv_geometry(msgspec.structs.replace(lay, dtype=name))
        assert g.head_size is None and g.bytes_per_token == L * H * 2 * D * 2


def test_span_attributes_name_every_field_and_drop_the_unknown() -> None:
    g = KVGeometry(
        layers=2,
        form="latent",
        heads=1,
        head_size=None,
        dtype="",
        bytes_per_token=2304,
        block_tokens=16,
    )
    attrs = geometry_attributes(g)
    assert attrs[Attr.KV_FORM] == "latent" and attrs[Attr.KV_BYTES_PER_TOKEN] == 2304
    assert attrs[Attr.KV_LAYERS] == 2 and attrs[Attr.KV_BLOCK_TOKENS] == 16
    assert attrs[Attr.KV_HEADS] == 1
    assert attrs[Attr.KV_HEAD_SIZE] is None and attrs[Attr.KV_DTYPE] is None  # emit drops None

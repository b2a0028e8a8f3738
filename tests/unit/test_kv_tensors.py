"""vLLM's KV views (every KVCacheLayout pushkv can read, bf16 and fp8) described as a
KVLayout: every element's address as the tensor has it, planned transfers between two
layouts move the right bytes, and block rows cover exactly one block's data."""

from __future__ import annotations

import ctypes
import importlib.util

import pytest
import torch

from connector.core.errors import LayoutError
from connector.core.plan import plan_transfer
from connector.kv_tensors import (
    block_row_views,
    describe_kv_caches,
    physical_order,
    preferred_layout,
)
from connector.tools.kv_caches import LAYOUTS, layout_strides, vllm_kv_caches
from connector.tools.rank_spec import RankSpec, VllmKV

L, B, H, N, D = 3, 7, 2, 4, 8
READABLE = ("LBHNC", "LBNHC", "BLHNC", "BLNHC")
DTYPES = (torch.bfloat16, torch.float8_e4m3fn)


def caches(layout: str, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, dict]:
    return vllm_kv_caches(L, B, H, N, D, dtype=dtype, layout=layout)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", READABLE)
def test_every_element_is_where_the_layout_says(layout: str, dtype: torch.dtype) -> None:
    _, views = caches(layout, dtype)
    lay = describe_kv_caches(views, {}, (0, H))
    hs, ts = lay.strides()
    assert lay.token_bytes == 2 * D * views[next(iter(views))].element_size()
    assert lay.order == ("HND" if layout.index("H") < layout.index("N") else "NHD")
    for region, name in zip(lay.regions, views, strict=True):
        t = views[name]
        for b, h, n in ((0, 0, 0), (B - 1, H - 1, N - 1), (3, 1, 2)):
            assert region.base_addr + b * region.block_stride + h * hs + n * ts == (
                t[b, h, n].data_ptr()
            )


@pytest.mark.parametrize(
    ("cache_dtype", "dtype", "name"),
    [
        ("auto", torch.bfloat16, "bfloat16"),
        ("bfloat16", torch.bfloat16, "bfloat16"),
        ("fp8", torch.uint8, "fp8"),  # vLLM keeps every fp8 KV in uint8 tensors
        ("fp8_e4m3", torch.uint8, "fp8_e4m3"),
        ("fp8_e5m2", torch.uint8, "fp8_e5m2"),
    ],
)
def test_the_layout_names_the_kv_dtype(cache_dtype: str, dtype: torch.dtype, name: str) -> None:
    _, views = caches("LBHNC", dtype)
    lay = describe_kv_caches(views, {}, (0, H), cache_dtype=cache_dtype)
    assert lay.dtype == name and lay.token_bytes == 2 * D * dtype.itemsize
    lay.validate()  # the name fits the wire type


def test_block_outermost_layout_puts_a_blocks_layers_side_by_side() -> None:
    _, views = caches("BLHNC")
    lay = describe_kv_caches(views, {}, (0, H))
    page = H * N * lay.token_bytes
    assert [r.block_stride for r in lay.regions] == [L * page] * L
    assert [r.base_addr - lay.regions[0].base_addr for r in lay.regions] == [0, page, 2 * page]
    # Three contiguous blocks of every layer: one run of memory, one descriptor.
    ids = ((2, 3, 4),)
    pieces = plan_transfer(
        lay, ids, lay, ((0, 1, 2),), first_token=0, num_tokens=3 * N, heads=(0, H)
    )
    assert pieces.count == 1 and pieces.bytes_total == 3 * L * page


@pytest.mark.parametrize(("p_layout", "d_layout"), [("LBHNC", "BLHNC"), ("BLNHC", "LBHNC")])
def test_planned_pieces_move_the_right_bytes_between_layouts(p_layout: str, d_layout: str) -> None:
    p_raw, p_views = caches(p_layout)
    d_raw, d_views = caches(d_layout)
    g = torch.Generator().manual_seed(3)
    p_raw.copy_(torch.randint(0, 256, p_raw.shape, dtype=torch.uint8, generator=g))
    p_lay = describe_kv_caches(p_views, {}, (0, H), opaque=False)  # as on a GPU
    d_lay = describe_kv_caches(d_views, {}, (0, H), opaque=False)
    p_ids, d_ids, tokens = (5, 1), (2, 6), N + 3  # the last block is partial
    pieces = plan_transfer(
        p_lay, (p_ids,), d_lay, (d_ids,), first_token=0, num_tokens=tokens, heads=(0, H)
    )
    for s, d, n in zip(pieces.src, pieces.dst, pieces.length, strict=True):
        ctypes.memmove(int(d), int(s), int(n))
    for p_name, d_name in zip(p_views, d_views, strict=True):
        p_t, d_t = p_views[p_name], d_views[d_name]
        for k, (pb, db) in enumerate(zip(p_ids, d_ids, strict=True)):
            n = min(N, tokens - k * N)
            assert torch.equal(d_t[db, :, :n].view(torch.uint8), p_t[pb, :, :n].view(torch.uint8))
            assert int(d_t[db, :, n:].view(torch.uint8).sum()) == 0  # nothing past the prompt


@pytest.mark.parametrize("layout", READABLE)
def test_block_rows_are_each_blocks_bytes(layout: str) -> None:
    _, views = caches(layout)
    rows = block_row_views(views)
    for r, name in zip(rows, views, strict=True):
        t = views[name]
        assert r.shape == (B, H * N * t.shape[-1] * t.element_size())
        r[4].fill_(7)
        assert bool((t[4].view(torch.uint8) == 7).all())
        assert int(t[3].view(torch.uint8).sum()) == int(t[5].view(torch.uint8).sum()) == 0


@pytest.mark.parametrize("layout", ("LBHNC", "BLHNC"))
def test_latent_views_are_mlas_pages_of_one_head(layout: str) -> None:
    """MLA as vLLM 0.26 hands it: [B, N, latent] per layer, read as one head of the latent."""
    width = 12  # elements of the latent (DeepSeek-V3: 576)
    _, views = vllm_kv_caches(L, B, 1, N, width, layout=layout, latent=True)
    lay = describe_kv_caches(views, {}, (0, 1))
    elt = torch.empty(0, dtype=torch.bfloat16).element_size()
    assert all(t.shape == (B, N, width) for t in views.values())
    assert lay.num_heads == 1 and lay.token_bytes == width * elt
    assert lay.block_bytes == N * width * elt  # no V beside the latent
    for region, t in zip(lay.regions, views.values(), strict=True):
        assert region.base_addr + 3 * region.block_stride + 2 * lay.token_bytes == (
            t[3, 2].data_ptr()
        )
    rows = block_row_views(views)
    assert all(r.shape == (B, N * width * elt) for r in rows)
    with pytest.raises(ValueError, match="one head"):
        vllm_kv_caches(L, B, 2, N, width, latent=True)


def test_a_latent_rank_holds_its_latent_blocks() -> None:
    width = 12
    spec = RankSpec(
        "P",
        "p",
        0,
        1,
        1,
        num_layers=L,
        num_blocks=B,
        block_size=N,
        num_kv_heads=1,
        token_bytes=width * 2,
        kv_layout="LBHNC",
        latent=True,
    )
    kv = VllmKV(spec)
    assert all(t.shape == (B, N, width) for t in kv.views.values())
    assert kv.layout.token_bytes == spec.token_bytes and kv.layout.num_heads == 1
    sums = kv.block_sums([4, 1])
    assert sums.shape == (L, 2) and (sums > 0).all()  # P's seeded bytes are never 0


def test_unreadable_layouts_and_mismatches_are_clear_errors() -> None:
    _, views = caches("LBHNC")
    with pytest.raises(LayoutError, match="heads"):
        describe_kv_caches(views, {}, (0, H + 1))
    odd = dict(views)
    odd["model.layers.9.self_attn.attn"] = torch.zeros(B, H, N, 2 * D + 2, dtype=torch.bfloat16)
    with pytest.raises(LayoutError, match="differs"):
        describe_kv_caches(odd, {}, (0, H))
    with pytest.raises(LayoutError, match="no KV cache"):
        describe_kv_caches({}, {}, (0, H))
    _, head_outer = caches("LHBNC")
    with pytest.raises(LayoutError):
        describe_kv_caches(head_outer, {}, (0, H))  # a block's heads overlap other blocks


def test_pushkv_asks_for_block_outermost_on_gpus_only() -> None:
    assert preferred_layout("cuda") == "BLHNC"
    assert preferred_layout("cpu") == "LBHNC"


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed")
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_strides_match_vllms_own(layout: str) -> None:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, compute_layout_strides
    from vllm.v1.kv_cache_layout import KVCacheLayout

    spec = FullAttentionSpec(block_size=N, num_kv_heads=H, head_size=D, dtype=torch.bfloat16)
    want = compute_layout_strides(spec, B, L, KVCacheLayout[layout])
    assert layout_strides((L, B, H, N, 2 * D * 2), layout) == tuple(want)


@pytest.mark.parametrize("layout", READABLE)
def test_physical_order_names_the_layout_vllm_allocated(layout: str) -> None:
    _, views = caches(layout)
    assert physical_order(views) == layout


def test_physical_order_of_separately_allocated_layers_puts_layers_outermost() -> None:
    views = {f"model.layers.{i}.self_attn": torch.zeros(B, H, N, 2 * D) for i in range(L)}
    assert physical_order(views) == "LBHNC"

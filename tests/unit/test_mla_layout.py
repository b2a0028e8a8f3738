"""MLA's KV as pushkv sees it: vLLM's [blocks, tokens, latent] per layer is one KV head,
replicated on every TP rank, so one P rank writes each D rank and no head is split.

The views are built as vLLM's CPU and GPU MLA backends allocate them (MLAAttentionSpec:
[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]); the e2e proof on real vLLM is
tests/e2e/test_mla_e2e.py.
"""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import pytest
import torch

from connector.core.plan import plan_transfer
from connector.kv_tensors import as_bhnc, block_row_views, describe_kv_caches, physical_order
from connector.model_support import is_latent_kv, kv_heads_of
from connector.plugin import PushConnector
from connector.transfer.topology import Topology

L, B, N, C = 3, 6, 16, 576  # DeepSeek's latent: kv_lora_rank 512 + rope 64; CPU blocks of 16


def mla_caches() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One buffer, a [B, N, C] bf16 view per layer (vLLM's MLA KV, layer-outermost)."""
    raw = torch.zeros(L * B * N * C * 2, dtype=torch.uint8)
    per = B * N * C * 2
    views = {
        f"model.layers.{i}.self_attn.attn": raw[i * per : (i + 1) * per]
        .view(torch.bfloat16)
        .view(B, N, C)
        for i in range(L)
    }
    return raw, views


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)  # random bytes hold NaNs: compare bits


def test_the_latent_is_one_head_and_every_element_is_where_the_layout_says() -> None:
    _, views = mla_caches()
    lay = describe_kv_caches(views, {}, (0, 1))
    assert (lay.heads, lay.token_bytes, lay.block_size, lay.num_blocks) == ((0, 1), 2 * C, N, B)
    assert lay.opaque_blocks  # on CPU whole blocks move, as for every CPU layout
    hs, ts = lay.strides()
    for region, name in zip(lay.regions, views, strict=True):
        t = views[name]
        assert region.block_stride == N * C * 2
        for b, n in ((0, 0), (B - 1, N - 1), (3, 7)):
            assert region.base_addr + b * region.block_stride + n * ts == t[b, n].data_ptr()
    assert physical_order(views) == "LBHNC"  # H is the singleton latent head


@pytest.mark.parametrize("opaque", [True, False])
def test_planned_pieces_move_whole_latents_between_mla_caches(opaque: bool) -> None:
    p_raw, p_views = mla_caches()
    d_raw, d_views = mla_caches()
    g = torch.Generator().manual_seed(5)
    p_raw.copy_(torch.randint(0, 256, p_raw.shape, dtype=torch.uint8, generator=g))
    p_lay = describe_kv_caches(p_views, {}, (0, 1), opaque=opaque)
    d_lay = describe_kv_caches(d_views, {}, (0, 1), opaque=opaque)
    p_ids, d_ids, tokens = (4, 0, 2), (1, 5, 3), 2 * N + 5  # the last block is partial
    pieces = plan_transfer(
        p_lay, (p_ids,), d_lay, (d_ids,), first_token=0, num_tokens=tokens, heads=(0, 1)
    )
    for s, d, n in zip(pieces.src, pieces.dst, pieces.length, strict=True):
        ctypes.memmove(int(d), int(s), int(n))
    for p_name, d_name in zip(p_views, d_views, strict=True):
        p_t, d_t = p_views[p_name], d_views[d_name]
        for k, (pb, db) in enumerate(zip(p_ids, d_ids, strict=True)):
            n = N if opaque else min(N, tokens - k * N)  # opaque: partial blocks go whole
            assert torch.equal(_bytes(d_t[db, :n]), _bytes(p_t[pb, :n]))
            assert int(d_t[db, n:].view(torch.uint8).sum()) == 0
        untouched = set(range(B)) - set(d_ids)
        assert all(int(d_t[b].view(torch.uint8).sum()) == 0 for b in untouched)


def test_a_suffix_after_a_prefix_hit_moves_only_the_suffix_blocks() -> None:
    p_raw, p_views = mla_caches()
    d_raw, d_views = mla_caches()
    p_raw.copy_(torch.randint(1, 256, p_raw.shape, dtype=torch.uint8))
    p_lay = describe_kv_caches(p_views, {}, (0, 1))
    d_lay = describe_kv_caches(d_views, {}, (0, 1))
    # D had the first block cached: P sends tokens [16, 40) (its blocks 1, 2) into D's 2, 3.
    pieces = plan_transfer(
        p_lay, ((0, 1, 2),), d_lay, ((2, 3),), first_token=N, num_tokens=40, heads=(0, 1)
    )
    assert pieces.bytes_total == L * 2 * N * 2 * C  # two whole blocks per layer, not three
    for s, d, n in zip(pieces.src, pieces.dst, pieces.length, strict=True):
        ctypes.memmove(int(d), int(s), int(n))
    for p_t, d_t in zip(p_views.values(), d_views.values(), strict=True):
        assert torch.equal(_bytes(d_t[2]), _bytes(p_t[1]))
        assert torch.equal(_bytes(d_t[3]), _bytes(p_t[2]))
        assert all(int(d_t[b].view(torch.uint8).sum()) == 0 for b in (0, 1, 4, 5))


def test_block_rows_of_mla_views_are_each_blocks_latents() -> None:
    _, views = mla_caches()
    rows = block_row_views(views)
    assert all(r.shape == (B, N * C * 2) for r in rows)
    rows[1][2].fill_(9)
    t = views["model.layers.1.self_attn.attn"]
    assert bool((t[2].view(torch.uint8) == 9).all()) and int(t[1].view(torch.uint8).sum()) == 0


def test_as_bhnc_leaves_attention_views_alone() -> None:
    t = torch.zeros(B, 2, N, 8)
    assert as_bhnc(t) is t
    assert as_bhnc(torch.zeros(B, N, C)).shape == (B, 1, N, C)


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 1), (2, 1), (1, 2), (2, 2), (4, 2)])
def test_each_d_rank_is_written_by_exactly_one_p_rank(p_tp: int, d_tp: int) -> None:
    topo = Topology(num_kv_heads=1, p_tp=p_tp)
    for d in range(d_tp):
        (p,) = topo.sources(d, d_tp)  # one completion per D rank, from one P rank
        assert topo.heads(p, d, d_tp) == (0, 1)
    writers = {p for d in range(d_tp) for p in topo.sources(d, d_tp)}
    assert all(topo.targets(p, d_tp) for p in writers)
    assert all(not topo.targets(p, d_tp) for p in set(range(p_tp)) - writers)


def test_mla_models_count_one_kv_head_and_say_their_kv_is_latent() -> None:
    mla = SimpleNamespace(use_mla=True, get_total_num_kv_heads=lambda: 128)
    gqa = SimpleNamespace(use_mla=False, get_total_num_kv_heads=lambda: 8)
    assert kv_heads_of(mla) == 1 and kv_heads_of(gqa) == 8
    assert is_latent_kv(mla) and not is_latent_kv(gqa)


def test_pushkv_asks_no_kv_layout_of_an_mla_model() -> None:
    cfg = SimpleNamespace(
        model_config=SimpleNamespace(use_mla=True),
        device_config=SimpleNamespace(device_type="cpu"),
    )
    assert PushConnector.get_required_kvcache_layout(cfg) is None
    cfg.model_config.use_mla = False
    assert PushConnector.get_required_kvcache_layout(cfg) == "LBHNC"

"""bench/gpu_model_cost.py without processes: each GPU model's KV geometry comes from its
config in ``GPU_MODELS``, the ranks are laid out as vLLM 0.26 hands the KV on a GPU, block
ids fit the cache, and a failed pair shows in the table."""

from __future__ import annotations

import pytest

from bench.gpu_model import GPU_MODELS
from bench.gpu_model_cost import Blocks, geometry, rank_specs, table
from connector.tools.tinymodel import kv_bytes_per_token


@pytest.mark.parametrize(
    ("model", "layers", "heads", "token_bytes", "latent", "block_size", "per_token"),
    [
        ("llama8b", 32, 8, 2 * 128 * 2, False, 16, 128 * 1024),
        ("qwen32b-tp8", 64, 1, 2 * 128 * 2, False, 16, 32 * 1024),
        ("dsv3-tp8", 61, 1, 576 * 2, True, 64, 70_272),
    ],
)
def test_each_models_geometry_is_its_configs(
    model: str,
    layers: int,
    heads: int,
    token_bytes: int,
    latent: bool,
    block_size: int,
    per_token: int,
) -> None:
    g = geometry(model)
    assert (g.layers, g.heads, g.token_bytes, g.latent, g.block_size) == (
        layers,
        heads,
        token_bytes,
        latent,
        block_size,
    )
    assert g.bytes_per_token == per_token == kv_bytes_per_token(GPU_MODELS[model])
    assert geometry(model, block_size=32).block_size == 32


def test_ranks_hold_the_kv_as_vllm_026_hands_it_on_a_gpu() -> None:
    p, d = rank_specs(geometry("dsv3-tp8"), "cuda:0", "ipc", 321, "LBHNC")
    assert (p.role, d.role) == ("P", "D") and p.port != d.port and p.agent != d.agent
    for s in (p, d):
        assert s.kv_layout == "LBHNC" and s.latent and s.num_kv_heads == 1
        assert (s.token_bytes, s.block_size, s.num_blocks) == (1152, 64, 321)
        assert (s.xfer_paths, s.device, s.dtype) == ("ipc", "cuda:0", "bfloat16")


@pytest.mark.parametrize("pattern", ["contiguous", "scattered"])
def test_block_ids_are_distinct_and_inside_the_cache(pattern: str) -> None:
    p_ids, d_ids = Blocks(40, seed=1)(pattern, 32)
    for ids in (p_ids, d_ids):
        assert len(set(ids)) == 32 and all(0 <= b < 40 for b in ids)
    if pattern == "contiguous":
        assert p_ids == tuple(range(32)) and d_ids == tuple(range(8, 40))


def test_a_failed_pair_is_a_row_of_its_own() -> None:
    md = table([{"model": "llama8b", "paths": "ipc", "error": "TimeoutError: x"}])
    assert md.splitlines()[-1] == "| llama8b | ipc | error: TimeoutError: x |"

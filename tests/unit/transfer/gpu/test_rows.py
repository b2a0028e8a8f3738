"""Gather, scatter and scattered -> scattered copies on CPU tensors shaped like vLLM's
GPU attention caches, checked bytewise; the Triton kernel through Triton's interpreter."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator

import pytest
import torch

from connector.core.errors import LayoutError
from connector.transfer.gpu import rows as R

NB, N, H, D = 12, 16, 2, 8  # blocks, tokens per block, KV heads, head dim


def flash_attn(dtype: torch.dtype, layers: int = 3) -> list[torch.Tensor]:
    """FlashAttention: per layer [2, num_blocks, block_size, heads, head_dim]."""
    return [_rand((2, NB, N, H, D), dtype) for _ in range(layers)]


def flashinfer(dtype: torch.dtype, layers: int = 3, hnd: bool = False) -> list[torch.Tensor]:
    """FlashInfer: per layer [num_blocks, 2, block_size, heads, head_dim] (NHD) or
    [num_blocks, 2, heads, block_size, head_dim] (HND)."""
    shape = (NB, 2, H, N, D) if hnd else (NB, 2, N, H, D)
    return [_rand(shape, dtype) for _ in range(layers)]


def _rand(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    raw = torch.randint(
        1,
        255,
        (*shape[:-1], shape[-1] * torch.tensor([], dtype=dtype).element_size()),
        dtype=torch.uint8,
    )
    return raw.view(dtype)


def table(kvs: list[torch.Tensor], packed_dim: int) -> R.RowTable:
    """K and V of every layer as separate regions (layer-major, K before V)."""
    if packed_dim == 0:
        return R.RowTable.of([R.block_rows(kv[p]) for kv in kvs for p in (0, 1)])
    return R.RowTable.of([R.block_rows(kv[:, p]) for kv in kvs for p in (0, 1)])


LAYOUTS: dict[str, tuple[Callable[[], list[torch.Tensor]], int]] = {
    "flash_attn_bf16": (lambda: flash_attn(torch.bfloat16), 0),
    "flash_attn_fp8": (lambda: flash_attn(torch.float8_e4m3fn), 0),
    "flashinfer_nhd_bf16": (lambda: flashinfer(torch.bfloat16), 1),
    "flashinfer_hnd_fp8": (lambda: flashinfer(torch.float8_e4m3fn, hnd=True), 1),
}


def block_bytes(kv: torch.Tensor, packed_dim: int, part: int, b: int) -> torch.Tensor:
    blk = kv[part, b] if packed_dim == 0 else kv[b, part]
    return blk.contiguous().view(torch.uint8).reshape(-1)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_block_rows_are_each_blocks_bytes(name: str) -> None:
    make, pd = LAYOUTS[name]
    kvs = make()
    t = table(kvs, pd)
    for r, (layer, part) in enumerate((i, p) for i in range(len(kvs)) for p in (0, 1)):
        for b in (0, 5, NB - 1):
            assert torch.equal(t.tensors[r][b], block_bytes(kvs[layer], pd, part, b))


def test_block_rows_refuses_non_contiguous_blocks() -> None:
    kv = torch.zeros(2, NB, N, H, D)
    with pytest.raises(LayoutError):
        R.block_rows(kv.transpose(2, 3))


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_gather_scatter_and_copy_move_exactly_the_named_rows(
    name: str, backend: str, interpreted: None
) -> None:
    make, pd = LAYOUTS[name]
    src = table(make(), pd)
    dst_kvs = [torch.zeros_like(kv) for kv in make()]
    dst = table(dst_kvs, pd)
    s_ids = torch.tensor([7, 0, 3, 11, 4], dtype=torch.int64)
    d_ids = torch.tensor([2, 9, 10, 1, 5], dtype=torch.int64)
    r0, r1 = 1, 5  # a chunk of regions
    stage = torch.full(((r1 - r0) * 5 * src.row_bytes + 64,), 0xAB, dtype=torch.uint8)
    R.gather(src, s_ids, stage, (r0, r1), backend=backend)  # type: ignore[arg-type]
    view = stage[: (r1 - r0) * 5 * src.row_bytes].view(r1 - r0, 5, src.row_bytes)
    for k, r in enumerate(range(r0, r1)):
        assert torch.equal(view[k], src.tensors[r][s_ids])
    assert bool((stage[-64:] == 0xAB).all())  # nothing past the chunk written
    R.scatter(stage, dst, d_ids, (r0, r1), backend=backend)  # type: ignore[arg-type]
    for r in range(dst.num_regions):
        for j in range(5):
            want = (
                src.tensors[r][s_ids[j]]
                if r0 <= r < r1
                else torch.zeros(src.row_bytes, dtype=torch.uint8)
            )
            assert torch.equal(dst.tensors[r][d_ids[j]], want)
    untouched = [b for b in range(NB) if b not in d_ids.tolist()]
    assert all(int(t[untouched].sum()) == 0 for t in dst.tensors)
    dst2 = table([torch.zeros_like(kv) for kv in make()], pd)
    R.copy_rows(src, s_ids, dst2, d_ids, backend=backend)  # type: ignore[arg-type]
    for r in range(src.num_regions):
        assert torch.equal(dst2.tensors[r][d_ids], src.tensors[r][s_ids])
        assert int(dst2.tensors[r][untouched].sum()) == 0


@pytest.fixture
def interpreted(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> Iterator[None]:
    """Run the Triton kernel under Triton's CPU interpreter (skipped without Triton)."""
    if request.node.callspec.params.get("backend") != "triton":
        yield
        return
    triton = pytest.importorskip("triton")
    if tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 9):
        pytest.skip("Triton's interpreter before 3.9 stops on this kernel (seen with 3.6)")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from connector.transfer.gpu import kernels

    importlib.reload(kernels)  # the decorator picks the interpreter at definition time
    R._kernels.cache_clear()
    yield
    monkeypatch.undo()
    importlib.reload(kernels)  # compiled again for later tests on a real GPU
    R._kernels.cache_clear()


def test_auto_backend_is_torch_on_cpu() -> None:
    t = table(flash_attn(torch.bfloat16), 0)
    assert R._pick("auto", t.device, t) == "torch"


def test_bad_arguments_raise() -> None:
    t = table(flash_attn(torch.bfloat16), 0)
    ids = torch.tensor([1, 2], dtype=torch.int64)
    with pytest.raises(LayoutError):
        R.gather(t, ids.to(torch.int32), torch.empty(10**6, dtype=torch.uint8))
    with pytest.raises(LayoutError):
        R.gather(t, ids, torch.empty(16, dtype=torch.uint8))  # slot too small
    with pytest.raises(LayoutError):
        R.RowTable.of([t.tensors[0], t.tensors[1][:3]])
    with pytest.raises(LayoutError):
        R.copy_rows(t, ids, t, ids[:1])


@pytest.mark.parametrize("backend", ["triton"])
@pytest.mark.parametrize("rows_per_prog", [1, 3])
def test_kernel_launch_shapes_cover_ragged_rows(
    backend: str, rows_per_prog: int, interpreted: None
) -> None:
    from connector.transfer.gpu.kernels import Tune

    g = torch.Generator().manual_seed(3)
    src = R.RowTable.of(
        [torch.randint(1, 255, (9, 384), dtype=torch.uint8, generator=g) for _ in range(3)]
    )
    dst = R.RowTable.of([torch.zeros(9, 384, dtype=torch.uint8) for _ in range(3)])
    s_ids = torch.tensor([8, 0, 4, 2, 6], dtype=torch.int64)
    d_ids = torch.tensor([1, 2, 3, 7, 5], dtype=torch.int64)
    tune = Tune(block_words=32, rows=rows_per_prog, num_warps=1)  # 48-word rows: masked tail
    R.copy_rows(src, s_ids, dst, d_ids, backend="triton", tune=tune)
    for s, d in zip(src.tensors, dst.tensors, strict=True):
        assert torch.equal(d[d_ids], s[s_ids])
        assert int(d[[0, 4, 6, 8]].sum()) == 0

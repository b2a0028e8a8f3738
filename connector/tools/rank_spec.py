"""One synthetic rank's description (``RankSpec``) and its KV cache: numpy buffers laid out
like vLLM's CPU cache, or (``kv_layout``) torch tensors as vLLM's views lay them out
(``VllmKV``). No vLLM, no NIXL; torch only for the latter and for CUDA buffers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from connector.core.heads import head_range
from connector.core.layout import KVLayout, Region
from connector.core.messages import PeerAddr
from connector.core.state import ReceiverPolicy, SenderPolicy

Role = Literal["P", "D"]


@dataclass(frozen=True)
class RankSpec:
    """One rank of a synthetic engine."""

    role: Role
    engine_id: str
    rank: int
    tp_size: int
    port: int
    num_layers: int = 2
    num_blocks: int = 64
    block_size: int = 16
    num_kv_heads: int = 4  # of the model, across all ranks
    token_bytes: int = 64
    order: Literal["HND", "NHD"] = "HND"
    p_tp: int = 1  # for D: the P engine's TP size (to know who writes to us)
    seed: int = 0
    device: str = "cpu"  # "cpu" (numpy, DRAM) or "cuda:N" (torch, VRAM)
    send_policy: SenderPolicy = field(default_factory=SenderPolicy)
    recv_policy: ReceiverPolicy = field(default_factory=ReceiverPolicy)
    dial_timeout_s: float = 5.0
    doorbell: bool = True  # UDP wake-ups on the listen port number (connector.transfer.doorbell)
    # A vLLM KVCacheLayout name ("LBHNC", "BLHNC", ...): the KV as vLLM's views lay it out
    # (connector.tools.kv_caches, token_bytes = K|V of one head), described as the worker
    # does; None: the synthetic buffer above. Needs torch.
    kv_layout: str | None = None
    dtype: str = "bfloat16"  # of the vLLM-shaped KV (bfloat16, float8_e4m3fn)
    # With kv_layout: MLA's KV, token_bytes one latent per token and layer (num_kv_heads 1),
    # each layer viewed [B, N, C] as vLLM 0.26 hands it (connector.tools.kv_caches).
    latent: bool = False
    xfer_paths: str = "auto"  # GPU: PushkvConfig.xfer_paths
    secret: bytes | None = None  # the P/D plane's shared secret (docs/security.md)
    # The address the side channel and doorbell bind and peers dial: a netbed host's
    # (connector.tools.netbed) when the rank runs in a namespace of its own.
    host: str = "127.0.0.1"

    @property
    def agent(self) -> str:
        return f"{self.engine_id}-{self.rank}"

    @property
    def addr(self) -> PeerAddr:
        return PeerAddr(agent=self.agent, host=self.host, port=self.port)

    @property
    def heads(self) -> tuple[int, int]:
        return head_range(self.rank, self.tp_size, self.num_kv_heads)

    def shape(self) -> tuple[int, ...]:
        h = self.heads[1] - self.heads[0]
        inner = (h, self.block_size) if self.order == "HND" else (self.block_size, h)
        return (self.num_layers, self.num_blocks, *inner, self.token_bytes)

    def allocate(self) -> Any:
        """P: seeded random bytes (so a misplaced byte shows); D: zeros. On CUDA a torch
        tensor, created before the transport so CUDA is up when UCX starts."""
        if self.device != "cpu":
            import torch

            dev = torch.device(self.device)
            torch.cuda.set_device(dev)
            if self.role == "P":
                g = torch.Generator(device=dev).manual_seed(self.seed * 1000 + self.rank)
                return torch.randint(
                    1, 256, self.shape(), dtype=torch.uint8, device=dev, generator=g
                )
            return torch.zeros(self.shape(), dtype=torch.uint8, device=dev)
        if self.role == "P":
            rng = np.random.default_rng(self.seed * 1000 + self.rank)
            return rng.integers(1, 256, size=self.shape(), dtype=np.uint8)
        return np.zeros(self.shape(), dtype=np.uint8)

    def layout(self, buf: Any) -> KVLayout:
        block_stride = int(np.prod(buf.shape[2:]))
        cuda = self.device != "cpu"
        addr = (lambda i: int(buf[i].data_ptr())) if cuda else (lambda i: int(buf[i].ctypes.data))
        regions = tuple(
            Region(layer=i, group=0, part=0, base_addr=addr(i), block_stride=block_stride)
            for i in range(self.num_layers)
        )
        return KVLayout(
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            heads=self.heads,
            token_bytes=self.token_bytes,
            order=self.order,
            regions=regions,
            mem_type="VRAM" if cuda else "DRAM",
            device_id=int(buf.device.index or 0) if cuda else 0,
        )


class VllmKV:
    """A rank's KV as vLLM hands it to the worker (``connector.tools.kv_caches``)."""

    def __init__(self, spec: RankSpec) -> None:
        import torch

        from connector.kv_tensors import describe_kv_caches
        from connector.tools.kv_caches import vllm_kv_caches

        self.spec, dev = spec, torch.device(spec.device)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        dtype = getattr(torch, spec.dtype)
        elt = torch.empty(0, dtype=dtype).element_size()
        h = spec.heads[1] - spec.heads[0]
        self.raw, self.views = vllm_kv_caches(
            spec.num_layers,
            spec.num_blocks,
            h,
            spec.block_size,
            spec.token_bytes // (elt if spec.latent else 2 * elt),
            dtype=dtype,
            layout=spec.kv_layout or "LBHNC",
            device=dev,
            latent=spec.latent,
        )
        if spec.role == "P":
            self.fill(list(range(spec.num_blocks)), spec.seed * 1000 + spec.rank)
        self.layout = describe_kv_caches(self.views, {}, spec.heads)

    def fill(self, block_ids: list[int], seed: int) -> None:
        """Seeded random bytes into these blocks of every layer, on the current stream."""
        import torch

        g = torch.Generator(device=self.raw.device).manual_seed(seed)
        for t in self.views.values():
            rows = t.view(torch.uint8)[block_ids]
            t.view(torch.uint8)[block_ids] = torch.randint(
                1, 256, rows.shape, dtype=torch.uint8, device=rows.device, generator=g
            )

    def block_sums(self, block_ids: list[int]) -> np.ndarray:
        """(layers, blocks) checksums."""
        import torch

        sums = [
            t.view(torch.uint8)[block_ids].reshape(len(block_ids), -1).to(torch.int64).sum(-1)
            for t in self.views.values()
        ]
        return torch.stack(sums).cpu().numpy()  # type: ignore[no-any-return]

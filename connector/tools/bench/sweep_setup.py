"""What every configuration of one sweep shares: the model, the servers' dtype, context and
KV size (``Setup``), from the command line's choices. No vLLM, NIXL or torch."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from connector.tools.bench.client_zygote import ClientZygote
from connector.tools.bench.sweep_points import SweepPlan
from connector.tools.tinyfamilies import is_mla
from connector.tools.tinymodel import MODELS, kv_bytes_per_token, make_tiny_model

WARMUP_PROMPTS = 4
# KV room for this many requests of the longest length in flight (the cache of a tiny model).
KV_ROOM_REQUESTS = 16
MIN_KV_BYTES = 256 << 20

Log = Callable[[str], None]


@dataclass(frozen=True)
class Setup:
    """What every configuration of one sweep shares."""

    plan: SweepPlan
    model: Path
    server_args: tuple[str, ...]
    pin_servers: bool
    run_dir: Path
    deadline: float  # sweep_run.now() by which the sweep ends
    warmup: bool = True
    gpus: tuple[str, str] | None = None  # P's and D's CUDA_VISIBLE_DEVICES (single: P's)
    zygote: ClientZygote | None = None  # forks each vllm bench serve (None: a fresh process)


def resolve_model(name: str) -> tuple[Path, dict[str, Any]]:
    """A tiny model by name (built if absent) or a model directory; with its config.json."""
    path = make_tiny_model(name=name) if name in MODELS else Path(name).expanduser().resolve()
    try:
        config: dict[str, Any] = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    return path, config


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU computes bf16 natively (AVX512-BF16 or AMX), from /proc/cpuinfo."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return True  # not Linux: leave vLLM's default alone
    flags = set(cpuinfo.split())
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def resolve_dtype(dtype: str, gpus: object) -> str:
    if dtype != "auto":
        return dtype
    return "bfloat16" if gpus is not None or cpu_has_native_bf16() else "float32"


def server_args(
    plan: SweepPlan, config: dict[str, Any], kv_bytes: int | None, dtype: str = "bfloat16"
) -> list[str]:
    """Context, dtype and KV size for the longest prompt (after ``VllmServer``'s own flags,
    so they win)."""
    limit = config.get("max_position_embeddings")
    if limit is not None and plan.max_model_len() > int(limit):
        raise SystemExit(
            f"the longest point needs {plan.max_model_len()} tokens of context; the model has "
            f"{limit} (use --model tiny-kv, or shorter --lengths)"
        )
    if kv_bytes is None:
        per_token = _kv_per_token(config, 4 if dtype == "float32" else 2)
        kv_bytes = max(MIN_KV_BYTES, per_token * plan.max_model_len() * KV_ROOM_REQUESTS)
    return [
        "--max-model-len",
        str(plan.max_model_len()),
        "--dtype",
        dtype,
        "--kv-cache-memory-bytes",
        str(kv_bytes),
    ]


def _kv_per_token(config: dict[str, Any], dtype_bytes: int = 2) -> int:
    try:
        if is_mla(config):  # one latent per layer, whatever the heads
            return kv_bytes_per_token(config, dtype_bytes)
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        return kv_bytes_per_token(
            {
                "num_hidden_layers": config["num_hidden_layers"],
                "num_key_value_heads": config.get(
                    "num_key_value_heads", config["num_attention_heads"]
                ),
                "head_dim": head_dim,
            },
            dtype_bytes,
        )
    except (KeyError, TypeError, ZeroDivisionError):
        return 0  # unknown geometry: the minimum size

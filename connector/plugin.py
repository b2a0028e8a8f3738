"""``PushConnector``: the class vLLM loads (``kv_connector_module_path: "connector"``).

A thin facade: each hook delegates to the scheduler role (scheduler_side.py) or the
worker role (worker_side.py), chosen when vLLM builds the object. Imports only vLLM's
connector base classes at module level, through connector/vllm_compat.py (which knows how
vLLM 0.26 and 0.32 differ); the transport (NIXL, torch) loads when a worker registers its
KV cache, so the API server imports this cheaply.

At the boundary every scheduler hook is guarded: a bug of ours is logged with the
request id and turned into a definite, safe answer instead of killing EngineCore.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import connector.vllm_compat as compat
from connector.config import check_failure_policy, check_parallelism, load_secret, parse_config
from connector.core.stages import source_rank
from connector.kv_params import LegTrust
from connector.kv_tensors import preferred_layout
from connector.metadata import StepPlan
from connector.model_support import check_kv_cache_groups, is_latent_kv, kv_heads_of
from connector.scheduler_side import SchedulerSide
from connector.shutdown import ShutdownWatch
from connector.stats import PushkvPromMetrics, PushkvStats, recomputed_counts
from connector.vllm_compat import KVConnectorMetadata, KVConnectorRole

logger = logging.getLogger(__name__)

T = TypeVar("T")


def _log_security(trust: LegTrust, consumer: bool) -> None:
    """Say plainly at start-up what the P/D plane trusts (docs/security.md)."""
    if trust.key is None:
        logger.warning(
            "pushkv: the P/D plane is UNAUTHENTICATED (no auth_secret_file/auth_secret_env/"
            "auth_secret): anyone who reaches the side-channel ports is taken as a peer"
        )
    else:
        logger.info("pushkv: P/D plane messages are authenticated with the shared secret")
    if consumer and trust.open:
        logger.warning(
            "pushkv: D dials any P a decode leg names (set a secret, so only router-signed "
            "coordinates are dialed, or trusted_prefill)"
        )


def _adopt_vllm_logging() -> None:
    """Our modules log under "connector.*" with the stdlib; show them where vLLM's go."""
    ours, theirs = logging.getLogger("connector"), logging.getLogger("vllm")
    if not ours.handlers and theirs.handlers:
        for h in theirs.handlers:
            ours.addHandler(h)
        ours.setLevel(logging.INFO)
        ours.propagate = False


class PushkvMetadata(KVConnectorMetadata):
    """One step's plan, pickled by vLLM from the scheduler to every worker."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


def _guard(default: Callable[..., Any]) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """A scheduler hook's boundary: our bug is logged, and the request it concerns is let
    go of definitely (``SchedulerSide.hook_failed``: D told, the load reported failed or
    computed here, P's blocks freed), traced and counted; ``default`` answers vLLM."""

    def wrap(fn: Callable[..., T]) -> Callable[..., T]:
        @functools.wraps(fn)
        def inner(self: PushConnector, *args: Any, **kwargs: Any) -> T:
            try:
                if self._faults is not None and args and self._faults.raises(fn.__name__, args[0]):
                    raise RuntimeError(f"injected failure in {fn.__name__} (test-only _faults)")
                return fn(self, *args, **kwargs)
            except Exception:  # the boundary: never let our bug kill the engine
                request = args[0] if args and hasattr(args[0], "request_id") else None
                rid = request.request_id if request is not None else "?"
                logger.exception("pushkv %s failed (request %s)", fn.__name__, rid)
                if self._sched is None:
                    pass
                elif request is None:
                    self._sched.count_hook_error()
                else:
                    loading = kwargs.get("num_external_tokens", args[2] if len(args) > 2 else 0)
                    blocks = args[1] if fn.__name__ == "update_state_after_alloc" else None
                    try:
                        self._sched.hook_failed(fn.__name__, request, loading, blocks)
                    except Exception:
                        logger.exception("pushkv could not let go of request %s", rid)
                return default(self, *args)

        return inner

    return wrap


class PushConnector(compat.connector_base()):  # type: ignore[misc]
    """KVConnectorBase_V1 (and SupportsHMA where vLLM takes it: vllm_compat.connector_base)."""

    if compat.CACHE_HIT_P2P is not None:  # vLLM 0.32+ labels external hits by tier
        _cache_hit_source = compat.CACHE_HIT_P2P

    def __init__(
        self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        _adopt_vllm_logging()
        compat.announce()  # which vLLM; an unsupported one is refused here
        self._invalid_blocks: set[int] = set()  # vLLM 0.26: failed loads, as block ids
        ktc = vllm_config.kv_transfer_config
        if not ktc.engine_id:
            raise ValueError("pushkv needs a stable engine_id in --kv-transfer-config")
        self._cfg = parse_config(ktc.kv_connector_extra_config)
        self._faults = self._cfg.faults  # test-only; None in production
        self._sched: SchedulerSide | None = None
        self._recompute = ktc.kv_load_failure_policy == "recompute"
        check_failure_policy(self._cfg, ktc.kv_load_failure_policy, ktc.is_kv_consumer)
        parallel = vllm_config.parallel_config
        self._tp_size = parallel.tensor_parallel_size
        check_parallelism(parallel.pipeline_parallel_size, ktc.is_kv_consumer)
        self._worker: Any = None
        # A model feature pushkv cannot push stops the engine here, named (vLLM 0.26 passes
        # no kv_cache_config: describe_kv_caches refuses layers that differ instead).
        groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
        check_kv_cache_groups(groups)
        if role == KVConnectorRole.SCHEDULER:
            trust = LegTrust(load_secret(self._cfg), frozenset(self._cfg.trusted_prefill))
            _log_security(trust, ktc.is_kv_consumer)
            self._sched = SchedulerSide(
                ktc.engine_id,
                ktc.is_kv_producer,
                ktc.is_kv_consumer,
                trust,
                refuse_untrusted=self._cfg.untrusted_leg == "refuse",
                host=self._cfg.side_channel_host,
                failures_as_blocks=not compat.HAS_TRANSFER_RESULTS,
                shutdown=ShutdownWatch(
                    self._cfg.shutdown_grace_s, getattr(vllm_config, "shutdown_timeout", 0) or 0
                ),
                pp_size=parallel.pipeline_parallel_size,
            )
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            from connector.worker_side import WorkerSide

            group_of = {name: g for g, grp in enumerate(groups) for name in grp.layer_names}
            self._worker = WorkerSide(
                self._cfg,
                ktc.engine_id,
                ktc.is_kv_producer,
                ktc.is_kv_consumer,
                tp_rank=get_tensor_model_parallel_rank(),
                tp_size=vllm_config.parallel_config.tensor_parallel_size,
                num_kv_heads=kv_heads_of(vllm_config.model_config),
                logical_block_size=vllm_config.cache_config.block_size,
                group_of=group_of,
                cache_dtype=str(vllm_config.cache_config.cache_dtype),
                latent=is_latent_kv(vllm_config.model_config),
                stage=compat.pipeline_stage(vllm_config),
            )

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        # vLLM 0.33+ asks before sleep mode: it remaps the KV memory NIXL keeps registered
        # (and peers keep writing into). 0.32 never calls this.
        return False

    @classmethod
    def kv_cache_access(cls, kv_transfer_config: Any) -> Any:
        # vLLM 0.34+ asks before it allocates the KV: NIXL registers it (one physical
        # allocation per segment), and the GPU IPC path exports it through legacy CUDA IPC
        # (torch's _share_cuda_), which driver-mapped (extensible) KV memory cannot do.
        from vllm.config.kv_transfer import KVCacheAccess

        access = KVCacheAccess.REGISTERS
        extra = kv_transfer_config.kv_connector_extra_config or {}
        if extra.get("xfer_paths", "auto") != "direct":
            access |= KVCacheAccess.LEGACY_IPC
        return access

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        # GPU: block-outermost, one page per block across all layers (merged runs); CPU
        # attention takes only [blocks, heads, tokens, K|V] per layer. connector/kv_tensors.py.
        # MLA: no wish; its [blocks, tokens, latent] per layer has no heads to order.
        compat.announce()  # vLLM asks this early, in the API server too
        model = getattr(vllm_config, "model_config", None)
        if model is not None and model.use_mla:
            return None
        device = getattr(getattr(vllm_config, "device_config", None), "device_type", "cpu")
        return preferred_layout(str(device), compat.NAMED_LAYOUTS)

    # ================================================================ scheduler role
    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        assert self._sched is not None
        self._sched.bind_kv_cache_manager(kv_cache_manager)

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        assert self._sched is not None
        self._sched.set_handshakes(metadata)

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], Any]) -> None:
        """Every worker's handshake keyed by (PP rank, TP rank) (0.26 and 0.32; the base
        class refuses a PP rank past 0): keyed by source rank for the coordinates."""
        self.set_xfer_handshake_metadata(
            {source_rank(pp, tp, self._tp_size): hs for (pp, tp), hs in metadata.items()}
        )

    @_guard(lambda *a: None)
    def on_new_request(self, request: Any) -> None:
        assert self._sched is not None
        self._sched.on_new_request(request)

    @_guard(lambda *a: (0, False))
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._sched is not None
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    @_guard(lambda *a: None)
    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._sched is not None
        self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self._sched is not None
        try:
            return PushkvMetadata(self._sched.build_connector_meta(scheduler_output))
        except Exception:
            # No request to let go of: the transfers' own deadlines end what this step staged.
            self._sched.count_hook_error()
            logger.exception("pushkv build_connector_meta failed")
            return PushkvMetadata(StepPlan())

    @_guard(lambda *a: None)
    def update_connector_output(self, connector_output: Any) -> None:
        assert self._sched is not None
        self._sched.update_connector_output(connector_output)

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    @_guard(lambda self, request, *a: (self._sched.keeps_blocks(request), None))
    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._sched is not None
        return self._sched.request_finished(request, block_ids)

    def has_pending_push_work(self) -> bool:
        return self._sched is not None and self._sched.has_pending_push_work()

    # ================================================================ metrics
    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> PushkvStats:
        return PushkvStats(data) if data is not None else PushkvStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> PushkvPromMetrics:
        return PushkvPromMetrics(metric_types, labelnames, per_engine_labelvalues)

    def get_kv_connector_stats(self) -> PushkvStats | None:  # type: ignore[override]
        if not self._cfg.metrics:
            return None
        try:
            if self._worker is not None:
                data = self._worker.stats()
            else:
                assert self._sched is not None
                data = recomputed_counts(self._sched.recomputed, self._recompute)
            return PushkvStats(data) if data else None
        except Exception:  # metrics must never stop a step
            logger.exception("pushkv get_kv_connector_stats failed")
            return None

    # ================================================================ worker role
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._worker.register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> Any:
        return self._worker.handshake() if self._worker is not None else None

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        assert isinstance(kv_connector_metadata, PushkvMetadata)
        self._worker.before_forward(kv_connector_metadata.plan)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        assert isinstance(connector_metadata, PushkvMetadata)
        self._worker.bind(connector_metadata.plan)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        if self._worker is not None:
            self._worker.clear()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        pass  # D's loads are pushed into it; the registration went out in bind

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        pass  # P pushes whole prompts from the transfer thread, never per layer

    def wait_for_save(self) -> None:
        self._worker.after_forward()

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """vLLM 0.32+: one snapshot of sends, receives and failed receives."""
        sent, received, failed = self._worker.take_results()
        return compat.transfer_results(sent, received, failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """vLLM 0.26 (0.32 calls get_transfer_results): a failed receive is reported
        received here and its first loaded block in get_block_ids_with_load_errors, which
        vLLM calls right after."""
        sent, received, _ = self._worker.take_results()
        self._invalid_blocks |= self._worker.failed_blocks()
        return sent, received

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid, self._invalid_blocks = self._invalid_blocks, set()
        return invalid

    def shutdown(self) -> None:
        # vLLM's processes may end by a re-raised signal or SIGKILL (its API server
        # force-kills a worker that is still shutting down, seen right after this hook
        # started), where atexit never runs: write this process's spans out first.
        from telemetry.setup import flush_process

        flush_process()
        if self._sched is not None and self._sched.counters:
            logger.info("pushkv scheduler counters: %s", dict(self._sched.counters))
        if self._worker is not None:
            self._worker.shutdown()
        flush_process()

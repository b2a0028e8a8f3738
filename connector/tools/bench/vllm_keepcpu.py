"""vLLM's own NIXL connectors without vLLM's CPU pin (a ``kv_connector_module_path``).

Owns: the wrapper that undoes the CPU pin of vLLM's NIXL worker when
``kv_connector_extra_config`` has ``"bench_keep_cpu_binding": true``, and two re-exports under
vLLM's own names (``NixlConnector``, ``NixlPushConnector``; vLLM switches behaviour on the
name in ``kv_connector``, so the names must not change). ``connector.tools.bench.vllm_noprog``
imports this module, so the same switch works there.

Why: ``NixlBaseConnectorWorker.__init__`` (``vllm/distributed/kv_transfer/kv_connector/v1/
nixl/base_worker.py``) calls ``os.sched_setaffinity(0, <last core of each NUMA node>)``
("reserve different cores for start_load_kv() from model_forward()"). It runs on the
worker's main thread, which is the model runner, so on a 2-core machine P's and D's forward
passes both land on core 1 whatever ``VLLM_CPU_OMP_THREADS_BIND`` says
(docs/operations.md, "Tuning"). While D busy-loops on requests waiting
for KV (its engine steps without pause), P's worker on the same core gets no CPU time for
seconds (runnable, ``nr_switches`` unchanged) and the stack livelocks: P never finishes the
prefill D is waiting for. The wrapper records the thread's affinity before
vLLM's ``__init__`` and restores it afterwards, so the model runner keeps the binding the
benchmark gives every configuration (P core 0, D core 1), as pushkv's connector does.
Threads vLLM starts later (push writer, handshake executor) inherit the restored set.

Must not import anything of pushkv: it runs inside vLLM's processes.
"""

from __future__ import annotations

import functools
import os
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
    NixlConnector,
    NixlPushConnector,
)
from vllm.logger import init_logger

logger = init_logger(__name__)
KEEP_CPU_BINDING_KEY = "bench_keep_cpu_binding"  # the kv_connector_extra_config switch
# The benchmark counts this line in the server logs (connector.tools.bench.serve_run.LOG_SIGNALS).
KEPT_MARKER = "connector.tools.bench.vllm_keepcpu: kept CPUs"
_WRAPPED = "_bench_keepcpu_wrapped"


def _keep_cpu_binding(init: Any) -> Any:
    @functools.wraps(init)
    def wrapper(self: Any, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        before = os.sched_getaffinity(0)
        init(self, vllm_config, *args, **kwargs)
        ktc = vllm_config.kv_transfer_config
        if ktc is None or not ktc.get_from_extra_config(KEEP_CPU_BINDING_KEY, False):
            return
        pinned = os.sched_getaffinity(0)
        if pinned != before:
            os.sched_setaffinity(0, before)
            logger.warning(
                "%s %s (vLLM's NIXL worker had pinned %s)",
                KEPT_MARKER,
                sorted(before),
                sorted(pinned),
            )

    setattr(wrapper, _WRAPPED, True)
    return wrapper


def install() -> None:
    """Wrap ``NixlBaseConnectorWorker.__init__`` once (idempotent)."""
    cls = base_worker.NixlBaseConnectorWorker
    if not getattr(cls.__init__, _WRAPPED, False):
        cls.__init__ = _keep_cpu_binding(cls.__init__)  # type: ignore[method-assign]


install()
__all__ = ["KEEP_CPU_BINDING_KEY", "KEPT_MARKER", "NixlConnector", "NixlPushConnector", "install"]

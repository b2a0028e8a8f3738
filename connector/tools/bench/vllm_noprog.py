"""vLLM's own NIXL connectors with NIXL's progress thread off (a ``kv_connector_module_path``).

Owns: import-time patches of the NIXL agent vLLM creates, and two re-exports (the opt-in
CPU-pin undo comes from ``connector.tools.bench.vllm_keepcpu``). Used by the
push-vs-pull benchmark (``connector/tools/bench/serve_bench.py``) as ``vllm-push-noprog`` and
``vllm-pull-noprog``::

    --kv-transfer-config '{"kv_connector": "NixlPushConnector",   # or "NixlConnector"
                           "kv_connector_module_path": "connector.tools.bench.vllm_noprog", ...}'

vLLM's factory imports this module in every process that resolves the connector class (API
server, EngineCore, the worker), then takes ``getattr(module, kv_connector)``. The classes are
re-exported under vLLM's own names on purpose: vLLM switches behaviour on the *name* in
``kv_connector`` (``KVTransferConfig.has_connector("NixlConnector")`` in
``vllm/platforms/cpu.py`` and ``vllm/config/vllm.py``), so another name would change more than
the progress thread.

Why
---
NIXL's UCX progress thread busy-polls (``nixl_agent`` hard-codes ``pthrDelay = 0``) from
start-up: an idle P/D pair keeps both cores of a 2-core machine at 100 %, and every engine
step competes with it (`python -m bench.poll_cost` measures our own polling instead).
vLLM 0.32 builds its agent in
``vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py``, ``NixlBaseWorker.__init__``
(``nixl_agent_config(num_threads=num_threads, capture_telemetry=True)``, then
``NixlWrapper(str(uuid.uuid4()), config)``), and offers no switch.

What is patched, exactly
------------------------
1. ``nixl_agent_config`` becomes :class:`NoProgAgentConfig`, whose defaults differ in two
   fields: ``enable_prog_thread=False``, and ``sync_mode=NIXL_THREAD_SYNC_STRICT`` when none
   is given. The second is needed because vLLM calls one agent from several threads (engine
   thread, push writer thread, handshake executor; plus the progress loop of change 2).
   NIXL's UCX backend makes its workers thread-safe (``nixl_ucx_mt_t::WORKER``) only when
   "sync mode is RW or there is a progress thread" (``nixlUcxContext``,
   ``src/plugins/ucx/ucx_utils.cpp``); with the thread off and vLLM's default sync mode (NONE,
   as the listener is off) they are single-threaded, and concurrent calls race. STRICT makes
   the agent serialize every call ("with strict synchronization model nixlAgent serializes
   access to backends"). Not RW, which would also make the workers thread-safe: under RW's
   shared lock two threads may run ``getNotifs`` at once, and the UCX engine appends
   notifications from progress callbacks to a list it locks only for its own progress
   thread (``appendNotif`` in ``ucx_backend.cpp``; code reading, not a measured failure).
2. ``NixlWrapper`` (``nixl_agent``) becomes :class:`ProgressedAgent`. Without a progress
   thread UCX moves data only inside NIXL calls: a process that just sleeps delivers
   nothing, not even its own queued send_notif (NIXL 1.5.1 with the UCX backend), and
   over ``tcp`` a WRITE or READ needs the *target* to progress as well. vLLM's engines stop
   calling NIXL when they have nothing to schedule (P after its prefill, for one), so with
   change 1 alone transfers can stall. ``ProgressedAgent`` therefore runs one daemon thread
   per agent that calls ``getNotifs`` (the call that drives UCX progress) every
   ``PROGRESS_INTERVAL_S`` and *sleeps* in between, which is what makes it cheap where NIXL's
   thread spins (``python -m bench.cpu_split`` shows each thread's share). Notifications it
   collects are kept and handed out, in arrival order, by the next ``get_new_notifs`` call,
   so vLLM sees exactly the notifications it would have seen.
3. Opt-in, with ``"bench_keep_cpu_binding": true`` in ``kv_connector_extra_config``: vLLM's
   CPU pin of the model runner is undone (``connector.tools.bench.vllm_keepcpu``, imported
   here; its docstring says why). Without it, changes 1 and 2 can still livelock on a 2-core
   host (P's worker, pinned to the same core as D's busy-looping one, gets no CPU), so the
   benchmark turns it on for these configurations.

Names are replaced where they are looked up: ``vllm.distributed.nixl_utils`` (vLLM's lazy
loader), ``base_worker`` (which bound them at import; the lookup happens when a worker is
constructed, so the import order does not matter) and, for the config only, ``nixl._api`` and
``nixl`` (what ``nixl_agent(name, None)`` uses). Nothing else changes: the same UCX backend,
``num_threads`` (4), telemetry and listener settings.

Must not import anything of pushkv but ``connector.tools.bench.vllm_keepcpu``: it runs inside vLLM's
processes.
"""

from __future__ import annotations

import sys
import threading
import weakref
from typing import Any

from vllm.distributed import nixl_utils
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
    NixlConnector,
    NixlPushConnector,
)
from vllm.logger import init_logger

from connector.tools.bench import vllm_keepcpu  # noqa: F401  (installs change 3's opt-in wrapper)

logger = init_logger(__name__)
# The benchmark greps the server logs for this line to prove the patch was active.
PATCHED_MARKER = (
    "connector.tools.bench.vllm_noprog: NIXL agents default to enable_prog_thread=False"
)
PROGRESS_INTERVAL_S = 0.001  # the replacement progress loop's sleep between two polls

# base_worker's import went through vLLM's own loader (vllm.distributed.nixl_utils), which
# sets UCX_RCACHE_MAX_UNRELEASED before NIXL is imported, exactly as in the default setup.
_OriginalAgentConfig: Any = nixl_utils.nixl_agent_config
_OriginalAgent: Any = nixl_utils.NixlWrapper
if _OriginalAgentConfig is None or _OriginalAgent is None:
    raise ImportError("connector.tools.bench.vllm_noprog: NIXL is not importable, nothing to patch")
_SYNC: Any = sys.modules[_OriginalAgentConfig.__module__].nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT


class NoProgAgentConfig(_OriginalAgentConfig):  # type: ignore[misc, valid-type]
    """``nixl_agent_config`` with the progress thread off and every agent call serialized,
    unless the caller asks otherwise explicitly."""

    def __init__(
        self, enable_prog_thread: bool = False, *args: Any, sync_mode: Any = None, **kwargs: Any
    ) -> None:
        super().__init__(
            enable_prog_thread, *args, sync_mode=_SYNC if sync_mode is None else sync_mode, **kwargs
        )


def _progress_loop(ref: weakref.ReferenceType[ProgressedAgent], stop: threading.Event) -> None:
    while not stop.wait(PROGRESS_INTERVAL_S):
        agent = ref()
        if agent is None:
            return
        try:
            agent._poll()
        except Exception:  # the agent is being torn down: stop driving it
            logger.exception(
                "connector.tools.bench.vllm_noprog: progress loop of %s stopped", agent.name
            )
            return
        del agent  # no strong reference while sleeping: the agent can be collected


class ProgressedAgent(_OriginalAgent):  # type: ignore[misc, valid-type]
    """``nixl_agent`` plus a sleeping progress loop; notifications it collects are returned
    by the next ``get_new_notifs``."""

    def __init__(self, agent_name: str, nixl_conf: Any = None, instantiate_all: bool = False):
        super().__init__(agent_name, nixl_conf, instantiate_all)
        self._inbox: dict[str, list[bytes]] = {}
        self._inbox_lock = threading.Lock()
        self._stop = threading.Event()
        threading.Thread(
            target=_progress_loop,
            args=(weakref.ref(self), self._stop),
            name=f"nixl-noprog-progress-{agent_name[:8]}",
            daemon=True,
        ).start()

    def _poll(self) -> None:
        """Drive UCX progress once; keep whatever notifications arrived."""
        fresh = self.agent.getNotifs({}, [])
        if fresh:
            with self._inbox_lock:
                for peer, msgs in fresh.items():
                    self._inbox.setdefault(peer, []).extend(msgs)

    def get_new_notifs(self, backends: list[str] = []) -> dict[str, list[bytes]]:  # noqa: B006
        fresh = super().get_new_notifs(backends)
        with self._inbox_lock:
            out, self._inbox = self._inbox, {}
        for peer, msgs in fresh.items():
            out.setdefault(peer, []).extend(msgs)
        return out

    def __del__(self) -> None:
        self._stop.set()
        parent_del = getattr(super(), "__del__", None)
        if parent_del is not None:
            parent_del()


def _patch() -> None:
    for module in (nixl_utils, base_worker, sys.modules.get("nixl._api"), sys.modules.get("nixl")):
        if module is not None and hasattr(module, "nixl_agent_config"):
            module.nixl_agent_config = NoProgAgentConfig  # type: ignore[attr-defined,union-attr]
    # The agent class only where vLLM looks it up: other NIXL users keep the plain agent.
    nixl_utils.NixlWrapper = ProgressedAgent  # type: ignore[attr-defined]
    base_worker.NixlWrapper = ProgressedAgent  # type: ignore[attr-defined]
    logger.warning(
        "%s; sync_mode STRICT; progress driven every %.1f ms by a sleeping thread",
        PATCHED_MARKER,
        PROGRESS_INTERVAL_S * 1e3,
    )


_patch()
__all__ = [
    "PATCHED_MARKER",
    "NixlConnector",
    "NixlPushConnector",
    "NoProgAgentConfig",
    "ProgressedAgent",
]

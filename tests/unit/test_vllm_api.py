"""``PushConnector`` against the connector API of each supported vLLM, read from source.

0.32 is the installed vLLM (it also runs end to end in tests/e2e); 0.33 cannot run here
(it needs torch 2.14 with CUDA), so its modules are a fixture copied from its wheel
(tests/fixtures/vllm_0_33/README.md) and parsed with ``ast``, as 0.32's are, never
imported. 0.26 is a fixture too (it runs end to end in its own venv, ``make
test-vllm026``); where its API differs, connector/vllm_compat.py's flags must say so. A
vLLM that adds a hook fails ``test_every_hook_is_ours_or_its_default_fits`` until someone
decides whether pushkv must override it.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import Any

import pytest

from tests.vllm_api import (
    BASE,
    FILES,
    Method,
    ModuleApi,
    compatible,
    fixture_dir,
    installed_root,
    read_api,
)

PushConnector = pytest.importorskip("connector.plugin").PushConnector

FIXTURES = ("0.26.0", "0.33.0", "0.34.0")
ROOTS: dict[str, Path | None] = {"0.32": installed_root()} | {
    v.rsplit(".", 1)[0]: fixture_dir(v) for v in FIXTURES
}

# Hooks whose default is right for pushkv, and why (by groups). A hook pushkv overrides
# may be listed too (another branch may override a default that was fine).
DEFAULTS_THAT_FIT = {
    # Base plumbing pushkv uses as is.
    "role", "has_connector_metadata", "get_mem_pool_context", "get_finished_count",
    # Results: pushkv overrides get_transfer_results, which replaces get_finished, and
    # reports a failed load there (failed_recving), not as blocks with load errors.
    "get_finished", "get_block_ids_with_load_errors",
    # Features pushkv does not use: no per-forward capture, no host buffers, no block
    # pool, no KV events, no partial-tail offload, no hybrid hits, no PP > 1 (the default
    # refuses pp_rank > 0), all hits counted as P2P (_cache_hit_source).
    "build_connector_worker_meta", "finish_forward", "reset_capture_state",
    "set_host_xfer_buffer_ops", "bind_gpu_block_pool", "get_loaded_kv_cache_group_ids",
    "register_finished_partial_tail", "take_events", "get_kv_connector_kv_cache_events",
    "reset_cache", "has_pending_block_frees", "get_external_cache_hit_sources",
    "supports_divergent_local_hybrid_hits", "requires_piecewise_for_cudagraph",
    "set_xfer_handshake_metadata_pp_aware",
    # A producer's hand-off must be delivered: a preempted P request is recomputed.
    "requires_kv_delivery",
    # vLLM's own connector statistics and Prometheus metrics: none (yet).
    "get_kv_connector_stats", "build_kv_connector_stats", "build_prom_metrics",
    # 0.33: never called, since supports_sleep_mode is False (NIXL keeps the KV registered).
    "unregister_kv_caches", "restore_kv_caches",
    # 0.34: no lookahead block hashing; a request may load asynchronously exactly when it
    # has do_remote_prefill (the default), which is when pushkv's D loads asynchronously.
    "supports_lookahead_block_hashes", "may_load_async",
    # 0.26: no cross-layer KV tensor (pushkv registers per-layer views; block-outermost
    # pages only on 0.32+ through the BLHNC layout); 0.26 binds only the block pool, which
    # pushkv does not need (block_tracker.BlockTracker keeps P's block ids instead).
    "prefer_cross_layer_blocks", "register_cross_layers_kv_cache",
}  # fmt: skip

# What pushkv imports from vLLM (connector/vllm_compat.py) in every version, by module.
IMPORTED = {
    BASE: {"KVConnectorBase_V1", "KVConnectorMetadata", "KVConnectorRole", "SupportsHMA"},
}
# What it imports where present, and the first version that has it (vllm_compat's flags).
SINCE_0_32 = {
    (BASE, "KVConnectorTransferResults"),  # HAS_TRANSFER_RESULTS
    ("vllm/v1/metrics/cache_hit_source.py", "CacheHitSource"),  # CACHE_HIT_P2P
}

# What pushkv reads of the objects vLLM hands its hooks (connector/plugin.py and
# scheduler_side.py and its parts read them duck-typed): file -> class -> attributes.
READ = {
    "vllm/v1/request.py": {
        "Request": {
            "request_id", "kv_transfer_params", "num_computed_tokens", "num_prompt_tokens",
            "num_output_tokens", "arrival_time",
        },
    },
    "vllm/v1/core/sched/output.py": {
        "SchedulerOutput": {
            "num_scheduled_tokens", "total_num_scheduled_tokens", "preempted_req_ids",
        },
    },
    "vllm/v1/outputs.py": {"KVConnectorOutput": {"finished_sending", "finished_recving"}},
    "vllm/v1/core/kv_cache_manager.py": {
        "KVCacheManager": {"get_block_ids"},
        "KVCacheBlocks": {"get_unhashed_block_ids_all_groups"},
    },
    "vllm/config/kv_transfer.py": {
        "KVTransferConfig": {
            "engine_id", "kv_connector_extra_config", "is_kv_producer", "is_kv_consumer",
        },
    },
    BASE: {
        "KVConnectorTransferResults": {"finished_sending", "finished_recving", "failed_recving"},
        "KVConnectorRole": {"SCHEDULER", "WORKER"},
    },
}  # fmt: skip


@pytest.fixture(params=sorted(ROOTS), ids=lambda v: f"vllm-{v}")
def api(request: pytest.FixtureRequest) -> dict[str, ModuleApi]:
    root = ROOTS[request.param]
    if root is None:
        pytest.skip(f"vLLM {request.param} is not installed")
    return read_api(root)


def _hooks(api: dict[str, ModuleApi]) -> dict[str, Method]:
    classes = api[BASE].classes
    return {**classes["KVConnectorBase_V1"].methods, **classes["SupportsHMA"].methods}


def _ours(name: str) -> Method:
    """PushConnector's own definition of ``name``, in the shape ``tests.vllm_api`` reads."""
    raw: Any = PushConnector.__dict__[name]
    if isinstance(raw, property):
        return Method("property", (), 0)
    kind = {classmethod: "classmethod", staticmethod: "staticmethod"}.get(type(raw), "method")
    params = list(inspect.signature(getattr(raw, "__func__", raw)).parameters.values())
    if kind != "staticmethod":
        params = params[1:]
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    kwonly = [p for p in params if p.kind is p.KEYWORD_ONLY]
    return Method(
        kind=kind,
        positional=tuple(p.name for p in positional),
        required=sum(p.default is p.empty for p in positional),
        kwonly=tuple(p.name for p in kwonly),
        kwonly_required=tuple(p.name for p in kwonly if p.default is p.empty),
        varargs=any(p.kind is p.VAR_POSITIONAL for p in params),
        varkw=any(p.kind is p.VAR_KEYWORD for p in params),
    )


def test_every_abstract_method_is_implemented(api: dict[str, ModuleApi]) -> None:
    abstract = {name for name, m in _hooks(api).items() if m.abstract}
    assert abstract, "no abstract methods read: the fixture or the parser is broken"
    missing = sorted(abstract - set(PushConnector.__dict__))
    assert not missing, f"PushConnector does not implement {missing}"


def test_overrides_take_every_call_vllm_makes(api: dict[str, ModuleApi]) -> None:
    hooks = _hooks(api)
    ours = [n for n in PushConnector.__dict__ if n in hooks and n != "__init__"]
    assert len(ours) >= 20
    bad = {n: why for n in ours if (why := compatible(hooks[n], _ours(n))) is not None}
    assert not bad, f"PushConnector's hooks do not match vLLM's: {bad}"
    init = compatible(hooks["__init__"], _ours("__init__"))
    assert init is None, f"PushConnector.__init__: {init}"


def test_every_hook_is_ours_or_its_default_fits(api: dict[str, ModuleApi]) -> None:
    public = {n for n in _hooks(api) if not n.startswith("_")}
    unreviewed = sorted(public - set(PushConnector.__dict__) - DEFAULTS_THAT_FIT)
    assert not unreviewed, (
        f"vLLM hooks with a default nobody checked for pushkv: {unreviewed}; override them "
        "in connector/plugin.py or add them to DEFAULTS_THAT_FIT with the reason"
    )


def test_what_pushkv_imports_exists(api: dict[str, ModuleApi]) -> None:
    missing = {f: sorted(names - api[f].names) for f, names in IMPORTED.items()}
    assert not any(missing.values()), f"gone from vLLM: {missing}"
    hits = api.get("vllm/v1/metrics/cache_hit_source.py")
    assert hits is None or "P2P" in hits.classes["CacheHitSource"].attributes


def test_what_only_newer_vllms_have_is_where_vllm_compat_says(
    api: dict[str, ModuleApi], request: pytest.FixtureRequest
) -> None:
    # Each name vllm_compat imports conditionally: present from 0.32 on, absent in 0.26.
    major, minor = request.node.callspec.params["api"].split(".")
    new = (int(major), int(minor)) >= (0, 32)
    for f, name in SINCE_0_32:
        assert (f in api and name in api[f].names) == new, (f, name)
    # 0.26 reports results through get_finished and failed loads as block ids only; 0.32
    # binds the cache manager (P's block ids) and reports failed loads by request.
    hooks = _hooks(api)
    assert ("get_transfer_results" in hooks) == new
    assert ("bind_kv_cache_manager" in hooks) == new
    assert {"get_finished", "get_block_ids_with_load_errors"} <= set(hooks)
    out = api["vllm/v1/outputs.py"].classes["KVConnectorOutput"].attributes
    assert "invalid_block_ids" in out and ("failed_recving" in out) == new


def test_what_pushkv_reads_exists(api: dict[str, ModuleApi]) -> None:
    missing = {
        f"{cls}": sorted(attrs - api[f].classes[cls].attributes)
        for f, classes in READ.items()
        for cls, attrs in classes.items()
        if (f, cls) not in SINCE_0_32 or cls in api[f].classes  # 0.26 has no such class
    }
    assert not any(missing.values()), f"gone from vLLM: {missing}"


def test_pushkv_refuses_sleep_mode() -> None:
    # 0.33 asks before enabling sleep mode; its default (True) would let vLLM remap KV
    # memory that NIXL still has registered, as vLLM's own NixlConnector says of itself.
    assert PushConnector.supports_sleep_mode(None) is False


def test_declares_how_it_reaches_the_kv(monkeypatch: pytest.MonkeyPatch) -> None:
    # 0.34 would otherwise allocate driver-mapped KV memory, which NIXL cannot register in
    # one piece and legacy CUDA IPC cannot export. KVCacheAccess is 0.34's, from the fixture.
    import enum
    import types

    import vllm.config.kv_transfer as installed

    src = (fixture_dir("0.34.0") / "vllm/config/kv_transfer.py").read_text()
    (node,) = [n for n in ast.parse(src).body if getattr(n, "name", "") == "KVCacheAccess"]
    scope: dict[str, Any] = {"enum": enum}
    exec(compile(ast.Module([node], []), "kv_transfer.py", "exec"), scope)
    access = scope["KVCacheAccess"]
    monkeypatch.setattr(installed, "KVCacheAccess", access, raising=False)
    auto = PushConnector.kv_cache_access(types.SimpleNamespace(kv_connector_extra_config={}))
    assert auto == access.REGISTERS | access.LEGACY_IPC
    direct = types.SimpleNamespace(kv_connector_extra_config={"xfer_paths": "direct"})
    assert PushConnector.kv_cache_access(direct) == access.REGISTERS


@pytest.mark.parametrize("version", FIXTURES)
def test_the_fixture_holds_exactly_the_files_read(version: str) -> None:
    here = fixture_dir(version)
    got = {p.relative_to(here).as_posix() for p in here.rglob("*.py")}
    absent = {"vllm/v1/metrics/cache_hit_source.py"} if version == "0.26.0" else set()
    assert got == set(FILES) - absent


def test_compatible_catches_what_breaks_a_call() -> None:
    base = Method("method", ("request", "block_ids"), 2, varkw=True)
    assert compatible(base, Method("method", ("request", "block_ids"), 2, varkw=True)) is None
    assert compatible(base, Method("method", ("request", "blocks"), 2, varkw=True))
    assert compatible(base, Method("method", ("request",), 1, varkw=True))
    assert compatible(base, Method("method", ("request", "block_ids", "x"), 3, varkw=True))
    assert compatible(base, Method("method", ("request", "block_ids"), 2))  # no **kwargs
    assert compatible(base, Method("classmethod", ("request", "block_ids"), 2, varkw=True))
    assert compatible(base, Method("method", ("request", "block_ids", "x"), 2, varkw=True)) is None

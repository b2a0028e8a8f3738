"""bench/cpu_split.py's accounting on synthetic /proc snapshots (pure), and one real snapshot."""

from __future__ import annotations

import os

from bench.cpu_split import HZ, Proc, Snap, client_runs, role_of, snapshot, split

ROLES = {10: "P", 20: "D", 30: "router"}


def _snap(t: float, ticks: int) -> Snap:
    s = Snap(t)
    s.procs = {
        1: Proc(0, "pushkv bench", {1: ("python", ticks)}),  # the harness: no role
        10: Proc(1, "vllm api_server", {10: ("python", ticks)}),
        11: Proc(
            10,
            "VLLM::EngineCore",
            {11: ("VLLM::EngineCor", 2 * ticks), 12: ("pushkv-prefill-", ticks)},
        ),
        20: Proc(1, "vllm api_server", {20: ("python", ticks)}),
        21: Proc(20, "VLLM::EngineCore", {21: ("VLLM::EngineCor", ticks)}),
        30: Proc(1, "pushkv router", {30: ("python", ticks)}),
        40: Proc(1, "vllm bench serve --result-filename c16.json", {40: ("vllm", 3 * ticks)}),
        41: Proc(40, "vllm bench serve --result-filename c16.json", {41: ("vllm", ticks)}),
    }
    return s


def test_threads_are_charged_to_the_role_of_their_nearest_named_ancestor() -> None:
    a, b = _snap(0.0, 100), _snap(10.0, 150)
    assert role_of(b, 11, ROLES) == "P" and role_of(b, 21, ROLES) == "D"
    assert role_of(b, 41, ROLES) == "client" and role_of(b, 1, ROLES) is None
    got = split(a, b, ROLES)
    assert got[("P", "VLLM::EngineCor")] == 100 and got[("P", "pushkv-prefill-")] == 50
    assert got[("D", "python")] == 50 and got[("client", "vllm")] == 150 + 50
    assert not any(role is None for role, _ in got), "the harness itself is not counted"


def test_a_thread_born_between_snapshots_counts_from_zero() -> None:
    a, b = _snap(0.0, 100), _snap(10.0, 150)
    b.procs[21].threads[22] = ("pushkv-decode-t", 7)
    assert split(a, b, ROLES)[("D", "pushkv-decode-t")] == 7


def test_only_long_enough_top_level_client_processes_are_runs() -> None:
    snaps = [_snap(float(t), 100 + t) for t in range(12)]
    assert client_runs(snaps, min_s=8.0) == [(0, 11, 40)], "the child of a client is not a run"
    assert client_runs(snaps, min_s=20.0) == []


def test_a_real_snapshot_sees_this_process() -> None:
    me = snapshot().procs[os.getpid()]
    assert me.threads and all(ticks >= 0 for _, ticks in me.threads.values()) and HZ > 0

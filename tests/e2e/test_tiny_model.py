"""One real vLLM server on the tiny model, no KV connector: the model is fit for equality tests.

Checks that greedy output depends on more than the last tokens (the weights are not
degenerate, unlike ``--load-format dummy``), that it is reproducible to the logprob, that chat
works, and that stopping by PID frees the port. Prints the timings it measures.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from connector.tools.procgroup import group_pids
from connector.tools.stack import ServerError, VllmServer, free_port, port_is_free

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

SHARED_TAIL = " seven lazy dogs sleep under the old bridge"


@pytest.fixture(scope="module")
def server(tiny_model: Path, e2e_log_dir: Path) -> Iterator[VllmServer]:
    port = free_port()
    srv = VllmServer(tiny_model, port, log_path=e2e_log_dir / f"single-{port}.log")
    t0 = time.monotonic()
    srv.start()
    try:
        srv.wait_healthy(300)
        print(
            f"\n[tiny] healthy after {time.monotonic() - t0:.1f} s; "
            f"RSS {srv.rss_bytes() / 2**30:.2f} GiB (process group)"
        )
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server: VllmServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=120, trust_env=False) as c:
        # The first request that asks for logprobs pays a one-off warm-up of seconds.
        complete(c, "warm up")
        yield c


def complete(client: httpx.Client, prompt: str, **extra: Any) -> dict[str, Any]:
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": 16,
        "temperature": 0,
        "logprobs": 1,
        "ignore_eos": True,
        **extra,
    }
    resp = client.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def token_ids(client: httpx.Client, text: str) -> list[int]:
    resp = client.post(
        "/tokenize", json={"model": "tiny", "prompt": text, "add_special_tokens": False}
    )
    assert resp.status_code == 200, resp.text
    return list(resp.json()["tokens"])


def test_output_depends_on_whole_prompt(client: httpx.Client) -> None:
    a = "Once upon a time, a fox and a crow met at dawn;" + SHARED_TAIL
    b = "In 1999 the market fell by 12 percent and then" + SHARED_TAIL
    tail_a, tail_b = token_ids(client, a)[-8:], token_ids(client, b)[-8:]
    assert tail_a == tail_b, "the prompts must share their last 8 tokens"
    out_a, out_b = complete(client, a), complete(client, b)
    text_a, text_b = out_a["choices"][0]["text"], out_b["choices"][0]["text"]
    assert out_a["usage"]["completion_tokens"] == 16 == out_b["usage"]["completion_tokens"]
    assert text_a != text_b, f"output ignores all but the last tokens: {text_a!r}"
    # Not just a different sampling path: the very first greedy token differs.
    assert (
        out_a["choices"][0]["logprobs"]["tokens"][0] != out_b["choices"][0]["logprobs"]["tokens"][0]
    )


def test_greedy_is_reproducible_to_the_logprob(client: httpx.Client) -> None:
    prompt = "The quick brown fox jumps over the lazy dog, and then"
    t0 = time.monotonic()
    first = complete(client, prompt)
    duration_s = time.monotonic() - t0
    second = complete(client, prompt)
    lp1, lp2 = first["choices"][0]["logprobs"], second["choices"][0]["logprobs"]
    assert first["choices"][0]["text"] == second["choices"][0]["text"]
    assert lp1["tokens"] == lp2["tokens"]
    # Bit-for-bit, as floats, even on a loaded box: the same request on the same server takes
    # the same path whatever the timing, and vLLM's CPU backend gave equal logprobs for a
    # prompt alone and batched with 1-4 other requests (24 runs). Answers computed along
    # another path (KV from P) are compared within a tolerance (tests/e2e/greedy.py).
    assert lp1["token_logprobs"] == lp2["token_logprobs"]
    print(
        f"\n[tiny] 16-token greedy completion: {duration_s * 1000:.0f} ms "
        f"({16 / duration_s:.0f} tokens/s, prompt {first['usage']['prompt_tokens']} tokens)"
    )


def test_chat_completions(client: httpx.Client) -> None:
    resp = client.post(
        "/v1/chat/completions",
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
        },
    )
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["choices"][0]["message"]["content"]
    assert body["usage"]["completion_tokens"] == 8


def test_stop_by_pid_frees_port(server: VllmServer, client: httpx.Client) -> None:
    # Runs last in this module (file order); the fixture's stop() is then a no-op.
    pid, port = server.pid, server.port
    assert pid is not None and server.is_running()
    t0 = time.monotonic()
    server.stop(timeout_s=30)
    print(f"\n[tiny] stopped in {time.monotonic() - t0:.1f} s")
    assert not server.is_running() and server.pid is None
    # No process of the group runs, EngineCore included (one that exited may still wait
    # for PID 1 to reap it: procgroup.group_pids leaves those out).
    assert group_pids(pid) == []
    assert port_is_free(port)
    server.stop()  # idempotent


def test_child_env_and_flags(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A stray VLLM_CPU_KVCACHE_SPACE would silently override --kv-cache-memory-bytes.
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")
    srv = VllmServer(
        tiny_model,
        1234,
        env={"VLLM_NIXL_SIDE_CHANNEL_PORT": "5600"},
        kv_transfer_config={"kv_connector": "X", "kv_role": "kv_both"},
        extra_args=["--max-num-seqs", "8"],
    )
    env, cmd = srv.child_env(), srv.command()
    assert "VLLM_CPU_KVCACHE_SPACE" not in env
    assert env["HF_HUB_OFFLINE"] == "1" and env["UCX_NET_DEVICES"] == "lo"
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5600"
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"
    assert cmd[cmd.index("--kv-cache-memory-bytes") + 1] == str(256 << 20)
    kv_json = cmd[cmd.index("--kv-transfer-config") + 1]
    assert kv_json == '{"kv_connector": "X", "kv_role": "kv_both"}'
    assert cmd[-2:] == ["--max-num-seqs", "8"]


def test_wait_healthy_fails_fast_with_log_tail(tmp_path: Path, e2e_log_dir: Path) -> None:
    srv = VllmServer(tmp_path / "no-such-model", free_port(), log_path=e2e_log_dir / "bad.log")
    srv.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(ServerError, match="exited with code") as info:
            srv.wait_healthy(120)
        assert time.monotonic() - t0 < 90
        assert "no-such-model" in str(info.value)  # the log tail is in the message
    finally:
        srv.stop()

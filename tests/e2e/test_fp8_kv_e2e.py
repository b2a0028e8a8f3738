"""fp8 KV cache end to end: P and D both started with ``--kv-cache-dtype fp8`` (vLLM's e4m3),
then both with ``fp8_e5m2``, on the tiny model.

Greedy output through the router equals D alone (fp8 KV too; tests/e2e/greedy.py's rule), D
took every prompt token from P (its prompt-token metric by source), P's transfer spans carry
fp8's geometry (one byte per element: half of bf16's bytes per token) and both workers
describe their KV as fp8 (the name their layouts carry and P compares, connector/core/layout.py
``check_same_dtype``). One stack start per dtype (about a minute each on a 2-core machine).

vLLM's CPU attention stores fp8 KV only on x86 with AVX-512 or AMX and head sizes divisible
by 32 (``_get_attn_isa`` in vllm/v1/attention/backends/cpu_attn.py); the tiny model's heads
are 64 wide. k/v scales: vLLM keeps them per attention layer (``_k_scale``/``_v_scale``,
loaded from a quantized checkpoint, else 1.0); the tiny model has none, so both sides use
the static 1.0 and pushkv moves the fp8 bytes as they are.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from connector.tools.tinymodel import ARCH, kv_bytes_per_token
from telemetry.schema import Attr
from tests.e2e.conftest import running_pd
from tests.e2e.greedy import assert_matches_reference, greedy_body
from tests.e2e.test_push_e2e import (
    assert_prompt_tokens_from_p,
    post_ok,
    random_prompt,
    source_tokens,
)
from tests.e2e.transfer_spans import assert_kv_geometry, traced_completion, transfer_trace

if TYPE_CHECKING:
    from conftest import Pd  # tests/e2e/conftest.py (the fixture's type)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

# vLLM's CPU attention's fp8 KV dtypes ("fp8" is e4m3; "fp8_e4m3" the same bytes again).
KV_DTYPES = ("fp8", "fp8_e5m2")
PROMPT_LENGTHS = (20, 129, 600)  # one block, across a block edge, several blocks


def _geometry(kv_dtype: str) -> dict[str, object]:
    return {
        Attr.KV_LAYERS.value: ARCH["num_hidden_layers"],
        Attr.KV_FORM.value: "heads",
        Attr.KV_HEADS.value: ARCH["num_key_value_heads"],
        Attr.KV_HEAD_SIZE.value: ARCH["head_dim"],
        Attr.KV_DTYPE.value: kv_dtype,
        Attr.KV_BYTES_PER_TOKEN.value: kv_bytes_per_token(ARCH, dtype_bytes=1),  # half of bf16's
    }


def _fp8_kv_unsupported() -> str | None:
    """Why this CPU cannot run vLLM's fp8 KV cache, or None."""
    import torch  # the test process only: the servers import their own

    if torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported():
        return None
    return "vLLM's CPU attention needs AVX-512 or AMX for an fp8 KV cache (cpu_attn._get_attn_isa)"


@pytest.fixture(scope="module", params=KV_DTYPES)
def pd_fp8(request: pytest.FixtureRequest, tiny_model: Path, e2e_log_dir: Path) -> Iterator[Pd]:
    if (reason := _fp8_kv_unsupported()) is not None:
        pytest.skip(reason)
    kv_dtype: str = request.param
    run_dir = e2e_log_dir / f"pd-push-{kv_dtype}"
    with running_pd(tiny_model, run_dir, server_args=["--kv-cache-dtype", kv_dtype]) as stack:
        yield stack


def test_fp8_kv_greedy_equals_single_instance(pd_fp8: Pd) -> None:
    run_dir = pd_fp8.stack.run_dir
    kv_dtype = run_dir.name.removeprefix("pd-push-")
    for side in ("prefill", "decode"):  # the worker's start-up line names the layout's dtype
        log = (run_dir / f"{side}.log").read_text(errors="replace")
        assert f"KV {kv_dtype} " in log, f"{side}'s pushkv worker did not log {kv_dtype}: {run_dir}"
    prompts = {n: random_prompt(n, seed=3000 + n) for n in PROMPT_LENGTHS}
    before = source_tokens(pd_fp8.decode)
    disagg: dict[int, dict[str, Any]] = {}
    trace_ids: dict[int, str] = {}
    for n, prompt in prompts.items():
        trace_ids[n], disagg[n] = traced_completion(pd_fp8.router, greedy_body(prompt))
        assert disagg[n]["usage"]["prompt_tokens"] == n
    total = sum(PROMPT_LENGTHS)
    assert_prompt_tokens_from_p(pd_fp8.decode, before, total, f"logs in {run_dir}")
    for n, trace_id in trace_ids.items():  # P's spans name fp8: one byte per element
        trace = transfer_trace(run_dir, trace_id)
        assert_kv_geometry(trace, _geometry(kv_dtype), f"{n}-token prompt, {kv_dtype}, {run_dir}")
    for n, prompt in prompts.items():
        ref = post_ok(
            pd_fp8.decode, "/v1/completions", greedy_body(prompt, cache_salt=uuid.uuid4().hex)
        )
        assert_matches_reference(disagg[n], ref, f"{n}-token prompt, {kv_dtype} KV")

"""The baseline of ``test_vllm_router_e2e.py``: vLLM's own ``NixlPushConnector`` behind the
same ``vllm-router`` (``--vllm-pd-disaggregation --kv-connector nixl``), on the tiny model,
with the same requests: a cold first request (sequential) and 19 concurrent ones, whose
greedy outputs equal the single instance's (tests/e2e/greedy.py's rule), D taking its
prompts' KV from P (``vllm:prompt_tokens_by_source_total``) for all prompts but at most one.

The stack is the bench's ``vllm-push-vr`` configuration (``connector.tools.bench.stacks``):
P, D and vllm-router started together, stopped by PID on the way out. No other e2e starts
a NixlPushConnector pair, so it has a stack of its own (about a minute of CI).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from connector.tools.bench.stacks import CONFIGS, make_stack
from connector.tools.vllm_router import vllm_router_installed
from tests.e2e.conftest import START_TIMEOUT_S, Pd, pd_clients
from tests.e2e.greedy import assert_matches_reference
from tests.e2e.test_push_e2e import reference
from tests.e2e.test_vllm_router_e2e import cold_then_concurrent

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(900),
    pytest.mark.skipif(
        not vllm_router_installed(),
        reason="vllm-router is not installed (pip install -e '.[test]')",
    ),
]

CONFIG = "vllm-push-vr"


@pytest.fixture(scope="module")
def stand(tiny_model: Path, e2e_log_dir: Path) -> Iterator[Pd]:
    stack = make_stack(CONFIGS[CONFIG], tiny_model, e2e_log_dir / f"{CONFIG}-e2e")
    try:
        stack.start(START_TIMEOUT_S)
        print(f"\n[{CONFIG}] healthy after {stack.start_duration_s:.1f} s\n{stack.describe()}")
        with pd_clients(stack) as clients:
            yield clients
    finally:
        stack.stop()


def test_cold_first_then_concurrent_requests_equal_single_instance(stand: Pd) -> None:
    # vLLM's own connector: once in CI (2-core, loaded) D computed one 20-token prompt itself
    # (local_compute 20 of 2604, cold first request 46.5 s). That is vLLM's behaviour, not
    # pushkv's; this baseline checks the stack serves right, so one prompt may fall back.
    prompts, answers = cold_then_concurrent(stand, CONFIG, recomputed_prompts=1)
    for i, (prompt, got) in enumerate(zip(prompts, answers, strict=True)):
        assert_matches_reference(got, reference(stand, prompt), f"request {i}")

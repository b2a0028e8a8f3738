"""Greedy outputs compared with a single instance's, for every end-to-end test that does so.

Owns: the greedy request body, ``LOGPROB_TOL`` and ``NEAR_TIE`` (the one tolerance for
logprobs of runs that computed the same tokens along different paths), and the comparison
itself (``assert_matches_reference``, ``assert_greedy_agrees``). Test code only; imports no
vLLM (the servers are child processes).

Why a tolerance at all. The tiny models run in bf16 on vLLM's CPU backend, and a
disaggregated answer is computed along another path than the single instance's: D takes the
prompt's KV from P and computes the last prompt token in a one-token forward, where the
single instance runs the whole prompt at once. The two round differently; a bf16 logit
between 8 and 16 moves in steps of 0.0625. Measured through a P/D pair, each prompt (20 to
1000 tokens) against D alone, with another process busy on a core: on tiny-kv (8 layers) 140
of 146 prompts equal to the bit, the other 6 (600 to 1000 tokens) at most 0.012 apart on the
first token and 0.094 on later ones, with the same tokens and the same figures on a second
run; on tiny, 110 of 110 equal to the bit. On one server, a prompt batched with 1 to 4 others
gave the same logprobs as alone (24 runs). CI saw 1e-3 to 0.04 in three tests run under
load. ``LOGPROB_TOL`` (0.15, about 2.5 bf16 steps) is above all of that. Wrong KV is caught
mostly by the tokens: changing one token in the middle of the prompt (its KV in one slot)
changed at least one of the 16 greedy tokens for 110 of 110 prompts on tiny-kv and 97 of
110 on tiny (the other 13 moved logprobs by 0.002 and more, under this tolerance).

Exactly, but for near-ties: a greedy token can only differ from the reference's where the
reference's top two logprobs are closer than ``NEAR_TIE`` (if each moves by at most
``LOGPROB_TOL``, their gap moves by at most twice that). The tiny model has such near-ties
(even exact ties in bf16), so an answer may part from the reference there, and only there;
the tokens before are compared exactly and their logprobs within ``LOGPROB_TOL``. Requests ask
for the top two logprobs (``logprobs: 2``) to know the gap.
"""

from __future__ import annotations

from typing import Any

MAX_TOKENS = 16
LOGPROB_TOL = 0.15
NEAR_TIE = 2 * LOGPROB_TOL


def greedy_body(prompt: list[int] | str, **extra: Any) -> dict[str, Any]:
    """A greedy completion of ``MAX_TOKENS`` with the top two logprobs of each token."""
    return {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "logprobs": 2,
        "ignore_eos": True,
        **extra,
    }


def choice(out: dict[str, Any]) -> tuple[str, list[str], list[float]]:
    """A completion's text, tokens and the logprob of each token."""
    c = out["choices"][0]
    return c["text"], c["logprobs"]["tokens"], c["logprobs"]["token_logprobs"]


def top_gaps(out: dict[str, Any]) -> list[float]:
    """Per generated token, the logprob gap between the top two candidates."""
    gaps = []
    for top in out["choices"][0]["logprobs"]["top_logprobs"]:
        best = sorted(top.values(), reverse=True)
        gaps.append(best[0] - best[1] if len(best) > 1 else float("inf"))
    return gaps


def assert_greedy_agrees(
    tokens: list[str], lps: list[float], ref: dict[str, Any], what: str
) -> int:
    """``tokens`` equal the reference's up to its first near-tie where they part (or all of
    them), and their logprobs are within ``LOGPROB_TOL``; how many tokens agree."""
    _, ref_tokens, ref_lps = choice(ref)
    assert len(tokens) == len(ref_tokens), f"{what}: {len(tokens)} tokens vs {len(ref_tokens)}"
    k = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens, strict=True)) if a != b), None)
    if k is not None:
        gap = top_gaps(ref)[k]
        assert gap < NEAR_TIE, (
            f"{what}: token {k} differs where the single instance's top two are {gap:.3f} "
            f"apart (a rounding difference parts them only under {NEAR_TIE}): "
            f"{tokens} vs {ref_tokens}"
        )
        print(f"\n[greedy] {what}: parts from the single instance at a near-tie, token {k}")
    n = len(tokens) if k is None else k
    worst = max((abs(a - b) for a, b in zip(lps[:n], ref_lps[:n], strict=True)), default=0.0)
    assert worst <= LOGPROB_TOL, (
        f"{what}: logprobs {worst:.4f} off (tolerance {LOGPROB_TOL}): {lps} vs {ref_lps}"
    )
    return n


def assert_matches_reference(got: dict[str, Any], ref: dict[str, Any], what: str) -> int:
    """A non-streamed greedy completion against the single instance's (``ref``): its length,
    its tokens and logprobs (``assert_greedy_agrees``), and its text where every token agrees;
    how many tokens agree."""
    text, tokens, lps = choice(got)
    assert got["usage"]["completion_tokens"] == MAX_TOKENS, what
    n = assert_greedy_agrees(tokens, lps, ref, what)
    if n == len(tokens):
        assert text == choice(ref)[0], f"{what}: text differs from the single instance"
    return n

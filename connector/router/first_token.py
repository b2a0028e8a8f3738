"""First token from P (``--first-token prefill``): the client's first token is the one P
samples at the end of its prefill, streamed the moment P answers; D's leg then continues
from the prompt's token ids plus that token, so D's first step computes token 2 instead of
recomputing token 1 (under vLLM's connector API a D that holds the whole prompt's KV must
still run one forward before it has a token to stream).

Owns: ``blocker`` (why a request cannot be served so: it then runs as in ``decode`` mode),
``PrefillToken`` (P's answer, read strictly), ``first_event`` (the client's first SSE event),
``continuation_body`` (D's leg) and ``count_token_as_output`` (D's usage as the client's).

Pure: no I/O. docs/operations.md ("First token from P") says when to use it.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from connector.core.errors import RemoteProtocolError
from connector.router.legs import Endpoint, JsonObj

# Fields whose meaning does not depend on where the output starts: D continuing from
# prompt + token 1 samples token 2 as the single instance would.
_FREE: Final = frozenset(
    {
        "model",
        "prompt",
        "max_tokens",
        "min_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "stream",
        "logprobs",
        "user",
        "ignore_eos",
        "stop_token_ids",
        "logit_bias",
        "allowed_token_ids",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "include_stop_str_in_output",
        "priority",
        "cache_salt",
        "request_id",
        "return_tokens_as_token_ids",
        "add_special_tokens",
        "n",  # legs.parse_client_body lets only 1 through
        "best_of",
    }
)

# Fields that are harmless only at their neutral value. Each says why it is not otherwise.
_NEUTRAL: Final[dict[str, tuple[Callable[[Any], bool], str]]] = {
    "stop": (lambda v: not v, "stop strings (one may span P's token and D's text)"),
    "presence_penalty": (lambda v: not v, "presence_penalty (counts output tokens)"),
    "frequency_penalty": (lambda v: not v, "frequency_penalty (counts output tokens)"),
    "repetition_penalty": (lambda v: v in (None, 1, 1.0), "repetition_penalty"),
    "echo": (lambda v: not v, "echo"),
    "suffix": (lambda v: v is None, "suffix"),
    "prompt_logprobs": (lambda v: v is None, "prompt_logprobs"),
    "return_token_ids": (lambda v: not v, "return_token_ids (D's prompt ids differ)"),
    "stream_options": (
        lambda v: v is None or (isinstance(v, dict) and not v.get("continuous_usage_stats")),
        "continuous_usage_stats",
    ),
}


def blocker(endpoint: Endpoint, body: JsonObj) -> str | None:
    """Why this request's first token cannot come from P (None: it can). Only streamed
    completions gain (TTFT is what a stream shows), and only when D's sampling from
    position 2 equals the single instance's: a field that is not known to be so blocks."""
    if endpoint is not Endpoint.COMPLETIONS:
        return "chat completions (D continues from token ids, which only /v1/completions takes)"
    if not body.get("stream"):
        return "not streamed"
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, int) and max_tokens <= 1:
        return "max_tokens <= 1 (P's token is the whole answer)"
    if body.get("seed") is not None and body.get("temperature") != 0:
        return "seeded sampling (D's draws would start one position late)"
    for key, value in body.items():
        if key in _FREE or key == "seed":
            continue
        neutral = _NEUTRAL.get(key)
        if neutral is None:
            return f"field {key!r}"
        if not neutral[0](value):
            return neutral[1]
    return None


@dataclass(frozen=True)
class PrefillToken:
    """What P's one-token answer (asked with ``return_token_ids``) gives the router."""

    answer: JsonObj  # P's whole answer, for the client's first event
    prompt_ids: list[int]
    token_id: int
    stopped: bool  # P's token ends the request (EOS, a stop token): D is not needed

    @classmethod
    def read(cls, answer: JsonObj) -> PrefillToken:
        try:
            choice = answer["choices"][0]
            prompt_ids = choice["prompt_token_ids"]
            (token_id,) = choice["token_ids"]
            reason = choice.get("finish_reason")
        except (KeyError, IndexError, TypeError, ValueError):
            raise RemoteProtocolError(
                f"prefill answer has no prompt_token_ids / one token id: {answer!r:.300}"
            ) from None
        if not (
            isinstance(prompt_ids, list)
            and prompt_ids
            and all(isinstance(t, int) for t in prompt_ids)
            and isinstance(token_id, int)
        ):
            raise RemoteProtocolError(f"prefill answer's token ids are malformed: {choice!r:.300}")
        return cls(answer, prompt_ids, token_id, stopped=reason == "stop")


def _sse(obj: JsonObj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _chunk(answer: JsonObj, **fields: Any) -> JsonObj:
    """A stream chunk of P's completion (same id: both legs carry the request's
    X-Request-Id, from which vLLM names the completion)."""
    keys = ("id", "created", "model")
    return {"object": "text_completion", **{k: answer.get(k) for k in keys}, **fields}


def first_event(token: PrefillToken) -> bytes:
    """The client's first SSE event, as vLLM would stream P's token."""
    choice = token.answer["choices"][0]
    event = _chunk(
        token.answer,
        choices=[
            {
                "index": 0,
                "text": choice.get("text", ""),
                "logprobs": choice.get("logprobs"),
                "finish_reason": "stop" if token.stopped else None,
                "stop_reason": choice.get("stop_reason") if token.stopped else None,
            }
        ],
    )
    return _sse(event)


def final_events(token: PrefillToken, body: JsonObj) -> bytes:
    """P's token ended the request: its usage event when the client asked, then [DONE]."""
    out = b""
    options = body.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage") and "usage" in token.answer:
        out = _sse(_chunk(token.answer, choices=[], usage=token.answer["usage"]))
    return out + b"data: [DONE]\n\n"


def continuation_body(body: JsonObj, token: PrefillToken) -> JsonObj:
    """The client's ``body`` continued from P's token, for D's leg (``legs.decode_body``
    adds its ``kv_transfer_params`` with ``remote_num_tokens`` = the prompt's length): D
    receives the KV of the prompt, computes the token's and samples token 2."""
    out = copy.deepcopy(body)
    out["prompt"] = [*token.prompt_ids, token.token_id]
    if isinstance(out.get("max_tokens"), int):
        out["max_tokens"] -= 1
    if isinstance(out.get("min_tokens"), int):
        out["min_tokens"] = max(0, out["min_tokens"] - 1)
    out.pop("add_special_tokens", None)  # token ids are used as given
    return out


_USAGE: Final = b'"usage":{'


def count_token_as_output(events: bytes) -> bytes:
    """D counts P's token as a prompt token; the client's usage counts it as output. Takes
    whole SSE events: only the usage event (one per stream) is rewritten."""
    if _USAGE not in events:
        return events
    return b"\n\n".join(_shift_usage(e) for e in events.split(b"\n\n"))


def _shift_usage(event: bytes) -> bytes:
    if not event.startswith(b"data: {") or _USAGE not in event:
        return event
    try:
        obj = json.loads(event[6:])
        usage = obj["usage"]
        usage["prompt_tokens"] -= 1
        usage["completion_tokens"] += 1
    except (ValueError, KeyError, TypeError):
        return event  # not vLLM's usage event: passed on as it came
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode()

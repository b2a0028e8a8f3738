"""What the router sends: client-body validation, the P and D leg bodies per mode, leg
headers, ids, the probe. Pure: no I/O.

Owns: ``Endpoint``, ``InvalidRequest``, ``parse_client_body``, ``prefill_body``,
``decode_body``, ``leg_headers``, ``new_transfer_id``, ``new_traceparent`` (the one place a
trace context is made; a real OpenTelemetry span replaces its body later), ``probe_body`` /
``parse_probe_response``.

Must not import: httpx, starlette, asyncio.
"""

from __future__ import annotations

import copy
import enum
import json
import re
import secrets
import uuid
from collections.abc import Callable
from typing import Any, Final, TypeVar

from msgspec import UNSET, UnsetType

from connector.core.errors import PushkvError, RemoteProtocolError
from connector.kv_params import (
    PARAMS_FIELD,
    DecodeLeg,
    KvParamsError,
    Leg,
    PrefillAnswer,
    PrefillLeg,
    ProbeLeg,
    VllmPrefillLeg,
    VllmPullOverride,
    VllmPushDecodeLeg,
    parse_prefill_answer,
)
from connector.router.config import Mode
from connector.router.coords import CoordOverride, PrefillCoords

JsonObj = dict[str, Any]
T = TypeVar("T")


class Endpoint(enum.Enum):
    """The generation endpoints; the value is (path, the key that must be present)."""

    COMPLETIONS = ("/v1/completions", "prompt")
    CHAT = ("/v1/chat/completions", "messages")
    RESPONSES = ("/v1/responses", "input")  # always D alone: ``decode_alone_reason``

    @property
    def path(self) -> str:
        return self.value[0]

    @property
    def required_key(self) -> str:
        return self.value[1]


class InvalidRequest(PushkvError):
    """The client's body cannot be routed (answered 400, never forwarded)."""


def parse_client_body(raw: bytes, endpoint: Endpoint) -> JsonObj:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidRequest("body must be a JSON object")
    key = endpoint.required_key
    if key not in body:
        raise InvalidRequest(f"missing required field {key!r}")
    value = body[key]
    if endpoint is Endpoint.CHAT:
        if not isinstance(value, list) or not value:
            raise InvalidRequest("'messages' must be a non-empty list")
    elif endpoint is Endpoint.RESPONSES:
        if not isinstance(value, str | list):
            raise InvalidRequest("'input' must be a string or a list")
    elif isinstance(value, list):
        if not value:
            raise InvalidRequest("'prompt' must not be empty")
    elif not isinstance(value, str):
        raise InvalidRequest("'prompt' must be a string or a list")
    if PARAMS_FIELD in body:
        raise InvalidRequest(f"{PARAMS_FIELD!r} is set by the router, not by clients")
    if not isinstance(body.get("stream", False), bool):
        raise InvalidRequest("'stream' must be a boolean")
    return body


# vLLM 0.32's Responses server gives the request's kv_transfer_params to every engine
# request of its tool loop (``<id>_<n>``, serving.py ``_generate_with_builtin_tools``).
RESPONSES_ALONE: Final = (
    "Responses API: vLLM passes kv_transfer_params to each engine request of its tool loop, "
    "and one transfer feeds one"
)


def decode_alone_reason(body: JsonObj, endpoint: Endpoint) -> str | None:
    """Why a valid request goes to D alone (D computes its prompt, as vLLM serves it), or
    None: what one transfer cannot carry. vLLM makes an engine request per prompt of a list
    and per sequence of ``n`` / ``best_of``, and one transfer_id pairs one P request with
    one D request. Values vLLM would refuse go to D too, which answers its own 400."""
    if endpoint is Endpoint.RESPONSES:
        return RESPONSES_ALONE

    def more_than_one(key: str) -> bool:
        v = body.get(key)
        return isinstance(v, int) and not isinstance(v, bool) and v > 1

    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) > 1 and not all(isinstance(t, int) for t in prompt):
        return f"a list of {len(prompt)} prompts: one transfer pairs one prompt"
    if more_than_one("n"):
        return f"n = {body['n']}: one transfer feeds one sequence"
    if more_than_one("best_of"):
        return f"best_of = {body['best_of']}: one transfer feeds one sequence"
    return None


def new_transfer_id() -> str:
    """Fresh per dispatch: a retry gets a new one, so P and D never mistake the failed
    attempt's transfer for the next one's."""
    return uuid.uuid4().hex


_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")


def new_traceparent(incoming: str | None = None) -> str:
    """A W3C traceparent for this request: the client's trace id if it sent a valid one,
    else a fresh one, and always a fresh parent id (the router's own span)."""
    trace_id = None
    if incoming:
        m = _TRACEPARENT.match(incoming.strip().lower())
        if m and m[1] != "ff" and m[2] != "0" * 32 and m[3] != "0" * 16:
            trace_id = m[2]
    trace_id = trace_id or secrets.token_hex(16)
    span_id = secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01"


_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


def request_id_from(header: str | None) -> str:
    """The client's X-Request-Id when it is a sane token (vLLM builds engine request ids from
    it), else a fresh uuid."""
    if header and _REQUEST_ID.match(header):
        return header
    return uuid.uuid4().hex


def leg_headers(request_id: str, traceparent: str, authorization: str | None) -> dict[str, str]:
    """Both legs carry the same ids, so P's and D's logs and spans line up."""
    headers = {"X-Request-Id": request_id, "traceparent": traceparent}
    if authorization:
        headers["Authorization"] = authorization
    return headers


def prefill_body(
    mode: Mode,
    endpoint: Endpoint,
    body: JsonObj,
    *,
    transfer_id: str,
    traceparent: str,
    token_ids: bool = False,
) -> JsonObj:
    """P's leg: prefill only (one token), never streamed. ``token_ids``: P's answer names
    the prompt's token ids and its token's (first token from P: D continues from them)."""
    out = copy.deepcopy(body)
    if token_ids:
        out["return_token_ids"] = True
    out["max_tokens"] = 1
    if endpoint is Endpoint.CHAT and "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    # vLLM rejects stream_options without stream, and min_tokens above max_tokens; P's
    # token is the client's with ``token_ids``, so EOS stays masked as min_tokens says.
    out.pop("stream_options", None)
    min_tokens = out.pop("min_tokens", None)
    if token_ids and isinstance(min_tokens, int) and min_tokens > 0:
        out["min_tokens"] = 1
    leg: Leg = VllmPrefillLeg()
    if mode is Mode.PUSH:
        leg = PrefillLeg(
            do_remote_decode=True,
            transfer_id=transfer_id,
            traceparent=traceparent,
            # no D leg follows a token that ends the request
            release_on_stop=True if token_ids else UNSET,
        )
    out[PARAMS_FIELD] = leg.params()
    return out


def decode_body(
    mode: Mode,
    body: JsonObj,
    *,
    transfer_id: str,
    traceparent: str,
    request_id: str,
    coords: PrefillCoords | None = None,
    prefill_params: JsonObj | None = None,
    remote_num_tokens: int | None = None,
    sign: Callable[[DecodeLeg], DecodeLeg] | None = None,
) -> JsonObj:
    """D's leg: ``body`` (the client's, or its continuation from P's token) plus what D
    needs to receive the KV. ``coords`` for the push modes; ``prefill_params`` (P's
    returned ``kv_transfer_params``, flags' overrides applied) for pull. Push mode only:
    ``remote_num_tokens`` (D loads that many prompt tokens' KV, first token from P) and
    ``sign`` (the router's signature over P's coordinates)."""
    out = copy.deepcopy(body)
    if mode is Mode.PULL:
        if prefill_params is None:
            raise ValueError("pull mode needs P's kv_transfer_params")
        out[PARAMS_FIELD] = copy.deepcopy(prefill_params)
        return out
    if coords is None:
        raise ValueError(f"{mode.value} mode needs P's transfer coordinates")
    if mode is Mode.PUSH:
        leg = DecodeLeg(
            do_remote_prefill=True,
            transfer_id=transfer_id,
            remote_engine_id=coords.engine_id,
            remote_host=coords.host,
            remote_port=coords.port,
            remote_tp_size=coords.tp_size,
            traceparent=traceparent,
            remote_ports=coords.ports or UNSET,
            remote_agents=coords.agents or UNSET,
            remote_num_tokens=remote_num_tokens or UNSET,
            remote_pp_size=coords.pp_size if coords.pp_size > 1 else UNSET,
        )
        out[PARAMS_FIELD] = (sign(leg) if sign is not None else leg).params()
        return out
    out[PARAMS_FIELD] = VllmPushDecodeLeg(
        remote_engine_id=coords.engine_id,
        remote_host=coords.host,
        remote_port=coords.port,
        tp_size=coords.tp_size,
        remote_request_id=request_id,
        transfer_id=transfer_id,
    ).params()
    return out


def vllm_transfer_id() -> str:
    """vLLM's push demo proxy's form (not read by vLLM 0.32; kept for its logs)."""
    return f"xfer-{uuid.uuid4()}"


def apply_pull_overrides(params: JsonObj, override: CoordOverride) -> JsonObj:
    """Pull mode: the ``--prefill-*`` flags replace what P reported (P may advertise an
    address D cannot reach; vLLM's own proxy rewrites ``remote_host`` for the same reason)."""
    flags = VllmPullOverride(
        remote_engine_id=_given(override.engine_id),
        remote_host=_given(override.host),
        remote_port=_given(override.port),
        tp_size=_given(override.tp_size),
    )
    return {**params, **flags.params()}


def _given(value: T | None) -> T | UnsetType:
    return UNSET if value is None else value


PROBE_PROMPT = "probe"


def probe_body(model: str) -> JsonObj:
    return {
        "model": model,
        "prompt": PROBE_PROMPT,
        "max_tokens": 1,
        "stream": False,
        PARAMS_FIELD: ProbeLeg().params(),
    }


def parse_models_response(obj: Any) -> str:
    """The first model id of an OpenAI ``/v1/models`` answer."""
    try:
        model = obj["data"][0]["id"]
    except (KeyError, IndexError, TypeError):
        raise RemoteProtocolError(f"/v1/models answer has no model id: {obj!r:.200}") from None
    if not isinstance(model, str):
        raise RemoteProtocolError(f"/v1/models model id is not a string: {model!r}")
    return model


def prefill_answer(answer: JsonObj) -> PrefillAnswer:
    """What pushkv's P put in its answer's ``kv_transfer_params``."""
    try:
        return parse_prefill_answer(answer.get(PARAMS_FIELD))
    except KvParamsError as exc:
        raise RemoteProtocolError(f"prefill answer: {exc}") from None


def refusal(answer: JsonObj) -> str | None:
    """Why pushkv's P refused the transfer of the prompt it computed, if it says so."""
    try:
        return prefill_answer(answer).pushkv_error or None
    except RemoteProtocolError:
        return None  # not pushkv's answer: nothing refused


def parse_probe_response(obj: Any) -> PrefillCoords:
    """P's answer to the probe carries ``kv_transfer_params.pushkv`` = its coordinates
    (``connector.kv_params.Coordinates``: optional per-rank ``ports`` and ``agents``)."""
    coords = prefill_answer(obj).pushkv if isinstance(obj, dict) else UNSET
    if not coords:
        raise RemoteProtocolError(f"probe answer lacks kv_transfer_params.pushkv: {obj!r:.300}")
    return coords

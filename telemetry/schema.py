"""The span schema of pushkv: every span name and attribute key, in one place.

Owns: the names. The connector, the router and the dashboard import them; no span name or
pushkv attribute key is spelled anywhere else. Imports nothing (cheap in every process).

One trace per request: the router's ``request`` span is the root; P's and D's spans join it
through the W3C ``traceparent`` the router puts in both legs (headers and
``kv_transfer_params``). Spans are per request or per transfer, never per layer or block:
counts go into attributes.
"""

from __future__ import annotations

from enum import Enum
from typing import Final

NAMESPACE: Final = "pushkv"


class Span(str, Enum):
    """Span names. The value is what exporters and the dashboard see."""

    # router
    REQUEST = "pushkv.request"  # root: client request in -> last byte out
    ROUTE = "pushkv.route"  # choosing D (and P) before prefill
    PREFILL_LEG = "pushkv.prefill_leg"  # router -> P -> router
    DECODE_LEG = "pushkv.decode_leg"  # router -> D -> stream back
    FIRST_BYTE = "pushkv.first_byte"  # decode leg sent -> first byte of D's answer
    # D
    REGISTER = "pushkv.register"  # blocks allocated -> registration sent
    AWAIT_KV = "pushkv.await_kv"  # registration sent -> last completion counted
    FIRST_TOKEN = "pushkv.first_token"  # KV complete -> first token scheduled out
    # P
    PREFILL = "pushkv.prefill"  # request arrival -> prompt KV complete (engine timestamps)
    RENDEZVOUS_WAIT = "pushkv.rendezvous_wait"  # first of registration/prefill -> second
    PREPARE_DESCRIPTORS = "pushkv.prepare_descriptors"
    WRITE = "pushkv.write"  # WRITE posted -> DONE


class Attr(str, Enum):
    """Attribute keys: pushkv's own namespace; GenAI conventions where they fit."""

    TRANSFER_ID = "pushkv.transfer_id"
    ROLE = "pushkv.role"  # "prefill" | "decode" | "router"
    ENGINE_ID = "pushkv.engine_id"
    TP_RANK = "pushkv.tp_rank"
    PEER = "pushkv.peer"  # remote agent of a WRITE or registration
    MODE = "pushkv.mode"  # router mode: push | vllm-push | pull
    DECODE_URL = "pushkv.decode_url"
    PREFILL_URL = "pushkv.prefill_url"
    ROUTE_REASON = "pushkv.route.reason"
    FIRST_ARRIVED = "pushkv.rendezvous.first"  # "registration" | "prefill"
    P_RANKS = "pushkv.p_ranks"  # completions D waits for
    BLOCKS = "pushkv.blocks"
    REGIONS = "pushkv.regions"  # byte regions after merging
    DESCRIPTORS = "pushkv.descriptors"
    BYTES = "pushkv.bytes"
    GBPS = "pushkv.gbps"
    PROMPT_TOKENS = "pushkv.prompt_tokens"
    FIRST_TOKEN_INDEX = "pushkv.first_token"  # tokens D already held (prefix hit)
    OUTCOME = "pushkv.outcome"  # "ok" | a FailReason value
    REASON = "pushkv.reason"  # why a span ended in error
    # GenAI semantic conventions
    REQUEST_MODEL = "gen_ai.request.model"
    REQUEST_ID = "gen_ai.request.id"
    INPUT_TOKENS = "gen_ai.usage.input_tokens"
    OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
    ERROR_TYPE = "error.type"


class Resource(str, Enum):
    """Resource attributes identifying a process (stable across forks)."""

    SERVICE_NAME = "service.name"
    ROLE = "pushkv.role"
    ENGINE_ID = "pushkv.engine_id"
    TP_RANK = "pushkv.tp_rank"

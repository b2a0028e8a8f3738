"""The span schema of pushkv: every span name and attribute key, in one place.

Owns: the names. The connector, the router and the dashboard import them; no span name or
pushkv attribute key is spelled anywhere else. Imports nothing (cheap in every process).

One trace per request: the router's ``request`` span is the root; P's and D's spans join it
through the W3C ``traceparent`` the router puts in both legs (headers and
``kv_transfer_params``). Spans are per request or per transfer, never per layer or block:
counts go into attributes.

The tree of one push request (process that emits it in brackets; every P span is per P TP
rank that writes, carrying ``pushkv.tp_rank``; with TP 1 each appears once)::

    request [router] (SERVER; event first_chunk = client-observed TTFT end)
      route [router]                     request in -> both legs about to be sent
      prefill_leg [router] (CLIENT)      P leg sent -> P's response read
        prefill [P]                      engine arrival -> prompt KV complete on this rank
                                         (event scheduled: first scheduled by P's engine)
      decode_leg [router] (CLIENT)       D leg sent -> D's stream fully relayed
        first_byte [router]              D leg sent -> first byte of D's answer
        register [D]                     blocks allocated -> registration sent
        await_kv [D]                     registration sent -> last completion counted (p_ranks)
        rendezvous_wait [P]              first of (registration, prefill done) -> second
                                         (events registration, prefill_done; attr first)
        prepare_descriptors [P]          block ids -> NIXL descriptors (blocks/regions/descs)
        write [P]                        WRITE posted -> DONE (bytes, descriptors, GB/s, peer)
        first_token [D]                  KV complete -> first token out of D's engine
                                         (event scheduled: D scheduled its first step)
        hook_failed [P or D]             only when a connector hook of ours raised for the
                                         request (zero length; reason hook_error)

P's transfer spans hang under the decode leg: the registration carries D's context to P,
and the transfer serves D's leg (P's HTTP answer may be back before its WRITE ends). With
no registration (a transfer that failed before one came) they fall back to P's leg.

Spans observed by polling carry the timestamps where they were observed, set explicitly.
A span that ends in failure (fail, cancel, lease expiry, deadline) has an error status and
``pushkv.reason``; ``pushkv.outcome`` is "ok" otherwise. In ``pull`` / ``vllm-push`` router
modes only the router's spans exist (vLLM's connectors emit none of ours).
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
    # P or D: a hook of ours raised for the request (zero length; error, reason hook_error;
    # attribute pushkv.hook names it); the request was let go of definitely
    HOOK_FAILED = "pushkv.hook_failed"


class Event(str, Enum):
    """Span events: instants inside a span, with their own timestamp."""

    SCHEDULED = "pushkv.scheduled"  # on P `prefill`: first scheduled; on D `first_token`: scheduled
    FIRST_CHUNK = "pushkv.first_chunk"  # on router `request`: first token sent to the client
    REGISTRATION = "pushkv.registration"  # on P `rendezvous_wait`: D's registration arrived
    PREFILL_DONE = "pushkv.prefill_done"  # on P `rendezvous_wait`: prompt KV complete
    # on router `request`: one attempt failed before the client got a byte (reason, role,
    # attempt number; the next attempt follows with a fresh transfer_id)
    ATTEMPT_FAILED = "pushkv.router.attempt_failed"


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
    REGIONS = "pushkv.regions"  # KV regions (layer x part) the transfer spans
    DESCRIPTORS = "pushkv.descriptors"  # NIXL descriptors, after merging contiguous runs
    BYTES = "pushkv.bytes"
    GBPS = "pushkv.gbps"
    PROMPT_TOKENS = "pushkv.prompt_tokens"
    FIRST_TOKEN_INDEX = "pushkv.first_token"  # tokens D already held (prefix hit)
    OUTCOME = "pushkv.outcome"  # "ok" | a FailReason value | "cancelled" | "error"
    STREAM = "pushkv.stream"  # client asked for a stream
    ENDPOINT = "pushkv.endpoint"  # "completions" | "chat"
    TTFT_MS = "pushkv.ttft_ms"  # router-observed: request in -> first token sent
    TPOT_MS = "pushkv.tpot_ms"  # router-observed: mean gap between later tokens
    PENDING = "pushkv.route.outstanding"  # outstanding requests on the chosen D
    LOCAL_TOKENS = "pushkv.local_tokens"  # prompt tokens D computed itself (prefix hit)
    HTTP_STATUS = "http.response.status_code"
    ATTEMPT = "pushkv.router.attempt"  # 1-based attempt of a request (event attempt_failed)
    ATTEMPTS = "pushkv.router.attempts"  # on `request`: attempts it took
    FAILED_ROLE = "pushkv.router.failed_role"  # "prefill" | "decode": whose leg failed
    DEGRADED = "pushkv.router.degraded"  # on `request`: served by D alone (no P usable)
    REASON = "pushkv.reason"  # why a span ended in error
    HOOK = "pushkv.hook"  # on `hook_failed`: the connector hook that raised
    FAULT = "pushkv.fault"  # an injected fault (test-only, connector/transport/faulty.py)
    # GenAI semantic conventions
    REQUEST_MODEL = "gen_ai.request.model"
    REQUEST_ID = "gen_ai.request.id"
    INPUT_TOKENS = "gen_ai.usage.input_tokens"
    OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
    ERROR_TYPE = "error.type"


class Outcome(str, Enum):
    """``pushkv.outcome`` values of their own (the others are FailReason values or a router
    error such as ``http_502``)."""

    OK = "ok"
    CANCELLED = "cancelled"  # the client left, or a leg was cancelled
    HOOK_ERROR = "hook_error"  # a connector hook of ours raised (pushkv.reason)


class Count(str, Enum):
    """Stable names of pushkv's fault counters: the transfer thread's ``counters`` (its
    Sender's and Receiver's merged in), the worker's and the scheduler role's. A value
    ending in "_" is a prefix, followed by a FailReason value (or a fault kind): e.g.
    ``recv_failed_deadline``. The metrics exporter publishes them under these names."""

    RECV_FAILED = "recv_failed_"  # D: a load reported failed, by reason
    RECV_ABANDONED = "recv_abandoned"  # D: a silent source given up (last resort)
    FAIL_SENT = "fail_sent_"  # P: a transfer ended without its WRITE and D was told, by reason
    COMPLETION_RESENT = "completion_resent"  # P: a cancel for a DONE transfer (lost `done`)
    WRITE_FAILED = "write_"  # P: a WRITE failed, by reason (post_error, write_timeout...)
    SEND_FAILED = "send_failed"  # a notification could not be sent
    HOOK_ERRORS = "hook_errors"  # a connector hook of ours raised
    HOOK_EFFECT = "hook_failed_"  # ... and what letting go of its request did (lifecycle)
    INJECTED = "injected_"  # a fault injected for a test (connector/transport/faulty.py)


class RouterMode(str, Enum):
    """``pushkv.mode`` values: the router's modes (connector/router/config.py's Mode)."""

    PUSH = "push"  # pushkv's PushConnector: every span of the tree
    VLLM_PUSH = "vllm-push"  # vLLM's NixlPushConnector: router spans only
    PULL = "pull"  # vLLM's NixlConnector: router spans only


class Service(str, Enum):
    """Default ``service.name`` per role (``OTEL_SERVICE_NAME`` overrides)."""

    ROUTER = "pushkv-router"
    PREFILL = "pushkv-prefill"
    DECODE = "pushkv-decode"


class Resource(str, Enum):
    """Resource attributes identifying a process (stable across forks)."""

    SERVICE_NAME = "service.name"
    ROLE = "pushkv.role"
    ENGINE_ID = "pushkv.engine_id"
    TP_RANK = "pushkv.tp_rank"

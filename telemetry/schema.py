"""The span and metric schema of pushkv: every span name, attribute key and metric name.

Owns: the names (``Metric`` and its catalog ``METRICS`` are the Prometheus side). The
connector, the router and the dashboard import them; no span name, pushkv attribute key or
metric name is spelled anywhere else. Imports nothing (cheap in every process).

One trace per request: the router's ``request`` span is the root; P's and D's spans join it
through the W3C ``traceparent`` the router puts in both legs (headers and
``kv_transfer_params``). Spans are per request or per transfer, never per layer or block:
counts go into attributes.

The tree of one push request (process that emits it in brackets; every P span is per P TP
rank that writes, carrying ``pushkv.tp_rank``; with TP 1 each appears once)::

    request [router] (SERVER; starts when the HTTP server accepted the connection opened
                      for it, else when it began parsing it; event first_chunk = TTFT end)
      connect [router]                   only on a new connection: accept -> first bytes
      ingress [router]                   first bytes -> its handler runs (waits on the loop)
      route [router]                     handler -> both legs about to be sent
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
                                         (both: the KV geometry, pushkv.kv.*)
        first_token [D]                  KV complete -> first token out of D's engine
                                         (event scheduled: D scheduled its first step)
        hook_failed [P or D]             only when a connector hook of ours raised for the
                                         request (zero length; reason hook_error)
        freed_check [D]                  test-only: an aborted transfer's freed blocks
                                         filled with a pattern -> checked intact

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
    REQUEST = "pushkv.request"  # root: client request in (server's stamp) -> last byte out
    # the server accepted a connection the client opened for this request -> its first bytes
    CONNECT = "pushkv.connect"
    INGRESS = "pushkv.ingress"  # the request's first bytes -> the handler runs (queued on the loop)
    ROUTE = "pushkv.route"  # choosing D (and P) before prefill
    PREFILL_LEG = "pushkv.prefill_leg"  # router -> P -> router
    DECODE_LEG = "pushkv.decode_leg"  # router -> D -> stream back
    FIRST_BYTE = "pushkv.first_byte"  # decode leg sent -> first byte of D's answer
    # D
    REGISTER = "pushkv.register"  # blocks allocated -> registration sent
    AWAIT_KV = "pushkv.await_kv"  # registration sent -> last completion counted
    FIRST_TOKEN = "pushkv.first_token"  # KV complete -> first token scheduled out
    LEG_REJECTED = "pushkv.leg_rejected"  # an untrusted decode leg: computed locally (instant)
    # P
    PREFILL = "pushkv.prefill"  # request arrival -> prompt KV complete (engine timestamps)
    RENDEZVOUS_WAIT = "pushkv.rendezvous_wait"  # first of registration/prefill -> second
    PREPARE_DESCRIPTORS = "pushkv.prepare_descriptors"
    WRITE = "pushkv.write"  # WRITE posted -> DONE
    # P or D: a hook of ours raised for the request (zero length; error, reason hook_error;
    # attribute pushkv.hook names it); the request was let go of definitely
    HOOK_FAILED = "pushkv.hook_failed"
    # D, test-only (_faults.check_freed_tokens): the blocks of an aborted transfer, filled
    # with a pattern when D freed them -> checked intact until no WRITE may land (error,
    # reason late_write, when a byte changed; pushkv_testing/freed_check.py)
    FREED_CHECK = "pushkv.freed_check"


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
    PP_STAGE = "pushkv.pp_stage"  # P's pipeline stage, on its spans where P runs several
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
    # P's KV geometry, on `prepare_descriptors` and `write` (connector/core/geometry.py):
    # why one model's transfers move more bytes than another's
    KV_LAYERS = "pushkv.kv.layers"
    KV_FORM = "pushkv.kv.form"  # "heads" (K and V per head) | "latent" (MLA)
    KV_HEADS = "pushkv.kv.heads"  # KV heads on this rank (MLA's latent: 1)
    KV_HEAD_SIZE = "pushkv.kv.head_size"  # elements of K (= V) per head, or the latent's
    KV_DTYPE = "pushkv.kv.dtype"  # "bfloat16", "fp8_e4m3", ...
    KV_BYTES_PER_TOKEN = "pushkv.kv.bytes_per_token"  # this rank, every layer, K and V
    KV_BLOCK_TOKENS = "pushkv.kv.block_tokens"  # tokens per kernel block
    GBPS = "pushkv.gbps"
    XFER_PATH = "pushkv.xfer.path"  # "direct" | "ipc" | "staged" (per target, joined by ",")
    XFER_REASON = "pushkv.xfer.reason"  # why that path (connector/core/xfer_path.py)
    XFER_COPY_MS = "pushkv.xfer.copy_ms"  # device time of the IPC copy kernel
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
    LOOP_LAG_MS = "pushkv.router.loop_lag_ms"  # on `request`: worst event-loop lag while open
    # on `request`: who sent the client's first token, "prefill" | "decode" (--first-token),
    # and, when prefill was asked for but the request could not be served so, why not
    FIRST_TOKEN_FROM = "pushkv.router.first_token"
    FIRST_TOKEN_BLOCKER = "pushkv.router.first_token_blocker"
    # on `request`: where its start comes from: "server" (the HTTP server's stamp when it began
    # parsing the request) or "handler" (no stamp: the handler's start)
    ARRIVAL = "pushkv.router.arrival"
    # route choice (connector/router/chooser.py), on `route` and `request`: the --policy, why
    # P and why D were chosen, and how many prompt blocks the chosen D held (prefix policy)
    ROUTE_POLICY = "pushkv.route.policy"
    ROUTE_PREFILL_REASON = "pushkv.route.prefill_reason"
    ROUTE_PREFIX_BLOCKS = "pushkv.route.prefix_blocks"
    REASON = "pushkv.reason"  # why a span ended in error
    HOOK = "pushkv.hook"  # on `hook_failed`: the connector hook that raised
    FAULT = "pushkv.fault"  # an injected fault or check (test-only, pushkv_testing/faults.py)
    # GenAI semantic conventions
    REQUEST_MODEL = "gen_ai.request.model"
    REQUEST_ID = "gen_ai.request.id"
    INPUT_TOKENS = "gen_ai.usage.input_tokens"
    OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
    ERROR_TYPE = "error.type"
    # KV integrity (kv_checksum_every): D's verdict on P's digests, on `await_kv`:
    # "ok" | "mismatch" | "skipped" (connector/transfer/integrity.py)
    KV_CHECK = "pushkv.kv_check"


class Outcome(str, Enum):
    """``pushkv.outcome`` values of their own (the others are FailReason values or a router
    error such as ``http_502``)."""

    OK = "ok"
    CANCELLED = "cancelled"  # the client left, or a leg was cancelled
    HOOK_ERROR = "hook_error"  # a connector hook of ours raised (pushkv.reason)
    LATE_WRITE = "late_write"  # test-only: a WRITE landed in blocks D had freed


class Count(str, Enum):
    """Stable names of pushkv's counters: each component's ``counters``
    (``telemetry.counts.Counts``, written only through its ``add``), the transfer thread's
    with its Sender's, Receiver's, peers', doorbell's and transport's merged in when it
    stops, and the scheduler role's. A value ending in "_" is a prefix, followed by a
    detail: a FailReason value, a fault kind, a message type or a merged component's own
    name (e.g. ``recv_failed_deadline``, ``bell_rung``). The worker logs them at shutdown;
    ``connector.transfer.metrics`` turns a few into labelled ``Metric`` values."""

    # fault counters
    RECV_FAILED = "recv_failed_"  # D: a load reported failed, by reason
    RECV_ABANDONED = "recv_abandoned"  # D: a silent source given up (last resort)
    FAIL_SENT = "fail_sent_"  # P: a transfer ended without its WRITE and D was told, by reason
    COMPLETION_RESENT = "completion_resent"  # P: a cancel for a DONE transfer (lost `done`)
    WRITE_FAILED = "write_"  # P: a WRITE failed, by reason (post_error, write_timeout...)
    SEND_FAILED = "send_failed"  # a notification could not be sent
    HOOK_ERRORS = "hook_errors"  # a connector hook of ours raised
    HOOK_EFFECT = "hook_failed_"  # ... and what letting go of its request did (lifecycle)
    INJECTED = "injected_"  # a fault injected for a test (pushkv_testing/faults.py)
    # Sender (P) and Receiver (D)
    SENDER_MISMATCH = "sender_mismatch"  # a rank's message claiming another's address
    UNEXPECTED = "unexpected_"  # a message the endpoint never takes, by type
    HEARTBEATS = "heartbeats"  # P: heartbeats received
    IPC_OFFERS_IGNORED = "ipc_offers_ignored"  # P without a GPU path driver
    PATH = "path_"  # P: WRITEs ended, by transfer path (direct, staged, ipc...)
    HEARTBEATS_SENT = "heartbeats_sent"  # D
    HEARTBEAT_FAILED = "heartbeat_failed"  # D: a heartbeat could not be sent
    # the transfer thread
    POLLS = "polls"
    LOOP_ERRORS = "loop_errors"  # an iteration raised (logged; the thread goes on)
    EVENT_ERRORS = "event_errors"  # an engine event our tables refused (logged)
    GET_NOTIFS_FAILED = "get_notifs_failed"
    FOREIGN_NOTIFS = "foreign_notifs"  # a notification that is no pushkv frame
    MALFORMED_NOTIFS = "malformed_notifs"  # a pushkv frame that does not decode
    UNAUTHENTICATED_NOTIFS = "unauthenticated_notifs"  # refused by the guard
    MISROUTED_NOTIFS = "misrouted_notifs"  # for an endpoint this rank does not run
    INCOMING_DROPPED = "incoming_dropped"  # D: a WRITE bell past the tracked cap
    INCOMING_EXPIRED = "incoming_expired"  # D: a WRITE bell whose completion never came
    IDLE_STEP_WAITS = "idle_step_waits"  # an empty engine step waited for a result...
    IDLE_STEP_WAIT_RESULTS = "idle_step_wait_results"  # ... and got one
    IDLE_STEP_WAIT_TIMEOUTS = "idle_step_wait_timeouts"  # ... or did not
    BELL = "bell_"  # the doorbell's counters, merged in under this prefix
    # peers
    PEER_BACKOFF_FAILED = "peer_backoff_failed"  # a send refused while its peer backs off
    PEER_GONE = "peer_gone"
    PEER_UNREACHABLE = "peer_unreachable"
    # the guard: a refused sealed message, by reason
    AUTH = "auth_"
    # the doorbell
    RUNG = "rung"
    RING_FAILED = "ring_failed"
    REFUSED = "refused"  # a datagram that failed authentication
    HEARD = "heard"
    HEARD_WRITE = "heard_write"
    HEARD_DONE = "heard_done"
    # the NIXL transport's metadata loads, by outcome, and the side channel's drops
    MD_LOADED = "md_loaded"
    MD_RELOADED = "md_reloaded"
    MD_UNCHANGED = "md_unchanged"
    MD_REJECTED = "md_rejected"
    MD_NAME_MISMATCH = "md_name_mismatch"
    SIDE_DIALS_OK = "dials_ok"
    SIDE_DIALS_FAILED = "dials_failed_"  # by reason
    SIDE_ACCEPT_FAILED = "accept_failed"
    SIDE_SERVED = "served"
    SIDE_DROPPED = "dropped_"  # a request refused, by reason
    SIDE_CHANNEL = "side_"  # the side channel's counters, merged in under this prefix
    # test-only: the freed-block check (pushkv_testing/freed_check.py)
    FREED_FILLED = "freed_filled"
    FREED_INTACT = "freed_intact"
    LATE_WRITES = "late_writes"
    # KV integrity (kv_checksum_every, connector/transfer/integrity.py)
    KV_DIGESTS = "kv_digests"  # P: a WRITE's completion carries a digest of its KV
    KV_DIGESTS_SKIPPED = "kv_digests_skipped"  # P: sampled, but it cannot compute the digest
    KV_CHECK = "kv_check_"  # D: a completion's digest checked, by verdict (ok, mismatch...)


class Recomputed(str, Enum):
    """``reason`` label values of ``Metric.RECOMPUTED``: why D computed a prompt itself."""

    BAD_PARAMS = "bad_params"  # a decode leg whose kv_transfer_params did not parse
    TRANSFER_FAILED = "transfer_failed"  # the load failed (kv_load_failure_policy recompute)


class RouterMode(str, Enum):
    """``pushkv.mode`` values: the router's modes (connector/router/config.py's Mode)."""

    PUSH = "push"  # pushkv's PushConnector: every span of the tree
    VLLM_PUSH = "vllm-push"  # vLLM's NixlPushConnector: router spans only
    PULL = "pull"  # vLLM's NixlConnector: router spans only


class RoutePolicy(str, Enum):
    """``pushkv.route.policy`` values: the router's ``--policy`` (connector/router/chooser.py's
    Policy)."""

    LEAST_LOAD = "least-load"  # the router's own count of outstanding legs
    ENGINE_LOAD = "engine-load"  # the engines' queues and KV usage
    PREFIX = "prefix"  # the backend holding the prompt's prefix (pushkv.route.prefix_blocks)


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
    # The address an engine's ranks advertise to peers (its side_channel_host): which host
    # served a request, where P and D run on separate hosts.
    HOST_ADDR = "pushkv.host.addr"


class Metric(str, Enum):
    """Prometheus metric names. The engine's (``vllm:pushkv_*``) go through vLLM's
    connector-stats hooks onto each vLLM server's ``/metrics``, next to vLLM's own and with
    its labels (``model_name``, ``engine``); each TP rank counts its own transfers. The
    router's (``pushkv_router_*``) are on the router's ``/metrics``. Kinds, extra labels
    and help texts are in ``METRICS``; docs/operations.md#metrics says what each means."""

    # P (producer): one observation per transfer and rank, successful transfers only
    RENDEZVOUS_WAIT = "vllm:pushkv_rendezvous_wait_seconds"
    PREPARE = "vllm:pushkv_prepare_descriptors_seconds"
    WRITE = "vllm:pushkv_write_seconds"
    WRITE_THROUGHPUT = "vllm:pushkv_write_throughput_bytes_per_second"
    PUSH = "vllm:pushkv_push_seconds"
    BYTES = "vllm:pushkv_transfer_bytes"
    DESCRIPTORS = "vllm:pushkv_transfer_descriptors"
    # D (consumer)
    KV_WAIT = "vllm:pushkv_kv_wait_seconds"
    RECOMPUTED = "vllm:pushkv_recomputed_requests_total"
    # both sides
    TRANSFERS = "vllm:pushkv_transfers_total"
    DROPPED = "vllm:pushkv_messages_dropped_total"
    HEARTBEATS = "vllm:pushkv_heartbeats_total"
    DOORBELLS = "vllm:pushkv_doorbell_rings_total"
    # gauges: P
    REGISTRATIONS_WAITING = "vllm:pushkv_registrations_waiting"
    PREFILLS_WAITING = "vllm:pushkv_prefills_waiting"
    BLOCKS_HELD = "vllm:pushkv_blocks_held"
    OLDEST_HELD = "vllm:pushkv_oldest_held_seconds"
    WRITES_IN_FLIGHT = "vllm:pushkv_writes_in_flight"
    # gauge: D
    AWAITING_KV = "vllm:pushkv_transfers_awaiting_kv"
    # router
    ROUTER_REQUESTS = "pushkv_router_requests_total"
    ROUTER_RETRIES = "pushkv_router_retries_total"
    ROUTER_DEGRADED = "pushkv_router_degraded_requests_total"
    ROUTER_LEGS = "pushkv_router_legs_total"
    ROUTER_TTFT = "pushkv_router_ttft_seconds"
    ROUTER_E2E = "pushkv_router_e2e_seconds"
    ROUTER_OVERHEAD = "pushkv_router_overhead_seconds"
    ROUTER_BACKEND_HEALTHY = "pushkv_router_backend_healthy"
    ROUTER_OUTSTANDING = "pushkv_router_backend_outstanding_legs"
    ROUTER_LOOP_LAG = "pushkv_router_loop_lag_seconds"
    # drain (connector/router/drain.py)
    ROUTER_DRAINING = "pushkv_router_backend_draining"


# The exemplar label of the router's latency histograms: the request's trace id (hex), which
# Grafana's exemplar links and Prometheus' /api/v1/query_exemplars name.
EXEMPLAR_TRACE_ID: Final = "trace_id"


class MetricLabel(str, Enum):
    """Labels of pushkv's metrics beyond vLLM's own."""

    SIDE = "side"  # "send" (P) | "recv" (D)
    OUTCOME = "outcome"  # done | failed | cancelled | expired (router: ok | error | ...)
    REASON = "reason"  # a FailReason value, or "" when done
    FIRST = "first"  # rendezvous: "registration" | "prefill" arrived first
    PATH = "path"  # "direct" | "ipc" (per target, joined by ",")
    DIRECTION = "direction"  # "sent" | "received"
    MODE = "mode"  # router mode
    ROLE = "role"  # "prefill" | "decode"
    BACKEND = "backend"  # a backend's URL


# (kind, extra labels, help) per metric; kind is "histogram" | "counter" | "gauge".
_L = MetricLabel
METRICS: Final[dict[Metric, tuple[str, tuple[MetricLabel, ...], str]]] = {
    Metric.RENDEZVOUS_WAIT: (
        "histogram",
        (_L.FIRST,),
        "P: first of (registration, prefill done) to the second, by which came first.",
    ),
    Metric.PREPARE: ("histogram", (), "P: block ids to NIXL descriptors."),
    Metric.WRITE: ("histogram", (_L.PATH,), "P: first WRITE posted to last WRITE DONE."),
    Metric.WRITE_THROUGHPUT: ("histogram", (_L.PATH,), "P: bytes per second of WRITE time."),
    Metric.PUSH: ("histogram", (), "P: prompt KV complete to last WRITE DONE."),
    Metric.BYTES: ("histogram", (), "P: bytes written per transfer."),
    Metric.DESCRIPTORS: ("histogram", (), "P: NIXL descriptors per transfer (merged runs)."),
    Metric.KV_WAIT: ("histogram", (), "D: registration sent to last completion counted."),
    Metric.RECOMPUTED: (
        "counter",
        (_L.REASON,),
        "D: requests computed locally (transfer_failed, bad_params).",
    ),
    Metric.TRANSFERS: (
        "counter",
        (_L.SIDE, _L.OUTCOME, _L.REASON),
        "Transfers ended, by side, outcome and FailReason.",
    ),
    Metric.DROPPED: ("counter", (_L.REASON,), "Protocol messages dropped, by reason."),
    Metric.HEARTBEATS: ("counter", (_L.DIRECTION,), "Lease heartbeats (D sends, P receives)."),
    Metric.DOORBELLS: ("counter", (_L.DIRECTION,), "UDP doorbell rings."),
    Metric.REGISTRATIONS_WAITING: ("gauge", (), "P: registrations waiting for their prefill."),
    Metric.PREFILLS_WAITING: ("gauge", (), "P: finished prefills waiting for a registration."),
    Metric.BLOCKS_HELD: ("gauge", (), "P: source blocks held for pushes (sum over ranks)."),
    Metric.OLDEST_HELD: ("gauge", (), "P: age of the oldest held transfer's blocks."),
    Metric.WRITES_IN_FLIGHT: ("gauge", (), "P: transfers with WRITEs in flight (sum)."),
    Metric.AWAITING_KV: ("gauge", (), "D: transfers waiting for their KV."),
    Metric.ROUTER_REQUESTS: (
        "counter",
        (_L.MODE, _L.OUTCOME),
        "Client requests by mode and outcome (ok, cancelled, http_<status>, error).",
    ),
    Metric.ROUTER_RETRIES: (
        "counter",
        (_L.ROLE,),
        "Attempts retried before the first byte, by the failed leg's role.",
    ),
    Metric.ROUTER_DEGRADED: ("counter", (), "Attempts sent to D alone while no P was usable."),
    Metric.ROUTER_LEGS: (
        "counter",
        (_L.ROLE, _L.BACKEND, _L.OUTCOME),
        "Legs ended, by role, backend and outcome (ok, error, cancelled).",
    ),
    Metric.ROUTER_TTFT: ("histogram", (_L.MODE,), "Request in to first token sent (ok only)."),
    Metric.ROUTER_E2E: ("histogram", (_L.MODE,), "Request in to answer complete (ok only)."),
    Metric.ROUTER_OVERHEAD: ("histogram", (_L.MODE,), "Request in to its first leg sent."),
    Metric.ROUTER_BACKEND_HEALTHY: ("gauge", (_L.ROLE, _L.BACKEND), "1 if healthy, else 0."),
    Metric.ROUTER_OUTSTANDING: ("gauge", (_L.ROLE, _L.BACKEND), "Legs in flight per backend."),
    Metric.ROUTER_LOOP_LAG: ("gauge", (), "Worst event-loop lag of the last second."),
    Metric.ROUTER_DRAINING: ("gauge", (_L.ROLE, _L.BACKEND), "1 while drained (no new legs)."),
}

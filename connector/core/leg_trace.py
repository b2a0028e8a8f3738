"""The trace a leg's spans join when its ``kv_transfer_params`` carry none.

pushkv's router puts its request span's ``traceparent`` in both legs. Routers written for
NixlConnector put none there (docs/routers.md): ``vllm-router`` forwards the client's
``traceparent`` / ``tracestate`` *headers* to both legs unchanged, which vLLM hands to the
engine (``Request.trace_headers``) only with its own tracing on. So a leg without one takes,
in order: the request's ``traceparent`` header where vLLM passed it on (P's and D's spans
become children of the client's span), else one derived from the transfer id, which P and
D agree on (core/pairing.py): one trace per request either way, in the second under a
parent span nobody emits (viewers show the trace with its root missing). Pure: dicts in,
dicts out, no vLLM.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from typing import Any, Final

TRACEPARENT_PATTERN: Final = r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$"
_TRACEPARENT: Final = re.compile(TRACEPARENT_PATTERN)
_MAX_TRACESTATE: Final = 512  # kv_params.Tracestate's bound
_DERIVED: Final = b"pushkv.trace:"


def derived_traceparent(transfer_id: str) -> str:
    """A sampled W3C ``traceparent`` that is a function of ``transfer_id`` alone."""
    h = hashlib.sha256(_DERIVED + transfer_id.encode()).hexdigest()
    return f"00-{h[:32]}-{h[32:48]}-01"


def valid_traceparent(value: object) -> bool:
    """W3C version 00-fe, trace and parent ids not all zeros."""
    if not isinstance(value, str) or not _TRACEPARENT.match(value):
        return False
    version, trace_id, span_id, _ = value.split("-")
    return version != "ff" and trace_id.strip("0") != "" and span_id.strip("0") != ""


def with_trace(params: Any, trace_headers: Mapping[str, str] | None) -> Any:
    """``params`` (a leg, after core/pairing.adapt) with a ``traceparent`` when it has none:
    the request's header's if valid, else one derived from its ``transfer_id``. Anything
    that is no leg with a transfer id, or already names a trace, comes back as it is."""
    if not isinstance(params, dict) or params.get("traceparent"):
        return params
    tid = params.get("transfer_id")
    if not isinstance(tid, str) or not (
        params.get("do_remote_decode") or params.get("do_remote_prefill")
    ):
        return params
    headers = trace_headers or {}
    header = headers.get("traceparent")
    if valid_traceparent(header):
        state = headers.get("tracestate") or ""
        out = {**params, "traceparent": header}
        if state and len(state) <= _MAX_TRACESTATE:
            out["tracestate"] = state
        return out
    return {**params, "traceparent": derived_traceparent(tid)}

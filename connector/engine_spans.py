"""Spans the engine emits itself, outside the transfer thread: D's ``first_token``, a leg D
rejected, a hook of ours that raised; and ``engine_tracer``, the tracer of an engine
process.

Owns the spans the scheduler role emits (and the worker role's tracer); the transfer's own
spans are ``connector.transfer.spans``, which the scheduler role must not import (it runs
in EngineCore, where no transfer thread exists). Names and keys come from
``telemetry.schema``; nothing here touches vLLM or NIXL.
"""

from __future__ import annotations

from typing import Any

from connector.core.messages import TraceContext
from telemetry.emit import emit, parent_of
from telemetry.schema import Attr, Event, Outcome, Span


def emit_first_token(
    tracer: Any,
    trace: TraceContext | None,
    *,
    transfer_id: str,
    request_id: str,
    engine_id: str,
    kv_ns: int,
    scheduled_ns: int,
    out_ns: int,
    local_tokens: int,
    error: str | None = None,
) -> None:
    """D: KV complete (as the scheduler learned it) -> first token out of the engine."""
    emit(
        tracer,
        Span.FIRST_TOKEN,
        parent=parent_of(trace),
        start_ns=kv_ns,
        end_ns=out_ns,
        events=[(Event.SCHEDULED, scheduled_ns)],
        attributes={
            **_request_attrs(transfer_id, request_id, engine_id),
            Attr.LOCAL_TOKENS: local_tokens,
        },
        error=error,
    )


def _request_attrs(transfer_id: str, request_id: str, engine_id: str) -> dict[Attr, Any]:
    return {Attr.TRANSFER_ID: transfer_id, Attr.REQUEST_ID: request_id, Attr.ENGINE_ID: engine_id}


def emit_leg_rejected(
    tracer: Any,
    trace: TraceContext | None,
    *,
    transfer_id: str,
    request_id: str,
    engine_id: str,
    peer: str,
    reason: str,
    at_ns: int,
) -> None:
    """D: a decode leg whose P coordinates D does not trust (docs/security.md); D computes
    the prompt itself or refuses it (``untrusted_leg``), and dials nothing. An instant, in
    error, with the reason."""
    if tracer is None:
        return
    emit(
        tracer,
        Span.LEG_REJECTED,
        parent=parent_of(trace),
        start_ns=at_ns,
        end_ns=at_ns,
        attributes={**_request_attrs(transfer_id, request_id, engine_id), Attr.PEER: peer},
        error=reason,
    )


def emit_hook_failed(
    tracer: Any,
    trace: TraceContext | None,
    *,
    hook: str,
    transfer_id: str | None,
    request_id: str,
    engine_id: str,
    at_ns: int,
) -> None:
    """P or D: a hook of ours raised for this request, which was let go of definitely."""
    emit(
        tracer,
        Span.HOOK_FAILED,
        parent=parent_of(trace),
        start_ns=at_ns,
        end_ns=at_ns,
        attributes={
            Attr.TRANSFER_ID: transfer_id,
            Attr.REQUEST_ID: request_id,
            Attr.ENGINE_ID: engine_id,
            Attr.HOOK: hook,
        },
        error=Outcome.HOOK_ERROR.value,
    )


def engine_tracer(engine_id: str, *, producer: bool, host: str = "") -> Any:
    """The tracer of a vLLM engine process (scheduler or worker), or None when tracing is
    off. P's processes are ``pushkv-prefill``, D's ``pushkv-decode`` (OTEL_SERVICE_NAME
    overrides); ``host`` is the address the engine advertises to its peers."""
    from telemetry.schema import Resource, Service
    from telemetry.setup import process_tracer

    service, role = (Service.PREFILL, "prefill") if producer else (Service.DECODE, "decode")
    attributes = {Resource.ENGINE_ID.value: engine_id}
    if host:
        attributes[Resource.HOST_ADDR.value] = host
    return process_tracer(service.value, role=role, attributes=attributes)

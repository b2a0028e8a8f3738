"""Legs from routers written for vLLM's NixlConnector: pairing without a ``transfer_id``.

Owns: how a leg that carries no ``transfer_id`` gets one, the same on P and on D; the
``kv_transfer_params`` P answers such a leg with; and the translation of such routers' D
legs into pushkv's (``tp_size``, P's agent names). Pure: dicts in, dicts out, no vLLM, no
clocks; ``connector/scheduler_side.py`` applies it before ``connector/kv_params.py`` parses
a leg, so the legs' schemas stay the single place that validates them.

Why the request id. ``vllm-router`` (``--vllm-pd-disaggregation --kv-connector nixl``),
llm-d's sidecar and vLLM's example proxies send P ``{do_remote_decode: true}`` with no
``transfer_id``, and send both legs with the same ``X-Request-Id`` header. vLLM (0.26 and
0.32 alike) turns that header X into the engine's request id by decorating it:
``cmpl-X-<prompt index>-<8 random hex>`` for ``/v1/completions``, ``chatcmpl-X-<8 random
hex>`` for ``/v1/chat/completions`` (no random part under
``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION``). P's transfer id is ``request_key`` of its own
request id, which strips those decorations back to X (``X-<i>`` for a list's prompt i > 0,
so that each prompt of a list pairs with its own D request).

D gets one of two things. In the sequential flow (P first, then D with P's answer, as
vllm-router's NixlConnector mode, llm-d's sidecar and vLLM's proxies do) D's leg is P's
answer (``answer_params``) and carries the ``transfer_id`` itself. In vllm-router's push mode
(P's answer said ``transfer_mode: "push"``: every later request is sent to P and D at once)
D's leg carries ``remote_request_id``, the X-Request-Id, and no transfer id. D then applies
``request_key`` to its *own* request id when that id contains X: both engines decorated the
same X the same way but for the random part, which ``request_key`` always strips, so both
sides get the same key even where the decorations are ambiguous (an X that ends like a
decoration, randomization off). Otherwise D uses X itself.

Why an engine reference. vllm-router's push mode forwards to D only P's
``remote_engine_id``, ``remote_host``, ``remote_port`` and ``tp_size``; pushkv's agent names
carry a per-worker incarnation D cannot guess. So P answers ``remote_engine_id`` as
``<engine id>#pushkv:<incarnation of rank 0>.<rank 1>...`` and D turns it back into the
engine id and each rank's agent name. P says ``transfer_mode: "push"`` only when those four
fields are enough (each rank's port is ``remote_port + rank``, the reference fits a name);
otherwise such a router stays in its sequential flow, where D gets P's whole answer.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from typing import Any, Final

import msgspec

from connector.core.messages import Name, TransferId

# vLLM's decorations of an X-Request-Id: the random tail of every engine request id
# (``f"{id}-{random_uuid():.8}"``), and per endpoint a prefix, with the prompt's index after
# the id for completions (``f"cmpl-{X}"``, then ``f"{id}-{i}"``).
_RANDOM_TAIL: Final = re.compile(r"-[0-9a-f]{8}$")
_FIRST_PROMPT: Final = "-0"  # a list's other prompts keep their index: keys stay unique
_PREFIXES: Final = (("cmpl-", True), ("chatcmpl-", False))  # (prefix, indexed per prompt)
# An X-Request-Id shorter than this is not looked for anywhere inside D's own request id
# (only as what its decorations wrap).
_MIN_SHARED_ID: Final = 8
_HASHED: Final = "rid-"  # a key that is no valid transfer id travels as its hash

REF_MARK: Final = "#pushkv:"
_INCARNATION: Final = re.compile(r"^[\w-]*$")
TRANSFER_MODE: Final = "push"


class ForeignLegError(ValueError):
    """A D leg naming P's ranks inconsistently (``remote_engine_id``); says why."""


def request_key(request_id: str) -> str:
    """``request_id`` without what vLLM added to the X-Request-Id it came from."""
    key = _RANDOM_TAIL.sub("", request_id, count=1)
    for prefix, indexed in _PREFIXES:
        if key.startswith(prefix):
            key = key[len(prefix) :]
            if indexed and key.endswith(_FIRST_PROMPT):
                key = key[: -len(_FIRST_PROMPT)]
            break
    return key or request_id


def transfer_id_for(key: str) -> str:
    """``key`` as a transfer id: itself when it is a valid one, else ``rid-`` + its hash."""
    try:
        valid: str = msgspec.convert(key, TransferId)
        return valid
    except msgspec.ValidationError:
        return _HASHED + hashlib.sha256(key.encode()).hexdigest()[:48]


def decode_key(remote_request_id: str, own_request_id: str) -> str:
    """D's pairing key for a leg naming ``remote_request_id`` (the X-Request-Id both legs
    were sent with), given D's own engine request id."""
    own = request_key(own_request_id)
    if len(remote_request_id) >= _MIN_SHARED_ID and remote_request_id in own_request_id:
        return own
    index = own[len(remote_request_id) + 1 :] if own.startswith(remote_request_id + "-") else ""
    return own if own == remote_request_id or index.isdigit() else remote_request_id


def adapt(params: Any, request_id: str) -> tuple[Any, bool]:
    """The leg in ``params`` as pushkv's schemas expect it, and whether its transfer id was
    derived here (a leg from a router written for NixlConnector). ``params`` is not changed;
    anything that is no leg of ours to adapt comes back as it is."""
    if not isinstance(params, dict) or params.get("transfer_id") is not None:
        if isinstance(params, dict) and params.get("do_remote_prefill"):
            return _decode_fields(params), False
        return params, False
    if params.get("do_remote_decode"):
        key = request_key(request_id)
        return {**params, "transfer_id": transfer_id_for(key)}, True
    if params.get("do_remote_prefill"):
        rrid = params.get("remote_request_id")
        if not isinstance(rrid, str) or not rrid:
            return _decode_fields(params), False  # the leg's schema says what is missing
        tid = transfer_id_for(decode_key(rrid, request_id))
        return _decode_fields({**params, "transfer_id": tid}), True
    return params, False


def _decode_fields(params: dict[str, Any]) -> dict[str, Any]:
    """NixlConnector's names for a D leg's fields (``tp_size``, ``pp_size``) and P's engine
    reference."""
    out = dict(params)
    for theirs, ours in (("tp_size", "remote_tp_size"), ("pp_size", "remote_pp_size")):
        if ours not in out and isinstance(out.get(theirs), int):
            out[ours] = out[theirs]
    engine = out.get("remote_engine_id")
    if isinstance(engine, str) and REF_MARK in engine:
        base, _, tail = engine.rpartition(REF_MARK)
        incarnations = tail.split(".")
        tp, pp = out.get("remote_tp_size", 1), out.get("remote_pp_size", 1)
        workers = tp * pp if isinstance(tp, int) and isinstance(pp, int) else tp
        if not base or len(incarnations) != workers:
            stages = f" x remote_pp_size {pp}" if pp != 1 else ""
            raise ForeignLegError(
                f"kv_transfer_params: remote_engine_id {engine!r} names "
                f"{len(incarnations)} ranks for remote_tp_size {tp}{stages}"
            )
        out["remote_engine_id"] = base
        if out.get("remote_agents") is None:
            out["remote_agents"] = [_agent(base, r, inc) for r, inc in enumerate(incarnations)]
    return out


def _agent(engine_id: str, rank: int, incarnation: str) -> str:
    # connector/kv_params.py's agent_name (the unit tests hold the two together).
    base = f"{engine_id}-tp{rank}"
    return f"{base}-{incarnation}" if incarnation else base


def engine_ref(
    engine_id: str, port: int, ports: Sequence[int], agents: Sequence[str]
) -> str | None:
    """P's ``remote_engine_id`` that lets D find every rank from the four fields
    vllm-router forwards; None when they cannot (ports not consecutive, agent names not
    pushkv's, the reference too long)."""
    if ports and any(p != port + r for r, p in enumerate(ports)):
        return None
    incarnations = []
    for rank, agent in enumerate(agents):
        base = f"{engine_id}-tp{rank}"
        inc = agent[len(base) + 1 :] if agent.startswith(base + "-") else None
        if agent == base:
            inc = ""
        if inc is None or not _INCARNATION.match(inc):
            return None
        incarnations.append(inc)
    if not any(incarnations):
        return engine_id
    ref = f"{engine_id}{REF_MARK}{'.'.join(incarnations)}"
    try:
        valid: str = msgspec.convert(ref, Name)
        return valid
    except msgspec.ValidationError:
        return None


def answer_params(coords: Mapping[str, Any], transfer_id: str) -> dict[str, Any]:
    """What P adds to its answer to a leg that came without a ``transfer_id``: a D leg
    whole (the sequential flow hands it to D unchanged) in NixlConnector's field names,
    and ``transfer_mode: "push"`` where its four forwarded fields are enough for D (never
    with pipeline stages on P: D must know how many to wait for, which they do not say)."""
    engine_id: str = coords["engine_id"]
    port: int = coords["port"]
    tp: int = coords["tp_size"]
    pp: int = coords.get("pp_size", 1)
    ports: Sequence[int] = coords.get("ports") or ()
    agents: Sequence[str] = coords.get("agents") or ()
    ref = engine_ref(engine_id, port, ports, agents)
    out: dict[str, Any] = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "transfer_id": transfer_id,
        "remote_engine_id": ref or engine_id,
        "remote_host": coords["host"],
        "remote_port": port,
        "tp_size": tp,
        "remote_tp_size": tp,
    }
    if pp > 1:
        out["pp_size"] = out["remote_pp_size"] = pp
    if ports:
        out["remote_ports"] = list(ports)
    if agents:
        out["remote_agents"] = list(agents)
    if ref is not None and pp == 1:
        out["transfer_mode"] = TRANSFER_MODE
    return out

"""The ``kv_transfer_params`` contract between the router and the connector.

Owns: the strict schemas of the prefill leg (P), the decode leg (D), the probe and P's
answer, and their parsing from the free-form dict vLLM hands over; also the legs of vLLM's
own connectors that the router speaks in its ``pull`` and ``vllm-push`` modes. Pure
(msgspec only): the router builds legs with these structs (each key is spelled once, here),
the scheduler side parses them, and a malformed dict becomes a ``KvParamsError`` with a
message a user can act on, never an engine crash.
Also the trust in a D leg's P coordinates (docs/security.md): the router signs them for
one transfer id with a bounded lifetime (``sign_decode_params``), D checks the signature
or its allowlist (``LegTrust``) before it dials anything.
"""

from __future__ import annotations

import copyreg
from dataclasses import dataclass
from typing import Annotated, Any, Final

import msgspec
from msgspec import UNSET, UnsetType

from connector.core import auth
from connector.core.leg_trace import TRACEPARENT_PATTERN
from connector.core.messages import Host, Name, Port, TpSize, TraceContext, TransferId

Traceparent = Annotated[str, msgspec.Meta(pattern=TRACEPARENT_PATTERN)]
Tracestate = Annotated[str, msgspec.Meta(max_length=512)]


class KvParamsError(ValueError):
    """``kv_transfer_params`` is present but not usable; the message says why."""


# The request field (and answer field) vLLM carries a leg's parameters in.
PARAMS_FIELD: Final = "kv_transfer_params"


def _unset() -> UnsetType:
    return UNSET


# Legs travel pickled in each step's metadata (EngineCore -> workers). UNSET reduces to a
# bare name with no __module__, so pickle looks it up in every loaded module, and a lazy
# one raises on the lookup (transformers' models import torchvision, absent on CPU): every
# leg with an unset field then killed the engine. Reduced by this module's function instead
# (vLLM's pickler keeps copyreg's table).
copyreg.pickle(UnsetType, lambda _: (_unset, ()))


class Leg(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=False):
    """A leg's ``kv_transfer_params``, both ways: the router builds one and sends
    ``params()``; the receiving connector parses the dict back into the same type. A field
    typed ``... | UnsetType = UNSET`` is optional on the wire: left out unless set, so each
    leg carries exactly the keys its sender set. Fields are in the order they travel."""

    def params(self) -> dict[str, Any]:
        """The leg as JSON types, ready for a request body."""
        out: dict[str, Any] = msgspec.to_builtins(self)
        return out


class PrefillLeg(Leg, frozen=True, kw_only=True):
    """P leg: compute the prompt, then push its KV to whoever registers ``transfer_id``."""

    do_remote_decode: bool
    do_remote_prefill: bool = False  # vLLM's legs name both flags
    transfer_id: TransferId
    traceparent: Traceparent | None | UnsetType = UNSET
    tracestate: Tracestate | UnsetType = UNSET
    # The router sends no D leg when P's token ends the request (first token from P): a
    # stop (EOS, a stop token) frees P's blocks at once instead of at the lease's end.
    release_on_stop: bool | UnsetType = UNSET

    def trace(self) -> TraceContext | None:
        return _trace(self.traceparent, self.tracestate)


class DecodeLeg(Leg, frozen=True, kw_only=True):
    """D leg: allocate blocks, register them with P's ranks, decode once all have written."""

    do_remote_prefill: bool
    do_remote_decode: bool = False  # vLLM's legs name both flags
    transfer_id: TransferId
    remote_engine_id: Name
    remote_host: Host
    # P's worker r (its source rank: stage * remote_tp_size + TP rank) listens on
    # remote_ports[r], or remote_port + r
    remote_port: Port
    remote_tp_size: TpSize = 1
    traceparent: Traceparent | None | UnsetType = UNSET
    remote_ports: Annotated[tuple[Port, ...], msgspec.Meta(max_length=4096)] | UnsetType = UNSET
    remote_agents: Annotated[tuple[Name, ...], msgspec.Meta(max_length=4096)] | UnsetType = UNSET
    tracestate: Tracestate | UnsetType = UNSET
    # How many of the prompt's leading tokens P computes (unset: all). The router's first
    # token from P sends D the prompt plus P's token: D loads the prompt, computes the token.
    remote_num_tokens: Annotated[int, msgspec.Meta(ge=1)] | None | UnsetType = UNSET
    # The router's signature over the coordinates and transfer_id (``sign_decode_leg``).
    pushkv_sig: Annotated[str, msgspec.Meta(max_length=128)] | UnsetType = UNSET
    # P's pipeline stages (unset: 1); D waits for each writing TP rank of each stage.
    remote_pp_size: TpSize | UnsetType = UNSET

    @property
    def p_stages(self) -> int:
        return 1 if isinstance(self.remote_pp_size, UnsetType) else self.remote_pp_size

    @property
    def p_workers(self) -> int:
        """P's workers: one per TP rank per pipeline stage."""
        return self.remote_tp_size * self.p_stages

    @property
    def ports(self) -> tuple[int, ...]:
        """Each P worker's listener when P reported them; empty: ``remote_port + r``."""
        return self.remote_ports or ()

    @property
    def agents(self) -> tuple[str, ...]:
        return self.remote_agents or ()

    def covered(self, num_prompt_tokens: int) -> int:
        """The prompt tokens whose KV comes from P."""
        n = self.remote_num_tokens
        return min(n, num_prompt_tokens) if n else num_prompt_tokens

    def port_of(self, p_rank: int) -> int:
        return self.ports[p_rank] if self.ports else self.remote_port + p_rank

    def agent_of(self, p_rank: int) -> str:
        return self.agents[p_rank] if self.agents else agent_name(self.remote_engine_id, p_rank)

    def trace(self) -> TraceContext | None:
        return _trace(self.traceparent, self.tracestate)

    def validate(self) -> None:
        n, what = self.p_workers, f"remote_tp_size {self.remote_tp_size}"
        if self.p_stages > 1:
            what += f" x remote_pp_size {self.p_stages}"
        if self.ports and len(self.ports) != n:
            raise KvParamsError(f"remote_ports has {len(self.ports)} entries for {what}")
        if self.agents and len(self.agents) != n:
            raise KvParamsError(f"remote_agents has {len(self.agents)} entries for {what}")
        if self.p_workers > 4096:
            raise KvParamsError(f"{what} names more than 4096 P workers")
        if not self.ports and self.remote_port + n - 1 > 65535:
            raise KvParamsError(f"remote_port + {what} runs past port 65535")


def _trace(traceparent: str | None | UnsetType, tracestate: str | UnsetType) -> TraceContext | None:
    return TraceContext(traceparent, tracestate or "") if traceparent else None


MIN_SECRET_BYTES = auth.MIN_KEY_BYTES


class UntrustedLeg(KvParamsError):
    """A D leg names P coordinates D may not dial (no valid signature, not allowlisted)."""


def _coords_payload(leg: DecodeLeg) -> bytes:
    # Everything that decides whom D dials, and the transfer it is for (P's stages only
    # where it has several: a signature over a PP 1 leg is what it always was).
    fields: list[Any] = [
        leg.transfer_id,
        leg.remote_engine_id,
        leg.remote_host,
        leg.remote_port,
        leg.remote_tp_size,
        leg.ports,
        leg.agents,
    ]
    if leg.p_stages > 1:
        fields.append(leg.p_stages)
    return msgspec.json.encode(fields)


def sign_decode_leg(leg: DecodeLeg, key: bytes, now_ms: int, ttl_ms: int) -> DecodeLeg:
    """``leg`` with ``pushkv_sig``: valid for ``ttl_ms`` from ``now_ms``."""
    token = auth.sign_token(key, auth.COORDS, _coords_payload(leg), now_ms + ttl_ms)
    return msgspec.structs.replace(leg, pushkv_sig=token)


def sign_decode_params(
    params: dict[str, Any], key: bytes, now_ms: int, ttl_ms: int
) -> dict[str, Any]:
    """``params`` (a D leg as a dict) with ``pushkv_sig``, the other keys as they were."""
    leg = _convert({k: v for k, v in params.items() if k != "pushkv_sig"}, DecodeLeg)
    return {**params, "pushkv_sig": sign_decode_leg(leg, key, now_ms, ttl_ms).pushkv_sig}


@dataclass(frozen=True)
class LegTrust:
    """Which D legs' P coordinates D dials: signed by the router with ``key``, or on
    the ``allowed`` list ("host", or "host:port" for every rank's port). Neither set:
    any (the unauthenticated default)."""

    key: bytes | None = None
    allowed: frozenset[str] = frozenset()

    @property
    def open(self) -> bool:
        return self.key is None and not self.allowed

    def check(self, leg: DecodeLeg, now_ms: int) -> None:
        """Return if D may dial ``leg``'s coordinates; UntrustedLeg saying why not."""
        if self.open or self._allowlisted(leg):
            return
        where = f"{leg.remote_host}:{leg.remote_port}"
        if self.key is None:
            raise UntrustedLeg(f"prefill coordinates {where} are not in trusted_prefill")
        try:
            sig = leg.pushkv_sig or ""
            auth.verify_token(self.key, auth.COORDS, _coords_payload(leg), sig, now_ms)
        except auth.AuthError as exc:
            listed = " and not in trusted_prefill" if self.allowed else ""
            raise UntrustedLeg(
                f"prefill coordinates {where}: no valid router signature ({exc}){listed}"
            ) from None

    def _allowlisted(self, leg: DecodeLeg) -> bool:
        if leg.remote_host in self.allowed:
            return True
        ports = {leg.port_of(r) for r in range(leg.p_workers)}
        return all(f"{leg.remote_host}:{p}" in self.allowed for p in ports)


def agent_name(engine_id: str, rank: int, incarnation: str = "") -> str:
    """The transport agent name of one rank of one engine. Workers add an incarnation
    suffix so a restarted engine never collides with the stale metadata peers may still
    hold under its old name (NIXL refuses to load new metadata for a known name)."""
    base = f"{engine_id}-tp{rank}"
    return f"{base}-{incarnation}" if incarnation else base


def _convert(params: dict[str, Any], cls: type) -> Any:
    try:
        return msgspec.convert(params, cls, strict=True)
    except msgspec.ValidationError as exc:
        raise KvParamsError(f"kv_transfer_params: {exc}") from None


def parse_prefill_leg(params: dict[str, Any] | None) -> PrefillLeg | None:
    """The P leg in ``params``, None if this is no P leg; KvParamsError if malformed."""
    if not isinstance(params, dict) or not params.get("do_remote_decode"):
        return None
    leg = _convert(params, PrefillLeg)
    return leg


def parse_decode_leg(params: dict[str, Any] | None) -> DecodeLeg | None:
    """The D leg in ``params``, None if this is no D leg; KvParamsError if malformed."""
    if not isinstance(params, dict) or not params.get("do_remote_prefill"):
        return None
    leg: DecodeLeg = _convert(params, DecodeLeg)
    leg.validate()
    return leg


def is_probe(params: dict[str, Any] | None) -> bool:
    """The router's probe asks P for its transfer coordinates (see ``Coordinates``)."""
    return isinstance(params, dict) and params.get("pushkv_probe") is True


class ProbeLeg(Leg, frozen=True, kw_only=True):
    """The router's probe of a P: a one-token request P answers with its ``Coordinates``."""

    pushkv_probe: bool = True


class Coordinates(msgspec.Struct, frozen=True, omit_defaults=True):
    """Where a D engine finds one P engine's KV: what P returns to the router's probe (in
    its response's ``kv_transfer_params["pushkv"]``) and what the router puts in D's leg.
    ``ports`` / ``agents`` name each P worker's listener and transport agent when P reports
    them (worker r: pipeline stage r // tp_size, TP rank r % tp_size); empty means worker r
    listens on ``port + r`` under the default agent name. ``pp_size``: P's pipeline stages
    (left out at 1)."""

    engine_id: Name
    host: Host
    port: Port
    tp_size: TpSize
    ports: Annotated[tuple[Port, ...], msgspec.Meta(max_length=4096)] = ()
    agents: Annotated[tuple[Name, ...], msgspec.Meta(max_length=4096)] = ()
    pp_size: TpSize = 1

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = msgspec.to_builtins(self)
        return out

    def validate(self) -> None:
        n = self.tp_size * self.pp_size
        for name, values in (("ports", self.ports), ("agents", self.agents)):
            if values and len(values) != n:
                stages = f" x pp_size {self.pp_size}" if self.pp_size > 1 else ""
                raise KvParamsError(f"{len(values)} {name} for tp_size {self.tp_size}{stages}")


class PrefillAnswer(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """The ``kv_transfer_params`` of pushkv's P answer: its coordinates (to the probe and
    to a P leg) and the leg's ``transfer_id``, or why it refused the transfer."""

    pushkv: Coordinates | UnsetType = UNSET
    transfer_id: str | UnsetType = UNSET
    pushkv_error: str | UnsetType = UNSET


def parse_prefill_answer(params: Any) -> PrefillAnswer:
    """P's answer's ``kv_transfer_params``; KvParamsError if malformed."""
    answer: PrefillAnswer = _convert(params, PrefillAnswer)
    if answer.pushkv:
        answer.pushkv.validate()
    return answer


# -- vLLM's own connectors' legs (the router's ``pull`` and ``vllm-push`` modes) -----------


class VllmPrefillLeg(Leg, frozen=True, kw_only=True):
    """P leg of vLLM's NixlConnector and NixlPushConnector: prefill and keep the KV for D."""

    do_remote_decode: bool = True
    do_remote_prefill: bool = False


class VllmPushDecodeLeg(Leg, frozen=True, kw_only=True):
    """D leg of vLLM's NixlPushConnector, in the order its reference proxy sends it."""

    do_remote_decode: bool = False
    do_remote_prefill: bool = True
    remote_engine_id: str
    remote_host: str
    remote_port: int
    tp_size: int
    pp_size: int = 1
    remote_request_id: str
    transfer_id: str


class VllmPullOverride(Leg, frozen=True, kw_only=True):
    """The keys of P's returned NixlConnector parameters (pull mode's D leg) that the
    router's ``--prefill-*`` flags replace; unset ones stay as P reported them."""

    remote_engine_id: str | UnsetType = UNSET
    remote_host: str | UnsetType = UNSET
    remote_port: int | UnsetType = UNSET
    tp_size: int | UnsetType = UNSET

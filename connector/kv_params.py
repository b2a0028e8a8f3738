"""The ``kv_transfer_params`` contract between the router and the connector.

Owns: the strict schemas of the prefill leg (P), the decode leg (D) and the probe, and
their parsing from the free-form dict vLLM hands over. Pure (msgspec only): the router
builds legs with these structs, the scheduler side parses them, and a malformed dict
becomes a ``KvParamsError`` with a message a user can act on, never an engine crash.
Also the trust in a D leg's P coordinates (docs/security.md): the router signs them for
one transfer id with a bounded lifetime (``sign_decode_params``), D checks the signature
or its allowlist (``LegTrust``) before it dials anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

import msgspec

from connector.core import auth
from connector.core.messages import Host, Name, Port, TpSize, TraceContext, TransferId

Traceparent = Annotated[
    str, msgspec.Meta(pattern=r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")
]
Tracestate = Annotated[str, msgspec.Meta(max_length=512)]


class KvParamsError(ValueError):
    """``kv_transfer_params`` is present but not usable; the message says why."""


class PrefillLeg(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """P leg: compute the prompt, then push its KV to whoever registers ``transfer_id``."""

    do_remote_decode: bool
    transfer_id: TransferId
    traceparent: Traceparent | None = None
    tracestate: Tracestate = ""
    # The router sends no D leg when P's token ends the request (first token from P): a
    # stop (EOS, a stop token) frees P's blocks at once instead of at the lease's end.
    release_on_stop: bool = False

    def trace(self) -> TraceContext | None:
        return TraceContext(self.traceparent, self.tracestate) if self.traceparent else None


class DecodeLeg(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """D leg: allocate blocks, register them with P's ranks, decode once all have written."""

    do_remote_prefill: bool
    transfer_id: TransferId
    remote_engine_id: Name
    remote_host: Host
    remote_port: Port  # rank r of P listens on remote_ports[r], or remote_port + r
    remote_tp_size: TpSize = 1
    remote_ports: Annotated[tuple[Port, ...], msgspec.Meta(max_length=4096)] = ()
    remote_agents: Annotated[tuple[Name, ...], msgspec.Meta(max_length=4096)] = ()
    traceparent: Traceparent | None = None
    tracestate: Tracestate = ""
    # The router's signature over the coordinates and transfer_id (``sign_decode_params``).
    pushkv_sig: Annotated[str, msgspec.Meta(max_length=128)] = ""
    # How many of the prompt's leading tokens P computes (None: all). The router's first
    # token from P sends D the prompt plus P's token: D loads the prompt, computes the token.
    remote_num_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None

    def covered(self, num_prompt_tokens: int) -> int:
        """The prompt tokens whose KV comes from P."""
        n = self.remote_num_tokens
        return num_prompt_tokens if n is None else min(n, num_prompt_tokens)

    def port_of(self, p_rank: int) -> int:
        return self.remote_ports[p_rank] if self.remote_ports else self.remote_port + p_rank

    def agent_of(self, p_rank: int) -> str:
        return (
            self.remote_agents[p_rank]
            if self.remote_agents
            else agent_name(self.remote_engine_id, p_rank)
        )

    def trace(self) -> TraceContext | None:
        return TraceContext(self.traceparent, self.tracestate) if self.traceparent else None

    def validate(self) -> None:
        if self.remote_ports and len(self.remote_ports) != self.remote_tp_size:
            raise KvParamsError(
                f"remote_ports has {len(self.remote_ports)} entries for "
                f"remote_tp_size {self.remote_tp_size}"
            )
        if self.remote_agents and len(self.remote_agents) != self.remote_tp_size:
            raise KvParamsError(
                f"remote_agents has {len(self.remote_agents)} entries for "
                f"remote_tp_size {self.remote_tp_size}"
            )
        if not self.remote_ports and self.remote_port + self.remote_tp_size - 1 > 65535:
            raise KvParamsError("remote_port + remote_tp_size runs past port 65535")


MIN_SECRET_BYTES = auth.MIN_KEY_BYTES


class UntrustedLeg(KvParamsError):
    """A D leg names P coordinates D may not dial (no valid signature, not allowlisted)."""


def _coords_payload(leg: DecodeLeg) -> bytes:
    # Everything that decides whom D dials, and the transfer it is for.
    return msgspec.json.encode(
        [
            leg.transfer_id,
            leg.remote_engine_id,
            leg.remote_host,
            leg.remote_port,
            leg.remote_tp_size,
            leg.remote_ports,
            leg.remote_agents,
        ]
    )


def sign_decode_params(
    params: dict[str, Any], key: bytes, now_ms: int, ttl_ms: int
) -> dict[str, Any]:
    """``params`` (a D leg) with ``pushkv_sig``: valid for ``ttl_ms`` from ``now_ms``."""
    leg = _convert({k: v for k, v in params.items() if k != "pushkv_sig"}, DecodeLeg)
    token = auth.sign_token(key, auth.COORDS, _coords_payload(leg), now_ms + ttl_ms)
    return {**params, "pushkv_sig": token}


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
            auth.verify_token(self.key, auth.COORDS, _coords_payload(leg), leg.pushkv_sig, now_ms)
        except auth.AuthError as exc:
            listed = " and not in trusted_prefill" if self.allowed else ""
            raise UntrustedLeg(
                f"prefill coordinates {where}: no valid router signature ({exc}){listed}"
            ) from None

    def _allowlisted(self, leg: DecodeLeg) -> bool:
        if leg.remote_host in self.allowed:
            return True
        ports = {leg.port_of(r) for r in range(leg.remote_tp_size)}
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


class Coordinates(msgspec.Struct, frozen=True):
    """Where a D engine finds one P engine's KV: what P returns to the router's probe (in
    its response's ``kv_transfer_params["pushkv"]``) and what the router puts in D's leg.
    ``ports`` / ``agents`` name each P rank's listener and transport agent when P reports
    them; empty means rank r listens on ``port + r`` under the default agent name."""

    engine_id: str
    host: str
    port: int
    tp_size: int
    ports: tuple[int, ...] = ()
    agents: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "engine_id": self.engine_id,
            "host": self.host,
            "port": self.port,
            "tp_size": self.tp_size,
        }
        if self.ports:
            out["ports"] = list(self.ports)
        if self.agents:
            out["agents"] = list(self.agents)
        return out

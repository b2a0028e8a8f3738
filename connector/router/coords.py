"""Where D reaches one P's KV, and what an operator's ``--prefill-*`` flags change of it.

Owns: ``PrefillCoords`` (the connector's own ``Coordinates``, so the router and the scheduler
role cannot drift apart) and ``CoordOverride`` (the flags of one P, applied over a probe).

Must not import: httpx, starlette, uvicorn, vLLM, NIXL (plain data, read by the CLI).
"""

from __future__ import annotations

from dataclasses import dataclass

from msgspec import structs

from connector.kv_params import Coordinates

PrefillCoords = Coordinates


@dataclass(frozen=True)
class CoordOverride:
    """The ``--prefill-*`` flags of one P. A field left ``None`` comes from the probe;
    ``pp_size`` (P's pipeline stages) from the probe too, or 1 when the other four are set
    and no probe runs."""

    engine_id: str | None = None
    host: str | None = None
    port: int | None = None
    tp_size: int | None = None
    pp_size: int | None = None

    @property
    def complete(self) -> bool:
        """engine id, host, port and TP size set: no probe is needed for this P."""
        return None not in (self.engine_id, self.host, self.port, self.tp_size)

    @property
    def empty(self) -> bool:
        return self == CoordOverride()

    def apply(self, probed: PrefillCoords | None) -> PrefillCoords | None:
        """Flags win over what the probe learned; ``None`` if something is still unknown."""
        e, h, p, t = self.engine_id, self.host, self.port, self.tp_size
        if e is not None and h is not None and p is not None and t is not None:
            return PrefillCoords(e, h, p, t, pp_size=self.pp_size or 1)
        if probed is None:
            return None
        out = structs.replace(
            probed,
            **{
                k: v
                for k, v in (
                    ("engine_id", self.engine_id),
                    ("host", self.host),
                    ("port", self.port),
                    ("tp_size", self.tp_size),
                    ("pp_size", self.pp_size),
                )
                if v is not None
            },
        )
        # Per-rank lists that a changed field invalidates: ports follow the port, agent
        # names the engine id, and both the number of workers (TP size x stages).
        workers = out.tp_size * out.pp_size != probed.tp_size * probed.pp_size
        if out.port != probed.port or workers:
            out = structs.replace(out, ports=())
        if out.engine_id != probed.engine_id or workers:
            out = structs.replace(out, agents=())
        return out

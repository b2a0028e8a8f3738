"""The router's configuration: one validated, frozen ``RouterConfig``, and its CLI parser.

Owns: ``Mode``, ``FirstToken``, ``RouterConfig`` and ``parse_args`` (one P's ``--prefill-*``
flags become a ``connector.router.coords.CoordOverride``). Nothing else in the router reads
raw flags.

Must not import: httpx, starlette, uvicorn, vLLM, NIXL (this is plain data; the CLI parses
it before anything heavy is imported).
"""

from __future__ import annotations

import argparse
import enum
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from connector.core.errors import ConfigError
from connector.kv_params import MIN_SECRET_BYTES
from connector.router import choice_args
from connector.router.chooser import Policy
from connector.router.coords import CoordOverride

# Environment variables the router reads (docs/security.md): secrets stay off command lines.
ENV_API_KEY = "PUSHKV_ROUTER_API_KEY"
ENV_BACKEND_API_KEY = "PUSHKV_BACKEND_API_KEY"
ENV_AUTH_SECRET = "PUSHKV_AUTH_SECRET"


class Mode(enum.Enum):
    """Which connector the P and D servers run, hence how the two legs are built and sent."""

    PUSH = "push"  # pushkv's PushConnector: legs at the same moment, coordinates probed
    VLLM_PUSH = (
        "vllm-push"  # vLLM's NixlPushConnector: legs at the same moment, coordinates from flags
    )
    PULL = "pull"  # vLLM's NixlConnector: P first, then D with P's returned kv_transfer_params


class FirstToken(enum.Enum):
    """Who gives the client its first token (connector/router/first_token.py)."""

    DECODE = "decode"  # D, after the KV is in and its first step ran
    PREFILL = "prefill"  # P, the moment it answers; D continues from token 2


def check_url(url: str) -> str:
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"backend URL must start with http:// or https://, got {url!r}")
    return url.rstrip("/")


@dataclass(frozen=True)
class RouterConfig:
    """Everything the router needs; validated once, here."""

    prefill_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    mode: Mode = Mode.PUSH
    # push mode only; a request first_token.blocker refuses runs as with DECODE.
    first_token: FirstToken = FirstToken.DECODE
    host: str = "127.0.0.1"
    port: int = 8000
    # One per prefill URL (empty tuple: no overrides anywhere).
    prefill_overrides: tuple[CoordOverride, ...] = ()
    timeout_s: float = 300.0  # per leg: P's whole leg; D's time to headers and between bytes
    connect_timeout_s: float = 5.0
    health_interval_s: float = 2.0
    health_timeout_s: float = 1.0
    probe_timeout_s: float = 30.0
    # Per backend. Each routed request holds one connection to its P and one to its D; the
    # head-room over ~64 concurrent requests covers health checks, probes and /v1/models.
    max_connections: int = 80
    # An idle pooled connection is dropped after this long: below the servers' own keep-alive
    # timeout (uvicorn's and vLLM's default, 5 s), so the router never sends a leg down a
    # connection the server is closing at that moment (httpx's default is also 5 s); above
    # health_interval_s, so each health check reuses its connection instead of opening one.
    keepalive_expiry_s: float = 4.0
    # Attempts per client request: a leg failing before the client got a byte is retried on
    # another D (or P), with a fresh transfer_id; 1 disables retries.
    max_attempts: int = 2
    # While no P is usable, send each request to a D whole (D computes the prompt): losing
    # every P costs latency, not availability. False: answer 503 instead.
    degraded: bool = True
    # SIGTERM: refuse new requests (/health 503 "draining"), let those in flight finish
    # for up to this long, then exit (connector/router/serve.py).
    drain_timeout_s: float = 30.0
    log_level: str = "info"
    realtime_priority: int = 0  # SCHED_FIFO priority of the router's threads; 0: normal class
    # Security (docs/security.md): the key clients must send (Bearer), the key the router
    # sends the backends, the P/D plane's shared secret (signs P's coordinates in D's leg)
    # and how long such a signature stays valid.
    api_key: str | None = field(default=None, repr=False)
    backend_api_key: str | None = field(default=None, repr=False)
    auth_secret: bytes | None = field(default=None, repr=False)
    coords_ttl_s: float = 60.0
    # Backend choice (connector/router/chooser.py): the policy, how often the engines'
    # /metrics are read for it (signals older than 3 intervals are ignored), the prefix
    # policy's block size and how far above the least-loaded backend a prefix holder may be.
    policy: Policy = Policy.LEAST_LOAD
    signals_interval_s: float = 1.0
    prefix_block_chars: int = 64
    max_imbalance: float = 4.0
    # Membership from a watched file (connector/router/discovery.py), re-read this often.
    members_file: str | None = None
    members_interval_s: float = 5.0

    def __post_init__(self) -> None:
        if not self.members_file:
            if not self.prefill_urls:
                raise ConfigError("at least one --prefill URL (or a --members-file) is required")
            if not self.decode_urls:
                raise ConfigError("at least one --decode URL (or a --members-file) is required")
        elif self.mode is Mode.VLLM_PUSH:
            raise ConfigError("--members-file cannot give --mode vllm-push its P coordinates")
        object.__setattr__(self, "prefill_urls", tuple(check_url(u) for u in self.prefill_urls))
        object.__setattr__(self, "decode_urls", tuple(check_url(u) for u in self.decode_urls))
        overrides = self.prefill_overrides or tuple(CoordOverride() for _ in self.prefill_urls)
        if len(overrides) != len(self.prefill_urls):
            raise ConfigError(
                f"{len(overrides)} prefill overrides for {len(self.prefill_urls)} prefill URLs"
            )
        object.__setattr__(self, "prefill_overrides", tuple(overrides))
        for name in (
            "timeout_s",
            "connect_timeout_s",
            "health_interval_s",
            "health_timeout_s",
            "probe_timeout_s",
            "keepalive_expiry_s",
            "coords_ttl_s",
            "drain_timeout_s",
            "signals_interval_s",
            "members_interval_s",
        ):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.auth_secret is not None and len(self.auth_secret) < MIN_SECRET_BYTES:
            raise ConfigError(f"the P/D secret needs at least {MIN_SECRET_BYTES} bytes")
        if self.prefix_block_chars < 1:
            raise ConfigError(f"--prefix-block-chars must be >= 1, got {self.prefix_block_chars}")
        if self.max_imbalance < 0:
            raise ConfigError(f"--max-imbalance must be >= 0, got {self.max_imbalance}")
        if self.max_connections < 1:
            raise ConfigError("max_connections must be >= 1")
        if self.max_attempts < 1:
            raise ConfigError(f"max_attempts must be >= 1, got {self.max_attempts!r}")
        if not 0 <= self.realtime_priority <= 99:
            raise ConfigError(f"--realtime-priority must be 0-99, got {self.realtime_priority}")
        for o in self.prefill_overrides:
            if o.port is not None and not 0 < o.port < 65536:
                raise ConfigError(f"--prefill-kv-port out of range: {o.port}")
            if o.tp_size is not None and o.tp_size < 1:
                raise ConfigError(f"--prefill-tp-size must be >= 1: {o.tp_size}")
            if o.pp_size is not None and o.pp_size < 1:
                raise ConfigError(f"--prefill-pp-size must be >= 1: {o.pp_size}")
            if o.pp_size not in (None, 1) and self.mode is not Mode.PUSH:
                # vLLM's legs carry no stage count: only pushkv's D waits per stage.
                raise ConfigError("--prefill-pp-size above 1 needs --mode push")
        if self.first_token is FirstToken.PREFILL and self.mode is not Mode.PUSH:
            raise ConfigError("--first-token prefill needs --mode push")
        if self.mode is Mode.VLLM_PUSH:
            # vLLM's push D reads these by index (a missing key kills its EngineCore), and
            # NixlPushConnector has no probe: they must come from the flags.
            missing = [
                url
                for url, o in zip(self.prefill_urls, self.prefill_overrides, strict=True)
                if not o.complete
            ]
            if missing:
                raise ConfigError(
                    "--mode vllm-push needs --prefill-engine-id, --prefill-kv-host and "
                    f"--prefill-kv-port for every prefill server; incomplete for {missing}"
                )


def _broadcast(name: str, values: Sequence[object] | None, n: int) -> list[object | None]:
    """One value per --prefill URL, or one for all."""
    if not values:
        return [None] * n
    if len(values) == 1:
        return list(values) * n
    if len(values) != n:
        raise ConfigError(
            f"--{name}: give one value, or one per --prefill URL ({n}); got {len(values)}"
        )
    return list(values)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pushkv router",
        description="OpenAI-compatible front for disaggregated prefill (P) / decode (D) vLLM "
        "servers: picks D before prefill, sends both legs, streams D's answer.",
    )
    p.add_argument(
        "--prefill",
        nargs="+",
        metavar="URL",
        help="base URL of each prefill vLLM server (http://host:port); required unless "
        "--members-file lists them",
    )
    p.add_argument(
        "--decode",
        nargs="+",
        metavar="URL",
        help="base URL of each decode vLLM server",
    )
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--mode", choices=[m.value for m in Mode], default=Mode.PUSH.value)
    p.add_argument(
        "--first-token",
        choices=[f.value for f in FirstToken],
        default=FirstToken.DECODE.value,
        help="prefill: stream P's token at once, D continues from it (docs/operations.md)",
    )
    g = p.add_argument_group(
        "prefill transfer coordinates (override the probe; one value "
        "per --prefill URL or one for all)"
    )
    g.add_argument("--prefill-engine-id", nargs="+", metavar="ID")
    g.add_argument("--prefill-kv-host", nargs="+", metavar="HOST")
    g.add_argument("--prefill-kv-port", nargs="+", type=int, metavar="PORT")
    g.add_argument("--prefill-tp-size", nargs="+", type=int, metavar="N")
    g.add_argument(
        "--prefill-pp-size",
        nargs="+",
        type=int,
        metavar="N",
        help="P's pipeline stages (default: the probe's answer, or 1 without a probe)",
    )
    p.add_argument("--timeout", type=float, default=300.0, help="per-leg timeout, s")
    p.add_argument("--connect-timeout", type=float, default=5.0)
    p.add_argument("--health-interval", type=float, default=2.0)
    p.add_argument("--health-timeout", type=float, default=1.0)
    p.add_argument("--probe-timeout", type=float, default=30.0)
    p.add_argument("--max-connections", type=int, default=80, help="per backend")
    p.add_argument(
        "--max-attempts",
        type=int,
        default=2,
        help="attempts per request before its first byte (1: no retry)",
    )
    p.add_argument(
        "--degraded",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="while no P is healthy, send requests to D whole (D computes the prompt)",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="on SIGTERM, refuse new requests and let those in flight finish for up to S s",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument(
        "--realtime-priority",
        type=int,
        default=0,
        metavar="N",
        help="run the router at SCHED_FIFO priority N (1-99; needs root or CAP_SYS_NICE), "
        "so requests do not wait for a core the engines hold (0: the normal class)",
    )
    choice_args.add_to(p)
    s = p.add_argument_group("security (docs/security.md)")
    s.add_argument(
        "--api-key",
        metavar="KEY",
        help=f"clients must send 'Authorization: Bearer KEY' (every route but /health); "
        f"default ${ENV_API_KEY}, which keeps it off the command line",
    )
    s.add_argument(
        "--backend-api-key-file",
        metavar="PATH",
        help=f"file holding the backends' vLLM --api-key (default ${ENV_BACKEND_API_KEY})",
    )
    s.add_argument(
        "--auth-secret-file",
        metavar="PATH",
        help=f"file holding the P/D plane's shared secret, to sign P's coordinates in D's "
        f"leg (default ${ENV_AUTH_SECRET})",
    )
    s.add_argument("--coords-ttl", type=float, default=60.0, help="lifetime of those signatures, s")
    return p


def _secret(path: str | None, env: str) -> str | None:
    """A secret from ``path``'s file, else from ``$env``; None if neither is set."""
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                return f.read().strip() or None
        except OSError as exc:
            raise ConfigError(f"cannot read {path}: {exc}") from None
    return os.environ.get(env) or None


def parse_args(argv: Sequence[str]) -> RouterConfig:
    """Parse the arguments after ``pushkv router``. Exits (argparse's way) on bad input."""
    parser = build_parser()
    a = parser.parse_args(list(argv))
    try:
        prefill, decode = a.prefill or [], a.decode or []
        n = len(prefill)
        ids = _broadcast("prefill-engine-id", a.prefill_engine_id, n)
        hosts = _broadcast("prefill-kv-host", a.prefill_kv_host, n)
        ports = _broadcast("prefill-kv-port", a.prefill_kv_port, n)
        tps = _broadcast("prefill-tp-size", a.prefill_tp_size, n)
        pps = _broadcast("prefill-pp-size", a.prefill_pp_size, n)
        mode = Mode(a.mode)
        overrides = []
        for i in range(n):
            tp = tps[i]
            if mode is Mode.VLLM_PUSH and tp is None:
                tp = 1  # vLLM's own proxy defaults --prefill-tp-size to 1 as well
            overrides.append(
                CoordOverride(ids[i], hosts[i], ports[i], tp, pps[i])  # type: ignore[arg-type]
            )
        return RouterConfig(
            prefill_urls=tuple(prefill),
            decode_urls=tuple(decode),
            mode=mode,
            first_token=FirstToken(a.first_token),
            host=a.host,
            port=a.port,
            prefill_overrides=tuple(overrides),
            timeout_s=a.timeout,
            connect_timeout_s=a.connect_timeout,
            health_interval_s=a.health_interval,
            health_timeout_s=a.health_timeout,
            probe_timeout_s=a.probe_timeout,
            max_connections=a.max_connections,
            max_attempts=a.max_attempts,
            degraded=a.degraded,
            drain_timeout_s=a.drain_timeout,
            log_level=a.log_level,
            realtime_priority=a.realtime_priority,
            api_key=a.api_key or os.environ.get(ENV_API_KEY) or None,
            backend_api_key=_secret(a.backend_api_key_file, ENV_BACKEND_API_KEY),
            auth_secret=(
                s.encode() if (s := _secret(a.auth_secret_file, ENV_AUTH_SECRET)) else None
            ),
            coords_ttl_s=a.coords_ttl,
            **choice_args.config_of(a),
        )
    except ConfigError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits

"""``kv_connector_extra_config`` parsed once into a validated, frozen ``PushkvConfig``.

Owns: every pushkv knob, its default and its check. No other module reads raw config
dicts or environment variables for pushkv settings. Pure (msgspec and the pure polling policy
only), except ``load_secret``, which reads the secret's file or environment variable.
"""

from __future__ import annotations

import os
from typing import Annotated, Any, Literal

import msgspec

from connector.core.auth import MIN_KEY_BYTES
from connector.core.errors import ConfigError
from connector.core.state import ReceiverPolicy, SenderPolicy

Seconds = Annotated[float, msgspec.Meta(gt=0, le=24 * 3600)]


def _s(ns: int) -> float:
    """A protocol policy's default in seconds: each timing knob has its one default in
    ``connector.core.state``'s policies, which this config only converts."""
    return ns / 1e9


class Faults(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Test-only fault injection (``_faults``; docs/operations.md#fault-injection-test-only).
    Each fault hits the requests whose prompt has exactly that many tokens; 0 is off."""

    fail_write_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0  # P: the WRITE's post fails
    drop_completion_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0  # D: first `done` lost
    # P: the WRITE is held (in flight, not posted) until D's cancel for it arrives, or
    # hold_write_s after it was issued; then it is posted.
    hold_write_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0
    hold_write_s: Annotated[float, msgspec.Meta(gt=0, le=60)] = 0.4
    # D: the blocks of such a transfer that D aborted are filled with a pattern when D
    # frees them, and checked until no WRITE may land any more (D's own bound).
    check_freed_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0
    # D: one byte of such a transfer's KV flipped once it landed, before D reads its `done`
    # (with kv_checksum_every, D must fail the load: checksum_mismatch). KV in DRAM only.
    flip_kv_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0
    raise_hook: str = ""  # a scheduler hook of PushConnector that raises...
    raise_hook_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0  # ...for these requests

    def raises(self, hook: str, request: Any) -> bool:
        return (
            hook == self.raise_hook
            and getattr(request, "num_prompt_tokens", -1) == self.raise_hook_tokens
        )


class PushkvConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    # Where this instance's ranks listen for metadata (NIXL side channel). Rank r uses
    # side_channel_port + r; 0 picks free ports (published to the router by the probe).
    side_channel_host: str = "127.0.0.1"
    side_channel_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0
    # P: how long finished blocks wait for D's registration (renewed by heartbeats).
    lease_s: Seconds = _s(SenderPolicy.lease_ns)
    # P: longest a registration may wait for the prefill it names.
    max_registration_ttl_s: Seconds = _s(SenderPolicy.max_registration_ttl_ns)
    # P: a WRITE running longer than this is cancelled and reported failed. D sends its own
    # value in each registration and P applies the shorter, so D knows when a WRITE into
    # its blocks has ended at the latest.
    write_timeout_s: Seconds = _s(SenderPolicy.write_timeout_ns)
    # D: from registration to the last completion; then D cancels and fails the load. P
    # posts no WRITE after it (each registration says how much of it is left).
    receive_timeout_s: Seconds = _s(ReceiverPolicy.timeout_ns)
    # D: a P rank that never answers a cancel is given up this long after the latest moment
    # its WRITE could end (receive deadline + write_timeout_s): the margin for a message's
    # one-way delay and an aborted WRITE's wind-down. An answer ends the wait at once.
    grace_s: Seconds = _s(ReceiverPolicy.grace_ns)
    # D: how often it renews P's leases while it waits; P answers a heartbeat for a transfer
    # it already ended, so this also bounds how long a lost `done` or `fail` costs D, and
    # a P whose process died is known as gone at the next one (the send is refused), so
    # its transfers end with peer_lost within this of the death. One notification per P
    # agent per heartbeat, batched, and only while D waits.
    heartbeat_s: Seconds = _s(ReceiverPolicy.heartbeat_interval_ns)
    # Dialing a peer's side channel (metadata exchange) gives up after this long.
    dial_timeout_s: Seconds = 10.0
    # Transfer-thread polling: fast while our own work needs progress (a WRITE in flight,
    # a dial), slow when idle. Idle is off the critical path: an engine event wakes the
    # thread at once, and a transfer in progress switches it to fast polling.
    poll_hot_max_s: Annotated[float, msgspec.Meta(gt=0, le=0.1)] = 0.001
    poll_idle_s: Annotated[float, msgspec.Meta(gt=0, le=1.0)] = 0.05
    # Idle with a doorbell: every peer's news rings, and an engine event wakes the thread, so
    # the idle poll only catches a peer without doorbells (whose registration P then takes
    # up at its own prefill's end at the latest). Each idle poll is a round of UCX progress,
    # cheap at this interval (docs/benchmarks.md, "Measurements behind the defaults"). Not
    # longer: a new peer's first message needs a few rounds of our progress for UCX's
    # wire-up, and its bell rings before the first of them.
    # The thread still wakes for every lease, deadline and heartbeat on time (_until_due).
    poll_idle_bell_s: Annotated[float, msgspec.Meta(gt=0, le=60.0)] = 0.5
    # Doorbells (connector/transfer/doorbell.py): a peer that sends us something also sends a UDP
    # datagram to our side-channel port number, so a thread that only waits on its peer
    # (D for its KV, P for a registration) sleeps until then instead of polling every
    # poll_hot_max_s; it still polls every poll_bell_fallback_s, so a lost bell, a
    # firewalled UDP port or a peer without doorbells costs latency, never a transfer.
    doorbells: bool = True
    poll_bell_fallback_s: Annotated[float, msgspec.Meta(gt=0, le=1.0)] = 0.005
    # D, once every P rank it waits on has rung it before: their WRITEs and completions
    # ring too, so this poll only covers a dropped datagram, and D's polls stay off the core
    # of its decode steps (``python -m bench.poll_cost``).
    poll_bell_trusted_s: Annotated[float, msgspec.Meta(gt=0, le=1.0)] = 0.05
    # D, while a P's WRITE into it is in flight: over TCP it completes only after D's UCX
    # progress took the bytes in (connector/transfer/polling.py); P rings again when it is DONE.
    # A steady poll costs D less CPU per transfer than hot polling, for a little latency
    # (``python -m bench.poll_cost`` prints both).
    poll_incoming_s: Annotated[float, msgspec.Meta(gt=0, le=0.1)] = 0.00025
    # An engine step that schedules nothing while a transfer is in progress (D waiting for
    # KV, P writing) waits up to this long for the transfer to end before it returns:
    # vLLM's engine otherwise runs such empty steps back to back, which on a small host
    # takes the CPU from P's prefill and D's API server. It returns as soon as
    # a result is in, so it never delays one of its rank's; a rank with none of its own (MLA's
    # P ranks past 0) sleeps it whole, so the step may end up to this long after another
    # rank's result. 0 turns it off.
    idle_step_wait_s: Annotated[float, msgspec.Meta(ge=0, le=0.1)] = 0.005
    tombstone_s: Seconds = _s(SenderPolicy.tombstone_ns)
    # Shutdown (vLLM's SIGTERM with --shutdown-timeout N > 0: it stops taking requests and
    # steps until the ones in flight end). WRITEs already posted or ready run to their end;
    # this long after the signal (at most half of N), every transfer still waiting (P: for
    # D's registration or its own prefill; D: for its KV) ends with reason "shutdown", its
    # peer told at once: D recomputes (or fails the leg, which the router retries) instead
    # of waiting for its receive timeout, and P's blocks go back (connector/shutdown.py).
    shutdown_grace_s: Annotated[float, msgspec.Meta(ge=0, le=3600)] = 2.0
    # At the connector's own shutdown (the engine's loop has ended): how long its transfer
    # thread may take to finish WRITEs in flight and hear its peers' answers to the
    # cancels and fails it sends for everything still waiting.
    shutdown_drain_s: Annotated[float, msgspec.Meta(ge=0, le=600)] = 5.0
    # GPU only: how P moves KV into a D on its own node. "auto" picks per transfer between
    # NIXL descriptors and a copy kernel into D's KV mapped through CUDA IPC
    # (connector/core/xfer_path.py: the kernel moves scattered blocks near the contiguous
    # rate, descriptors far below it; docs/benchmarks.md); "direct" always uses descriptors;
    # "ipc" copies whenever D's KV can be mapped (benchmarks, tests).
    xfer_paths: Literal["auto", "direct", "ipc"] = "auto"
    # Security (docs/security.md). The P/D plane's shared secret: a file holding it, the
    # name of an environment variable holding it, or (only where this config is not on a
    # command line) the secret itself. Unset: the P/D plane is unauthenticated.
    auth_secret_file: str = ""
    auth_secret_env: str = ""
    auth_secret: str = ""
    # How old (or, for clock skew, how far ahead) a sealed message may be; also how long
    # its stamp is remembered against replays. Longer than write_timeout_s: a completion
    # is sealed when its WRITE is posted.
    auth_window_s: Seconds = 120.0
    # D: P addresses it dials without the router's signature ("host" or "host:port").
    trusted_prefill: tuple[str, ...] = ()
    # D: a decode leg naming P coordinates D may not dial (above) is never dialed; it is
    # "recompute"d here (the reason in the response's kv_transfer_params), or "refuse"d:
    # reported as a failed load, which vLLM ends with an error (needs
    # kv_load_failure_policy "fail"; vLLM's connector API gives no 4xx).
    untrusted_leg: Literal["recompute", "refuse"] = "recompute"
    # Transfer metrics for vLLM's /metrics (connector/stats.py, connector/transfer/metrics.py).
    # False: nothing is recorded or reported (measures their cost: ``pushkv bench``).
    metrics: bool = True
    # KV integrity (docs/operations.md#kv-integrity): P sends a digest of the KV it pushes
    # with one transfer in this many (1: every one; 0: off): CRC-32 between host memories,
    # a device-side weighted sum (wsum64) where either side's KV is in GPU memory; D, with
    # it above 0, checks each digest it gets and fails a load whose blocks differ
    # (checksum_mismatch): vLLM's kv_load_failure_policy then recomputes or fails the request.
    kv_checksum_every: Annotated[int, msgspec.Meta(ge=0)] = 0

    def __repr__(self) -> str:  # never print an inline secret in a log line
        fields = msgspec.structs.asdict(self)
        if fields["auth_secret"]:
            fields["auth_secret"] = "<hidden>"
        return f"PushkvConfig({', '.join(f'{k}={v!r}' for k, v in fields.items())})"

    @property
    def authenticated(self) -> bool:
        return bool(self.auth_secret_file or self.auth_secret_env or self.auth_secret)

    # Test-only: inject faults on a real engine (pushkv_testing/faults.py). Absent in
    # production, where nothing is wrapped and nothing costs.
    faults: Faults | None = msgspec.field(default=None, name="_faults")

    def idle_poll_s(self, doorbell: bool) -> float:
        """The transfer thread's idle poll: long with a doorbell, short without."""
        return self.poll_idle_bell_s if doorbell else self.poll_idle_s

    def sender_policy(self) -> SenderPolicy:
        return SenderPolicy(
            lease_ns=_ns(self.lease_s),
            max_registration_ttl_ns=_ns(self.max_registration_ttl_s),
            write_timeout_ns=_ns(self.write_timeout_s),
            tombstone_ns=_ns(self.tombstone_s),
        )

    def receiver_policy(self) -> ReceiverPolicy:
        return ReceiverPolicy(
            timeout_ns=_ns(self.receive_timeout_s),
            grace_ns=_ns(self.grace_s),
            write_timeout_ns=_ns(self.write_timeout_s),
            heartbeat_interval_ns=_ns(self.heartbeat_s),
            tombstone_ns=_ns(self.tombstone_s),
        )


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def parse_config(extra: dict[str, Any] | None) -> PushkvConfig:
    """Validate ``kv_connector_extra_config``; unknown keys are errors (typos must show)."""
    try:
        cfg = msgspec.convert(extra or {}, PushkvConfig, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"kv_connector_extra_config: {exc}") from None
    if cfg.heartbeat_s >= cfg.lease_s:
        raise ConfigError(
            "heartbeat_s must be shorter than lease_s, or P's lease expires between heartbeats"
        )
    if cfg.write_timeout_s >= cfg.receive_timeout_s:
        raise ConfigError(
            "write_timeout_s must be shorter than receive_timeout_s, so P answers before D gives up"
        )
    load_secret(cfg)  # a missing file or variable must show at start-up
    if cfg.untrusted_leg == "refuse" and not (cfg.authenticated or cfg.trusted_prefill):
        raise ConfigError(
            "untrusted_leg: refuse needs a secret or trusted_prefill (without either, D "
            "trusts every leg and refuses none)"
        )
    if cfg.auth_window_s <= cfg.write_timeout_s:
        raise ConfigError("auth_window_s must be longer than write_timeout_s")
    return cfg


def check_failure_policy(cfg: PushkvConfig, kv_load_failure_policy: str, consumer: bool) -> None:
    """``untrusted_leg: refuse`` on D fails the refused leg's load, which vLLM turns into an
    error only under ``kv_load_failure_policy: fail`` (under "recompute" it would compute
    the request, silently not refusing it)."""
    if consumer and cfg.untrusted_leg == "refuse" and kv_load_failure_policy != "fail":
        raise ConfigError(
            f"untrusted_leg: refuse needs kv_load_failure_policy 'fail' on D, not "
            f"{kv_load_failure_policy!r} (vLLM recomputes a failed load under 'recompute')"
        )


def check_parallelism(pp_size: int, consumer: bool) -> None:
    """Pipeline stages on P are pushed (each stage writes its layers); on D pushkv has no
    way to take them: D's ranks would each wait for every layer while holding only their
    stage's (vLLM's own NixlPushConnector refuses a PP consumer too)."""
    if consumer and pp_size > 1:
        raise ConfigError(
            f"pushkv does not support pipeline parallelism on D (kv_consumer or kv_both; "
            f"--pipeline-parallel-size {pp_size}): start D with --pipeline-parallel-size 1 "
            "(--tensor-parallel-size or more D instances for capacity); P may run pipeline "
            "stages"
        )


def load_secret(cfg: PushkvConfig) -> bytes | None:
    """The P/D plane's shared secret from the one place the config names, or None."""
    given = [k for k in ("auth_secret_file", "auth_secret_env", "auth_secret") if getattr(cfg, k)]
    if len(given) > 1:
        raise ConfigError(f"give the secret in one place only, not {given}")
    raw: str | bytes | None = cfg.auth_secret or None
    if cfg.auth_secret_env:
        raw = os.environ.get(cfg.auth_secret_env)
        if not raw:
            raise ConfigError(f"auth_secret_env: ${cfg.auth_secret_env} is unset or empty")
    elif cfg.auth_secret_file:
        try:
            with open(cfg.auth_secret_file, "rb") as f:
                raw = f.read().strip()
        except OSError as exc:
            raise ConfigError(f"auth_secret_file: {exc}") from None
    if raw is None:
        return None
    key = raw.encode() if isinstance(raw, str) else raw
    if len(key) < MIN_KEY_BYTES:
        raise ConfigError(f"the pushkv secret needs at least {MIN_KEY_BYTES} bytes")
    return key

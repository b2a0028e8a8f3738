"""What the scheduler role tells the worker role each step, and what workers publish.

Owns: plain, picklable dataclasses (vLLM pickles the step's metadata into the
SchedulerOutput). No vLLM import: plugin.py wraps ``StepPlan`` in vLLM's metadata type.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from connector.core.events import BlockTable
from connector.kv_params import DecodeLeg, PrefillLeg


@dataclass(frozen=True)
class StagedPrefill:
    """P: this step completes the prompt's KV; push it right after the forward."""

    transfer_id: str
    request_id: str
    block_ids: BlockTable
    num_tokens: int
    leg: PrefillLeg
    arrival_ns: int = 0  # engine timestamps, wall clock: the prefill span
    scheduled_ns: int = 0


@dataclass(frozen=True)
class StagedRegistration:
    """D: blocks were allocated this step; register them with P's ranks now."""

    transfer_id: str
    request_id: str
    block_ids: BlockTable  # D's blocks for tokens [first_token, num_tokens)
    first_token: int
    num_tokens: int
    leg: DecodeLeg
    alloc_ns: int = 0  # wall clock: the register span starts here


@dataclass(frozen=True)
class StagedAbort:
    """A request left before its transfer ended. ``kind``:
    - "prefill_aborted" (P): the prompt never completed; tell D not to wait;
    - "aborted" (D): stop waiting, free blocks once no WRITE can land;
    - "not_needed" (D): a prefix-cache hit made the transfer pointless; free P's blocks."""

    transfer_id: str
    request_id: str
    kind: Literal["prefill_aborted", "aborted", "not_needed"]
    leg: DecodeLeg | None


@dataclass
class StepPlan:
    prefills: list[StagedPrefill] = field(default_factory=list)
    registrations: list[StagedRegistration] = field(default_factory=list)
    aborts: list[StagedAbort] = field(default_factory=list)
    # P: transfers whose request vLLM preempted after the push began; its blocks are free
    # again, so this step's forward must wait until no WRITE reads them.
    reclaimed: list[str] = field(default_factory=list)
    # P: transfers whose request stopped at its first token with no D to follow
    # (``release_on_stop``): reclaimed the same way; one still waiting ends "not needed".
    stopped: list[str] = field(default_factory=list)
    # D: requests whose load failed here, before anything was registered (a hook of ours
    # raised): every worker reports them received and failed at once.
    failed_loads: list[str] = field(default_factory=list)
    # D: the first block each load staged this step writes (a registration or a failed
    # load), by request: vLLM 0.26 takes a failed load only as block ids
    # (connector/vllm_compat.py), so the workers report this block for it.
    load_blocks: dict[str, int] = field(default_factory=dict)
    # The step schedules no tokens (vLLM steps anyway while transfers are in progress).
    idle: bool = False
    # A transfer of some request is still in progress on some rank (the scheduler role's
    # view): on an idle step every rank waits, also one with no transfer of its own.
    transfers_pending: bool = False
    # The engine is shutting down (connector/shutdown.py): transfers still waiting this
    # long from now end with reason "shutdown". None while it runs.
    shutdown_grace_s: float | None = None

    def empty(self) -> bool:
        return not (
            self.prefills
            or self.registrations
            or self.aborts
            or self.reclaimed
            or self.stopped
            or self.failed_loads
        )


@dataclass(frozen=True)
class Handshake:
    """Published by each worker at start-up (get_handshake_metadata): where its transport
    agent listens. The scheduler role hands these to the router through the probe."""

    agent: str
    host: str
    port: int

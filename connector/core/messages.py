"""Wire messages of the push protocol (docs/protocol.md) and their strict codec.

Owns: the message structs, the frame format and the limits. Pure: imports msgspec and the
core's layout structs only; nothing of vLLM, NIXL or threads.

A frame is ``MAGIC`` followed by a msgpack map. Every map carries ``version`` and ``type``;
the codec reads those two first so an unknown version is told apart from a malformed body.
Decoding is strict: unknown fields, wrong types, out-of-range numbers, oversized frames
and unknown versions all raise ``RemoteProtocolError``; callers drop and count them.
With the P/D secret (a ``key`` argument) a frame travels sealed (``core/auth.py``).
"""

from __future__ import annotations

import enum
from typing import Annotated, Final

import msgspec
from msgspec import UNSET, UnsetType

from connector.core import auth
from connector.core.errors import RemoteProtocolError
from connector.core.layout import KVLayout

MAGIC: Final = b"pkv\x00"
VERSION: Final = 1
SUPPORTED_VERSIONS: Final = frozenset({VERSION})
# A registration for a 128k-token prompt with 16-token blocks holds ~8k ids (~25 KiB); the
# cap leaves room for several KV groups while bounding what a bad peer can make us parse.
MAX_FRAME_BYTES: Final = 512 * 1024
MAX_BLOCKS_PER_GROUP: Final = 1 << 17
MAX_GROUPS: Final = 16
MAX_HEARTBEAT_IDS: Final = 4096
# A CUDA IPC export names each allocation (~200 bytes) and each region (~20 bytes): a
# 128-layer model with one allocation per layer stays under 32 KiB.
MAX_IPC_EXPORT_BYTES: Final = 256 * 1024

TransferId = Annotated[str, msgspec.Meta(min_length=1, max_length=128, pattern=r"^[\w.:@-]+$")]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
Host = Annotated[str, msgspec.Meta(min_length=1, max_length=255)]
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
Rank = Annotated[int, msgspec.Meta(ge=0, le=4095)]
TpSize = Annotated[int, msgspec.Meta(ge=1, le=4096)]
Count = Annotated[int, msgspec.Meta(ge=0, le=1 << 40)]
BlockId = Annotated[int, msgspec.Meta(ge=0, le=(1 << 31) - 1)]
BlockIds = Annotated[tuple[BlockId, ...], msgspec.Meta(max_length=MAX_BLOCKS_PER_GROUP)]
Detail = Annotated[str, msgspec.Meta(max_length=512)]
MAX_TTL_MS: Final = 24 * 3600 * 1000
TtlMs = Annotated[int, msgspec.Meta(ge=1, le=MAX_TTL_MS)]


class FailReason(str, enum.Enum):
    """Why a transfer ended without the KV landing. Travels in ``Fail`` and ``Cancel``."""

    HANDSHAKE = "handshake"
    POST_ERROR = "post_error"
    WRITE_ERROR = "write_error"
    WRITE_TIMEOUT = "write_timeout"
    PREFILL_ABORTED = "prefill_aborted"
    LEASE_EXPIRED = "lease_expired"
    REGISTRATION_EXPIRED = "registration_expired"
    CANCELLED = "cancelled"
    UNKNOWN_TRANSFER = "unknown_transfer"
    LAYOUT_MISMATCH = "layout_mismatch"
    PEER_LOST = "peer_lost"
    DEADLINE = "deadline"
    ABORTED = "aborted"
    NOT_NEEDED = "not_needed"
    SHUTDOWN = "shutdown"
    CHECKSUM_MISMATCH = "checksum_mismatch"  # D: its blocks differ from P's digest


class TraceContext(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """W3C trace context carried with a transfer (filled by the router)."""

    traceparent: Annotated[str, msgspec.Meta(max_length=128)]
    tracestate: Annotated[str, msgspec.Meta(max_length=512)] = ""


class PeerAddr(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where a rank's transport agent can be reached (its NIXL listener)."""

    agent: Name
    host: Host
    port: Port


class _Msg(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="type", kw_only=True):
    transfer_id: TransferId
    version: Annotated[int, msgspec.Meta(ge=0, le=255)] = VERSION


class Register(_Msg, tag="register", frozen=True):
    """D→P: "write tokens [first_token, num_tokens) of this transfer into these blocks"."""

    d_engine_id: Name
    d_rank: Rank
    d_tp_size: TpSize
    d_addr: PeerAddr
    layout: KVLayout
    block_ids: Annotated[tuple[BlockIds, ...], msgspec.Meta(min_length=1, max_length=MAX_GROUPS)]
    first_token: Count
    num_tokens: Count
    # Relative, not absolute: P and D clocks need not agree. What remains of D's wait when
    # it sends this: P posts no WRITE later than ttl_ms after receiving it.
    ttl_ms: TtlMs
    trace: TraceContext | None = None
    # D's bound on one WRITE into these blocks (done or aborted within it); P applies the
    # shorter of this and its own write_timeout_s. None: P's own (an older D).
    write_timeout_ms: TtlMs | None = None
    # The pipeline stages of P that D waits for (one completion per writing TP rank per
    # stage); each P stage refuses a registration that names another number than it runs
    # (``connector.core.stages``). Unset (left out of the frame, as an older P reads it): 1.
    p_pp_size: TpSize | UnsetType = UNSET

    @property
    def p_stages(self) -> int:
        """The pipeline stages of P that D waits for."""
        return 1 if isinstance(self.p_pp_size, UnsetType) else self.p_pp_size


class KvDigest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A checksum of what one P rank wrote into one D rank (``kv_checksum_every``): the
    bytes of D's blocks it fills with ``heads``, in D's address order
    (``connector.core.digest_ranges``)."""

    algo: Annotated[str, msgspec.Meta(min_length=1, max_length=16)]
    value: Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]  # msgspec: int64
    nbytes: Count
    heads: tuple[Count, Count]
    # A P pipeline stage's layers [first, end), which it alone wrote; unset (left out of
    # the frame): every layer of D.
    layers: tuple[Count, Count] | UnsetType = UNSET


class Completion(_Msg, tag="done", frozen=True):
    """P→D, as the WRITE's own notification: this P rank's bytes have landed. ``p_rank``
    (in ``Fail`` too) is the P worker's source rank: its TP rank, or with pipeline stages
    on P its rank among the engine's workers (``connector.core.stages.source_rank``)."""

    p_rank: Rank
    p_tp_size: TpSize
    bytes_total: Count = 0
    descriptors: Count = 0
    # Only where P checksums this transfer; left out of the frame otherwise (``encode``),
    # so a D that predates it still reads every completion P sends with checks off.
    digest: KvDigest | None = None


class Fail(_Msg, tag="fail", frozen=True):
    """P→D: this P rank will not write (or its WRITE failed); D must not wait for it."""

    p_rank: Rank
    reason: FailReason
    detail: Detail = ""


class Cancel(_Msg, tag="cancel", frozen=True):
    """D→P: D no longer wants the KV. P answers with ``Fail`` (or its WRITE's completion)."""

    d_rank: Rank
    d_addr: PeerAddr
    reason: FailReason


class Heartbeat(_Msg, tag="heartbeat", frozen=True):
    """D→P: D still wants these transfers; renews P's lease on each of them."""

    d_rank: Rank
    d_addr: PeerAddr
    more_ids: Annotated[tuple[TransferId, ...], msgspec.Meta(max_length=MAX_HEARTBEAT_IDS)] = ()

    def transfer_ids(self) -> tuple[str, ...]:
        return (self.transfer_id, *self.more_ids)


class IpcOffer(_Msg, tag="ipc_offer", frozen=True):
    """D→P, before D's first registration with a P rank, where D's KV is in GPU memory: a
    process on D's node may map D's KV cache (CUDA IPC) and copy into it directly. P takes
    it only if it runs on ``node``, in another process, and sees the GPU ``device_uuid``;
    otherwise it writes through the transport as always. ``transfer_id``: the transfer
    whose registration follows (for logs)."""

    d_rank: Rank
    d_addr: PeerAddr
    node: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]  # host identity
    pid: Annotated[int, msgspec.Meta(ge=0)]
    device_uuid: Annotated[str, msgspec.Meta(max_length=64)]
    # connector.transfer.gpu.ipc.IpcExport as msgpack: opaque here, decoded where torch is.
    export: Annotated[bytes, msgspec.Meta(max_length=MAX_IPC_EXPORT_BYTES)]
    # D's pid namespace ("pid:[inode]"): where it is P's too, P can see D's process die.
    pid_ns: Annotated[str, msgspec.Meta(max_length=64)] = ""


Message = Register | Completion | Fail | Cancel | Heartbeat | IpcOffer


class _Header(msgspec.Struct):
    """Read first, leniently, to tell an unknown version from a malformed body."""

    version: int
    type: str


_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(_Header)
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message, key: bytes | None = None, stamp: auth.Stamp | None = None) -> bytes:
    """Frame a message for the wire; with a ``key``, sealed (``core/auth.py``) with ``stamp``."""
    if isinstance(msg, Completion) and msg.digest is None:
        body = msgspec.to_builtins(msg)
        del body["digest"]
        frame = MAGIC + _encoder.encode(body)
    else:
        frame = MAGIC + _encoder.encode(msg)
    if key is None:
        return frame
    if stamp is None:
        raise ValueError("a sealed message needs a stamp")
    return auth.seal(key, auth.NOTIF, frame, stamp)


def decode(
    frame: bytes,
    key: bytes | None = None,
    *,
    now_ms: int = 0,
    replay: auth.ReplayWindow | None = None,
) -> Message:
    """Parse one frame strictly; raise RemoteProtocolError on anything but a valid message.
    With a ``key`` the frame must be sealed with it, fresh and (``replay``) new: else
    ``auth.AuthError``. Without one a sealed frame is refused too (mismatched config)."""
    if len(frame) > MAX_FRAME_BYTES + auth.OVERHEAD:
        raise RemoteProtocolError(f"frame of {len(frame)} bytes exceeds {MAX_FRAME_BYTES}")
    if key is not None:
        if replay is None:
            raise ValueError("a sealed message is opened with a replay window")
        frame, _ = auth.unseal(key, auth.NOTIF, frame, now_ms, replay.window_ms, replay=replay)
    elif auth.is_sealed(frame):
        raise auth.AuthError("unexpected", "sealed frame, but no secret is configured here")
    if len(frame) > MAX_FRAME_BYTES:
        raise RemoteProtocolError(f"frame of {len(frame)} bytes exceeds {MAX_FRAME_BYTES}")
    if not frame.startswith(MAGIC):
        raise RemoteProtocolError("not a pushkv frame (bad magic)")
    body = memoryview(frame)[len(MAGIC) :]
    try:
        header = _header_decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise RemoteProtocolError(f"malformed frame header: {exc}") from exc
    if header.version not in SUPPORTED_VERSIONS:
        raise RemoteProtocolError(f"unknown protocol version {header.version}")
    try:
        return _decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise RemoteProtocolError(f"malformed {header.type!r} message: {exc}") from exc


def is_frame(data: bytes) -> bool:
    """Cheap check used to route notifications that are not ours (e.g. another connector's)."""
    return data.startswith(MAGIC) or auth.is_sealed(data)

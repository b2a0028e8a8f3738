"""The side channel's wire codec: one frame, encoded and decoded without sockets.

Owns: the frame format (``MAGIC``, ``VERSION``, kinds, ``HEADER``, caps), ``encode_frame`` and
the incremental ``FrameReader``. Pure: imports ``core.errors`` only; ``sidechannel.py`` owns
the sockets and threads.

Wire (version 1), both directions the same frame:
    magic b"PKSC" | version u8 | kind u8 | name_len u16 | md_len u32 | name | metadata
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from connector.core.errors import LocalProtocolError, RemoteProtocolError

MAGIC = b"PKSC"
VERSION = 1
KIND_EXCHANGE = 1
KIND_REPLY = 2
_KINDS = (KIND_EXCHANGE, KIND_REPLY)
HEADER = struct.Struct("!4sBBHI")  # magic, version, kind, name_len, md_len
MAX_NAME_BYTES = 1024
MAX_METADATA_BYTES = 64 << 20  # NIXL metadata is KBs; 64 MiB leaves room for huge layouts


@dataclass(frozen=True)
class Frame:
    kind: int
    name: str
    metadata: bytes


def encode_frame(
    kind: int, name: str, metadata: bytes, max_metadata_bytes: int = MAX_METADATA_BYTES
) -> bytes:
    """One wire frame. Oversized input is our bug (LocalProtocolError), not the peer's."""
    raw = name.encode("utf-8")
    if kind not in _KINDS or not raw or len(raw) > MAX_NAME_BYTES:
        raise LocalProtocolError(f"side channel frame: kind {kind}, name {name!r}")
    if len(metadata) > max_metadata_bytes:
        raise LocalProtocolError(
            f"side channel frame: {len(metadata)} bytes of metadata (cap {max_metadata_bytes})"
        )
    return HEADER.pack(MAGIC, VERSION, kind, len(raw), len(metadata)) + raw + bytes(metadata)


def bad(reason: str, detail: str) -> RemoteProtocolError:
    # args[0] is the counter key (no extra exception type: core.errors owns those).
    return RemoteProtocolError(reason, detail)


def drop_reason(exc: RemoteProtocolError) -> str:
    return str(exc.args[0]) if exc.args else "malformed"


class FrameReader:
    """Incremental decoder of one frame: ``feed`` bytes until it returns the Frame.
    Raises RemoteProtocolError (``drop_reason`` gives the counter key) as soon as the
    header is wrong, so an oversized frame is refused before its body is buffered."""

    def __init__(self, max_metadata_bytes: int = MAX_METADATA_BYTES) -> None:
        self._max = max_metadata_bytes
        self._buf = bytearray()
        self._lens: tuple[int, int, int] | None = None  # kind, name_len, md_len

    @property
    def wanted(self) -> int:
        """Bytes still missing (from the header's lengths once it is in)."""
        if self._lens is None:
            return HEADER.size - len(self._buf)
        return HEADER.size + self._lens[1] + self._lens[2] - len(self._buf)

    def feed(self, data: bytes) -> Frame | None:
        self._buf += data
        if self._lens is None and len(self._buf) >= HEADER.size:
            magic, version, kind, name_len, md_len = HEADER.unpack_from(self._buf)
            if magic != MAGIC:
                raise bad("bad_magic", f"magic {bytes(magic)!r}")
            if version != VERSION:
                raise bad("bad_version", f"version {version} (we speak {VERSION})")
            if kind not in _KINDS:
                raise bad("bad_kind", f"kind {kind}")
            if md_len > self._max or name_len > MAX_NAME_BYTES:
                raise bad("oversized", f"name {name_len} B, metadata {md_len} B (cap {self._max})")
            if name_len == 0:
                raise bad("malformed", "empty agent name")
            self._lens = (kind, name_len, md_len)
        if self._lens is None or self.wanted > 0:
            return None
        if self.wanted < 0:
            raise bad("malformed", f"{-self.wanted} bytes past the end of the frame")
        kind, name_len, md_len = self._lens
        body = bytes(self._buf[HEADER.size :])
        try:
            name = body[:name_len].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise bad("malformed", f"agent name is not UTF-8: {exc}") from None
        return Frame(kind, name, body[name_len:])

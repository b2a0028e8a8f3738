"""Authentication of the P/D plane with a shared secret (docs/security.md): sealed frames,
their replay window, and signed tokens with an expiry.

Owns: the envelope format (``SEAL_MAGIC``), ``seal`` / ``unseal`` (HMAC-SHA256 over a domain,
a timestamp, a nonce, associated data and the body), ``ReplayWindow`` (which stamps were
already accepted), ``sign_token`` / ``verify_token`` (the router's signature on P's
coordinates) and ``AuthError``. Pure: stdlib ``hmac``/``hashlib`` only; time and nonces
are arguments, the key is a parameter (``connector/config.py`` reads it).

Envelope: ``SEAL_MAGIC | ts_ms u64 | nonce 16 B | tag 32 B | body``. The tag covers
``domain`` (so a tag made for one channel is worthless on another), the stamp, ``aad``
(e.g. the sender's agent name) and the body. Tags are compared with
``hmac.compare_digest``.
"""

from __future__ import annotations

import base64
import heapq
import hmac
import struct
from dataclasses import dataclass
from typing import Final

from connector.core.errors import RemoteProtocolError

SEAL_MAGIC: Final = b"pka\x00"
NONCE_BYTES: Final = 16
TAG_BYTES: Final = 32
_STAMP = struct.Struct("!Q16s")
OVERHEAD: Final = len(SEAL_MAGIC) + _STAMP.size + TAG_BYTES
MIN_KEY_BYTES: Final = 16
# Domains: one per channel, so a sealed frame of one cannot be replayed on another.
NOTIF: Final = b"pushkv/notif/1"
SIDE_EXCHANGE: Final = b"pushkv/side-exchange/1"
SIDE_REPLY: Final = b"pushkv/side-reply/1"
BELL: Final = b"pushkv/bell/1"
COORDS: Final = b"pushkv/coords/1"


class AuthError(RemoteProtocolError):
    """A frame or token failed authentication; ``reason`` is the counter key: ``missing``
    (no seal), ``unexpected`` (sealed, but we have no secret), ``malformed``, ``bad_tag``
    (wrong key or tampered), ``stale`` / ``future`` (outside the window), ``replayed``,
    ``expired`` (a token past its lifetime)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass(frozen=True)
class Stamp:
    """When a frame was sealed (sender's wall clock, ms) and its unique nonce."""

    ts_ms: int
    nonce: bytes


def check_key(key: bytes) -> bytes:
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(f"a pushkv secret needs at least {MIN_KEY_BYTES} bytes, got {len(key)}")
    return key


def _tag(key: bytes, domain: bytes, stamp: bytes, aad: bytes, body: bytes) -> bytes:
    # Lengths first: (aad, body) pairs cannot be re-split into another valid pair. One-shot
    # hmac.digest (OpenSSL, no HMAC object) is the cheapest call per message.
    lengths = struct.pack("!BII", 0, len(aad), len(body))
    return hmac.digest(key, b"".join((domain, lengths, stamp, aad, body)), "sha256")


def seal(key: bytes, domain: bytes, body: bytes, stamp: Stamp, aad: bytes = b"") -> bytes:
    """``body`` in an envelope whose tag proves it came from a holder of ``key``."""
    if len(stamp.nonce) != NONCE_BYTES:
        raise ValueError(f"nonce must be {NONCE_BYTES} bytes")
    head = _STAMP.pack(stamp.ts_ms, stamp.nonce)
    return SEAL_MAGIC + head + _tag(key, domain, head, aad, body) + body


def is_sealed(frame: bytes) -> bool:
    return frame[: len(SEAL_MAGIC)] == SEAL_MAGIC


def unseal(
    key: bytes,
    domain: bytes,
    frame: bytes,
    now_ms: int,
    window_ms: int,
    aad: bytes = b"",
    replay: ReplayWindow | None = None,
) -> tuple[bytes, Stamp]:
    """The body of a sealed ``frame`` and its stamp; AuthError unless the tag is right,
    the stamp is within ``window_ms`` of ``now_ms`` and (with ``replay``) new."""
    if not is_sealed(frame):
        raise AuthError("missing", "the frame is not sealed (a peer without the secret?)")
    if len(frame) < OVERHEAD:
        raise AuthError("malformed", f"sealed frame of {len(frame)} bytes")
    view = memoryview(frame)
    head = bytes(view[len(SEAL_MAGIC) : len(SEAL_MAGIC) + _STAMP.size])
    tag = bytes(view[OVERHEAD - TAG_BYTES : OVERHEAD])
    body = bytes(view[OVERHEAD:])
    if not hmac.compare_digest(tag, _tag(key, domain, head, aad, body)):
        raise AuthError("bad_tag", "wrong secret, or the frame was altered")
    ts_ms, nonce = _STAMP.unpack(head)
    stamp = Stamp(ts_ms, nonce)
    check_fresh(stamp.ts_ms, now_ms, window_ms)
    if replay is not None:
        replay.accept(stamp, now_ms)
    return body, stamp


def check_fresh(ts_ms: int, now_ms: int, window_ms: int) -> None:
    if ts_ms < now_ms - window_ms:
        raise AuthError("stale", f"sealed {now_ms - ts_ms} ms ago (window {window_ms} ms)")
    if ts_ms > now_ms + window_ms:
        raise AuthError("future", f"sealed {ts_ms - now_ms} ms ahead (clock skew?)")


class ReplayWindow:
    """The stamps accepted within the last ``window_ms``: a stamp is accepted once only.

    Only authenticated stamps enter (the tag is checked first), so only a holder of the
    secret can fill it. At ``max_entries`` the oldest is forgotten and every stamp at or
    before its time is refused from then on (``floor_ms``): a full window costs late
    messages, never a replay."""

    def __init__(self, window_ms: int, max_entries: int = 1 << 16) -> None:
        if window_ms <= 0 or max_entries <= 0:
            raise ValueError("window_ms and max_entries must be positive")
        self.window_ms, self.max_entries = window_ms, max_entries
        self.floor_ms = -1  # stamps at or before this are refused (evicted while fresh)
        self._seen: set[Stamp] = set()
        self._heap: list[tuple[int, bytes]] = []

    def __len__(self) -> int:
        return len(self._seen)

    def accept(self, stamp: Stamp, now_ms: int) -> None:
        """Record ``stamp``; AuthError if it is outside the window or seen before."""
        check_fresh(stamp.ts_ms, now_ms, self.window_ms)
        self._expire(now_ms)
        if stamp.ts_ms <= self.floor_ms:
            raise AuthError("stale", "older than what a full replay window still holds")
        if stamp in self._seen:
            raise AuthError("replayed", f"stamp {stamp.ts_ms} seen before")
        while len(self._seen) >= self.max_entries:
            ts, nonce = heapq.heappop(self._heap)
            self._seen.discard(Stamp(ts, nonce))
            self.floor_ms = max(self.floor_ms, ts)
        if stamp.ts_ms <= self.floor_ms:
            raise AuthError("stale", "older than what a full replay window still holds")
        self._seen.add(stamp)
        heapq.heappush(self._heap, (stamp.ts_ms, stamp.nonce))

    def _expire(self, now_ms: int) -> None:
        # A stamp older than the window is refused as stale anyway: no need to remember it.
        while self._heap and self._heap[0][0] < now_ms - self.window_ms:
            ts, nonce = heapq.heappop(self._heap)
            self._seen.discard(Stamp(ts, nonce))


# -- tokens: a signature with an expiry over a payload the caller makes canonical --------

_TOKEN_PREFIX: Final = "v1."


def sign_token(key: bytes, domain: bytes, payload: bytes, expires_ms: int) -> str:
    """``v1.<expires_ms>.<tag>``: valid for ``payload`` until ``expires_ms``."""
    tag = _tag(key, domain, struct.pack("!Q", expires_ms), b"", payload)
    return f"{_TOKEN_PREFIX}{expires_ms}.{base64.urlsafe_b64encode(tag).decode().rstrip('=')}"


def verify_token(key: bytes, domain: bytes, payload: bytes, token: str, now_ms: int) -> None:
    """AuthError unless ``token`` signs ``payload`` with ``key`` and has not expired."""
    if not token:
        raise AuthError("missing", "no signature")
    try:
        if not token.startswith(_TOKEN_PREFIX):
            raise ValueError("unknown token version")
        expires, b64 = token[len(_TOKEN_PREFIX) :].split(".", 1)
        if not expires.isdigit() or len(expires) > 19:
            raise ValueError("bad expiry")
        expires_ms = int(expires)
        tag = base64.urlsafe_b64decode(b64 + "=" * (-len(b64) % 4))
    except ValueError as exc:
        raise AuthError("malformed", f"signature: {exc}") from None
    want = _tag(key, domain, struct.pack("!Q", expires_ms), b"", payload)
    if not hmac.compare_digest(tag, want):
        raise AuthError("bad_tag", "signature does not match (wrong secret or altered fields)")
    if now_ms > expires_ms:
        raise AuthError("expired", f"signature expired {now_ms - expires_ms} ms ago")

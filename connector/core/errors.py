"""The exception hierarchy of pushkv (h11's split: who is at fault).

Owns: every exception type the project raises. Imports nothing of the project.
"""


class PushkvError(Exception):
    """Base of every error pushkv raises."""


class LocalProtocolError(PushkvError):
    """We broke the protocol (a bug of ours). Tests raise it; production logs it once and
    fails the transfer."""


class RemoteProtocolError(PushkvError):
    """The peer sent something malformed, oversized, of an unknown version or out of turn.
    The message is dropped and counted; it never raises into the engine."""


class LayoutError(PushkvError):
    """Two KV layouts cannot be mapped onto each other, or a block table does not cover
    the tokens it claims to."""


class ConfigError(PushkvError):
    """Invalid pushkv configuration."""


class TransportError(PushkvError):
    """A transport (NIXL) call failed. For a WRITE it becomes a ``WriteFailed`` event."""


class PeerUnreachable(TransportError):
    """The peer's metadata could not be fetched before the deadline (listener down, wrong
    address)."""


class PeerUnknown(TransportError):
    """The peer's metadata is not loaded (NIXL_ERR_NOT_FOUND)."""


class PeerDisconnected(TransportError):
    """The peer went away (NIXL_ERR_REMOTE_DISCONNECT): nothing more will arrive from it."""


class PeerGone(PeerDisconnected):
    """The peer's process is gone: its side channel refused our connection. An answer, not
    a timeout: what waits on that peer fails at once."""

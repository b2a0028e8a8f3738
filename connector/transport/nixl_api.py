"""The nixl wheel, imported lazily, and its exceptions as pushkv's errors.

Owns: ``load_nixl_api`` (nixl's ``_api`` module from whichever wheel is installed, or a
``TransportError`` saying how to install one), ``map_nixl_error`` and ``nixl_call`` (every
NIXL exception raised inside it becomes a ``connector.core.errors.TransportError``, chained).
Calls nothing of NIXL itself: ``nixl.py`` is the only module that does.
Must not import at module level: nixl, torch, vLLM.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

from connector.core.errors import PeerDisconnected, PeerUnknown, TransportError

# The meta package first (it picks cu12/cu13 from the CUDA stack it sees); the wheels
# directly next, because the meta package raises ImportError when its pick is missing.
_API_MODULES = ("nixl._api", "nixl_cu13._api", "nixl_cu12._api")


def _api_order() -> tuple[str, ...]:
    """``_API_MODULES``, the wheels first on a host without an NVIDIA driver and no torch
    imported yet: there the meta package's CUDA probe imports all of torch (about 1.3 s of
    CPU per process, every NIXL rank a test starts) to pick a wheel that cannot matter."""
    if "torch" in sys.modules or os.path.exists("/dev/nvidiactl"):
        return _API_MODULES
    return tuple(sorted(_API_MODULES, key=lambda name: name == "nixl._api"))


def load_nixl_api() -> ModuleType:
    """Import and return nixl's ``_api`` module; TransportError if none is installed."""
    for mod_name in _api_order():
        try:
            return importlib.import_module(mod_name)
        except ImportError:
            continue
    raise TransportError("nixl is not installed: pip install nixl==1.5.1")


def _is_nixl_error(exc: BaseException) -> bool:
    # The bindings' exceptions (nixlBackendError, nixlNotFoundError, ...) derive straight
    # from Exception, so match them by name/module; pybind turns other C++ exceptions
    # into RuntimeError (also raised by nixl_agent when no plugin loads).
    cls = type(exc)
    return (
        cls.__name__.startswith("nixl")
        or (cls.__module__ or "").startswith("nixl")
        or isinstance(exc, RuntimeError)
    )


def map_nixl_error(exc: BaseException, op: str, peer: str | None) -> TransportError:
    """One of our TransportErrors for a NIXL exception; the caller chains ``from exc``."""
    where = f"{op} (peer {peer!r})" if peer else op
    kind = type(exc).__name__
    ours = {"nixlRemoteDisconnectError": PeerDisconnected, "nixlNotFoundError": PeerUnknown}
    return ours.get(kind, TransportError)(f"{where}: {kind}: {exc}")


@contextmanager
def nixl_call(op: str, peer: str | None = None) -> Iterator[None]:
    try:
        yield
    except TransportError:
        raise
    except Exception as exc:
        if not _is_nixl_error(exc):
            raise
        raise map_nixl_error(exc, op, peer) from exc

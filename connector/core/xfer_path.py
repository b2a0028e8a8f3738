"""Which way one transfer's bytes should travel: ``direct``, ``staged`` or ``ipc``.

Owns: ``XferPath``, ``Locality``, the cost model ``PathModel`` and ``choose_path``.
- ``direct``: NIXL descriptors as ``plan.py`` planned them. Cheap for few, large
  descriptors; every descriptor that cannot merge with its neighbour costs microseconds
  on the GPU path (``python -m bench.gpu_paths``), so scattered blocks are slow.
- ``staged``: gather the blocks into a registered staging buffer, one WRITE per chunk,
  scatter on D. Few descriptors, but the bytes cross HBM three times.
- ``ipc``: P and D on one node: a kernel copies scattered source blocks straight into
  scattered destination blocks through CUDA IPC; no descriptors, no extra bytes.

Pure: no torch, no NIXL, no clock. The model's defaults are fitted to one H200 with P and
D sharing the GPU (``python -m bench.gpu_paths`` measures each path; the fit and its one
miss: docs/benchmarks.md, "Scattered blocks on an H200"). Other machines pass their own
``PathModel``.
"""

import dataclasses
from enum import Enum

from connector.core.errors import LocalProtocolError


class XferPath(str, Enum):
    DIRECT = "direct"
    STAGED = "staged"
    IPC = "ipc"


class Locality(str, Enum):
    """Where D's memory is, seen from P's."""

    SAME_GPU = "same_gpu"
    SAME_NODE = "same_node"  # another GPU of this host (NVLink / PCIe peer access)
    REMOTE = "remote"  # another host (RDMA)


@dataclasses.dataclass(frozen=True)
class PathModel:
    """Cost of each path as fixed + per-descriptor + per-byte terms (ns and GB/s).

    ``staged_min_descriptors`` and ``min_gain`` keep small or already contiguous
    transfers on the direct path, the one with the fewest moving parts.
    """

    direct_fixed_ns: int = 1_200_000  # 1k contiguous tokens, planning included
    direct_desc_ns: int = 8_300  # per descriptor left after merging
    direct_gbps: float = 1_200.0
    staged_fixed_ns: int = 2_500_000  # four or more chunks, each a WRITE + notification
    staged_gbps: float = 600.0  # same GPU, 4 x 512 MiB pools; across hosts: the link's rate
    ipc_fixed_ns: int = 500_000  # launch + notification
    ipc_gbps: float = 1_700.0
    staged_min_descriptors: int = 256
    min_gain: float = 1.25  # another path must beat direct by this factor

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if getattr(self, f.name) < 0:
                raise LocalProtocolError(f"PathModel.{f.name} must be >= 0")
        if min(self.direct_gbps, self.staged_gbps, self.ipc_gbps) <= 0:
            raise LocalProtocolError("PathModel rates must be > 0")
        if self.min_gain < 1:
            raise LocalProtocolError("PathModel.min_gain must be >= 1")

    def estimate_ns(self, path: XferPath, descriptors: int, bytes_total: int) -> int:
        """Predicted time from the first byte read on P to KV ready on D."""
        if path is XferPath.DIRECT:
            fixed, rate = self.direct_fixed_ns + descriptors * self.direct_desc_ns, self.direct_gbps
        elif path is XferPath.STAGED:
            fixed, rate = self.staged_fixed_ns, self.staged_gbps
        else:
            fixed, rate = self.ipc_fixed_ns, self.ipc_gbps
        return int(fixed + bytes_total / rate)  # bytes / (GB/s) = ns


@dataclasses.dataclass(frozen=True)
class PathChoice:
    path: XferPath
    reason: str  # why, in a few words (for the ``write`` span)
    estimates_ns: tuple[tuple[XferPath, int], ...]  # every path considered
    bytes_total: int = 0  # what a non-direct path moves (whole block rows)


def choose_path(
    descriptors: int,
    bytes_total: int,
    *,
    src_mem: str,
    dst_mem: str,
    locality: Locality,
    staging_ok: bool = True,
    ipc_ok: bool = True,
    model: PathModel = PathModel(),
) -> PathChoice:
    """The path for one transfer of ``descriptors`` (after merging) and ``bytes_total``.

    ``staging_ok``: both sides have a staging pool with room and the same block geometry;
    ``ipc_ok``: D's KV cache is mapped into P's process. Direct is chosen unless the
    best other path is predicted at least ``model.min_gain`` times faster.
    """
    if descriptors < 0 or bytes_total < 0:
        raise LocalProtocolError("descriptors and bytes_total must be >= 0")
    direct_ns = model.estimate_ns(XferPath.DIRECT, descriptors, bytes_total)
    considered = [(XferPath.DIRECT, direct_ns)]
    if descriptors == 0 or bytes_total == 0:
        return PathChoice(XferPath.DIRECT, "empty", tuple(considered))
    if src_mem != "VRAM" or dst_mem != "VRAM":
        return PathChoice(XferPath.DIRECT, "host memory", tuple(considered))
    if ipc_ok and locality is not Locality.REMOTE:
        considered.append((XferPath.IPC, model.estimate_ns(XferPath.IPC, 0, bytes_total)))
    if staging_ok and descriptors >= model.staged_min_descriptors:
        considered.append((XferPath.STAGED, model.estimate_ns(XferPath.STAGED, 1, bytes_total)))
    best, best_ns = min(considered[1:], key=lambda pe: pe[1], default=(XferPath.DIRECT, 0))
    if best is XferPath.DIRECT or best_ns * model.min_gain > direct_ns:
        return PathChoice(XferPath.DIRECT, "direct fastest", tuple(considered))
    reason = f"{best.value} {direct_ns / max(best_ns, 1):.1f}x"
    return PathChoice(best, reason, tuple(considered), bytes_total)

"""What the CUDA backends share: the extension ``deep_ep._C``, its error records, and the NVSHMEM bootstrap.

Importing this module raises ``ImportError`` when the extension is not built; ``Buffer`` then keeps the torch
backend. Kernels never trap: a kernel-side wait that runs out of ``DEEP_EP_TIMEOUT_S`` fills a host-mapped error
record and the kernel exits; the backend's next call turns the record into ``CommTimeoutError`` /
``PeerAbortedError`` / ``RoutingError``, or ``ArgumentMismatchError`` where the kernels saw the ranks' call
signatures differ (:func:`raise_from_record`).
"""
from __future__ import annotations

import os
import socket
from typing import Callable, Optional, Sequence

import torch

from deep_ep.errors import (
    ArgumentMismatchError,
    CommError,
    CommTimeoutError,
    PeerAbortedError,
    RoutingError,
    name_ranks,
)

try:
    from deep_ep import _C
except ImportError as exc:  # pragma: no cover - exercised only on machines without the build
    raise ImportError(f"deep_ep._C is not built ({exc}); build it with `MAX_JOBS=32 python setup.py build_ext "
                      "--inplace` on a CUDA machine (see docs/build.md)") from exc

# NVSHMEM's symmetric heap reserve beyond the buffers (teams, internal buffers).
_HEAP_MARGIN = 256 * 1024 * 1024


def raise_from_record(record: Optional[dict], names: Optional[Sequence[int]] = None, scope: str = "") -> None:
    """Turn the dict of a runtime's ``read_error()`` into the matching exception (no-op for ``None``); ``names`` and
    ``scope``: see :func:`deep_ep.errors.name_ranks`."""
    if record is None:
        return
    code = record["code"]
    message = name_ranks(record["message"], names, scope)
    if code == "timeout":
        raise CommTimeoutError(message)
    if code == "peer_aborted":
        raise PeerAbortedError(message)
    if code in ("bad_routing", "count_mismatch"):
        raise RoutingError(message)
    if code == "argument_mismatch":
        raise ArgumentMismatchError(message)
    raise CommError(message)


def record_streams(tensors: Sequence[torch.Tensor], stream: "torch.cuda.Stream") -> None:
    """``t.record_stream(stream)`` for every tensor, in one call into the extension."""
    _C.record_stream(list(tensors), stream.stream_id, stream.device_index, stream.device_type)


def has_nic() -> bool:
    """True when the host exposes an InfiniBand/RoCE device (``/sys/class/infiniband`` is non-empty)."""
    try:
        return len(os.listdir("/sys/class/infiniband")) > 0
    except OSError:
        return False


def nvshmem_environment(heap_bytes: int, num_qps_per_rank: int, allow_nvlink: bool, allow_mnnvl: bool,
                        single_host: bool, nic: bool) -> dict[str, str]:
    """The NVSHMEM variables to set before initialisation (values that ``setdefault`` semantics apply to, except
    ``NVSHMEM_DISABLE_NVLS`` which is always 1: NVLink multicast is never used)."""
    env = {
        "NVSHMEM_DISABLE_P2P": "0" if allow_nvlink else "1",
        "NVSHMEM_DISABLE_MNNVL": "0" if allow_mnnvl else "1",
        "NVSHMEM_IBGDA_NUM_RC_PER_PE": str(num_qps_per_rank),
        "NVSHMEM_QP_DEPTH": "1024",
        "NVSHMEM_MAX_TEAMS": "7",
        "NVSHMEM_CUMEM_GRANULARITY": str(2 ** 29),
        "NVSHMEM_SYMMETRIC_SIZE": str(max(2 ** 30, heap_bytes + _HEAP_MARGIN)),
    }
    if nic:
        env["NVSHMEM_IB_ENABLE_IBGDA"] = "1"
    elif single_host:
        # No NIC and every peer on this host: NVLink P2P only, and no noisy probing of absent RDMA transports.
        env["NVSHMEM_REMOTE_TRANSPORT"] = "none"
        env["NVSHMEM_IB_ENABLE_IBGDA"] = "0"
    return env


# The unique id of the world this process joined (the C++ bootstrap keeps the world itself: _C.ll_world()).
_world_id: Optional[bytes] = None


def join_nvshmem_world(rank: int, heap_bytes: int, num_qps_per_rank: int, allow_nvlink: bool,
                       allow_mnnvl: bool, all_gather: Callable[[object], list]) -> bytes:
    """Collective: set the NVSHMEM environment (user values win, ``NVSHMEM_DISABLE_NVLS=1`` always) and return
    rank 0's unique id of the world of all ranks (PE = rank). ``heap_bytes``: what this process allocates on the
    symmetric heap (the sum of its symmetric buffers; the first join of a process sizes the heap). The C++ runtimes
    pass the id to the shared bootstrap, which initialises NVSHMEM once per process: the low-latency and the
    internode runtimes join the same world, and later Buffers of the same ranks join it again without a new id
    (NVSHMEM is never asked for one once initialised). Raises ``RuntimeError`` on every rank, before any NVSHMEM
    call, when some rank's process already joined another world (NVSHMEM cannot join a second one)."""
    global _world_id
    gathered = all_gather((socket.gethostname(), _joined_world()))
    hosts, worlds, num_ranks = [g[0] for g in gathered], [g[1] for g in gathered], len(gathered)
    if any(world is not None for world in worlds):
        wrong = [(r, world) for r, world in enumerate(worlds) if world != (r, num_ranks)]
        if wrong:
            r, world = wrong[0]
            joined = "has not joined one" if world is None else f"joined one as PE {world[0]} of {world[1]}"
            raise RuntimeError(
                f"rank {r}'s process {joined}, but this Buffer needs every rank in an NVSHMEM world as PE = rank of "
                f"{num_ranks}: NVSHMEM is initialised once per process, so every NVSHMEM Buffer of a process must "
                "have the same ranks (the same process group, or one of the same ranks in the same order)")
        return _world_id if _world_id is not None else bytes(128)
    for name, value in nvshmem_environment(heap_bytes, num_qps_per_rank, allow_nvlink, allow_mnnvl,
                                           len(set(hosts)) == 1, has_nic()).items():
        os.environ.setdefault(name, value)
    os.environ["NVSHMEM_DISABLE_NVLS"] = "1"
    unique_id = bytes(_C.ll_unique_id()) if rank == 0 else None
    _world_id = all_gather(unique_id)[0]
    return _world_id


def _joined_world() -> Optional[tuple[int, int]]:
    """(PE, number of PEs) of the NVSHMEM world this process joined, or None (also for a build without NVSHMEM)."""
    world = getattr(_C, "ll_world", lambda: None)()
    return None if world is None else (int(world[0]), int(world[1]))

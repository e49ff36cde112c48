"""CUDA internode backend of ``deep_ep.Buffer`` for groups of one GPU per node, and the ring kernels over NVSHMEM.

With one GPU per node every peer is a scale-out peer and each token travels once, straight to its destination's
final row (each expert row straight back to its owner's combine slot): the data flow of the intranode ring kernels.
:class:`InternodeCuda` runs them over a buffer on the NVSHMEM symmetric heap of the world of all ranks (PE = rank),
reaching a peer through ``nvshmem_ptr`` where it can. A peer it cannot reach (behind a NIC) is a put peer: the
copy warps stage its ring records and put them per block, the tail follows as a signal; once any pair is a put pair,
every buffer carves a put area and combines through the rings. The word a combine's kernel sends every peer at its
start (the ranks' agreement on the call, ``cuda_intranode``) reaches a put peer as a signal. :class:`SymmetricCuda`
is that buffer and its put peers, the base of this backend and of the fused internode kernels
(deep_ep/backends/fused_internode.py).

The internode handle is built on the comm stream from the kernels' intranode fields
(:func:`deep_ep.handle.single_gpu_nodes_handle`); with one GPU per node a node's partial sum is one BF16 row, so the
kernels' single fp32 accumulation over ranks equals the reference's two-level combine bit for bit.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from deep_ep import envs, layout, testing
from deep_ep import handle as hd
from deep_ep.backends.base import LayoutRequest
from deep_ep.backends.common import object_all_gather
from deep_ep.backends.cuda_common import _C, join_nvshmem_world
from deep_ep.backends.cuda_intranode import CudaBackend
from deep_ep.backends.cuda_tuning import put_peers
from deep_ep.config import Topology
from deep_ep.pool import OutputPool
from deep_ep.results import DispatchLayout


class UnsupportedTopology(RuntimeError):
    """Raised on every rank (collectively) when this backend cannot serve the group (the Buffer falls back)."""


class SymmetricCuda(CudaBackend):
    """The ring kernels of :class:`CudaBackend` over a buffer on the NVSHMEM symmetric heap, for one rank of a group
    that is the NVSHMEM world (PE = rank) of 2..``max_ranks()`` ranks that reach each other by ``nvshmem_ptr`` where
    they can and by NVSHMEM puts and signals where they cannot (put peers). Intranode interface and handles.

    Args:
        rank, num_ranks: position in the group (the NVSHMEM world); ``2 <= num_ranks <= max_ranks()`` (the ring
            kernels' 24, ``_C.MAX_RANKS``; a subclass running other kernels may allow more).
        num_rdma_bytes: bytes of the symmetric buffer the kernels carve (equal on every rank).
        num_qps_per_rank, allow_mnnvl: NVSHMEM environment, as for the low-latency runtime.
        all_gather: ``all_gather(obj) -> list`` over the group (bootstrap only); barrier: ``barrier()`` or None.

    Construction is collective: the symmetric allocation (and its release) needs every PE, with the same
    ``num_rdma_bytes``.
    """

    @classmethod
    def max_ranks(cls) -> int:
        """Largest group this backend's kernels serve (the ring kernels' ``_C.MAX_RANKS``)."""
        return _C.MAX_RANKS

    def forced_put_span(self) -> int:
        """Under ``internode_put_only``: 0, every pair is a put pair; ``G`` > 0, only pairs of different nodes of
        ``G`` ranks are."""
        return 0

    # The put area a world with put pairs carves (deep_ep.layout PUT_AREA_*): the ring kernels stage in its halves.
    put_area_kind = layout.PUT_AREA_MIRROR

    # The copy-engine combine copies into peers' buffers with cudaMemcpyAsync; over the NVSHMEM heap that has not
    # run on a GPU yet, so this backend keeps its ring senders.
    copy_engine_combine = False
    buffer_arg = "num_rdma_bytes"

    def __init__(self, rank: int, num_ranks: int, num_rdma_bytes: int, num_qps_per_rank: int, allow_mnnvl: bool,
                 all_gather: Callable[[object], list], barrier: Optional[Callable[[], None]] = None) -> None:
        unique_id = join_nvshmem_world(rank, num_rdma_bytes, num_qps_per_rank, True, allow_mnnvl, all_gather)
        if not 2 <= num_ranks <= self.max_ranks():
            raise ValueError(f"num_ranks must be in [2, {self.max_ranks()}] for the CUDA kernels over NVSHMEM, got "
                             f"{num_ranks}")
        if num_rdma_bytes <= 0 or num_rdma_bytes % 128 != 0:
            raise ValueError(f"num_rdma_bytes must be a positive multiple of 128 for the CUDA kernels over NVSHMEM, "
                             f"got {num_rdma_bytes}")
        sizes = all_gather(num_rdma_bytes)
        if any(int(size) != num_rdma_bytes for size in sizes):
            raise ValueError(f"num_rdma_bytes must be equal on every rank (the kernels carve every peer's buffer "
                             f"with the same layout, and the symmetric allocation is world-wide), got {sizes}")
        self.rank, self.num_ranks, self.num_nvl_bytes = rank, num_ranks, num_rdma_bytes
        self.timeout_s = envs.TIMEOUT_S.get()
        self._barrier = barrier
        self.runtime = _C.Runtime(rank, num_ranks, num_rdma_bytes, self.timeout_s, symmetric=True)
        reached = self.runtime.sync_symmetric(unique_id)
        unreachable = [list(peers) for peers in all_gather(list(reached))]
        # (some peer unreachable, internode_put_only) of every rank
        flags = all_gather((bool(reached), testing.current().internode_put_only))
        put_only = any(only for _, only in flags)
        self.put_peers = put_peers(rank, unreachable, put_only, self.forced_put_span())
        # the same on every rank: the buffers' layout must agree
        self.put_area = put_area = put_only or any(far for far, _ in flags)
        try:
            self.runtime.set_put_peers(self.put_peers, self.put_area_kind if put_area else layout.PUT_AREA_NONE)
        except ValueError as exc:  # num_rdma_bytes and put_area agree on every rank, so every rank gets here together
            self.runtime.destroy()
            pairs = "; ".join(f"rank {r} cannot reach {peers}" for r, peers in enumerate(unreachable) if peers)
            raise UnsupportedTopology(f"NVSHMEM put peers ({pairs or 'internode_put_only'}): {exc}") from None
        self.comm_stream = torch.cuda.Stream(priority=-1)
        self._comm_ptr = self.comm_stream.cuda_stream
        self.output_pool = OutputPool(self.runtime.get_pool_offset(), self.runtime.get_pool_bytes())


class InternodeCuda(SymmetricCuda):
    """Internode normal-mode dispatch/combine for one rank of a group of ``R`` nodes of one GPU each.

    Args:
        rank, num_ranks: position in the group (the NVSHMEM world: PE = rank); ``2 <= num_ranks <= 24``.
        num_rdma_bytes: bytes of the symmetric buffer the kernels carve (equal on every rank).
        num_qps_per_rank, allow_mnnvl: NVSHMEM environment, as for the low-latency runtime.
        all_gather: ``all_gather(obj) -> list`` over the group (bootstrap only); barrier: ``barrier()`` or None.

    Construction is collective.
    """

    @classmethod
    def from_group(cls, group, **kwargs: Any) -> "InternodeCuda":
        import torch.distributed as dist

        all_gather = object_all_gather(group)
        return cls(dist.get_rank(group), dist.get_world_size(group), all_gather=all_gather,
                   barrier=lambda: dist.barrier(group=group), **kwargs)

    @staticmethod
    def unsupported_reason(topology: Topology, num_rdma_bytes: int) -> Optional[str]:
        """Why this backend cannot serve ``topology`` (``None`` when it can)."""
        if not getattr(_C, "HAS_LOW_LATENCY", False):
            return "the extension was built without NVSHMEM"
        if topology.num_scaleup_ranks != 1:
            return (f"{topology.num_scaleup_ranks} GPUs per node run the composed path "
                    "(deep_ep/backends/composed.py), this backend serves one GPU per node")
        if topology.num_ranks > _C.MAX_RANKS:
            return f"{topology.num_ranks} nodes exceed the kernels' {_C.MAX_RANKS} ranks"
        if num_rdma_bytes <= 0:
            return "num_rdma_bytes is 0"
        return None

    # ------------------------------------------------------------------------------------------------------------
    def get_local_buffer_tensor(self, dtype: torch.dtype, size: Optional[torch.Size], offset: int,
                                use_rdma_buffer: bool) -> torch.Tensor:
        """A view of the symmetric (RDMA) buffer; this backend has no NVL buffer."""
        if not use_rdma_buffer:
            raise ValueError("use_rdma_buffer=False: the CUDA internode backend (one GPU per node) keeps no NVL "
                             "buffer; pass use_rdma_buffer=True")
        return super().get_local_buffer_tensor(dtype, size, offset, False)

    def get_dispatch_layout(self, request: LayoutRequest) -> DispatchLayout:
        """As the intranode layout; a node is one rank, so ``num_tokens_per_rdma_rank`` is ``num_tokens_per_rank``
        (the same tensor)."""
        layout = super().get_dispatch_layout(request)
        return layout._replace(num_tokens_per_rdma_rank=layout.num_tokens_per_rank)

    def _kernel_handle(self, handle: hd.InternodeHandle) -> hd.IntranodeHandle:
        """The kernels' fields of an internode handle: the ones its dispatch produced (its ``backend_state``: a cached
        call launches nothing but its kernel), else converted on the comm stream."""
        if isinstance(handle.backend_state, hd.IntranodeHandle):
            return handle.backend_state
        with torch.cuda.stream(self.comm_stream):
            return hd.single_gpu_nodes_kernel_handle(handle, self.rank)

    def _user_handle(self, handle: hd.IntranodeHandle, current_after: bool) -> hd.InternodeHandle:
        compute = torch.cuda.current_stream()
        with torch.cuda.stream(self.comm_stream):
            out = hd.single_gpu_nodes_handle(handle, self.rank)
        for tensor in out:  # allocated on the comm stream, used by the caller's stream
            tensor.record_stream(compute)
        if current_after:  # the launch's wait predates the conversion
            compute.wait_stream(self.comm_stream)
        out.backend_state = handle
        return out

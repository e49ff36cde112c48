"""CUDA internode backend of ``deep_ep.Buffer`` for groups of one GPU per node (any node count up to 8).

With one GPU per node there is no NVLink forwarding stage (design guide §4, "G = 1"): every peer is a scale-out
peer and each token travels once, straight to the destination rank's final row, and each expert row travels once,
straight back to its owner's combine slot. That is exactly the data flow of the intranode ring kernels, so this
backend runs them (``csrc/kernels/intranode.cu``) over a buffer on the **NVSHMEM symmetric heap** of the world of
all ranks (PE = rank, the world the low-latency runtime joins too: one per process), reaching a peer through
``nvshmem_ptr`` instead of CUDA IPC where it can. On one host with ``DEEP_EP_GPUS_PER_NODE=1`` that is NVSHMEM's P2P
transport; the virtual nodes' "network" traffic is SM stores into the peers' symmetric buffers.

A peer that ``nvshmem_ptr`` cannot reach (behind a NIC) is a **put peer** (``csrc/kernels/put.cuh``): the kernels
stage its ring records in this rank's put area and put them to the same ring slots at the peer with
put-with-signal of the tail; tails, heads, notify flags and barrier arrivals of a put pair are NVSHMEM signals into
64-bit twins of the counter words. Put pairs receive through the rings only. The relation is symmetric and per peer
(a mixed world keeps pointers where it has them); once any pair of the world is a put pair, every rank carves the
put area (``kernels/layout.cuh`` ``put_layout``: the rings get a quarter each of what the fixed regions leave, the
staging the other half) and combines through the rings. ``DEEP_EP_INTERNODE_PUT_ONLY=1`` makes every pair a put
pair, which runs this path on one host.

What it adds on top of :class:`deep_ep.cuda_backend.CudaBackend`:

* construction over the symmetric heap (``num_rdma_bytes`` bytes: the internode kernels' buffer is the RDMA one),
  in :class:`SymmetricCuda`, which keeps the intranode interface and also serves a subgroup of the NVSHMEM world
  (the composed path's rail stage across hosts, ``deep_ep/composed_internode.py``: group rank ``r`` is PE
  ``pes[r]``);
* the internode 10-field handle (``deep_ep.handle.InternodeHandle``), built on the comm stream from the kernels'
  intranode fields (:func:`deep_ep.handle.single_gpu_nodes_handle`); cached dispatch and combine reuse the kernels'
  fields of that dispatch (or convert back, :func:`deep_ep.handle.single_gpu_nodes_kernel_handle`). With one GPU
  per node ``R_rdma = R``, the RDMA and global prefix matrices coincide and ``send_rdma_head`` is the ring sequence
  per (channel, node);
* ``num_tokens_per_rdma_rank`` from ``get_dispatch_layout`` (= ``num_tokens_per_rank``: a node is one rank).

Numerics: the spec's two-level combine rounds each node's partial sum to BF16 and then the sum over nodes. With one
GPU per node a partial is one BF16 row, which rounds to itself, so the kernels' single fp32 accumulation over ranks
(starting from the biases, ascending rank order, one rounding) is bit-identical to the reference.

Not served here: several GPUs per node (the composed path, ``deep_ep/composed_internode.py``, whose rail stage across
hosts is a :class:`SymmetricCuda`), and (the Buffer keeps the torch backend and says why) a world with put pairs
whose ``num_rdma_bytes`` leaves no room for the put area (:class:`UnsupportedTopology`). In worst-token mode
``send_nvl_head`` has ``num_worst_tokens`` rows, the padding rows -1 (the torch backend sizes it with the real count,
which needs a host synchronisation).
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Optional, Sequence

import torch

from deep_ep import envs, testing
from deep_ep import handle as hd
from deep_ep.backends.cuda_tuning import put_peers
from deep_ep.config import Topology
from deep_ep.cuda_backend import _C, CudaBackend
from deep_ep.cuda_low_latency import join_nvshmem_world
from deep_ep.pool import OutputPool
from deep_ep.torch_backend import object_all_gather


class UnsupportedTopology(RuntimeError):
    """Raised on every rank (collectively) when this backend cannot serve the group (the Buffer falls back)."""


class SymmetricCuda(CudaBackend):
    """The ring kernels of :class:`CudaBackend` over a buffer on the NVSHMEM symmetric heap, for one rank of a group
    of 2..24 ranks that reach each other by ``nvshmem_ptr`` where they can and by NVSHMEM puts and signals where they
    cannot (put peers). Intranode interface and handles.

    Args:
        rank, num_ranks: position in the group; ``2 <= num_ranks <= 24`` (``_C.MAX_RANKS``).
        num_rdma_bytes: bytes of the symmetric buffer the kernels carve (equal on every rank of the world).
        unique_id: the NVSHMEM world's unique id (``join_nvshmem_world`` over the world's group).
        world_rank, world_size: this process's PE and the world's size.
        pes: the PE of every group rank (``pes[rank] == world_rank``); ``range(num_ranks)`` when the group is the
            world.
        all_gather: ``all_gather(obj) -> list`` over the group (bootstrap only); barrier: ``barrier()`` or None.
        world_all_gather: the same over the whole world (``None``: the group is the world). Whether buffers carve a
            put area is decided world-wide, so that a buffer too small for it fails on every rank of the world alike.

    Construction is collective over the whole NVSHMEM world: the symmetric allocation (and its release) needs every
    PE, with the same ``num_rdma_bytes``, so every rank of the world builds one such backend (of its own group) at
    the same point, and destroys it at the same point.
    """

    # The copy-engine combine copies into peers' buffers with cudaMemcpyAsync; over the NVSHMEM heap that has not
    # run on a GPU yet, so this backend keeps its ring senders.
    copy_engine_combine = False
    buffer_arg = "num_rdma_bytes"

    def __init__(self, rank: int, num_ranks: int, num_rdma_bytes: int, unique_id: bytes, world_rank: int,
                 world_size: int, pes: Sequence[int], all_gather: Callable[[object], list],
                 barrier: Optional[Callable[[], None]] = None,
                 world_all_gather: Optional[Callable[[object], list]] = None) -> None:
        if not 2 <= num_ranks <= _C.MAX_RANKS:
            raise ValueError(f"num_ranks must be in [2, {_C.MAX_RANKS}] for the CUDA kernels over NVSHMEM, got "
                             f"{num_ranks}")
        if num_rdma_bytes <= 0 or num_rdma_bytes % 128 != 0:
            raise ValueError(f"num_rdma_bytes must be a positive multiple of 128 for the CUDA kernels over NVSHMEM, "
                             f"got {num_rdma_bytes}")
        world_all_gather = world_all_gather or all_gather
        sizes = world_all_gather(num_rdma_bytes)
        if any(int(size) != num_rdma_bytes for size in sizes):
            raise ValueError(f"num_rdma_bytes must be equal on every rank (the kernels carve every peer's buffer "
                             f"with the same layout, and the symmetric allocation is world-wide), got {sizes}")
        self.rank, self.num_ranks, self.num_nvl_bytes = rank, num_ranks, num_rdma_bytes
        self.pes = [int(pe) for pe in pes]
        self.timeout_s = envs.TIMEOUT_S.get()
        self._barrier = barrier
        self.runtime = _C.Runtime(rank, num_ranks, num_rdma_bytes, self.timeout_s, symmetric=True)
        reached = self.runtime.sync_symmetric(unique_id, world_rank, world_size, self.pes)
        unreachable = [list(peers) for peers in all_gather(list(reached))]
        # (some peer unreachable, DEEP_EP_INTERNODE_PUT_ONLY) of every rank of the world
        flags = world_all_gather((bool(reached), testing.current().internode_put_only))
        put_only = any(only for _, only in flags)
        self.put_peers = put_peers(rank, unreachable, put_only)
        put_area = put_only or any(far for far, _ in flags)  # the same on every rank: the buffers' layout must agree
        try:
            self.runtime.set_put_peers(self.put_peers, put_area)
        except ValueError as exc:  # num_rdma_bytes and put_area agree world-wide, so every rank gets here together
            self.runtime.destroy()
            pairs = "; ".join(f"rank {r} cannot reach {peers}" for r, peers in enumerate(unreachable) if peers)
            raise UnsupportedTopology(f"NVSHMEM put peers ({pairs or 'DEEP_EP_INTERNODE_PUT_ONLY'}): {exc}") from None
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

    def __init__(self, rank: int, num_ranks: int, num_rdma_bytes: int, num_qps_per_rank: int, allow_mnnvl: bool,
                 all_gather: Callable[[object], list], barrier: Optional[Callable[[], None]] = None) -> None:
        unique_id = join_nvshmem_world(rank, num_rdma_bytes, num_qps_per_rank, True, allow_mnnvl, all_gather)
        super().__init__(rank, num_ranks, num_rdma_bytes, unique_id, rank, num_ranks, range(num_ranks), all_gather,
                         barrier)
        # id(handle.recv_gbl_rank_prefix_sum) -> (weak reference to it, the kernels' IntranodeHandle of that dispatch)
        self._kernel_views: dict[int, tuple] = {}

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
                    "(deep_ep/composed_internode.py), this backend serves one GPU per node")
        if topology.num_ranks > _C.MAX_RANKS:
            return f"{topology.num_ranks} nodes exceed the kernels' {_C.MAX_RANKS} ranks"
        if num_rdma_bytes <= 0:
            return "num_rdma_bytes is 0"
        return None

    # ------------------------------------------------------------------------------------------------------------
    def get_local_buffer_tensor(self, dtype: torch.dtype, size: Optional[torch.Size] = None, offset: int = 0,
                                use_rdma_buffer: bool = False) -> torch.Tensor:
        """A view of the symmetric (RDMA) buffer; this backend has no NVL buffer."""
        if not use_rdma_buffer:
            raise ValueError("use_rdma_buffer=False: the CUDA internode backend (one GPU per node) keeps no NVL "
                             "buffer; pass use_rdma_buffer=True")
        return super().get_local_buffer_tensor(dtype, size, offset)

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, previous_event=None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """As the intranode layout; a node is one rank, so ``num_tokens_per_rdma_rank`` is ``num_tokens_per_rank``
        (the same tensor)."""
        layout = super().get_dispatch_layout(topk_idx, num_experts, previous_event, async_finish,
                                             allocate_on_comm_stream)
        return layout._replace(num_tokens_per_rdma_rank=layout.num_tokens_per_rank)

    def _kernel_handle(self, handle):
        """The kernels' fields of an internode handle: the ones its dispatch produced while the handle lives (so a
        cached call launches nothing but its kernel), else converted on the comm stream."""
        handle = hd.InternodeHandle(*handle)
        key = handle.recv_gbl_rank_prefix_sum
        entry = self._kernel_views.get(id(key))
        if entry is not None and entry[0]() is key:
            return entry[1]
        with torch.cuda.stream(self.comm_stream):
            return hd.single_gpu_nodes_kernel_handle(handle, self.rank)

    def _user_handle(self, handle, current_after: bool):
        compute = torch.cuda.current_stream()
        with torch.cuda.stream(self.comm_stream):
            out = hd.single_gpu_nodes_handle(handle, self.rank)
        for tensor in out:  # allocated on the comm stream, used by the caller's stream
            tensor.record_stream(compute)
        if current_after:  # the launch's wait predates the conversion
            compute.wait_stream(self.comm_stream)
        key = out.recv_gbl_rank_prefix_sum
        ident = id(key)
        self._kernel_views[ident] = (weakref.ref(key, lambda _ref: self._kernel_views.pop(ident, None)), handle)
        return out

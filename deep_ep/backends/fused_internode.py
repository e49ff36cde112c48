"""CUDA normal mode of ``N`` nodes x ``G > 1`` GPUs, one kernel per dispatch and per combine
(csrc/kernels/fused_internode.cu).

A token crosses to each node it needs once, to the GPU with the sender's local index, which forwards it over
NVLink to the node's GPUs that need it, inside the same kernel; combine reduces a token's rows inside the node at
that GPU (one BF16 rounding) and sends one partial per (token, node) back to the owner, which adds the biases and
the partials in ascending node order. The ranks' buffers are one NVSHMEM symmetric allocation of
``num_nvl_bytes + num_rdma_bytes`` of the Buffer (the kernels keep no separate NVLink buffer; a node's peers are
reached by pointer, another node's by pointer or, behind a NIC, by NVSHMEM puts). Notify builds
the internode handle's prefix matrices on the device; the dispatch kernel writes ``send_rdma_head``,
``send_nvl_head`` and ``recv_src_meta``. A combine's kernel first exchanges the hash of its call signature with
every rank and moves no row when they differ (raised at the next call, as on the intranode kernels). ``Buffer``
selects it for these groups where it serves them (deep_ep/backends/selection.py), the two-stage composition
(deep_ep/backends/composed.py) beyond; ``deep_ep.testing.overrides(internode='composed')`` selects the composition
instead.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from deep_ep import layout as lay
from deep_ep.backends.agreement import Signature
from deep_ep.backends.base import CombineRequest, DispatchRequest, LayoutRequest
from deep_ep.backends.common import object_all_gather
from deep_ep.backends.cuda_common import _C
from deep_ep.backends.cuda_internode import SymmetricCuda, UnsupportedTopology
from deep_ep.config import (
    NUM_MAX_FUSED_RANKS,
    NUM_MAX_SCALEUP_RANKS,
    Config,
    Topology,
    fused_channels,
    fused_config_ring_bytes,
)
from deep_ep.errors import CommTimeoutError, name_ranks
from deep_ep.handle import InternodeHandle, node_mask
from deep_ep.results import CombineResult, DispatchLayout, DispatchResult


class FusedInternodeCuda(SymmetricCuda):
    """Internode normal mode for one rank of ``N`` nodes x ``G`` GPUs (``2 <= G <= 8``, ``N >= 2``,
    ``N * G <= 64``, ``NUM_MAX_FUSED_RANKS``, with or without NVSHMEM put peers), every rank of its own node
    reachable by ``nvshmem_ptr``.

    Args:
        rank, topology: this rank and the group's ``N x G`` (the NVSHMEM world: PE = rank).
        num_rdma_bytes: bytes of the symmetric buffer (equal on every rank): the Buffer's ``num_nvl_bytes +
            num_rdma_bytes``.
        num_qps_per_rank, allow_mnnvl: NVSHMEM environment.
        all_gather, barrier: over the group (bootstrap, destroy, reset).

    Construction is collective. Ranks of one node reach each other by pointer; a rank of another node may be an
    NVSHMEM put peer (behind a NIC; ``internode_put_only`` makes every such pair one), reached by the rail hops'
    staged puts and signals, the buffer then carving a put area. It raises :class:`UnsupportedTopology` on every rank
    when two ranks of one node have no pointer path, or when ``num_rdma_bytes`` leaves no room for the put area.
    """

    # The agreement rides in the fused notify (non-cached dispatch); a cached dispatch's kernel and a combine's
    # compare the hashes of the ranks' call signatures in the agreement words they exchange at their start, put peers
    # included (Backend.handle_agreement, Backend.combine_agreement).
    handle_agreement = True
    combine_agreement = True

    def __init__(self, rank: int, topology: Topology, num_rdma_bytes: int, num_qps_per_rank: int, allow_mnnvl: bool,
                 all_gather: Callable[[object], list], barrier: Optional[Callable[[], None]] = None) -> None:
        reason = self.unsupported_reason(topology, num_rdma_bytes)
        if reason is not None:
            raise ValueError(f"the fused internode kernels cannot serve this group: {reason}")
        num_ranks = topology.num_ranks
        self.topology = topology
        self.num_nodes, self.per_node = topology.num_scaleout_ranks, topology.num_scaleup_ranks
        self._rings_checked: set[tuple] = set()  # check_rings: the call geometries that fit
        super().__init__(rank, num_ranks, num_rdma_bytes, num_qps_per_rank, allow_mnnvl, all_gather, barrier)
        # Decided on every rank alike: the symmetric buffer is released collectively.
        near = [list(peers) for peers in all_gather(self.same_node_put_peers(rank, self.put_peers, self.per_node))]
        if any(near):
            self.runtime.destroy()
            pairs = "; ".join(f"rank {r} reaches {peers} only by puts" for r, peers in enumerate(near) if peers)
            raise UnsupportedTopology(f"NVSHMEM put peers inside a node ({pairs}): the fused internode kernels reach "
                                      "the ranks of their own node by pointer")

    # The put area is the header alone: the kernels stage their rail records and notify words inside their region.
    put_area_kind = lay.PUT_AREA_IN_REGION

    def forced_put_span(self) -> int:
        """``internode_put_only`` makes the rail pairs (ranks of different nodes) put pairs; NVLink stays pointer."""
        return self.per_node

    @staticmethod
    def same_node_put_peers(rank: int, put_peers: Sequence[int], per_node: int) -> list[int]:
        """The put peers of ``rank`` on its own node (the fused kernels serve none)."""
        return sorted(r for r in put_peers if r // per_node == rank // per_node)

    @classmethod
    def from_group(cls, group: Any, topology: Topology, **kwargs: Any) -> "FusedInternodeCuda":
        import torch.distributed as dist

        return cls(dist.get_rank(group), topology, all_gather=object_all_gather(group),
                   barrier=lambda: dist.barrier(group=group), **kwargs)

    @staticmethod
    def unsupported_reason(topology: Topology, num_rdma_bytes: int) -> Optional[str]:
        """Why the fused kernels cannot serve ``topology`` (``None`` when they can)."""
        if not getattr(_C, "HAS_LOW_LATENCY", False):
            return "the extension was built without NVSHMEM"
        per_node = topology.num_scaleup_ranks
        if not 2 <= per_node <= NUM_MAX_SCALEUP_RANKS or topology.num_scaleout_ranks < 2:
            return f"{topology.num_scaleout_ranks} nodes x {per_node} GPUs (needs >= 2 nodes of 2..8 GPUs)"
        if topology.num_ranks > NUM_MAX_FUSED_RANKS:
            return f"{topology.num_ranks} ranks exceed the kernels' {NUM_MAX_FUSED_RANKS}"
        if num_rdma_bytes <= 0:
            return "num_rdma_bytes is 0"
        return None

    @classmethod
    def max_ranks(cls) -> int:
        """Largest group of the fused kernels (their own limit, above the ring kernels')."""
        return NUM_MAX_FUSED_RANKS

    def refuse_dispatch(self, signature) -> None:
        """As :meth:`CudaBackend.refuse_dispatch`, through the fused notify's own slots (the peers run the fused
        notify)."""
        if self.runtime is not None:
            self.runtime.fused_refuse_notify(signature.values(), self.per_node, self._comm_ptr)

    def refuse_cached_dispatch(self, signature: Signature, handle: object, num_channels: int) -> None:
        """As :meth:`CudaBackend.refuse_cached_dispatch`, with the fused dispatch kernel over ``handle`` (``None``:
        a stand-in of no tokens over ``num_channels``; the agreement words do not depend on the channels), a stand-in
        payload of 8 columns and the smallest rings."""
        if self.runtime is None:
            return
        hashed = self._checked_hash(signature)
        self._call_prologue()
        if not isinstance(handle, InternodeHandle):
            handle = self._stand_in_handle(num_channels)
        device = handle.is_token_in_rank.device
        self.runtime.fused_dispatch(
            torch.empty(handle.is_token_in_rank.size(0), 8, dtype=torch.bfloat16, device=device), None, None, None, 0,
            handle.is_token_in_rank, self.per_node, handle.recv_rdma_channel_prefix_matrix,
            handle.recv_rdma_rank_prefix_sum, handle.recv_gbl_channel_prefix_matrix, handle.recv_gbl_rank_prefix_sum,
            None, None, None, handle.recv_src_meta.size(0), False, handle.rdma_channel_prefix_matrix.size(1), 1, 2, 1,
            2, self._comm_ptr, True, True, hashed)
        self._verdict_pending = self._verdict_awaited(hashed)

    def refuse_combine(self, signature: Signature, handle: object) -> None:
        """As :meth:`CudaBackend.refuse_combine`, with the fused combine kernel over ``handle`` (``None``: a stand-in
        of no tokens over one channel), a stand-in ``x`` of 8 columns and the smallest rings."""
        if self.runtime is None:
            return
        hashed = self._checked_hash(signature)
        self._call_prologue()
        if not isinstance(handle, InternodeHandle):
            handle = self._stand_in_handle(1)
        rows, device = handle.recv_src_meta.size(0), handle.send_rdma_head.device
        self._launch_combine(torch.empty(rows, 8, dtype=torch.bfloat16, device=device), None, None, None, handle,
                             handle.rdma_channel_prefix_matrix.size(1), (1, 2, 1, 2), True, True, hashed)

    def _stand_in_handle(self, num_channels: int) -> InternodeHandle:
        """A handle of no tokens and no rows over ``num_channels`` channels (every count and prefix 0): the handle a
        refusal launches its kernel with when its own is not valid."""
        N, R, zeros = self.num_nodes, self.num_ranks, self._zeros
        return InternodeHandle(zeros(0, R, dtype=torch.bool), zeros(N, num_channels), zeros(R, num_channels),
                               zeros(N, num_channels), zeros(N), zeros(R, num_channels), zeros(R),
                               zeros(0, 8, dtype=torch.uint8), zeros(0, N), zeros(0, 8))

    def _launch_combine(self, x: torch.Tensor, topk_weights: Optional[torch.Tensor], bias_0: Optional[torch.Tensor],
                        bias_1: Optional[torch.Tensor], handle: InternodeHandle, num_channels: int,
                        chunks: tuple[int, int, int, int], after_current: bool, current_after: bool,
                        hashed: int) -> tuple:
        """The fused combine kernel over ``handle`` with ring chunks ``(rdma send, rail slots, nvl send, node
        slots)`` and the hash its kernel compares (0: unchecked); a checked call's verdict awaits the next call."""
        out = self.runtime.fused_combine(
            x, topk_weights, bias_0, bias_1, self.per_node, handle.recv_rdma_channel_prefix_matrix,
            handle.recv_rdma_rank_prefix_sum, handle.recv_gbl_channel_prefix_matrix, handle.recv_gbl_rank_prefix_sum,
            handle.send_rdma_head, handle.send_nvl_head, num_channels, *chunks, self._comm_ptr, after_current,
            current_after, hashed)
        self._verdict_pending = self._verdict_awaited(hashed)
        return out

    def _error_record(self) -> Optional[dict]:
        """The pending device error, if any; the message names the peer's node and local index too."""
        record = self.runtime.read_error()
        if record is not None and record.get("peer", -1) >= 0:
            peer = record["peer"]
            record = {**record, "message": f"{record['message']} [peer {peer} is node {peer // self.per_node}, "
                                           f"local {peer % self.per_node}]"}
        return record

    def num_channels(self, config: Config) -> int:
        """One channel per two SMs (:func:`deep_ep.config.fused_channels`)."""
        return fused_channels(config)

    def check_rings(self, kind: str, hidden_bytes: int, num_scales: int, num_topk: int, config: Config) -> None:
        """Raise ValueError unless the call's rings fit a half of the buffer: the rail rings hold
        ``num_max_rdma_chunked_recv_tokens`` records per (channel, source node) and the node rings
        ``num_max_nvl_chunked_recv_tokens / N`` per (channel, source rank) (:func:`node_ring`) whatever the buffer's
        size, and with NVSHMEM put peers the rail rings' staging too (deep_ep/layout.py). Equal on every rank that
        makes the same call; a passing geometry is remembered."""
        key = (kind, hidden_bytes, num_scales, num_topk, config)
        if key in self._rings_checked:
            return
        node, _ = node_ring(config, self.num_nodes)
        if node < 2:
            raise ValueError(f"the fused internode kernels need num_max_nvl_chunked_recv_tokens >= 2 * num_nodes "
                             f"(two slots per source node), got {config.num_max_nvl_chunked_recv_tokens} for "
                             f"{self.num_nodes} nodes")
        channels, rail = self.num_channels(config), config.num_max_rdma_chunked_recv_tokens
        if kind == "dispatch":
            record = lay.intranode_dispatch_record_bytes(hidden_bytes, num_scales, num_topk)
        else:
            record = lay.intranode_combine_record_bytes(hidden_bytes // 2, num_topk)
        used = fused_config_ring_bytes(config, self.num_nodes, self.per_node, record, self.put_area)
        half = lay.fused_half_bytes(self.ring_bytes())
        if used <= half:
            self._rings_checked.add(key)
            return
        need = lay.fused_min_rdma_bytes(used, self.put_area)
        put = " and the staging of NVSHMEM put peers" if self.put_area else ""
        raise ValueError(f"num_nvl_bytes + num_rdma_bytes={self.num_nvl_bytes} is too small for this fused internode "
                         f"{kind}: its rings take {used} bytes ({channels} channels of {self.num_nodes} rail rings "
                         f"of {rail} and {self.num_ranks} node rings of {node} records of {record} bytes{put}), a "
                         f"half of the buffer holds {half}; build the Buffer with num_nvl_bytes + num_rdma_bytes >= "
                         f"{need}{self._size_hints_text(config, hidden_bytes, num_scales, need)}")

    def _size_hints_text(self, config: Config, hidden_bytes: int, num_scales: int, need: int) -> str:
        """The config's size hints as the sizes to build the Buffer with, when their sum holds ``need`` bytes (the
        hints take BF16-sized rows, ``hidden * 2`` bytes, and 8 GPUs per node, as DeepEP's), else nothing."""
        hint_bytes = hidden_bytes * 2 if num_scales else hidden_bytes
        try:
            nvl = config.get_nvl_buffer_size_hint(hint_bytes, self.num_ranks)
            rdma = config.get_rdma_buffer_size_hint(hint_bytes, self.num_ranks)
        except ValueError:  # a rank count the hints do not take
            return ""
        if nvl + rdma < need:
            return ""
        return (f" (this config's size hints hold it: num_nvl_bytes=config.get_nvl_buffer_size_hint({hint_bytes}, "
                f"{self.num_ranks}) = {nvl}, num_rdma_bytes=config.get_rdma_buffer_size_hint({hint_bytes}, "
                f"{self.num_ranks}) = {rdma})")

    def get_local_buffer_tensor(self, dtype: torch.dtype, size: Optional[torch.Size], offset: int,
                                use_rdma_buffer: bool) -> torch.Tensor:
        """A view of the symmetric (RDMA) buffer; this backend has no NVL buffer."""
        if not use_rdma_buffer:
            raise ValueError("use_rdma_buffer=False: the fused internode backend keeps no NVL buffer; pass "
                             "use_rdma_buffer=True")
        return super().get_local_buffer_tensor(dtype, size, offset, False)

    def get_dispatch_layout(self, request: LayoutRequest) -> DispatchLayout:
        """The layout kernel, and ``num_tokens_per_rdma_rank`` (tokens that need node ``n``) after it on the comm
        stream."""
        self._call_prologue()
        topk_idx = request.topk_idx
        with self._scope(request) as scope:
            per_rank, per_expert, in_rank = self.runtime.get_dispatch_layout(
                topk_idx, request.num_experts, self._comm_ptr, scope.after_current, False)
            compute = torch.cuda.current_stream()
            with torch.cuda.stream(self.comm_stream):
                per_node = node_mask(in_rank, self.topology).sum(0, dtype=torch.int32)
            if compute != self.comm_stream:
                per_node.record_stream(compute)
                if scope.current_after:
                    compute.wait_stream(self.comm_stream)
            event = scope.finish((topk_idx, per_rank, per_node, per_expert, in_rank))
        return DispatchLayout(per_rank, per_node, per_expert, in_rank, event)

    # ------------------------------------------------------------------------------------------------------------
    def dispatch(self, request: DispatchRequest) -> DispatchResult:
        """Fused internode dispatch; ``handle`` given: cached (``(recv_x, None, None, None, None, event)``)."""
        self._call_prologue()
        data, scales = request.payload()
        config = request.config
        num_channels = self.num_channels(config)
        num_nodes, num_ranks = self.num_nodes, self.num_ranks
        cached = request.handle is not None
        topk_idx = request.topk_idx.contiguous() if request.topk_idx is not None else None
        topk_weights = request.topk_weights.contiguous() if request.topk_weights is not None else None
        num_experts = request.num_tokens_per_expert.numel() if request.num_tokens_per_expert is not None else 0
        num_worst_tokens = request.num_worst_tokens
        per_expert_list = None
        with self._scope(request) as scope:
            after_current = scope.after_current
            if cached:
                handle = request.handle
                if not isinstance(handle, InternodeHandle) or handle.rdma_channel_prefix_matrix.size(1) != num_channels:
                    raise ValueError(f"handle must be an internode handle of {num_channels} channels "
                                     f"(config.num_sms={config.num_sms}); use the dispatch's handle and config")
                is_token_in_rank = handle.is_token_in_rank
                prefixes = (handle.recv_rdma_channel_prefix_matrix, handle.recv_rdma_rank_prefix_sum,
                            handle.recv_gbl_channel_prefix_matrix, handle.recv_gbl_rank_prefix_sum)
                num_rows, worst = handle.recv_src_meta.size(0), False
                heads = (None, None, None)
            else:
                is_token_in_rank = request.is_token_in_rank.contiguous()
                device = data.device

                def int32(*shape: int) -> torch.Tensor:
                    return torch.empty(*shape, dtype=torch.int32, device=device)

                sender = (int32(num_nodes, num_channels), int32(num_ranks, num_channels))
                prefixes = (int32(num_nodes, num_channels), int32(num_nodes), int32(num_ranks, num_channels),
                            int32(num_ranks))
                signature = request.signature  # the ranks' agreement rides in notify's slots
                words = signature.values() if signature is not None else []
                self.runtime.fused_notify(request.num_tokens_per_rank, request.num_tokens_per_rdma_rank,
                                          request.num_tokens_per_expert, is_token_in_rank, num_experts, num_channels,
                                          self.per_node, request.expert_alignment, False, *sender, *prefixes,
                                          self._comm_ptr, after_current, words, True)
                after_current = False
                num_local_experts = num_experts // num_ranks
                try:
                    num_recv, per_expert_list = self.runtime.wait_recv_counts(num_local_experts)
                except (_C.HostTimeout, _C.DeviceError) as exc:
                    self.check_errors()  # a device-side report names the missing peer: prefer it
                    raise CommTimeoutError(name_ranks(str(exc), self.rank_names, self.rank_scope)) from None
                if signature is not None:
                    self._check_signatures(signature, words)  # before any row moves, on every rank alike
                num_forwarded = self.runtime.forward_count()
                worst = num_worst_tokens > 0
                num_rows = num_worst_tokens if worst else num_recv
                per_expert_list = [] if worst else list(per_expert_list)
                meta = (torch.zeros if worst else torch.empty)(num_rows, 8, dtype=torch.uint8, device=device)
                heads = (int32(data.size(0), num_nodes), int32(num_forwarded, 8), meta)
            hashed = self._checked_hash(request.signature) if cached else 0
            recv_x, recv_scales, recv_topk_idx, recv_topk_weights = self.runtime.fused_dispatch(
                data, scales, topk_idx, topk_weights, num_experts, is_token_in_rank, self.per_node, *prefixes,
                *heads, num_rows, worst, num_channels, config.num_max_rdma_chunked_send_tokens,
                config.num_max_rdma_chunked_recv_tokens, *node_ring(config, num_nodes)[::-1], self._comm_ptr,
                after_current, scope.current_after, hashed)
            self._verdict_pending = self._verdict_awaited(hashed)
            new_handle = None
            if not cached:
                send_rdma_head, send_nvl_head, recv_src_meta = heads
                new_handle = InternodeHandle(is_token_in_rank, *sender, *prefixes[:2], prefixes[2], prefixes[3],
                                             recv_src_meta, send_rdma_head, send_nvl_head)
            event = scope.finish((data, scales, topk_idx, topk_weights, is_token_in_rank, recv_x, recv_scales,
                                  recv_topk_idx, recv_topk_weights, *prefixes, *(t for t in heads if t is not None),
                                  *(new_handle or ())))
        out_x = (recv_x, recv_scales) if scales is not None else recv_x
        if cached:
            return DispatchResult(out_x, None, None, None, None, event)
        return DispatchResult(out_x, recv_topk_idx, recv_topk_weights, per_expert_list, new_handle, event)

    def combine(self, request: CombineRequest) -> CombineResult:
        """Reduce ``x [M, H]`` BF16 (rows aligned with the dispatch's ``recv_x``) back to the original tokens with
        the internode rounding points (see ``FusedCombineArgs`` in csrc/kernels/fused_internode.cuh)."""
        self._call_prologue()
        config, handle = request.config, request.handle
        num_channels = self.num_channels(config)
        if not isinstance(handle, InternodeHandle) or handle.rdma_channel_prefix_matrix.size(1) != num_channels:
            raise ValueError(f"handle must be an internode handle of {num_channels} channels "
                             f"(config.num_sms={config.num_sms}); use the dispatch's handle and config")
        x = request.x.contiguous()
        topk_weights = request.topk_weights.contiguous() if request.topk_weights is not None else None
        bias_0, bias_1 = (*(b.contiguous() for b in request.bias), None, None)[:2]
        with self._scope(request) as scope:
            # The ranks' agreement rides in the words the kernel exchanges at its start; the next call raises a
            # disagreement.
            combined_x, combined_topk_weights = self._launch_combine(
                x, topk_weights, bias_0, bias_1, handle, num_channels,
                (config.num_max_rdma_chunked_send_tokens, config.num_max_rdma_chunked_recv_tokens,
                 *node_ring(config, self.num_nodes)[::-1]),
                scope.after_current, scope.current_after, self._checked_hash(request.signature))
            event = scope.finish((request.x, x, topk_weights, bias_0, bias_1, combined_x, combined_topk_weights,
                                  *handle))
        return CombineResult(combined_x, combined_topk_weights, event)


def node_ring(config: Config, num_nodes: int) -> tuple[int, int]:
    """``(slots, publish chunk)`` of a fused node ring under ``config`` (:func:`deep_ep.layout.fused_node_ring`)."""
    return lay.fused_node_ring(config.num_max_nvl_chunked_send_tokens, config.num_max_nvl_chunked_recv_tokens,
                               num_nodes)

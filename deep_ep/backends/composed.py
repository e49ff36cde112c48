"""Internode normal dispatch/combine of ``N`` nodes x ``G > 1`` GPUs, composed of two intranode stages.

Rank ``r = (m, l)`` sits on node ``m = r // G`` at local index ``l = r % G``. The rail group of local index ``l``
holds ranks ``(0, l) .. (N-1, l)`` (rail rank = node), the node group of node ``m`` ranks ``(m, 0) .. (m, G-1)``.
The rail stage is the torch backend over the rail group; the node stage the CUDA ring kernels over CUDA IPC, or the
torch backend. This module only moves bytes between the stages.

Dispatch: the rail stage carries each token once to every node it needs (the forwarder ``(n, l)``), with its
payload, global top-k, source channel and local-rank bit mask per node; the node stage forwards each row to the
local ranks of its mask, top-k ids made node-local. A stable sort on the carried source rank gives the contract's
row order (source rank, token). Combine runs the reverse: the node stage sums a node's rows into a BF16 partial at
the forwarder, the rail stage adds the biases and the partials in ascending node order (float32, one more BF16
rounding). Every stage call is synchronous with the caller's stream. A CUDA node stage checks first, on every rank
alike, that its rings hold ``2 * num_max_nvl_chunked_send_tokens`` records (``stage_nvl_bytes`` names the size
needed).
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence

import torch

from deep_ep import handle as hd
from deep_ep import layout as lay
from deep_ep.backends.base import Backend, CombineRequest, DispatchRequest, LayoutRequest
from deep_ep.backends.common import StreamScope, as_bytes, check_worst_tokens, from_bytes, pad_rows
from deep_ep.backends.cuda_tuning import intranode_channels
from deep_ep.config import BUFFER_ALIGNMENT, Config, Topology, align_up
from deep_ep.results import CombineResult, DispatchLayout, DispatchResult

# Stage records are padded to a multiple of this many bytes (the CUDA kernels move rows in 16-byte units).
_RECORD_ALIGN = 16


class StageGroups(NamedTuple):
    """This rank's two stage subgroups and its rank in each.

    Fields:
        rail: process group of the ranks with this rank's local index (``N`` ranks, rail rank = node).
        node: process group of this rank's node (``G`` ranks, node rank = local index).
    """

    rail: Any
    node: Any


def make_stage_groups(group: Any, topology: Topology, backend: Optional[str] = None) -> StageGroups:
    """Create every rail and node subgroup of ``group`` and return this rank's two.

    Collective over the members of ``group``: every rank creates all ``G + N`` subgroups in the same order (rails
    by local index, then nodes by index), with ``use_local_synchronization`` so that ranks outside ``group`` take
    no part.

    Args:
        group: the Buffer's process group (ranks are group ranks, mapped to global ranks here).
        topology: ``N`` nodes x ``G`` ranks.
        backend: ``torch.distributed`` backend of the subgroups; ``None`` uses ``group``'s.
    """
    import torch.distributed as dist

    num_nodes, per_node = topology.num_scaleout_ranks, topology.num_scaleup_ranks
    backend = backend or dist.get_backend(group)
    members = [dist.get_global_rank(group, r) for r in range(topology.num_ranks)]
    me = group.rank()
    rail = node = None
    for local in range(per_node):
        ranks = [members[n * per_node + local] for n in range(num_nodes)]
        made = dist.new_group(ranks, backend=backend, use_local_synchronization=True) \
            if topology.local_of(me) == local else None
        rail = made if made is not None else rail
    for n in range(num_nodes):
        ranks = [members[n * per_node + local] for local in range(per_node)]
        made = dist.new_group(ranks, backend=backend, use_local_synchronization=True) \
            if topology.node_of(me) == n else None
        node = made if made is not None else node
    return StageGroups(rail, node)


class _Plan(NamedTuple):
    """What a dispatch keeps for its cached dispatch and combine.

    Fields:
        rail_handle / node_handle: the stages' intranode handles.
        order: ``[M]`` int64, the node-stage row of each final row: ``final = node_rows[order]``.
        inverse: ``[M]`` int64, the final row of each node-stage row: ``node_rows = final[inverse]``.
    """

    rail_handle: Any
    node_handle: Any
    order: torch.Tensor
    inverse: torch.Tensor


def _padded(num_bytes: int) -> int:
    """Bytes of a record whose parts take ``num_bytes``: padded to 16, at least 16."""
    return align_up(max(num_bytes, 1), _RECORD_ALIGN)


def _widths(parts: Sequence[torch.Tensor]) -> list[int]:
    """Byte width of each ``[rows, cols]`` part of a record."""
    return [p.size(1) * p.element_size() for p in parts]


def _record(parts: Sequence[torch.Tensor], num_rows: int, device: torch.device) -> tuple[torch.Tensor, list[int]]:
    """Concatenate ``[rows, *]`` tensors as bytes into ``[rows, W / 4]`` int32 (``W = _padded(sum of widths)``);
    returns the record and each part's byte width. One part that needs no padding is its own record (a view: the
    stages only read their input)."""
    raw = [as_bytes(p) for p in parts]
    widths = [r.size(1) for r in raw]
    pad = _padded(sum(widths)) - sum(widths)
    if len(raw) == 1 and pad == 0 and num_rows > 0:
        return raw[0].view(torch.int32), widths
    if pad:
        raw.append(torch.zeros(num_rows, pad, dtype=torch.uint8, device=device))
    return torch.cat(raw, dim=1).view(torch.int32), widths


def stage_nvl_bytes(record_bytes: int, num_ranks: int, num_channels: int, num_send_tokens: int) -> int:
    """Smallest ``num_nvl_bytes`` of a CUDA node stage of ``num_ranks`` ranks whose rings hold ``2 * num_send_tokens``
    records of ``record_bytes`` (the kernels' ring slot: ``deep_ep.layout.intranode_dispatch_record_bytes`` /
    ``intranode_combine_record_bytes``) per (channel, source); may exceed what a ring half can be (256 MiB)."""
    source = align_up(2 * num_send_tokens * num_channels * record_bytes, BUFFER_ALIGNMENT)
    return lay.intranode_control_bytes() + 2 * num_ranks * source


def _fields(record: torch.Tensor, widths: Sequence[int]) -> list[torch.Tensor]:
    """Inverse of :func:`_record`: the ``[rows, width]`` uint8 byte columns of each part."""
    return _split(as_bytes(record), widths)


def _channel_prefix(group_of_row: torch.Tensor, channel: torch.Tensor, num_groups: int,
                    num_channels: int) -> torch.Tensor:
    """``[G, C]`` int32 inclusive channel prefix of the rows of each group (e.g. rows per source and channel)."""
    counts = torch.zeros(num_groups * num_channels, dtype=torch.int64, device=channel.device)
    counts.index_add_(0, group_of_row.to(torch.int64) * num_channels + channel.to(torch.int64),
                      torch.ones_like(channel, dtype=torch.int64))
    return counts.view(num_groups, num_channels).cumsum(1).to(torch.int32)


def _source_of_rows(inclusive_prefix: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``[M]`` int64 source of each row, given the inclusive prefix over sources of the rows received."""
    rows = torch.arange(num_rows, dtype=inclusive_prefix.dtype, device=inclusive_prefix.device)
    return torch.searchsorted(inclusive_prefix.contiguous(), rows, right=True)


def internode_handle_fields(mask: torch.Tensor, topology: Topology, num_channels: int, rail_prefix: torch.Tensor,
                            fwd_channel: torch.Tensor, fwd_local_mask: torch.Tensor, src_rank: torch.Tensor,
                            src_channel: torch.Tensor, src_local_mask: torch.Tensor) -> hd.InternodeHandle:
    """The ten internode handle fields of rank ``(n, l)`` from what the stages delivered (device ops only).

    Args:
        mask: ``[T, R]`` bool, this rank's ``is_token_in_rank`` (sender fields).
        topology: ``N x G``.
        num_channels: ``C``.
        rail_prefix: ``[N]`` inclusive prefix over source nodes of the rows this rank forwards (the rail stage's
            ``rank_prefix_matrix[:, n]``).
        fwd_channel / fwd_local_mask: ``[F]`` source channel and ``[F, G]`` bool destinations in node ``n`` of every
            forwarded row (rail-stage order: source node, then token).
        src_rank / src_channel / src_local_mask: ``[M]`` global source rank, ``[M]`` source channel and ``[M, G]``
            bool local destinations of every received row, in the final order.
    """
    sender = hd.internode_sender(mask, num_channels, topology)
    num_nodes, per_node = topology.num_scaleout_ranks, topology.num_scaleup_ranks
    fwd_node = _source_of_rows(rail_prefix, fwd_channel.size(0))
    recv_rdma_prefix = hd.recv_rdma_channel_prefix_matrix(
        _channel_prefix(fwd_node, fwd_channel, num_nodes, num_channels))
    src_prefix = _channel_prefix(src_rank, src_channel, topology.num_ranks, num_channels)
    gbl_rank_prefix = hd.recv_gbl_rank_prefix_sum(src_prefix[:, -1])  # rows per source: its last channel's prefix
    gbl_channel_prefix = hd.recv_gbl_channel_prefix_matrix(src_prefix, gbl_rank_prefix)
    return hd.InternodeHandle(
        is_token_in_rank=mask,
        rdma_channel_prefix_matrix=sender.rdma_channel_prefix_matrix,
        gbl_channel_prefix_matrix=sender.gbl_channel_prefix_matrix,
        recv_rdma_channel_prefix_matrix=recv_rdma_prefix,
        recv_rdma_rank_prefix_sum=rail_prefix.to(torch.int32).clone(),
        recv_gbl_channel_prefix_matrix=gbl_channel_prefix,
        recv_gbl_rank_prefix_sum=gbl_rank_prefix,
        recv_src_meta=hd.encode_src_meta(src_rank.to(torch.int64) // per_node, src_local_mask),
        send_rdma_head=sender.send_rdma_head,
        send_nvl_head=hd.forwarder_send_nvl_head(fwd_node, fwd_channel, fwd_local_mask, num_channels))


class ComposedInternode(Backend):
    """Internode normal dispatch/combine of one rank ``(n, l)`` as a rail stage then a node stage.

    Args:
        rail: torch stage backend over the rail group of local index ``l`` (``N`` ranks; its rank = ``n``).
        node: stage backend over node ``n``'s group (``G`` ranks; its rank = ``l``).
        rank: this rank in the Buffer's group.
        topology: ``N x G`` with ``N > 1``, ``1 < G``.
        cuda_node: the node stage is the CUDA ring kernels (``ring_bytes()``, ``buffer_arg``, ``reset()``): every
            call checks its rings and the kernels' top-k limit first.

    The stages are intranode backends (their ``dispatch`` / ``combine`` and intranode handles).
    """

    needs_host_checks = True

    def __init__(self, rail: Backend, node: Backend, rank: int, topology: Topology, cuda_node: bool = False) -> None:
        if not topology.is_internode or topology.num_scaleup_ranks < 2:
            raise ValueError(f"the composed internode path needs N > 1 nodes of G > 1 ranks, got "
                             f"{topology.num_scaleout_ranks} x {topology.num_scaleup_ranks}")
        self.rail, self.node, self.rank, self.topology = rail, node, rank, topology
        self.num_ranks = topology.num_ranks
        self.cuda_node = cuda_node
        self.my_node, self.my_local = topology.node_of(rank), topology.local_of(rank)
        # Stage errors name the Buffer's ranks (the stages number their own): rail rank n is rank n * G + l, node
        # rank l' is rank m * G + l'.
        num_nodes, per_node = topology.num_scaleout_ranks, topology.num_scaleup_ranks
        for stage, members, scope in (
                (rail, [n * per_node + self.my_local for n in range(num_nodes)], "composed rail stage"),
                (node, [self.my_node * per_node + local for local in range(per_node)], "composed node stage")):
            stage.set_rank_names(members, scope)

    # ------------------------------------------------------------------------------------------------------------
    # Bookkeeping
    # ------------------------------------------------------------------------------------------------------------
    def _plan(self, handle: hd.InternodeHandle) -> _Plan:
        """The stage handles and row order behind ``handle`` (its ``backend_state``)."""
        plan = handle.backend_state
        if not isinstance(plan, _Plan):
            raise ValueError(f"handle was not returned by this Buffer's composed internode dispatch (rank "
                             f"{self.rank}); pass the handle of a dispatch made with the same Buffer")
        return plan

    @staticmethod
    def _scope(request: Any, device: torch.device) -> StreamScope:
        """The call's stream protocol: every stage runs synchronously with the current stream, where the stage
        records are built, so the call orders after ``previous_event`` there and an asynchronous call gets an
        event recorded there after the last step."""
        stream = torch.cuda.current_stream() if device.type == "cuda" else None
        return StreamScope(stream, request.previous_event, request.async_finish)

    def _stage_request(self, config: Config) -> dict:
        """What every stage call passes besides its data: the call's config, synchronous."""
        return dict(config=config)

    def destroy(self) -> None:
        self.rail.destroy()
        self.node.destroy()

    def reset(self) -> None:
        """Collective: the CUDA node stage's recovery after a failed call."""
        if self.cuda_node:
            self.node.reset()

    def check_errors(self) -> None:
        """Raise a stage's pending device error, if any."""
        self.rail.check_errors()
        self.node.check_errors()

    def _check_stage(self, kind: str, record_bytes: int, config: Config) -> None:
        """Raise ValueError unless a CUDA node stage's rings hold ``2 * num_max_nvl_chunked_send_tokens`` ring slots
        of ``record_bytes`` for ``kind`` ('dispatch' / 'combine') per (channel, source)."""
        if not self.cuda_node:
            return
        num_ranks = self.topology.num_scaleup_ranks
        channels = intranode_channels(config.num_sms, num_ranks)
        geometry = lay.intranode_ring_geometry(self.node.ring_bytes(), num_ranks, channels, record_bytes,
                                               config.num_max_nvl_chunked_recv_tokens, kind == "combine")
        need = 2 * config.num_max_nvl_chunked_send_tokens
        if geometry.capacity >= need:
            return
        want = stage_nvl_bytes(record_bytes, num_ranks, channels, config.num_max_nvl_chunked_send_tokens)
        fix = f"build the Buffer with num_nvl_bytes >= {want}" \
            if want <= lay.intranode_control_bytes() + 2 * lay.INTRANODE_MAX_RING_HALF_BYTES else \
            "lower config.num_sms or num_max_nvl_chunked_send_tokens (no buffer size fits)"
        raise ValueError(f"num_nvl_bytes={self.node.num_nvl_bytes} is too small for the composed internode path's "
                         f"node stage {kind}: its rings hold {geometry.capacity} slots of {record_bytes} bytes "
                         f"(payload, top-k and metadata) per (channel, rank) with {channels} channels and "
                         f"{num_ranks} ranks, need >= 2 * num_max_nvl_chunked_send_tokens = {need}; {fix}")

    def _check_dispatch(self, payload: list[torch.Tensor], topk_idx: Optional[torch.Tensor], config: Config) -> None:
        """Checks of a non-cached dispatch on a CUDA node stage, before any communication (equal on every rank)."""
        if not self.cuda_node:
            return
        num_topk = topk_idx.size(1) if topk_idx is not None else 0
        if num_topk > lay.INTRANODE_MAX_TOPK:
            raise ValueError(f"the composed internode path on a CUDA node stage carries at most "
                             f"{lay.INTRANODE_MAX_TOPK} top-k entries per token (the intranode kernels' limit), got "
                             f"{num_topk}")
        node = _padded(sum(_widths(payload)) + 12)
        self._check_stage("dispatch", lay.intranode_dispatch_record_bytes(node, 0, num_topk), config)

    def get_comm_stream(self) -> Any:
        return self.node.get_comm_stream()

    # ------------------------------------------------------------------------------------------------------------
    # Layout
    # ------------------------------------------------------------------------------------------------------------
    def get_dispatch_layout(self, request: LayoutRequest) -> DispatchLayout:
        """Local computation (:func:`deep_ep.handle.layout_from_topk`) on the current stream."""
        with self._scope(request, request.topk_idx.device) as scope:
            layout = hd.layout_from_topk(request.topk_idx, request.num_experts, self.topology)
            return DispatchLayout(*layout, scope.finish(()))

    # ------------------------------------------------------------------------------------------------------------
    # Dispatch
    # ------------------------------------------------------------------------------------------------------------
    def dispatch(self, request: DispatchRequest) -> DispatchResult:
        """Normal internode dispatch (see ``Buffer.dispatch``); ``handle`` given: cached dispatch."""
        data, scales = request.payload()
        stage = self._stage_request(request.config)
        if request.handle is not None:
            plan = self._plan(request.handle)
            with self._scope(request, data.device) as scope:
                recv_x = self._cached_dispatch(data, scales, plan, stage)
                return DispatchResult(recv_x, None, None, None, None, scope.finish(()))
        self._check_dispatch(self._payload(data, scales), request.topk_idx, request.config)
        with self._scope(request, data.device) as scope:
            out = self._dispatch(data, scales, request.is_token_in_rank, request.num_tokens_per_expert,
                                 request.topk_idx, request.topk_weights, request.expert_alignment, stage)
            if request.num_worst_tokens > 0:
                out = self._pad_to_worst(out, request.num_worst_tokens)
            return DispatchResult(*out, scope.finish(()))

    def _pad_to_worst(self, out: tuple, num_worst_tokens: int) -> tuple:
        """Worst-token mode: every output padded to ``num_worst_tokens`` rows (payload and scales 0, top-k
        ids -1, weights 0, the handle's ``recv_src_meta`` 0) and an empty per-expert list; the plan is kept under the
        padded handle. The stages have synchronised with the host for their counts all the same: same outputs as
        the kernels' worst-token mode, not its capturability."""
        recv_x, recv_idx, recv_weights, _, handle = out
        check_worst_tokens(num_worst_tokens, recv_idx.size(0), self.rank)
        if isinstance(recv_x, tuple):
            recv_x = tuple(pad_rows(t, num_worst_tokens) for t in recv_x)
        else:
            recv_x = pad_rows(recv_x, num_worst_tokens)
        padded = handle._replace(recv_src_meta=pad_rows(handle.recv_src_meta, num_worst_tokens))
        padded.backend_state = handle.backend_state
        return (recv_x, pad_rows(recv_idx, num_worst_tokens, -1), pad_rows(recv_weights, num_worst_tokens), [],
                padded)

    def _payload(self, data: torch.Tensor, scales: Optional[torch.Tensor]) -> list[torch.Tensor]:
        return [data] if scales is None else [data, scales.contiguous()]

    def _unpack_payload(self, cols: list[torch.Tensor], order: torch.Tensor, data: torch.Tensor,
                        scales: Optional[torch.Tensor]) -> Any:
        """The payload fields ``cols`` (byte columns of the node stage's rows) in the contract's row ``order``: one
        gather per field, straight into its own tensor."""
        recv_data = _gathered(cols[0], order, data.dtype, data.size(1))
        if scales is None:
            return recv_data
        return recv_data, _gathered(cols[1], order, scales.dtype, scales.size(1))

    def _rail_dispatch(self, record: torch.Tensor, node_mask: torch.Tensor, num_tokens_per_expert: torch.Tensor,
                       stage: dict) -> DispatchResult:
        """Rail-stage dispatch. Its "experts" are the global experts grouped by node, so that its per-expert list
        on the forwarder ``(n, l)`` is the rail sources' ``num_tokens_per_expert`` summed over node ``n``'s
        experts: what the node stage needs to report DeepEP's counts."""
        return self.rail.dispatch(DispatchRequest(record, None, node_mask.sum(0, dtype=torch.int32), None, node_mask,
                                                  num_tokens_per_expert, **stage))

    def _dispatch(self, data: torch.Tensor, scales: Optional[torch.Tensor], mask: torch.Tensor,
                  num_tokens_per_expert: torch.Tensor, topk_idx: Optional[torch.Tensor],
                  topk_weights: Optional[torch.Tensor], expert_alignment: int, stage: dict) -> tuple:
        topo, device = self.topology, data.device
        num_nodes, per_node = topo.num_scaleout_ranks, topo.num_scaleup_ranks
        num_tokens = data.size(0)
        num_channels = self.num_channels(stage["config"])
        mask = mask.to(torch.bool)
        has_topk = topk_idx is not None
        num_experts = num_tokens_per_expert.numel()
        experts_per_node = num_experts // num_nodes

        # (1) Rail stage: one record per token, to every node it needs.
        channel = hd.token_channels(num_tokens, num_channels, device).to(torch.int32)
        bits = hd.pack_rank_bits(mask.reshape(num_tokens, num_nodes, per_node))                 # [T, N] int32
        payload = self._payload(data, scales)
        parts = payload + ([topk_idx, topk_weights] if has_topk else []) + [channel.view(-1, 1), bits]
        record, widths = _record(parts, num_tokens, device)
        rail = self._rail_dispatch(record, hd.node_mask(mask, topo), num_tokens_per_expert, stage)
        cols = _fields(rail.recv_x, widths)
        num_fwd = rail.recv_x.size(0)
        num_payload = len(payload)
        fwd_channel = from_bytes(cols[-2], torch.int32, 1).view(-1)
        fwd_bits = from_bytes(cols[-1], torch.int32, num_nodes)[:, self.my_node].contiguous()
        fwd_mask = hd.unpack_rank_bits(fwd_bits, per_node)                                       # [F, G]
        rail_prefix = rail.handle.rank_prefix_matrix[:, self.my_node]
        fwd_node = _source_of_rows(rail_prefix, num_fwd)
        fwd_src_rank = (fwd_node * per_node + self.my_local).to(torch.int32)

        # (2) Node stage: forward each row to the local ranks of its mask, top-k ids made node-local.
        node_topk = {}
        if has_topk:
            fwd_idx = from_bytes(cols[num_payload], topk_idx.dtype, topk_idx.size(1))
            fwd_weights = from_bytes(cols[num_payload + 1], torch.float32, topk_idx.size(1))
            local = fwd_idx - self.my_node * experts_per_node
            local = torch.where((fwd_idx >= 0) & (local >= 0) & (local < experts_per_node), local,
                                torch.full_like(local, -1))
            node_topk = dict(topk_idx=local, topk_weights=fwd_weights)
        node_counts = torch.tensor(rail.num_recv_tokens_per_expert_list, dtype=torch.int32, device=device)
        node_record, node_widths = _record(
            [as_bytes(rail.recv_x)[:, :sum(widths[:num_payload])], fwd_channel.view(-1, 1),
             fwd_src_rank.view(-1, 1), fwd_bits.view(-1, 1)], num_fwd, device)
        node = self.node.dispatch(DispatchRequest(node_record, None, fwd_mask.sum(0, dtype=torch.int32), None,
                                                  fwd_mask, node_counts, node_topk.get("topk_idx"),
                                                  node_topk.get("topk_weights"), expert_alignment, **stage))

        # (3) Final order: global source rank, then source token (stable sort of the node-stage order).
        node_cols = _fields(node.recv_x, node_widths)
        src_rank = from_bytes(node_cols[2], torch.int32, 1).view(-1)
        order = torch.sort(src_rank.to(torch.int64), stable=True).indices
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        recv_x = self._unpack_payload(_split(node_cols[0], widths[:num_payload]), order, data, scales)
        recv_idx = recv_weights = None
        if has_topk:
            recv_idx, recv_weights = node.recv_topk_idx[order], node.recv_topk_weights[order]
        recv_channel = _gathered(node_cols[1], order, torch.int32, 1).view(-1)
        recv_mask = hd.unpack_rank_bits(_gathered(node_cols[3], order, torch.int32, 1).view(-1), per_node)
        new_handle = internode_handle_fields(mask, topo, num_channels, rail_prefix, fwd_channel, fwd_mask,
                                             src_rank[order], recv_channel, recv_mask)
        new_handle.backend_state = _Plan(rail.handle, node.handle, order, inverse)
        return recv_x, recv_idx, recv_weights, node.num_recv_tokens_per_expert_list, new_handle

    def _cached_dispatch(self, data: torch.Tensor, scales: Optional[torch.Tensor], plan: _Plan, stage: dict) -> Any:
        """Payload-only records (narrower than the dispatch's: the kernels size rings and output blocks per
        call, from the call's own row width)."""
        payload = self._payload(data, scales)
        width = lay.intranode_dispatch_record_bytes(_padded(sum(_widths(payload))), 0, 0)
        self._check_stage("dispatch", width, stage["config"])
        record, widths = _record(payload, data.size(0), data.device)
        rail = self.rail.dispatch(DispatchRequest(record, plan.rail_handle, **stage))
        node = self.node.dispatch(DispatchRequest(rail.recv_x, plan.node_handle, **stage))
        return self._unpack_payload(_split(as_bytes(node.recv_x), widths), plan.order, data, scales)

    # ------------------------------------------------------------------------------------------------------------
    # Combine
    # ------------------------------------------------------------------------------------------------------------
    def combine(self, request: CombineRequest) -> CombineResult:
        """Node-stage combine (per-node float32 sum, BF16 partial at the forwarder), then rail-stage combine (biases
        plus the partials in ascending node order, float32, one more BF16 rounding) at the owner."""
        x, topk_weights, config = request.x, request.topk_weights, request.config
        plan = self._plan(request.handle)
        stage = self._stage_request(config)
        width = lay.intranode_combine_record_bytes(x.size(1), topk_weights.size(1) if topk_weights is not None else 0)
        self._check_stage("combine", width, config)
        with self._scope(request, x.device) as scope:
            node_x = x.index_select(0, plan.inverse)
            node_w = topk_weights.index_select(0, plan.inverse) if topk_weights is not None else None
            node = self.node.combine(CombineRequest(node_x, plan.node_handle, node_w, **stage))
            rail = self.rail.combine(CombineRequest(node.combined_x, plan.rail_handle, node.combined_topk_weights,
                                                    request.bias, **stage))
            return CombineResult(rail.combined_x, rail.combined_topk_weights, scope.finish(()))


def _gathered(raw: torch.Tensor, order: torch.Tensor, dtype: torch.dtype, cols: int) -> torch.Tensor:
    """Rows ``order`` of a ``[rows, cols * itemsize]`` uint8 view (any column slice) as a fresh row-major
    ``[len(order), cols]`` tensor of ``dtype``: one pass over the bytes."""
    if order.numel() == 0 or cols == 0:
        return torch.empty(order.numel(), cols, dtype=dtype, device=raw.device)
    return raw.index_select(0, order).view(dtype).view(-1, cols)


def _split(rows: torch.Tensor, widths: Sequence[int]) -> list[torch.Tensor]:
    """``[M, >= sum(widths)]`` uint8 -> the byte columns of each width, in order (the padding is dropped)."""
    return list(torch.split(rows[:, :sum(widths)], list(widths), dim=1))

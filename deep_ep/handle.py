"""Dispatch handles and the bookkeeping math behind every handle field.

Torch only; no extension, no ``reference``. The functions are pure (tensors in, tensors out) and split the way a
distributed implementation runs them: the sender side (:func:`intranode_sender`, :func:`internode_sender`) from this
rank's ``is_token_in_rank`` and the channel count; an exchange of counts, prefixes and per-row metadata that the
caller makes; the receiver side (:func:`rank_prefix_matrix`, :func:`recv_channel_prefix_matrix`, the
``recv_gbl_*`` / ``recv_rdma_*`` functions, :func:`encode_src_meta`, :func:`forwarder_send_nvl_head`).

Channels: a sender splits its ``N`` tokens into ``C`` contiguous chunks of ``ceil(N / C)`` tokens; token ``t`` is in
channel ``t // ceil(N / C)``. A token's ring sequence number is its position among the earlier tokens of the same
ring (same channel and destination), from 0, never reduced modulo the ring capacity. Integer handle tensors are
int32, as in DeepEP; ``recv_src_meta`` is uint8 and ``is_token_in_rank`` bool.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from deep_ep.config import NUM_MAX_SCALEUP_RANKS, Topology, ceil_div, num_local_experts
from deep_ep.numerics import dense_copy
from deep_ep.validate import check_expert_range

# ---------------------------------------------------------------------------------------------------------------
# Handle and result types (tuple positions are DeepEP's).
# ---------------------------------------------------------------------------------------------------------------

class HandleState:
    """What a handle carries beside DeepEP's tuple fields (attributes, not tuple positions).

    Attributes:
        owner: the token of the ``Buffer`` that returned the handle (``None``: no Buffer returned it); a Buffer
            accepts only its own handles.
        backend_state: what the backend that made the handle reuses in its cached dispatch and combine (the CUDA
            kernels' pair counts or intranode handle, the composed path's stage handles), ``None`` for nothing.
        serial: the number of the call that made the handle among its Buffer's dispatches since its last
            ``clean_low_latency_buffer``, plus 10**12 times the number of those cleans (the same on every rank that
            made the same calls since the last clean; the ranks check it agrees when the handle is used), ``-1``
            for none.
    """

    __slots__ = ()
    owner: object = None
    serial: int = -1
    backend_state: object = None


class _IntranodeFields(NamedTuple):
    rank_prefix_matrix: torch.Tensor
    channel_prefix_matrix: torch.Tensor
    recv_channel_prefix_matrix: torch.Tensor
    recv_src_idx: torch.Tensor
    is_token_in_rank: torch.Tensor
    send_head: torch.Tensor


class IntranodeHandle(_IntranodeFields, HandleState):
    """Handle of an intranode normal dispatch (DeepEP's 6-tuple).

    Fields (``R`` ranks, ``C`` channels, ``N`` tokens sent by this rank, ``M`` rows received by this rank):
        rank_prefix_matrix: ``[R, R]`` int32. ``[s, d]`` = tokens sent to ``d`` by ranks ``0..s`` (inclusive prefix
            over the source axis); identical on every rank; ``[R-1, d]`` = rows received by ``d``.
        channel_prefix_matrix: ``[R, C]`` int32, sender side. ``[d, c]`` = this rank's tokens to ``d`` in channels
            ``0..c`` (inclusive).
        recv_channel_prefix_matrix: ``[R, C]`` int32, receiver side. ``[s, c]`` = start of source ``s``'s channel
            ``c`` inside the block of rows from ``s`` (exclusive prefix, rank offset not included).
        recv_src_idx: ``[M]`` int32: row index of each received token in its source rank's ``x``.
        is_token_in_rank: ``[N, R]`` bool: the routing mask this rank dispatched with.
        send_head: ``[N, R]`` int32: ring sequence number of token ``t`` in ring (channel of ``t``, ``d``), or -1 if
            ``t`` was not sent to ``d``.
    """


class _InternodeFields(NamedTuple):
    is_token_in_rank: torch.Tensor
    rdma_channel_prefix_matrix: torch.Tensor
    gbl_channel_prefix_matrix: torch.Tensor
    recv_rdma_channel_prefix_matrix: torch.Tensor
    recv_rdma_rank_prefix_sum: torch.Tensor
    recv_gbl_channel_prefix_matrix: torch.Tensor
    recv_gbl_rank_prefix_sum: torch.Tensor
    recv_src_meta: torch.Tensor
    send_rdma_head: torch.Tensor
    send_nvl_head: torch.Tensor


class InternodeHandle(_InternodeFields, HandleState):
    """Handle of an internode normal dispatch (DeepEP's 10-tuple).

    ``R_so`` = nodes (scale-out ranks), ``P`` = ranks per node; this rank is ``(my_node, my_local)``.

    Fields:
        is_token_in_rank: ``[N, R]`` bool, sender-side mask.
        rdma_channel_prefix_matrix: ``[R_so, C]`` int32, sender: inclusive channel prefix of tokens that need node
            ``n`` (a token counts once per node).
        gbl_channel_prefix_matrix: ``[R, C]`` int32, sender: inclusive channel prefix of tokens sent to rank ``d``.
        recv_rdma_channel_prefix_matrix: ``[R_so, C]`` int32, forwarder: for source node ``n``, the inclusive channel
            prefix of tokens arriving from rank ``(n, my_local)`` (i.e. that rank's
            ``rdma_channel_prefix_matrix[my_node]``).
        recv_rdma_rank_prefix_sum: ``[R_so]`` int32, forwarder: inclusive prefix over source nodes of tokens arriving
            from ``(n, my_local)``; the last entry is the number of forwarded tokens ``F``.
        recv_gbl_channel_prefix_matrix: ``[R, C]`` int32, receiver: absolute first row in ``recv_x`` of source
            ``s``'s channel ``c``.
        recv_gbl_rank_prefix_sum: ``[R]`` int32, receiver: inclusive prefix over sources of rows received.
        recv_src_meta: ``[M, 8]`` uint8: per row two little-endian int32 words, the source node and the bit mask of
            the local ranks of this rank's node that receive the token (see :func:`encode_src_meta`).
        send_rdma_head: ``[N, R_so]`` int32, sender: ring sequence number per (channel, node), or -1.
        send_nvl_head: ``[F, 8]`` int32, forwarder: per forwarded token (source node asc, then token asc) and local
            destination ``j``, the ring sequence number per (source node, channel, ``j``), or -1; columns
            ``j >= P`` are -1.
    """


class _LowLatencyFields(NamedTuple):
    packed_recv_src_info: torch.Tensor
    packed_recv_layout_range: torch.Tensor
    num_max_dispatch_tokens_per_rank: int
    hidden: int
    num_experts: int


class LowLatencyHandle(_LowLatencyFields, HandleState):
    """Handle of a low-latency dispatch (DeepEP's 5-tuple).

    Fields (``L`` local experts, ``R`` ranks, ``T`` = num_max_dispatch_tokens_per_rank):
        packed_recv_src_info: ``[L, R*T]`` int32: for each valid packed row, the token's row in its source's ``x``.
        packed_recv_layout_range: ``[L, R]`` int64: ``(begin << 32) | count`` of the contiguous rows of expert
            ``j`` that came from source ``s``.
        num_max_dispatch_tokens_per_rank: ``T`` (int).
        hidden: ``H`` (int).
        num_experts: ``E`` (int).
    """


class LayoutResult(NamedTuple):
    """What ``get_dispatch_layout`` computes (without the event).

    Fields:
        num_tokens_per_rank: ``[R]`` int32: tokens with at least one expert on rank ``r``.
        num_tokens_per_rdma_rank: ``[R_so]`` int32: tokens with at least one expert on node ``n``; ``None`` unless
            the topology spans several nodes.
        num_tokens_per_expert: ``[E]`` int32: ``(token, k)`` pairs selecting expert ``e`` (duplicates count twice).
        is_token_in_rank: ``[N, R]`` bool.
    """

    num_tokens_per_rank: torch.Tensor
    num_tokens_per_rdma_rank: Optional[torch.Tensor]
    num_tokens_per_expert: torch.Tensor
    is_token_in_rank: torch.Tensor


class IntranodeSender(NamedTuple):
    """Sender-side part of an intranode handle: ``channel_prefix_matrix [R, C]`` and ``send_head [N, R]``."""

    channel_prefix_matrix: torch.Tensor
    send_head: torch.Tensor


class InternodeSender(NamedTuple):
    """Sender-side part of an internode handle (see :class:`InternodeHandle` for shapes)."""

    rdma_channel_prefix_matrix: torch.Tensor
    gbl_channel_prefix_matrix: torch.Tensor
    send_rdma_head: torch.Tensor


# ---------------------------------------------------------------------------------------------------------------
# Layout.
# ---------------------------------------------------------------------------------------------------------------

def layout_from_topk(topk_idx: torch.Tensor, num_experts: int, topology: Topology) -> LayoutResult:
    """``get_dispatch_layout`` semantics for one rank's routing.

    Args:
        topk_idx: ``[N, K]`` int32/int64 global expert ids in ``[0, E)`` or -1 (ignored).
        num_experts: ``E``, divisible by ``topology.num_ranks``.
        topology: rank/node mapping.
    Returns:
        :class:`LayoutResult` (all int32 counts, bool mask), on ``topk_idx``'s device.
    """
    if not isinstance(topk_idx, torch.Tensor) or topk_idx.dim() != 2:
        raise ValueError(f"topk_idx must be a 2-D tensor [num_tokens, num_topk], got {topk_idx!r:.80}")
    if topk_idx.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_idx must be int32 or int64, got {topk_idx.dtype}")
    num_ranks = topology.num_ranks
    experts_per_rank = num_local_experts(num_experts, num_ranks)
    idx = topk_idx.to(torch.int64)
    check_expert_range("topk_idx", idx, num_experts)
    valid = idx >= 0
    num_tokens = idx.size(0)
    num_tokens_per_expert = torch.bincount(idx[valid], minlength=num_experts).to(torch.int32)
    owner = torch.where(valid, idx // experts_per_rank, torch.full_like(idx, num_ranks))
    hits = torch.zeros(num_tokens, num_ranks + 1, dtype=torch.bool, device=idx.device)
    hits.scatter_(1, owner, True)
    is_token_in_rank = hits[:, :num_ranks].contiguous()
    num_tokens_per_rank = is_token_in_rank.sum(0, dtype=torch.int32)
    num_tokens_per_rdma_rank = None
    if topology.is_internode:
        per_node = node_mask(is_token_in_rank, topology)
        num_tokens_per_rdma_rank = per_node.sum(0, dtype=torch.int32)
    return LayoutResult(num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank)


def node_mask(is_token_in_rank: torch.Tensor, topology: Topology) -> torch.Tensor:
    """``[N, R]`` bool -> ``[N, R_so]`` bool: does the token need any rank of node ``n``."""
    num_tokens = is_token_in_rank.size(0)
    return is_token_in_rank.reshape(num_tokens, topology.num_scaleout_ranks, topology.num_scaleup_ranks).any(-1)


# ---------------------------------------------------------------------------------------------------------------
# Sender side.
# ---------------------------------------------------------------------------------------------------------------

def token_channels(num_tokens: int, num_channels: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[N]`` int64: channel of every token (``t // ceil(N / C)``)."""
    if num_channels < 1:
        raise ValueError(f"num_channels must be >= 1, got {num_channels}")
    per_channel = max(ceil_div(num_tokens, num_channels), 1)
    return torch.arange(num_tokens, device=device) // per_channel


def channel_counts(mask: torch.Tensor, num_channels: int) -> torch.Tensor:
    """Per-destination, per-channel token counts.

    Args:
        mask: ``[N, D]`` bool, ``mask[t, d]`` = token ``t`` goes to destination ``d``.
        num_channels: ``C``.
    Returns:
        ``[D, C]`` int32: ``[d, c]`` = tokens of channel ``c`` that go to ``d`` (not cumulative).
    """
    num_tokens, num_dst = mask.shape
    channel = token_channels(num_tokens, num_channels, mask.device)
    counts = torch.zeros(num_channels, num_dst, dtype=torch.int64, device=mask.device)
    counts.index_add_(0, channel, mask.to(torch.int64))
    return counts.t().contiguous().to(torch.int32)


def ring_sequence(group: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Ring sequence numbers: for each row and column, how many earlier rows of the same group have the column set.

    Args:
        group: ``[N]`` int64, non-decreasing (rows of one group are contiguous), e.g. the channel of each token.
        mask: ``[N, D]`` bool.
    Returns:
        ``[N, D]`` int32: the count of rows ``r' < r`` with ``group[r'] == group[r]`` and ``mask[r', d]``, where
        ``mask[r, d]``; -1 elsewhere.
    """
    num_rows, num_dst = mask.shape
    if num_rows == 0:
        return torch.empty(0, num_dst, dtype=torch.int32, device=mask.device)
    inclusive = mask.to(torch.int64).cumsum(0)
    exclusive = inclusive - mask.to(torch.int64)
    # Rows before a group's first row: subtract the running count there.
    is_first = torch.ones(num_rows, dtype=torch.bool, device=mask.device)
    is_first[1:] = group[1:] != group[:-1]
    first_row = torch.cummax(torch.where(is_first, torch.arange(num_rows, device=mask.device), 0), 0).values
    seq = exclusive - exclusive[first_row]
    return torch.where(mask, seq, torch.full_like(seq, -1)).to(torch.int32)


def _check_mask(is_token_in_rank: torch.Tensor, num_ranks: Optional[int] = None) -> None:
    if not isinstance(is_token_in_rank, torch.Tensor) or is_token_in_rank.dtype != torch.bool \
            or is_token_in_rank.dim() != 2:
        raise ValueError("is_token_in_rank must be a 2-D bool tensor [num_tokens, num_ranks], got "
                         f"{getattr(is_token_in_rank, 'dtype', type(is_token_in_rank))} "
                         f"{tuple(getattr(is_token_in_rank, 'shape', ()))}")
    if num_ranks is not None and is_token_in_rank.size(1) != num_ranks:
        raise ValueError(f"is_token_in_rank must have {num_ranks} columns (num_ranks), got {is_token_in_rank.size(1)}")


def intranode_sender(is_token_in_rank: torch.Tensor, num_channels: int) -> IntranodeSender:
    """Sender-side handle fields of an intranode dispatch.

    Args:
        is_token_in_rank: ``[N, R]`` bool.
        num_channels: ``C``.
    Returns:
        :class:`IntranodeSender`: ``channel_prefix_matrix [R, C]`` int32 (inclusive over channels) and
        ``send_head [N, R]`` int32 (ring sequence number per (channel, destination), -1 if not sent).
    """
    _check_mask(is_token_in_rank)
    prefix = channel_counts(is_token_in_rank, num_channels).cumsum(1, dtype=torch.int32)
    channel = token_channels(is_token_in_rank.size(0), num_channels, is_token_in_rank.device)
    return IntranodeSender(prefix, ring_sequence(channel, is_token_in_rank))


def internode_sender(is_token_in_rank: torch.Tensor, num_channels: int, topology: Topology) -> InternodeSender:
    """Sender-side handle fields of an internode dispatch.

    Args:
        is_token_in_rank: ``[N, R]`` bool.
        num_channels: ``C``.
        topology: ``R = R_so * P``.
    Returns:
        :class:`InternodeSender`: ``rdma_channel_prefix_matrix [R_so, C]``, ``gbl_channel_prefix_matrix [R, C]``
        (inclusive over channels, int32) and ``send_rdma_head [N, R_so]`` int32.
    """
    _check_mask(is_token_in_rank, topology.num_ranks)
    nodes = node_mask(is_token_in_rank, topology)
    channel = token_channels(is_token_in_rank.size(0), num_channels, is_token_in_rank.device)
    return InternodeSender(channel_counts(nodes, num_channels).cumsum(1, dtype=torch.int32),
                           channel_counts(is_token_in_rank, num_channels).cumsum(1, dtype=torch.int32),
                           ring_sequence(channel, nodes))


# ---------------------------------------------------------------------------------------------------------------
# Receiver side.
# ---------------------------------------------------------------------------------------------------------------

def local_topk(topk_idx: torch.Tensor, topk_weights: torch.Tensor, rank: int,
               num_local_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A sender's global top-k rows as receiver ``rank`` sees them (``recv_topk_idx`` / ``recv_topk_weights``).

    Args:
        topk_idx: ``[M, K]`` global expert ids or -1.
        topk_weights: ``[M, K]`` float32.
        rank: the receiver, owner of experts ``[rank * L, (rank + 1) * L)``.
        num_local_experts: ``L``.
    Returns:
        ``[M, K]`` local expert ids (dtype of ``topk_idx``), -1 where the expert lives elsewhere, and ``[M, K]``
        float32 weights, 0 where the id is -1.
    """
    begin = rank * num_local_experts
    mine = (topk_idx >= begin) & (topk_idx < begin + num_local_experts)
    local = torch.where(mine, topk_idx - begin, torch.full_like(topk_idx, -1))
    weights = topk_weights.to(torch.float32)
    return local, torch.where(mine, weights, torch.zeros_like(weights))


def unpack_layout_range(layout_range: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[L, R]`` int64 ``(begin << 32) | count`` -> (``begin`` ``[L, R]`` int64, ``count`` ``[L, R]`` int64)."""
    return layout_range >> 32, layout_range & 0xFFFFFFFF


def rank_prefix_matrix(count_matrix: torch.Tensor) -> torch.Tensor:
    """``[R, R]`` counts ``[s, d]`` = tokens ``s`` sends to ``d`` -> ``[R, R]`` int32 inclusive prefix over ``s``."""
    return count_matrix.to(torch.int64).cumsum(0).to(torch.int32)


def recv_channel_prefix_matrix(src_channel_prefix: torch.Tensor) -> torch.Tensor:
    """Intranode receiver's channel starts.

    Args:
        src_channel_prefix: ``[R, C]``: row ``s`` = source ``s``'s ``channel_prefix_matrix[d]`` (inclusive).
    Returns:
        ``[R, C]`` int32: exclusive prefix (start of each channel inside source ``s``'s block).
    """
    prefix = src_channel_prefix.to(torch.int32)
    out = torch.zeros_like(prefix)
    out[:, 1:] = prefix[:, :-1]
    return out


def recv_gbl_rank_prefix_sum(counts_from_sources: torch.Tensor) -> torch.Tensor:
    """``[R]`` rows received from each source -> ``[R]`` int32 inclusive prefix over sources."""
    return counts_from_sources.to(torch.int64).cumsum(0).to(torch.int32)


def recv_gbl_channel_prefix_matrix(src_channel_prefix: torch.Tensor, rank_prefix_sum: torch.Tensor) -> torch.Tensor:
    """Internode receiver's absolute channel starts.

    Args:
        src_channel_prefix: ``[R, C]``: row ``s`` = source ``s``'s ``gbl_channel_prefix_matrix[d]`` (inclusive).
        rank_prefix_sum: ``[R]``: this receiver's ``recv_gbl_rank_prefix_sum``.
    Returns:
        ``[R, C]`` int32: first row in ``recv_x`` of each (source, channel).
    """
    rank_start = rank_prefix_sum.to(torch.int32) - src_channel_prefix[:, -1].to(torch.int32) \
        if src_channel_prefix.size(1) else rank_prefix_sum.to(torch.int32)
    return recv_channel_prefix_matrix(src_channel_prefix) + rank_start.unsqueeze(1)


def recv_rdma_channel_prefix_matrix(src_rdma_channel_prefix: torch.Tensor) -> torch.Tensor:
    """Forwarder's per-source-node channel prefix.

    Args:
        src_rdma_channel_prefix: ``[R_so, C]``: row ``n`` = rank ``(n, my_local)``'s
            ``rdma_channel_prefix_matrix[my_node]``.
    Returns:
        ``[R_so, C]`` int32 (inclusive, relative to each source node's block).
    """
    return src_rdma_channel_prefix.to(torch.int32).contiguous()


def recv_rdma_rank_prefix_sum(src_rdma_channel_prefix: torch.Tensor) -> torch.Tensor:
    """``[R_so, C]`` as in :func:`recv_rdma_channel_prefix_matrix` -> ``[R_so]`` int32 inclusive prefix of the
    per-node totals (last entry = tokens this rank forwards)."""
    totals = src_rdma_channel_prefix[:, -1].to(torch.int64) if src_rdma_channel_prefix.size(1) else \
        torch.zeros(src_rdma_channel_prefix.size(0), dtype=torch.int64, device=src_rdma_channel_prefix.device)
    return totals.cumsum(0).to(torch.int32)


def pack_rank_bits(mask: torch.Tensor) -> torch.Tensor:
    """``[..., P]`` bool -> ``[...]`` int32 bit mask ``sum_j mask[..., j] << j`` (local ranks of one node)."""
    weights = torch.tensor([1 << j for j in range(mask.size(-1))], dtype=torch.int32, device=mask.device)
    return (mask.to(torch.int32) * weights).sum(-1, dtype=torch.int32)


def unpack_rank_bits(bits: torch.Tensor, num_bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_rank_bits`: ``[...]`` int32 -> ``[..., num_bits]`` bool."""
    weights = torch.tensor([1 << j for j in range(num_bits)], dtype=torch.int32, device=bits.device)
    return (bits.unsqueeze(-1) & weights) != 0


def encode_src_meta(src_node: torch.Tensor, local_mask: torch.Tensor) -> torch.Tensor:
    """Internode source-meta records.

    Args:
        src_node: ``[M]`` integer source node of each received row.
        local_mask: ``[M, P]`` bool, ``P <= 8``: which local ranks of the receiving node get the token.
    Returns:
        ``[M, 8]`` uint8: int32 word 0 = ``src_node``, word 1 = ``sum_j local_mask[:, j] << j`` (little-endian).
    """
    num_rows = src_node.size(0)
    if local_mask.dim() != 2 or local_mask.size(0) != num_rows or local_mask.size(1) > NUM_MAX_SCALEUP_RANKS:
        raise ValueError(f"local_mask must be [M, <=8] bool matching src_node [M], got {tuple(local_mask.shape)}")
    words = dense_copy(torch.stack([src_node.to(torch.int32), pack_rank_bits(local_mask)], dim=1))
    return words.view(torch.uint8).reshape(num_rows, 8)


def decode_src_meta(recv_src_meta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`encode_src_meta`: ``[M, 8]`` uint8 -> (``[M]`` int64 source node, ``[M, 8]`` bool mask)."""
    words = dense_copy(recv_src_meta).view(torch.int32).reshape(-1, 2)
    return words[:, 0].to(torch.int64), unpack_rank_bits(words[:, 1], NUM_MAX_SCALEUP_RANKS)


def forwarder_send_nvl_head(src_node: torch.Tensor, channel: torch.Tensor, local_mask: torch.Tensor,
                            num_channels: Optional[int] = None) -> torch.Tensor:
    """Forwarder's ``send_nvl_head``.

    Args:
        src_node: ``[F]`` int64 source node of every forwarded token, non-decreasing.
        channel: ``[F]`` int64 channel of the token on its source rank (non-decreasing within a node).
        local_mask: ``[F, P]`` bool: local destination ranks of the token in this node.
        num_channels: ``C`` when known (no host synchronisation); ``None`` derives a bound from ``channel``.
    Returns:
        ``[F, 8]`` int32: ring sequence number per (source node, channel, local destination), -1 where the token
        does not go to that local rank (and in columns ``>= P``).
    """
    num_rows, num_local = local_mask.shape
    if num_channels is None:
        num_channels = int(channel.max()) + 1 if num_rows else 1
    mask = torch.zeros(num_rows, NUM_MAX_SCALEUP_RANKS, dtype=torch.bool, device=local_mask.device)
    mask[:, :num_local] = local_mask
    return ring_sequence(src_node.to(torch.int64) * num_channels + channel.to(torch.int64), mask)


# ---------------------------------------------------------------------------------------------------------------
# One GPU per node (deep_ep/backends/cuda_internode.py): internode handle <-> the intranode kernels' fields.
# ---------------------------------------------------------------------------------------------------------------

def single_gpu_nodes_handle(handle: IntranodeHandle, rank: int) -> InternodeHandle:
    """The internode handle of a group of one GPU per node (``R_rdma = R``), built from the CUDA kernels'
    intranode fields (runs on the current
    stream; no host synchronisation).

    Args:
        handle: the dispatch's ``IntranodeHandle`` on rank ``rank``: ``rank_prefix_matrix [R, R]`` (only column
            ``rank`` is read), ``channel_prefix_matrix [R, C]`` inclusive, ``recv_channel_prefix_matrix [R, C]``
            exclusive inside each source's block, ``recv_src_idx [M]`` (``M`` may include worst-token padding),
            ``is_token_in_rank``, ``send_head [N, R]``.
    Returns:
        :class:`InternodeHandle` for ``R_rdma = R``, one rank per node (the fields as the torch backend builds them).
    """
    prefix = handle.rank_prefix_matrix[:, rank].contiguous()                  # inclusive over sources
    counts = prefix - torch.cat([prefix.new_zeros(1), prefix[:-1]])
    recv_cpm = handle.recv_channel_prefix_matrix
    recv_rdma_cpm = torch.cat([recv_cpm[:, 1:], counts.view(-1, 1)], dim=1)  # inclusive inside each block
    recv_gbl_cpm = recv_cpm + (prefix - counts).view(-1, 1)                   # absolute first rows
    num_rows = handle.recv_src_idx.size(0)
    rows = torch.arange(num_rows, dtype=torch.int32, device=prefix.device)
    source = torch.searchsorted(prefix, rows, right=True)                     # num_ranks on padding rows
    real = source < prefix.numel()
    src_meta = encode_src_meta(torch.where(real, source, 0), real.view(-1, 1))
    starts = recv_gbl_cpm.flatten().contiguous()
    first = starts[torch.searchsorted(starts, rows, right=True) - 1] if starts.numel() else rows
    send_nvl_head = torch.full((num_rows, NUM_MAX_SCALEUP_RANKS), -1, dtype=torch.int32, device=prefix.device)
    send_nvl_head[:, 0] = torch.where(real, rows - first, -1)
    return InternodeHandle(handle.is_token_in_rank, handle.channel_prefix_matrix,
                           handle.channel_prefix_matrix.clone(), recv_rdma_cpm, prefix.clone(), recv_gbl_cpm, prefix,
                           src_meta, handle.send_head, send_nvl_head)


def single_gpu_nodes_kernel_handle(handle: InternodeHandle, rank: int) -> IntranodeHandle:
    """Inverse of :func:`single_gpu_nodes_handle` for the fields the kernels read (cached dispatch, combine).

    ``rank_prefix_matrix`` gets column ``rank`` only (the kernels read no other column; the rest is 0) and
    ``recv_src_idx`` is a fresh ``[M]`` int32 tensor that a cached dispatch overwrites (internode handles carry no
    source token index).
    """
    prefix = handle.recv_gbl_rank_prefix_sum
    num_ranks = prefix.numel()
    counts = prefix - torch.cat([prefix.new_zeros(1), prefix[:-1]])
    rank_prefix_matrix = torch.zeros(num_ranks, num_ranks, dtype=torch.int32, device=prefix.device)
    rank_prefix_matrix[:, rank] = prefix
    recv_cpm = handle.recv_gbl_channel_prefix_matrix - (prefix - counts).view(-1, 1)
    recv_src_idx = torch.empty(handle.recv_src_meta.size(0), dtype=torch.int32, device=prefix.device)
    return IntranodeHandle(rank_prefix_matrix, handle.gbl_channel_prefix_matrix, recv_cpm, recv_src_idx,
                           handle.is_token_in_rank, handle.send_rdma_head)

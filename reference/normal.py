"""Reference semantics of the normal (high-throughput) kernels: layout, dispatch, combine.

Global view: every function takes the inputs of all ``R`` ranks (lists indexed by rank) and returns the outputs of
all ranks. Plain loops over ranks: this module is the oracle, so it favours being obviously right.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence, Union

import torch

from deep_ep import handle as hd
from deep_ep.config import Topology, align_up, num_local_experts
from deep_ep.validate import check_int, check_tensor
from reference._checks import check_per_rank

# Channels when the caller does not say; the rows do not depend on it, only the handles' channel fields do.
DEFAULT_NUM_CHANNELS = 10

XInput = Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]
Handle = Union[hd.IntranodeHandle, hd.InternodeHandle]


class DispatchResult(NamedTuple):
    """One rank's normal-dispatch outputs (``M`` rows received; ``num_worst_tokens`` rows in worst-token mode).

    Fields:
        recv_x: ``[M, H]`` (dtype of ``x``) or ``(recv_fp8 [M, H], recv_scales [M, S])`` with scales contiguous
            row-major. Order-defined: rows by source rank ascending, then source token ascending.
        recv_topk_idx: ``[M, K]`` (dtype of ``topk_idx``): local expert ids in ``[0, L)`` or -1; ``None`` without
            top-k or in cached mode.
        recv_topk_weights: ``[M, K]`` float32: the sender's weight where ``recv_topk_idx >= 0``, else 0.
        num_recv_tokens_per_expert_list: ``list[int]`` of length ``L``, aligned up to ``expert_alignment``; ``[]`` in
            worst-token mode; ``None`` in cached mode.
        handle: :class:`deep_ep.handle.IntranodeHandle` or :class:`deep_ep.handle.InternodeHandle`; ``None`` in
            cached mode.
    """

    recv_x: XInput
    recv_topk_idx: Optional[torch.Tensor]
    recv_topk_weights: Optional[torch.Tensor]
    num_recv_tokens_per_expert_list: Optional[list[int]]
    handle: Optional[Handle]


class CombineResult(NamedTuple):
    """One rank's normal-combine outputs.

    Fields:
        combined_x: ``[N, H]`` bfloat16, one row per original token of this rank.
        combined_topk_weights: ``[N, K]`` float32, or ``None`` when no ``topk_weights`` were given.
    """

    combined_x: torch.Tensor
    combined_topk_weights: Optional[torch.Tensor]


# ---------------------------------------------------------------------------------------------------------------
# Layout.
# ---------------------------------------------------------------------------------------------------------------

def get_dispatch_layout(topk_idx: torch.Tensor, num_experts: int, topology: Topology) -> hd.LayoutResult:
    """``Buffer.get_dispatch_layout`` for one rank's routing, written as explicit loops.

    Args:
        topk_idx: ``[N, K]`` int32/int64 global expert ids in ``[0, E)``, or -1 (ignored).
        num_experts: ``E``, divisible by ``topology.num_ranks``.
        topology: rank/node mapping.
    Returns:
        :class:`deep_ep.handle.LayoutResult`: ``num_tokens_per_rank [R]`` int32 (tokens with at least one expert on
        the rank), ``num_tokens_per_rdma_rank [R_so]`` int32 (tokens touching the node; ``None`` unless internode),
        ``num_tokens_per_expert [E]`` int32 (``(t, k)`` pairs; a duplicated expert in a row counts twice),
        ``is_token_in_rank [N, R]`` bool. All set-free, fully defined.
    """
    check_tensor("topk_idx", topk_idx, dtype=(torch.int32, torch.int64), ndim=2, contiguous=False)
    num_ranks = topology.num_ranks
    experts_per_rank = num_local_experts(num_experts, num_ranks)
    rows = topk_idx.tolist()
    is_token_in_rank = torch.zeros(len(rows), num_ranks, dtype=torch.bool)
    per_expert = [0] * num_experts
    for t, row in enumerate(rows):
        for e in row:
            if e < 0:
                continue
            if e >= num_experts:
                raise ValueError(f"topk_idx entries must be -1 or in [0, {num_experts}), got {e}")
            per_expert[e] += 1
            is_token_in_rank[t, e // experts_per_rank] = True
    per_rank = is_token_in_rank.sum(0).to(torch.int32)
    per_node = None
    if topology.is_internode:
        per_node = torch.tensor([
            int(is_token_in_rank[:, n * topology.num_scaleup_ranks:(n + 1) * topology.num_scaleup_ranks]
                .any(1).sum()) for n in range(topology.num_scaleout_ranks)], dtype=torch.int32)
    return hd.LayoutResult(per_rank, per_node, torch.tensor(per_expert, dtype=torch.int32), is_token_in_rank)


# ---------------------------------------------------------------------------------------------------------------
# Dispatch.
# ---------------------------------------------------------------------------------------------------------------

def _split_x(name: str, x: XInput) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    if isinstance(x, tuple):
        if len(x) != 2:
            raise ValueError(f"{name} as a tuple must be (x_fp8, x_scales), got {len(x)} items")
        data, scales = x
        check_tensor(name + "[0]", data, ndim=2, contiguous=False)
        if data.element_size() != 1:
            raise ValueError(f"{name}[0] must be a 1-byte (FP8) tensor when scales are given, got {data.dtype}")
        check_tensor(name + "[1]", scales, dtype=(torch.float32, torch.int32), shape=(data.size(0), None),
                     contiguous=False)
        return data, scales
    return check_tensor(name, x, ndim=2, contiguous=False), None


def _intranode_handle(d: int, masks: Sequence[torch.Tensor], num_channels: int,
                      recv_src_idx: torch.Tensor) -> hd.IntranodeHandle:
    num_ranks = len(masks)
    senders = [hd.intranode_sender(m, num_channels) for m in masks]
    counts = torch.stack([m.sum(0, dtype=torch.int32) for m in masks])          # [s, d]
    return hd.IntranodeHandle(
        rank_prefix_matrix=hd.rank_prefix_matrix(counts),
        channel_prefix_matrix=senders[d].channel_prefix_matrix,
        recv_channel_prefix_matrix=hd.recv_channel_prefix_matrix(
            torch.stack([senders[s].channel_prefix_matrix[d] for s in range(num_ranks)])),
        recv_src_idx=recv_src_idx,
        is_token_in_rank=masks[d],
        send_head=senders[d].send_head)


def _internode_handle(d: int, masks: Sequence[torch.Tensor], num_channels: int, topology: Topology,
                      recv_rows: Sequence[torch.Tensor], num_rows: int) -> hd.InternodeHandle:
    num_ranks, per_node = topology.num_ranks, topology.num_scaleup_ranks
    my_node, my_local = topology.node_of(d), topology.local_of(d)
    senders = [hd.internode_sender(m, num_channels, topology) for m in masks]
    node_cols = slice(my_node * per_node, (my_node + 1) * per_node)

    # Forwarder view: tokens arriving over scale-out from (n, my_local), source node asc then token asc.
    peers = [n * per_node + my_local for n in range(topology.num_scaleout_ranks)]
    rdma_prefix = torch.stack([senders[p].rdma_channel_prefix_matrix[my_node] for p in peers])
    fwd_node, fwd_channel, fwd_mask = [], [], []
    for n, p in enumerate(peers):
        tokens = hd.node_mask(masks[p], topology)[:, my_node].nonzero().flatten()
        fwd_node.append(torch.full((tokens.numel(),), n, dtype=torch.int64))
        fwd_channel.append(hd.token_channels(masks[p].size(0), num_channels)[tokens])
        fwd_mask.append(masks[p][tokens][:, node_cols])

    # Receiver view.
    counts = torch.stack([masks[s][:, d].sum(dtype=torch.int32) for s in range(num_ranks)])
    gbl_prefix_sum = hd.recv_gbl_rank_prefix_sum(counts)
    src_node = torch.cat([torch.full((recv_rows[s].numel(),), topology.node_of(s), dtype=torch.int64)
                          for s in range(num_ranks)])
    local_mask = torch.cat([masks[s][recv_rows[s]][:, node_cols] for s in range(num_ranks)])
    meta = hd.encode_src_meta(src_node, local_mask)
    if num_rows > meta.size(0):
        meta = torch.cat([meta, torch.zeros(num_rows - meta.size(0), 8, dtype=torch.uint8)])
    return hd.InternodeHandle(
        is_token_in_rank=masks[d],
        rdma_channel_prefix_matrix=senders[d].rdma_channel_prefix_matrix,
        gbl_channel_prefix_matrix=senders[d].gbl_channel_prefix_matrix,
        recv_rdma_channel_prefix_matrix=hd.recv_rdma_channel_prefix_matrix(rdma_prefix),
        recv_rdma_rank_prefix_sum=hd.recv_rdma_rank_prefix_sum(rdma_prefix),
        recv_gbl_channel_prefix_matrix=hd.recv_gbl_channel_prefix_matrix(
            torch.stack([senders[s].gbl_channel_prefix_matrix[d] for s in range(num_ranks)]), gbl_prefix_sum),
        recv_gbl_rank_prefix_sum=gbl_prefix_sum,
        recv_src_meta=meta,
        send_rdma_head=senders[d].send_rdma_head,
        send_nvl_head=hd.forwarder_send_nvl_head(torch.cat(fwd_node), torch.cat(fwd_channel), torch.cat(fwd_mask)))


def _pad_rows(t: torch.Tensor, num_rows: int, fill: float | int = 0) -> torch.Tensor:
    if t.size(0) >= num_rows:
        return t
    pad = torch.full((num_rows - t.size(0), *t.shape[1:]), fill, dtype=t.dtype)
    return torch.cat([t, pad])


def dispatch(x: Sequence[XInput], is_token_in_rank: Optional[Sequence[torch.Tensor]], topology: Topology, *,
             topk_idx: Optional[Sequence[torch.Tensor]] = None,
             topk_weights: Optional[Sequence[torch.Tensor]] = None,
             num_experts: Optional[int] = None, expert_alignment: int = 1, num_worst_tokens: int = 0,
             num_channels: int = DEFAULT_NUM_CHANNELS,
             handles: Optional[Sequence[Handle]] = None) -> list[DispatchResult]:
    """Normal dispatch of every rank, global view.

    Rank ``d`` receives, for every source rank ``s`` ascending and every token ``t`` of ``s`` ascending with
    ``is_token_in_rank[s][t, d]``, one row: the token once per receiving rank however many of its experts live there.

    Args:
        x: per rank, ``[N_s, H]`` tensor (any dtype; bytes are copied), or ``(x_fp8 [N_s, H] float8_e4m3fn,
            x_scales [N_s, S] float32/int32 any strides)``, forwarded verbatim.
        is_token_in_rank: per rank ``[N_s, R]`` bool; routing is decided solely by it. ``None`` in cached mode.
        topology: ``Topology``; ``topology.is_internode`` selects the internode handle type (same data either way).
        topk_idx: per rank ``[N_s, K]`` int32/int64 global expert ids or -1; with ``topk_weights`` (both or neither).
        topk_weights: per rank ``[N_s, K]`` float32.
        num_experts: ``E``; required with top-k.
        expert_alignment: round each entry of ``num_recv_tokens_per_expert_list`` up to a multiple of this.
        num_worst_tokens: if > 0, every output has exactly this many rows; rows beyond the real count ``M`` have
            ``recv_topk_idx == -1`` and zeros elsewhere (the contract leaves them unspecified); requires top-k and
            ``M <= num_worst_tokens``; the per-expert list is ``[]``.
        num_channels: ``C`` (``config.num_sms // 2``); shapes the channel matrices and ring sequence numbers.
        handles: per rank handle of an earlier dispatch: cached mode. Top-k must be absent; the routing comes from
            each handle's ``is_token_in_rank``; returns ``recv_x`` only (every other field, the handle included, is
            ``None``, as DeepEP's cached dispatch returns; keep using the original handle).
    Returns:
        per rank :class:`DispatchResult`. Order-defined: ``recv_x``, ``recv_topk_*``, handle row fields. Fully
        defined: counts, prefix matrices, list.
    """
    num_ranks = topology.num_ranks
    check_per_rank("x", x, num_ranks)
    check_int("expert_alignment", expert_alignment, 1)
    check_int("num_worst_tokens", num_worst_tokens, 0)
    check_int("num_channels", num_channels, 1)
    cached = handles is not None
    if cached:
        check_per_rank("handles", handles, num_ranks)
        if topk_idx is not None or topk_weights is not None:
            raise ValueError("cached dispatch (handles given) must not pass topk_idx/topk_weights")
        masks = [h.is_token_in_rank for h in handles]
    else:
        masks = list(check_per_rank("is_token_in_rank", is_token_in_rank, num_ranks))
    datas, scaless = [], []
    for s in range(num_ranks):
        data, scales = _split_x(f"x[{s}]", x[s])
        datas.append(data)
        scaless.append(scales)
        if data.size(1) != datas[0].size(1) or (scales is None) != (scaless[0] is None) or \
                (scales is not None and scales.shape[1:] != scaless[0].shape[1:]):
            raise ValueError(f"x[{s}] must have the same form (tensor or (fp8, scales)), hidden size and scale "
                             f"count as x[0]")
        check_tensor(f"is_token_in_rank[{s}]", masks[s], dtype=torch.bool, shape=(data.size(0), num_ranks),
                     contiguous=False)
    if (topk_idx is None) != (topk_weights is None):
        raise ValueError("topk_idx and topk_weights must be given together or not at all")
    has_topk = topk_idx is not None
    if num_worst_tokens > 0 and not has_topk:
        raise ValueError("num_worst_tokens > 0 requires topk_idx and topk_weights")
    experts_per_rank = 0
    if has_topk:
        check_per_rank("topk_idx", topk_idx, num_ranks)
        check_per_rank("topk_weights", topk_weights, num_ranks)
        if num_experts is None:
            raise ValueError("num_experts is required when topk_idx is given")
        experts_per_rank = num_local_experts(num_experts, num_ranks)
        for s in range(num_ranks):
            check_tensor(f"topk_idx[{s}]", topk_idx[s], dtype=(torch.int32, torch.int64),
                         shape=(masks[s].size(0), None), contiguous=False)
            check_tensor(f"topk_weights[{s}]", topk_weights[s], dtype=torch.float32, shape=tuple(topk_idx[s].shape),
                         contiguous=False)

    results = []
    for d in range(num_ranks):
        recv_rows = [masks[s][:, d].nonzero().flatten() for s in range(num_ranks)]
        num_recv = sum(r.numel() for r in recv_rows)
        if num_worst_tokens and num_recv > num_worst_tokens:
            raise ValueError(f"num_worst_tokens ({num_worst_tokens}) is smaller than the {num_recv} rows rank {d} "
                             f"receives")
        num_rows = num_worst_tokens or num_recv
        recv_data = _pad_rows(torch.cat([datas[s][recv_rows[s]] for s in range(num_ranks)]), num_rows)
        if scaless[0] is not None:
            recv_scales = _pad_rows(torch.cat([scaless[s][recv_rows[s]] for s in range(num_ranks)]), num_rows)
            recv_x: XInput = (recv_data, recv_scales.contiguous())
        else:
            recv_x = recv_data
        src_idx = _pad_rows(torch.cat(recv_rows).to(torch.int32), num_rows)

        if cached:
            results.append(DispatchResult(recv_x, None, None, None, None))
            continue
        if topology.is_internode:
            handle: Handle = _internode_handle(d, masks, num_channels, topology, recv_rows, num_rows)
        else:
            handle = _intranode_handle(d, masks, num_channels, src_idx)

        recv_idx = recv_weights = None
        per_expert: Optional[list[int]] = None
        if has_topk:
            pairs = [hd.local_topk(topk_idx[s][recv_rows[s]], topk_weights[s][recv_rows[s]], d, experts_per_rank)
                     for s in range(num_ranks)]
            recv_idx = _pad_rows(torch.cat([p[0] for p in pairs]), num_rows, -1)
            recv_weights = _pad_rows(torch.cat([p[1] for p in pairs]), num_rows)
            if num_worst_tokens:
                per_expert = []
            else:
                lo = d * experts_per_rank
                per_expert = [align_up(sum(int((topk_idx[s] == lo + j).sum()) for s in range(num_ranks)),
                                       expert_alignment) for j in range(experts_per_rank)]
        results.append(DispatchResult(recv_x, recv_idx, recv_weights, per_expert, handle))
    return results


# ---------------------------------------------------------------------------------------------------------------
# Combine.
# ---------------------------------------------------------------------------------------------------------------

def _rows_on(handles: Sequence[Handle], masks: Sequence[torch.Tensor], s: int, d: int) -> tuple[torch.Tensor,
                                                                                                 torch.Tensor]:
    """(tokens of ``s`` held by ``d`` ascending, their rows in ``d``'s receive layout)."""
    tokens = masks[s][:, d].nonzero().flatten()
    h = handles[d]
    if isinstance(h, hd.InternodeHandle):
        start = int(h.recv_gbl_rank_prefix_sum[s - 1]) if s > 0 else 0
    else:
        start = int(h.rank_prefix_matrix[s - 1, d]) if s > 0 else 0
    return tokens, start + torch.arange(tokens.numel())


def combine(y: Sequence[torch.Tensor], handles: Sequence[Handle], topology: Topology, *,
            topk_weights: Optional[Sequence[torch.Tensor]] = None,
            bias: Optional[Sequence[Union[None, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]]] = None
            ) -> list[CombineResult]:
    """Normal combine of every rank, global view: the reverse of the dispatch behind ``handles``.

    For each original token ``t`` of rank ``s``, with holders ``D = {d : is_token_in_rank[s][t, d]}`` (from ``s``'s
    handle) and ``row_d`` the row of ``(s, t)`` in ``d``'s receive layout::

        intranode: out = bf16( f32(b0) + f32(b1) + sum_{d in D asc} f32(y[d][row_d]) )
        internode: p_n = bf16( sum_{d in D, node(d) = n, asc} f32(y[d][row_d]) )   (per node, starting at 0)
                   out = bf16( f32(b0) + f32(b1) + sum_{n asc, D meets n} f32(p_n) )

    No top-k weighting. A token sent nowhere gives ``bf16(b0 + b1)`` (zeros without bias).

    Args:
        y: per rank ``[M_d, H]`` bfloat16, rows aligned with that rank's ``recv_x`` (extra worst-token rows ignored).
        handles: per rank, the handle its dispatch returned.
        topology: as for the dispatch.
        topk_weights: per rank ``[M_d, K]`` float32 (optional). ``combined_topk_weights[s][t] = sum_{d in D}
            topk_weights[d][row_d]`` in float32 (internode: per-node sums, then summed over nodes ascending).
        bias: per rank ``None``, a ``[N_s, H]`` bfloat16 tensor, or a 2-tuple of them.
    Returns:
        per rank :class:`CombineResult` (``[N_s, H]`` bfloat16 and ``[N_s, K]`` float32 or ``None``); fully
        defined, bitwise deterministic.
    """
    num_ranks = topology.num_ranks
    check_per_rank("y", y, num_ranks)
    check_per_rank("handles", handles, num_ranks)
    masks = [h.is_token_in_rank for h in handles]
    for d in range(num_ranks):
        check_tensor(f"y[{d}]", y[d], dtype=torch.bfloat16, ndim=2, contiguous=False)
        needed = sum(int(masks[s][:, d].sum()) for s in range(num_ranks))
        if y[d].size(0) < needed:
            raise ValueError(f"y[{d}] must have at least {needed} rows (rank {d}'s received tokens), got "
                             f"{y[d].size(0)}")
    if topk_weights is not None:
        check_per_rank("topk_weights", topk_weights, num_ranks)
        for d in range(num_ranks):
            check_tensor(f"topk_weights[{d}]", topk_weights[d], dtype=torch.float32, shape=(y[d].size(0), None),
                         contiguous=False)
    if bias is not None:
        check_per_rank("bias", bias, num_ranks)
    hidden = y[0].size(1)
    per_node = topology.num_scaleup_ranks

    results = []
    for s in range(num_ranks):
        num_tokens = masks[s].size(0)
        acc = torch.zeros(num_tokens, hidden, dtype=torch.float32)
        biases = () if bias is None or bias[s] is None else (bias[s] if isinstance(bias[s], tuple) else (bias[s],))
        if len(biases) > 2:
            raise ValueError(f"bias[{s}] must be a tensor or a 2-tuple of tensors, got {len(biases)} items")
        for i, b in enumerate(biases):
            check_tensor(f"bias[{s}][{i}]", b, dtype=torch.bfloat16, shape=(num_tokens, hidden), contiguous=False)
            acc = acc + b.to(torch.float32)
        num_topk = topk_weights[0].size(1) if topk_weights is not None else 0
        w_acc = torch.zeros(num_tokens, num_topk, dtype=torch.float32)

        if topology.is_internode:
            for n in range(topology.num_scaleout_ranks):
                ranks = range(n * per_node, (n + 1) * per_node)
                part = torch.zeros(num_tokens, hidden, dtype=torch.float32)
                w_part = torch.zeros(num_tokens, num_topk, dtype=torch.float32)
                for d in ranks:  # ascending local index
                    tokens, rows = _rows_on(handles, masks, s, d)
                    part[tokens] += y[d][rows].to(torch.float32)
                    if topk_weights is not None:
                        w_part[tokens] += topk_weights[d][rows]
                touched = masks[s][:, n * per_node:(n + 1) * per_node].any(1)
                acc[touched] += part[touched].to(torch.bfloat16).to(torch.float32)
                w_acc[touched] += w_part[touched]
        else:
            for d in range(num_ranks):  # ascending rank: each token's additions happen in this order
                tokens, rows = _rows_on(handles, masks, s, d)
                acc[tokens] += y[d][rows].to(torch.float32)
                if topk_weights is not None:
                    w_acc[tokens] += topk_weights[d][rows]
        results.append(CombineResult(acc.to(torch.bfloat16), w_acc if topk_weights is not None else None))
    return results


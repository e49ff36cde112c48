"""Result types of ``deep_ep.Buffer``.

Each is a ``typing.NamedTuple``: it unpacks and indexes exactly like the tuple DeepEP V1 returns (same positions),
and also offers named fields.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Union

import torch

from deep_ep.event import EventOverlap

# ``x`` of a dispatch: BF16 ``[N, H]`` or ``(fp8 [N, H], scales [N, S])``.
TensorOrFp8 = Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]


class DispatchLayout(NamedTuple):
    """Result of ``Buffer.get_dispatch_layout``.

    Fields:
        num_tokens_per_rank: ``[R]`` int32, tokens with at least one expert on each rank.
        num_tokens_per_rdma_rank: ``[R_nodes]`` int32, tokens with at least one expert on each node; ``None``
            unless the group spans several nodes.
        num_tokens_per_expert: ``[E]`` int32, ``(token, k)`` pairs selecting each expert.
        is_token_in_rank: ``[N, R]`` bool.
        event: :class:`EventOverlap`.
    """

    num_tokens_per_rank: torch.Tensor
    num_tokens_per_rdma_rank: Optional[torch.Tensor]
    num_tokens_per_expert: torch.Tensor
    is_token_in_rank: torch.Tensor
    event: EventOverlap


class DispatchResult(NamedTuple):
    """Result of ``Buffer.dispatch``.

    Fields:
        recv_x: ``[M, H]`` (input dtype) or ``(fp8 [M, H], scales [M, S])`` with row-major scales; rows ordered by
            (source rank, source token).
        recv_topk_idx: ``[M, K]`` topk_idx_t, local expert ids or -1; ``None`` without top-k or when cached.
        recv_topk_weights: ``[M, K]`` float32, 0 where ``recv_topk_idx`` is -1; ``None`` like ``recv_topk_idx``.
        num_recv_tokens_per_expert_list: ``list[int]`` of length L (aligned counts); ``[]`` in worst-token mode;
            ``None`` for a cached dispatch.
        handle: intranode (6 fields) or internode (10 fields) handle; ``None`` for a cached dispatch.
        event: :class:`EventOverlap`.
    """

    recv_x: TensorOrFp8
    recv_topk_idx: Optional[torch.Tensor]
    recv_topk_weights: Optional[torch.Tensor]
    num_recv_tokens_per_expert_list: Optional[list]
    handle: Any
    event: EventOverlap


class CombineResult(NamedTuple):
    """Result of ``Buffer.combine``.

    Fields:
        combined_x: ``[N, H]`` BF16, sum over holding ranks plus biases.
        combined_topk_weights: ``[N, K]`` float32 or ``None`` when no ``topk_weights`` were given.
        event: :class:`EventOverlap`.
    """

    combined_x: torch.Tensor
    combined_topk_weights: Optional[torch.Tensor]
    event: EventOverlap


class LowLatencyDispatchResult(NamedTuple):
    """Result of ``Buffer.low_latency_dispatch``.

    Fields:
        recv_x: ``[L, R*T, H]`` BF16, or ``(fp8 [L, R*T, H], scales)`` where scales is ``[L, R*T, H/128]`` float32
            (or ``[L, R*T, H/512]`` int32 with UE8M0) as a column-major view.
        packed_recv_count: ``[L]`` int32 valid rows per local expert.
        handle: ``LowLatencyHandle(packed_recv_src_info, packed_recv_layout_range, T, H, E)``.
        event: :class:`EventOverlap`.
        hook: ``None``, or a callable that completes the receive when ``return_recv_hook=True``.
    """

    recv_x: TensorOrFp8
    packed_recv_count: torch.Tensor
    handle: Any
    event: EventOverlap
    hook: Optional[Callable[[], None]]


class LowLatencyCombineResult(NamedTuple):
    """Result of ``Buffer.low_latency_combine``.

    Fields:
        combined_x: ``[N, H]`` BF16, weighted sum of the expert outputs.
        event: :class:`EventOverlap`.
        hook: ``None`` or the receive hook.
    """

    combined_x: torch.Tensor
    event: EventOverlap
    hook: Optional[Callable[[], None]]

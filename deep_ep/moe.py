"""Autograd dispatch/combine and an expert-parallel MoE layer built on ``deep_ep.Buffer`` (normal kernels).

The layer follows the usual DeepEP recipe: router logits -> softmax -> top-k -> ``get_dispatch_layout`` ->
``dispatch`` -> local experts (grouped by ``num_recv_tokens_per_expert_list``, weighted by ``recv_topk_weights``)
-> ``combine`` -> output rows in the caller's token order. Autograd:

* ``dispatch``'s backward is a ``combine`` with the same handle: the gradient rows of ``recv_x`` on all holding
  ranks sum into the source token's row, those of ``recv_topk_weights`` (masked to the holder's local slots) into
  ``topk_weights``, the exact gradient of the ``[N, K]`` router weights (every expert lives on one rank);
* ``combine`` sums one row per holding rank (no weighting: the experts apply the router weights); its backward is
  a cached ``dispatch`` with the same handle, a copy of the output gradient row to each holder;
* combine and every gradient travel in BF16; forward dispatch in BF16 or, with ``use_fp8=True``, per-token FP8
  E4M3 with 128-channel scales (dequantised on the receiver; identity in backward).

Devices and dtypes come from the input tensors: the same code runs on gloo (torch backend) and NCCL (CUDA kernels).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from deep_ep.config import FP8_BLOCK, Topology, get_combine_config, get_dispatch_config
from deep_ep.numerics import per_token_cast_back, per_token_cast_to_fp8
from deep_ep.validate import check_tensor, topk_idx_dtype

__all__ = [
    "DispatchState",
    "ExpertParallelMoE",
    "combine",
    "dispatch",
    "grouped_expert_forward",
    "make_buffer",
    "route_topk",
    "topk_idx_dtype",
]

# Communication dtype of combine and of all gradients (DeepEP's normal combine is BF16 only).
COMM_DTYPE = torch.bfloat16


def _group_rank_and_size(buffer: Any) -> tuple[int, int]:
    """(rank, group size) of a ``deep_ep.Buffer``."""
    if not (hasattr(buffer, "rank") and hasattr(buffer, "group_size")):
        raise TypeError(f"buffer must be a deep_ep.Buffer (with .rank and .group_size), got {type(buffer).__name__}")
    return int(buffer.rank), int(buffer.group_size)


def make_buffer(group: Any, hidden: int, *, num_sms: int | None = None, **buffer_kwargs: Any) -> Any:
    """Build a ``deep_ep.Buffer`` big enough for normal dispatch/combine of BF16 tokens of width ``hidden``.

    The NVLink byte count is the larger of the dispatch and combine size hints of the default configs for the
    group size (DeepEP's formulas); an RDMA byte count is added when the group spans more than one NVLink domain
    (``DEEP_EP_GPUS_PER_NODE``).

    Args:
        group: a ``torch.distributed`` process group (gloo on CPU, NCCL on GPU).
        hidden: hidden size H (elements per token).
        num_sms: SM count of the default configs (``Buffer.num_sms`` when None).
        buffer_kwargs: forwarded to ``deep_ep.Buffer``.
    """
    import torch.distributed as dist

    from deep_ep import Buffer

    if isinstance(hidden, bool) or not isinstance(hidden, int) or hidden <= 0:
        raise ValueError(f"hidden must be a positive int, got {hidden!r}")
    num_ranks = dist.get_world_size(group)
    if num_sms is None:
        num_sms = Buffer.num_sms
    hidden_bytes = hidden * COMM_DTYPE.itemsize
    internode = Topology.from_env(num_ranks).is_internode
    num_nvl_bytes, num_rdma_bytes = 0, 0
    for config in (get_dispatch_config(num_ranks, num_sms), get_combine_config(num_ranks, num_sms)):
        num_nvl_bytes = max(num_nvl_bytes, config.get_nvl_buffer_size_hint(hidden_bytes, num_ranks))
        if internode:
            num_rdma_bytes = max(num_rdma_bytes, config.get_rdma_buffer_size_hint(hidden_bytes, num_ranks))
    return Buffer(group, num_nvl_bytes, num_rdma_bytes, **buffer_kwargs)


# ---------------------------------------------------------------------------------------------------------------
# Autograd functions
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class DispatchState:
    """What one ``dispatch`` leaves for the matching ``combine`` (and for both backward passes).

    Attributes:
        buffer: the ``deep_ep.Buffer`` that ran the dispatch; combine and both backwards use it again.
        handle: the dispatch handle (DeepEP's tuple); combine never invalidates it.
        recv_topk_idx: ``[M, K]`` ``topk_idx_t``: local expert id of every received (row, slot), ``-1`` when the slot's
            expert lives on another rank or was not selected.
        num_recv_tokens_per_expert_list: ``L`` Python ints: number of received (row, slot) pairs per local expert.
        num_tokens: N, the number of rows of the dispatched ``x`` (rows of combine's output).
        x_dtype: dtype of the dispatched ``x``; combine returns this dtype.
        config: the dispatch ``deep_ep.Config`` (None = default); combine's backward (a cached dispatch) reuses it,
            since a cached dispatch must run with the same ``num_sms`` as the dispatch that made the handle.
    """

    buffer: Any
    handle: Any = None
    recv_topk_idx: torch.Tensor | None = None
    num_recv_tokens_per_expert_list: list[int] = field(default_factory=list)
    num_tokens: int = 0
    x_dtype: torch.dtype = torch.bfloat16
    config: Any = None


def _as_comm(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous BF16 tensor (the wire format of combine and of every gradient)."""
    return t.to(COMM_DTYPE).contiguous()


class _Dispatch(torch.autograd.Function):
    """Normal dispatch as an autograd op. See :func:`dispatch` for shapes."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, topk_weights: torch.Tensor, topk_idx: torch.Tensor,
                num_experts: int, use_fp8: bool, config: Any, state: DispatchState
                ) -> tuple[torch.Tensor, torch.Tensor]:
        buffer = state.buffer
        num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank, _ = \
            buffer.get_dispatch_layout(topk_idx, num_experts)
        if use_fp8:
            send_x: Any = per_token_cast_to_fp8(x)
        else:
            send_x = _as_comm(x)
        recv_x, recv_topk_idx, recv_topk_weights, counts, handle, _ = buffer.dispatch(
            send_x, num_tokens_per_rank=num_tokens_per_rank, num_tokens_per_rdma_rank=num_tokens_per_rdma_rank,
            is_token_in_rank=is_token_in_rank, num_tokens_per_expert=num_tokens_per_expert,
            topk_idx=topk_idx, topk_weights=topk_weights, expert_alignment=1, config=config)
        if use_fp8:
            recv_x = per_token_cast_back(*recv_x)
        state.handle = handle
        state.recv_topk_idx = recv_topk_idx
        state.num_recv_tokens_per_expert_list = list(counts)
        state.num_tokens = x.size(0)
        state.x_dtype = x.dtype
        state.config = config
        ctx.state = state
        ctx.x_dtype, ctx.w_dtype = x.dtype, topk_weights.dtype
        return recv_x.to(x.dtype), recv_topk_weights.to(topk_weights.dtype)

    @staticmethod
    def backward(ctx: Any, grad_recv_x: torch.Tensor, grad_recv_topk_weights: torch.Tensor) -> tuple[Any, ...]:
        state: DispatchState = ctx.state
        recv_topk_idx = state.recv_topk_idx
        assert recv_topk_idx is not None, "dispatch backward before forward"
        # Gradients are materialised (zeros for unused outputs), so every rank joins the combine below.
        # recv_topk_weights is the constant 0 on slots owned by other ranks: no gradient flows there.
        grad_w = torch.where(recv_topk_idx >= 0, grad_recv_topk_weights.to(torch.float32),
                             torch.zeros((), dtype=torch.float32, device=grad_recv_x.device)).contiguous()
        grad_x, grad_topk_weights, _ = state.buffer.combine(_as_comm(grad_recv_x), state.handle,
                                                            topk_weights=grad_w, config=None)
        return grad_x.to(ctx.x_dtype), grad_topk_weights.to(ctx.w_dtype), None, None, None, None, None


class _Combine(torch.autograd.Function):
    """Normal combine as an autograd op. See :func:`combine` for shapes."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, state: DispatchState) -> torch.Tensor:
        combined_x, _, _ = state.buffer.combine(_as_comm(y), state.handle)
        ctx.state = state
        ctx.y_dtype = y.dtype
        return combined_x.to(state.x_dtype)

    @staticmethod
    def backward(ctx: Any, grad_combined: torch.Tensor) -> tuple[Any, ...]:
        state: DispatchState = ctx.state
        grad_y = state.buffer.dispatch(_as_comm(grad_combined), handle=state.handle, config=state.config)[0]
        return grad_y.to(ctx.y_dtype), None


def dispatch(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, buffer: Any, num_experts: int,
             *, use_fp8: bool = False, config: Any = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, DispatchState]:
    """Differentiable normal dispatch (layout + dispatch in one call).

    Args:
        x: ``[N, H]`` bfloat16 or float32 tokens of this rank (sent as BF16, or FP8 with ``use_fp8``).
        topk_idx: ``[N, K]`` ``topk_idx_t``: global expert ids in ``[0, num_experts)``, ``-1`` for no selection.
        topk_weights: ``[N, K]`` float32 router weights (differentiable).
        buffer: a ``deep_ep.Buffer`` on the expert-parallel group.
        num_experts: global expert count E (``E % group_size == 0``).
        use_fp8: send per-token FP8 E4M3 with 128-channel float32 scales (``H % 128 == 0``); ``recv_x`` is the
            dequantised value. Gradients still travel in BF16.
        config: a ``deep_ep.Config`` for the dispatch kernels (also used by the cached dispatch in combine's
            backward), or None for the default of the group size. Combine uses the default combine config.
    Returns:
        ``(recv_x, recv_topk_idx, recv_topk_weights, state)``:
        ``recv_x`` ``[M, H]`` in ``x.dtype``, one row per (source rank, token) holding a local expert, ordered by
        source rank then token; ``recv_topk_idx`` ``[M, K]`` local expert ids or ``-1``; ``recv_topk_weights``
        ``[M, K]`` float32, zero on ``-1`` slots; ``state`` to pass to :func:`combine`.
    Backward:
        ``grad_x = combine(grad_recv_x, handle)`` (sum over holding ranks) and
        ``grad_topk_weights = combine(..., topk_weights=grad_recv_topk_weights masked to local slots)``.
    """
    check_tensor("x", x, dtype=(torch.bfloat16, torch.float32), ndim=2, contiguous=False)
    check_tensor("topk_idx", topk_idx, dtype=(torch.int32, torch.int64), ndim=2, contiguous=False)
    check_tensor("topk_weights", topk_weights, dtype=torch.float32, ndim=2, contiguous=False)
    if topk_idx.shape != topk_weights.shape or topk_idx.size(0) != x.size(0):
        raise ValueError(f"topk_idx {tuple(topk_idx.shape)} and topk_weights {tuple(topk_weights.shape)} must both "
                         f"be [N, K] with N = x.size(0) = {x.size(0)}")
    if use_fp8 and x.size(1) % FP8_BLOCK != 0:
        raise ValueError(f"use_fp8=True needs hidden % {FP8_BLOCK} == 0, got hidden={x.size(1)}")
    state = DispatchState(buffer=buffer)
    recv_x, recv_topk_weights = _Dispatch.apply(x.contiguous(), topk_weights.contiguous(), topk_idx.contiguous(),
                                                num_experts, bool(use_fp8), config, state)
    return recv_x, state.recv_topk_idx, recv_topk_weights, state


def combine(y: torch.Tensor, state: DispatchState) -> torch.Tensor:
    """Differentiable normal combine: the inverse of the dispatch that produced ``state``.

    Args:
        y: ``[M, H]`` rows aligned with that dispatch's ``recv_x`` (any float dtype; sent as BF16). The caller has
            already applied the router weights: combine is a plain sum.
        state: the :class:`DispatchState` returned by :func:`dispatch`.
    Returns:
        ``[N, H]`` in the dispatched ``x``'s dtype: ``out[t] = sum over ranks d holding token t of y_d[row_d(t)]``
        (rounded to BF16 once), zero for tokens sent nowhere.
    Backward:
        ``grad_y = dispatch(grad_out, handle=state.handle)`` (cached dispatch, BF16): every holder gets the row.
    """
    check_tensor("y", y, dtype=(torch.bfloat16, torch.float32, torch.float16), ndim=2, contiguous=False)
    if state.handle is None:
        raise ValueError("state must come from a completed deep_ep.moe.dispatch (its handle is None)")
    return _Combine.apply(y, state)


# ---------------------------------------------------------------------------------------------------------------
# Router and local experts
# ---------------------------------------------------------------------------------------------------------------


def route_topk(router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool = True
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax-then-top-k routing (Mixtral / Qwen2-MoE style).

    Args:
        router_logits: ``[N, E]`` any float dtype.
        top_k: K, experts per token.
        norm_topk_prob: renormalise the K selected probabilities to sum to 1.
    Returns:
        ``(topk_idx [N, K] topk_idx_t, topk_weights [N, K] float32)``.
    """
    probs = torch.softmax(router_logits.float(), dim=-1)
    topk_weights, topk_idx = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_idx.to(topk_idx_dtype()), topk_weights


def grouped_expert_forward(recv_x: torch.Tensor, recv_topk_idx: torch.Tensor, recv_topk_weights: torch.Tensor,
                           num_recv_tokens_per_expert_list: list[int], gate_up_proj: torch.Tensor,
                           down_proj: torch.Tensor, act_fn: Callable[[torch.Tensor], torch.Tensor] = F.silu
                           ) -> torch.Tensor:
    """Run the local SwiGLU experts on the received rows and mix them with the router weights.

    The (row, slot) pairs with ``recv_topk_idx >= 0`` are sorted by local expert (stable, so rows stay in receive
    order inside an expert) and cut into one contiguous group per expert with the sizes in
    ``num_recv_tokens_per_expert_list``; each group is one matmul pair.

    Args:
        recv_x: ``[M, H]`` received tokens (bfloat16 or float32).
        recv_topk_idx: ``[M, K]`` local expert ids, ``-1`` for slots not served here.
        recv_topk_weights: ``[M, K]`` float32 router weights (zero on ``-1`` slots).
        num_recv_tokens_per_expert_list: ``L`` ints, pairs per local expert (dispatch with ``expert_alignment=1``).
        gate_up_proj: ``[L, 2I, H]``; rows ``[0, I)`` are the gate projection, ``[I, 2I)`` the up projection.
        down_proj: ``[L, H, I]``.
        act_fn: activation of the gate half (SiLU).
    Returns:
        ``[M, H]`` in ``recv_x.dtype``: ``out[m] = sum_k w[m, k] * down_e(act(gate_e x_m) * up_e x_m)``,
        ``e = recv_topk_idx[m, k]``. Rows with no local slot are zero.
    Raises:
        ValueError when the counts disagree with ``recv_topk_idx`` (wrong ``expert_alignment`` or a corrupt handle).
    """
    num_local_experts = gate_up_proj.size(0)
    if len(num_recv_tokens_per_expert_list) != num_local_experts:
        raise ValueError(f"num_recv_tokens_per_expert_list has {len(num_recv_tokens_per_expert_list)} entries, "
                         f"expected one per local expert ({num_local_experts})")
    rows, slots = torch.nonzero(recv_topk_idx >= 0, as_tuple=True)
    experts = recv_topk_idx[rows, slots]
    order = torch.argsort(experts, stable=True)
    rows, slots = rows[order], slots[order]
    if sum(num_recv_tokens_per_expert_list) != rows.numel():
        raise ValueError(f"num_recv_tokens_per_expert_list sums to {sum(num_recv_tokens_per_expert_list)} but "
                         f"recv_topk_idx has {rows.numel()} local (row, slot) pairs; dispatch must use "
                         f"expert_alignment=1")
    x_sorted = recv_x[rows]                                       # [P, H]
    w_sorted = recv_topk_weights[rows, slots]                     # [P] float32
    outputs = []
    for expert, x_group in enumerate(torch.split(x_sorted, num_recv_tokens_per_expert_list)):
        # Experts with zero rows still run (on an empty tensor) so every parameter joins the graph on every rank.
        gate, up = F.linear(x_group, gate_up_proj[expert]).chunk(2, dim=-1)
        outputs.append(F.linear(act_fn(gate) * up, down_proj[expert]))
    expert_out = torch.cat(outputs, dim=0)                        # [P, H]
    weighted = (expert_out * w_sorted.unsqueeze(-1)).to(recv_x.dtype)
    return torch.zeros_like(recv_x).index_add(0, rows, weighted)


# ---------------------------------------------------------------------------------------------------------------
# The layer
# ---------------------------------------------------------------------------------------------------------------


class ExpertParallelMoE(nn.Module):
    """Sparse MoE block (softmax top-k router + SwiGLU experts) with experts split over a ``deep_ep.Buffer`` group.

    Rank ``r`` of a group of ``R`` ranks owns the experts ``[r*L, (r+1)*L)`` with ``L = num_experts // R``; the
    router is replicated (its gradient is this rank's share: all-reduce it like any data-parallel parameter).

    Parameters (names follow Hugging Face's fused Mixtral experts, so state can be copied across):
        ``gate.weight`` ``[E, H]``; ``experts.gate_up_proj`` ``[L, 2I, H]``; ``experts.down_proj`` ``[L, H, I]``.

    Args:
        buffer: ``deep_ep.Buffer`` on the expert-parallel group (see :func:`make_buffer`).
        hidden_size: H.
        intermediate_size: I, per expert.
        num_experts: E (global), a multiple of the group size.
        top_k: experts per token.
        norm_topk_prob: renormalise the top-k probabilities (Mixtral: True).
        use_fp8: FP8 forward dispatch (``hidden_size % 128 == 0``).
        dtype, device: of the parameters (default: torch defaults).
    """

    def __init__(self, buffer: Any, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, *,
                 norm_topk_prob: bool = True, use_fp8: bool = False, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        for name, value in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size),
                            ("num_experts", num_experts), ("top_k", top_k)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        rank, num_ranks = _group_rank_and_size(buffer)
        if num_experts % num_ranks != 0:
            raise ValueError(f"num_experts must be a multiple of the group size {num_ranks}, got {num_experts}")
        if top_k > num_experts:
            raise ValueError(f"top_k must be <= num_experts ({num_experts}), got {top_k}")
        if use_fp8 and hidden_size % FP8_BLOCK != 0:
            raise ValueError(f"use_fp8=True needs hidden_size % {FP8_BLOCK} == 0, got hidden_size={hidden_size}")
        self.buffer = buffer
        self.rank, self.num_ranks = rank, num_ranks
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.num_experts, self.top_k = num_experts, top_k
        self.num_local_experts = num_experts // num_ranks
        self.norm_topk_prob, self.use_fp8 = norm_topk_prob, use_fp8
        factory = {"dtype": dtype, "device": device}
        self.gate = nn.Linear(hidden_size, num_experts, bias=False, **factory)
        self.experts = nn.Module()
        self.experts.gate_up_proj = nn.Parameter(
            torch.empty(self.num_local_experts, 2 * intermediate_size, hidden_size, **factory))
        self.experts.down_proj = nn.Parameter(
            torch.empty(self.num_local_experts, hidden_size, intermediate_size, **factory))
        self.reset_parameters()

    @property
    def local_expert_range(self) -> range:
        """Global ids of the experts this rank owns."""
        return range(self.rank * self.num_local_experts, (self.rank + 1) * self.num_local_experts)

    def reset_parameters(self, std: float = 0.02) -> None:
        """Normal(0, std) init of every parameter (as Hugging Face's MoE models do)."""
        with torch.no_grad():
            for p in (self.gate.weight, self.experts.gate_up_proj, self.experts.down_proj):
                p.normal_(0.0, std)

    def expert_parameters(self) -> list[nn.Parameter]:
        """Parameters that are sharded over the group (no all-reduce in data-parallel training)."""
        return [self.experts.gate_up_proj, self.experts.down_proj]

    def replicated_parameters(self) -> list[nn.Parameter]:
        """Parameters replicated on every rank (their gradients are per-rank shares; all-reduce them)."""
        return [self.gate.weight]

    @torch.no_grad()
    def load_from_hf(self, block: nn.Module) -> ExpertParallelMoE:
        """Copy this rank's share of a Hugging Face sparse MoE block (Mixtral, or Qwen2-MoE's routed experts).

        ``block.gate.weight`` ``[E, H]`` is copied whole. The experts ``[r*L, (r+1)*L)`` come from the fused
        tensors ``block.experts.gate_up_proj`` ``[E, 2I, H]`` / ``down_proj`` ``[E, H, I]`` (transformers >= 5), or
        from the per-expert MLPs of older releases (``block.experts[e].w1`` gate, ``w3`` up, ``w2`` down, each an
        ``nn.Linear``). Shapes are checked; the values are cast to the layer's dtype and device.
        """
        lo, hi = self.local_expert_range.start, self.local_expert_range.stop
        experts = block.experts
        if hasattr(experts, "gate_up_proj"):
            gate_up, down = experts.gate_up_proj[lo:hi], experts.down_proj[lo:hi]
        else:
            gate_up = torch.stack([torch.cat([experts[e].w1.weight, experts[e].w3.weight]) for e in range(lo, hi)])
            down = torch.stack([experts[e].w2.weight for e in range(lo, hi)])
        sources = ((self.gate.weight, block.gate.weight, "gate.weight"),
                   (self.experts.gate_up_proj, gate_up, "experts.gate_up_proj"),
                   (self.experts.down_proj, down, "experts.down_proj"))
        for target, source, name in sources:
            if tuple(source.shape) != tuple(target.shape):
                raise ValueError(f"block.{name} slice has shape {tuple(source.shape)}, expected {tuple(target.shape)}")
            target.copy_(source)
        return self

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Args: ``hidden_states`` ``[..., H]`` (this rank's tokens). Returns: same shape and dtype."""
        if not isinstance(hidden_states, torch.Tensor):
            raise TypeError(f"hidden_states must be a torch.Tensor, got {type(hidden_states).__name__}")
        if hidden_states.size(-1) != self.hidden_size:
            raise ValueError(f"hidden_states.size(-1) must be hidden_size={self.hidden_size}, "
                             f"got shape {tuple(hidden_states.shape)}")
        x = hidden_states.reshape(-1, self.hidden_size)                         # [N, H]
        topk_idx, topk_weights = route_topk(self.gate(x), self.top_k, self.norm_topk_prob)
        recv_x, recv_topk_idx, recv_topk_weights, state = dispatch(
            x, topk_idx, topk_weights, self.buffer, self.num_experts, use_fp8=self.use_fp8)
        y = grouped_expert_forward(recv_x, recv_topk_idx, recv_topk_weights, state.num_recv_tokens_per_expert_list,
                                   self.experts.gate_up_proj, self.experts.down_proj)
        return combine(y, state).reshape(hidden_states.shape)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, "
                f"num_experts={self.num_experts} (local {self.local_expert_range.start}.."
                f"{self.local_expert_range.stop - 1} on rank {self.rank}/{self.num_ranks}), top_k={self.top_k}, "
                f"use_fp8={self.use_fp8}")

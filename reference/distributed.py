"""Run the global reference inside a ``torch.distributed`` group: gather every rank's inputs, compute the global
answer on each rank, keep this rank's part.

For tests only: it moves every input to every rank (``all_gather_object``), so it is O(R) in memory and traffic.
Each function mirrors the matching global function, with this rank's inputs instead of per-rank lists; tensors
are computed on the CPU and returned on the CPU.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from deep_ep.config import Topology
from reference import low_latency, normal


def _gather(value: Any, group: Optional[dist.ProcessGroup]) -> list[Any]:
    """Every rank's ``value`` (moved to CPU), indexed by rank within ``group``."""
    cpu = _to_cpu(value)
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, cpu, group=group)
    return out


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_to_cpu(v) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


def _rank(group: Optional[dist.ProcessGroup]) -> int:
    return dist.get_rank(group)


def dispatch(x: normal.XInput, is_token_in_rank: Optional[torch.Tensor], topology: Topology, *,
             group: Optional[dist.ProcessGroup] = None, topk_idx: Optional[torch.Tensor] = None,
             topk_weights: Optional[torch.Tensor] = None, handle: Optional[normal.Handle] = None,
             **kwargs: Any) -> normal.DispatchResult:
    """This rank's :func:`reference.normal.dispatch` result; other keywords are passed through."""
    xs = _gather(x, group)
    masks = None if handle is not None else _gather(is_token_in_rank, group)
    idx = _gather(topk_idx, group) if topk_idx is not None else None
    weights = _gather(topk_weights, group) if topk_weights is not None else None
    handles = _gather(handle, group) if handle is not None else None
    results = normal.dispatch(xs, masks, topology, topk_idx=idx, topk_weights=weights, handles=handles, **kwargs)
    return results[_rank(group)]


def combine(y: torch.Tensor, handle: normal.Handle, topology: Topology, *,
            group: Optional[dist.ProcessGroup] = None, topk_weights: Optional[torch.Tensor] = None,
            bias: Any = None) -> normal.CombineResult:
    """This rank's :func:`reference.normal.combine` result."""
    ys, handles = _gather(y, group), _gather(handle, group)
    weights = _gather(topk_weights, group) if topk_weights is not None else None
    biases = _gather(bias, group) if bias is not None else None
    return normal.combine(ys, handles, topology, topk_weights=weights, bias=biases)[_rank(group)]


def low_latency_dispatch(x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                         num_experts: int, *, group: Optional[dist.ProcessGroup] = None,
                         **kwargs: Any) -> low_latency.LowLatencyDispatchResult:
    """This rank's :func:`reference.low_latency.low_latency_dispatch` result."""
    results = low_latency.low_latency_dispatch(_gather(x, group), _gather(topk_idx, group),
                                               num_max_dispatch_tokens_per_rank, num_experts, **kwargs)
    return results[_rank(group)]


def low_latency_combine(y: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                        handle: Any, *, group: Optional[dist.ProcessGroup] = None, **kwargs: Any) -> torch.Tensor:
    """This rank's :func:`reference.low_latency.low_latency_combine` result. ``y`` is gathered as a contiguous
    copy, so pass ``zero_copy`` only for its argument check."""
    ys = _gather(y.contiguous(), group)
    results = low_latency.low_latency_combine(ys, _gather(topk_idx, group), _gather(topk_weights, group),
                                              _gather(handle, group), **kwargs)
    return results[_rank(group)]

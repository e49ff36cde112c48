"""The interface of a ``deep_ep.Buffer`` backend and the requests ``Buffer`` hands it.

``Buffer`` validates a call, resolves its defaults (the config, the bias as a tuple) and passes one request to the
backend its routing table names for the call's mode and device. Each backend serves a part of :class:`Backend`:
the torch backend all of it, the CUDA intranode / internode backends and the composed path the normal mode, the
CUDA low-latency backend the low-latency mode; a method a backend does not serve raises ``NotImplementedError``,
and ``Buffer`` never routes a call there. Requests arrive validated; backends return the NamedTuples of
``deep_ep.results`` and the handle types of ``deep_ep.handle``.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional, Protocol, Sequence

import torch

from deep_ep.backends.cuda_tuning import intranode_channels
from deep_ep.config import Config
from deep_ep.results import (
    CombineResult,
    DispatchLayout,
    DispatchResult,
    LowLatencyCombineResult,
    LowLatencyDispatchResult,
)


class LayoutRequest(NamedTuple):
    """``Buffer.get_dispatch_layout``'s arguments (see there)."""

    topk_idx: torch.Tensor
    num_experts: int
    previous_event: Any = None
    async_finish: bool = False
    allocate_on_comm_stream: bool = False


class DispatchRequest(NamedTuple):
    """``Buffer.dispatch``'s arguments (see there): ``x`` is a tensor or ``(x_fp8, x_scales)``; ``handle`` given:
    a cached dispatch (top-k and the layout tensors are ``None``); ``config`` resolved. ``signature``: the call's
    ``deep_ep.backends.agreement.Signature`` when the backend checks the ranks' agreement in an exchange of the call
    (the torch backend's count exchange, the CUDA notify or cached-dispatch kernel), else ``None`` (checked before,
    or nothing to check)."""

    x: Any
    handle: Any = None
    num_tokens_per_rank: Optional[torch.Tensor] = None
    num_tokens_per_rdma_rank: Optional[torch.Tensor] = None
    is_token_in_rank: Optional[torch.Tensor] = None
    num_tokens_per_expert: Optional[torch.Tensor] = None
    topk_idx: Optional[torch.Tensor] = None
    topk_weights: Optional[torch.Tensor] = None
    expert_alignment: int = 1
    num_worst_tokens: int = 0
    config: Optional[Config] = None
    previous_event: Any = None
    async_finish: bool = False
    allocate_on_comm_stream: bool = False
    signature: Any = None

    def payload(self) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``(data, scales)``: ``x``, or the FP8 bytes and their scales."""
        return self.x if isinstance(self.x, tuple) else (self.x, None)


class CombineRequest(NamedTuple):
    """``Buffer.combine``'s arguments (see there): ``bias`` is a tuple of 0 to 2 tensors; ``config`` resolved;
    ``signature`` as in :class:`DispatchRequest` (where the kernels carry the call's agreement)."""

    x: torch.Tensor
    handle: Any
    topk_weights: Optional[torch.Tensor] = None
    bias: tuple = ()
    config: Optional[Config] = None
    previous_event: Any = None
    async_finish: bool = False
    allocate_on_comm_stream: bool = False
    signature: Any = None


class LowLatencyDispatchRequest(NamedTuple):
    """``Buffer.low_latency_dispatch``'s arguments (see there); ``signature`` as in :class:`DispatchRequest`."""

    x: torch.Tensor
    topk_idx: torch.Tensor
    num_max_dispatch_tokens_per_rank: int
    num_experts: int
    cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None
    dispatch_wait_recv_cost_stats: Optional[torch.Tensor] = None
    use_fp8: bool = True
    round_scale: bool = False
    use_ue8m0: bool = False
    async_finish: bool = False
    return_recv_hook: bool = False
    signature: Any = None


class LowLatencyCombineRequest(NamedTuple):
    """``Buffer.low_latency_combine``'s arguments (see there); ``signature`` as in :class:`DispatchRequest`."""

    x: torch.Tensor
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    handle: Any
    use_logfmt: bool = False
    zero_copy: bool = False
    async_finish: bool = False
    return_recv_hook: bool = False
    out: Optional[torch.Tensor] = None
    combine_wait_recv_cost_stats: Optional[torch.Tensor] = None
    signature: Any = None


def _unserved(backend: object, method: str) -> NotImplementedError:
    return NotImplementedError(f"{type(backend).__name__} does not serve {method}")


class Backend(Protocol):
    """Every method a ``Buffer`` backend may serve, declared once (see the module docstring).

    Attributes:
        num_ranks: ranks of the group the backend serves.
        needs_host_checks: the backend relies on ``Buffer`` for the checks that read tensor contents (expert ids in
            range, counts that match the routing); the CUDA kernels check those themselves (``RoutingError``).
        notify_agreement: a non-cached ``dispatch`` carries the call's signature in its notify kernel, and
            :meth:`refuse_dispatch` takes part in that exchange for a rank whose validation failed.
        hashes_signature: a ``low_latency_dispatch`` carries a hash of the call's signature in its count messages,
            and :meth:`refuse_low_latency_dispatch` sends them for a rank whose validation failed.
        handle_agreement: a cached ``dispatch`` carries a hash of the call's signature in the words its kernel
            exchanges at its start; a disagreement raises at the backend's next call.
            :meth:`refuse_cached_dispatch` takes part in that exchange for a rank whose validation failed.
        combine_agreement: ``combine`` carries a hash of the call's signature in the words its kernel exchanges at
            its start; a disagreement raises at the backend's next call. :meth:`refuse_combine` takes part in that
            exchange for a rank whose validation failed.
    """

    num_ranks: int
    needs_host_checks: bool = False
    notify_agreement: bool = False
    hashes_signature: bool = False
    handle_agreement: bool = False
    combine_agreement: bool = False

    # Normal mode.
    def get_dispatch_layout(self, request: LayoutRequest) -> DispatchLayout:
        raise _unserved(self, "get_dispatch_layout")

    def dispatch(self, request: DispatchRequest) -> DispatchResult:
        raise _unserved(self, "dispatch")

    def refuse_dispatch(self, signature: Any) -> None:
        raise _unserved(self, "refuse_dispatch")

    def refuse_cached_dispatch(self, signature: Any, handle: Any) -> None:
        raise _unserved(self, "refuse_cached_dispatch")

    def combine(self, request: CombineRequest) -> CombineResult:
        raise _unserved(self, "combine")

    def refuse_combine(self, signature: Any, handle: Any) -> None:
        raise _unserved(self, "refuse_combine")

    def num_channels(self, config: Config) -> int:
        """Channels of this backend's handles for ``config`` (the rule of the CUDA kernels, on every backend)."""
        return intranode_channels(config.num_sms, self.num_ranks)

    def check_rings(self, kind: str, hidden_bytes: int, num_scales: int, num_topk: int, config: Config) -> None:
        """Raise ValueError when the rings of a ``kind`` ('dispatch' / 'combine') call with rows of ``hidden_bytes``,
        ``num_scales`` scales and ``num_topk`` top-k entries under ``config`` do not fit this backend's buffer.
        ``Buffer`` calls it inside the call's validation, so that a failure reaches the peers as a refusal; the
        default accepts every call (rings whose capacity adapts to the buffer are checked by the kernels' launchers
        instead)."""

    # Low-latency mode.
    def low_latency_dispatch(self, request: LowLatencyDispatchRequest) -> LowLatencyDispatchResult:
        raise _unserved(self, "low_latency_dispatch")

    def refuse_low_latency_dispatch(self, signature: Any, num_max_tokens: int, hidden: int, num_experts: int,
                                    device: torch.device) -> None:
        raise _unserved(self, "refuse_low_latency_dispatch")

    def low_latency_combine(self, request: LowLatencyCombineRequest) -> LowLatencyCombineResult:
        raise _unserved(self, "low_latency_combine")

    def get_next_low_latency_combine_buffer(self, handle: Any) -> torch.Tensor:
        raise _unserved(self, "get_next_low_latency_combine_buffer")

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        raise _unserved(self, "clean_low_latency_buffer")

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool) -> None:
        raise _unserved(self, "low_latency_update_mask_buffer")

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        raise _unserved(self, "low_latency_query_mask_buffer")

    def low_latency_clean_mask_buffer(self) -> None:
        raise _unserved(self, "low_latency_clean_mask_buffer")

    # Buffers, streams, errors, lifetime.
    def get_local_buffer_tensor(self, dtype: torch.dtype, size: Optional[torch.Size], offset: int,
                                use_rdma_buffer: bool) -> torch.Tensor:
        raise _unserved(self, "get_local_buffer_tensor")

    def get_comm_stream(self) -> Optional["torch.cuda.Stream"]:
        """The communication stream; ``None`` where calls complete on the caller's thread (CPU)."""
        return None

    def set_rank_names(self, names: Sequence[int], scope: str) -> None:
        """Name group rank ``r`` as ``names[r]`` in error reports; ``scope`` names the group (a stage's subgroup)."""
        raise _unserved(self, "set_rank_names")

    def check_errors(self) -> None:
        """Raise the pending device error, if any (never synchronises)."""

    def destroy(self) -> None:
        """Release the backend's buffers (collective where they are shared)."""

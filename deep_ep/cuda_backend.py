"""CUDA backend of ``deep_ep.Buffer``: the intranode normal-mode kernels over NVLink (CUDA IPC buffers).

``Buffer`` (the validating front in ``deep_ep/buffer.py``) constructs one :class:`CudaBackend` per rank when the
extension ``deep_ep._C`` imports and the group fits one NVLink domain, and forwards ``get_dispatch_layout``,
``dispatch`` and ``combine`` for CUDA tensors. Arguments arrive already validated and with the config resolved;
results are the NamedTuples of ``deep_ep.results`` with the handle of ``deep_ep.handle``.

Division of labour:

* this module owns allocation of every output tensor and the stream protocol of the spec (§6.2): a dedicated
  high-priority communication stream, ``previous_event``, ``async_finish``, ``allocate_on_comm_stream``;
* ``deep_ep._C.Runtime`` (csrc/buffer.cpp) owns the IPC buffer, the host-mapped error record and counters, and
  turns tensors into pointers for the launchers of ``csrc/kernels/api.cuh``.

Errors: kernels never trap. A kernel-side wait that runs out of ``DEEP_EP_TIMEOUT_S`` fills a host-mapped error
record and the kernel exits; the next call into this backend (or :meth:`CudaBackend.check_errors`) raises
:class:`CommTimeoutError` / :class:`PeerAbortedError` / :class:`RoutingError` naming rank, peer, channel, phase and
the awaited value. Host-side waits (the CPU waiting for notify's counts) raise :class:`CommTimeoutError` directly.
After an error every rank must call :meth:`CudaBackend.reset` (collective) before the next call.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence

import torch

from deep_ep import envs
from deep_ep.config import NUM_MAX_SCALEUP_RANKS, Config, intranode_send_warps

try:  # The extension is optional: ``import deep_ep.cuda_backend`` raises ImportError without it.
    from deep_ep import _C
except ImportError as exc:  # pragma: no cover - exercised only on machines without the build
    raise ImportError(f"deep_ep._C is not built ({exc}); build it with `MAX_JOBS=32 python setup.py build_ext "
                      "--inplace` on a CUDA machine (see docs/build.md)") from exc


class CommError(RuntimeError):
    """A communication kernel or host wait failed; the message names rank, peer, channel, phase and values."""


class CommTimeoutError(CommError, TimeoutError):
    """A bounded wait (GPU or CPU) ran out of ``DEEP_EP_TIMEOUT_S``."""


class PeerAbortedError(CommError):
    """A peer reported an error and aborted the collective call."""


class RoutingError(CommError, ValueError):
    """The kernels detected routing inconsistent with the counts or the handle (DeepEP would hang here)."""


def _raise_from_record(record: Optional[dict]) -> None:
    """Turn the dict of ``_C.Runtime.read_error()`` into the matching exception (no-op for ``None``)."""
    if record is None:
        return
    code = record["code"]
    message = record["message"]
    if code == "timeout":
        raise CommTimeoutError(message)
    if code == "peer_aborted":
        raise PeerAbortedError(message)
    if code in ("bad_routing", "count_mismatch"):
        raise RoutingError(message)
    raise CommError(message)


def _wait_event(stream: torch.cuda.Stream, event: Any) -> None:
    """Make ``stream`` wait for ``event``: an EventOverlap, a torch.cuda.Event or a ``_C.EventHandle``."""
    inner = getattr(event, "event", event)
    if inner is None:
        raise ValueError("previous_event must wrap an event, got an EventOverlap with event=None")
    inner = getattr(inner, "cuda_event", inner)  # deep_ep.event.CudaEventHandle wraps a torch.cuda.Event
    if isinstance(inner, torch.cuda.Event):
        stream.wait_event(inner)
    else:  # a _C.EventHandle or another object with current_stream_wait(): run it with `stream` current
        with torch.cuda.stream(stream):
            inner.current_stream_wait()


class _StreamScope:
    """The spec's stream protocol (buffer_api §6.2) around one kernel call.

    ``begin`` switches allocation to the comm stream if asked and makes comm wait for its dependency;
    ``finish`` records the returned event (async) or makes the compute stream wait (sync), restores the stream,
    and keeps tensors alive with ``record_stream``.
    """

    def __init__(self, comm: torch.cuda.Stream, previous_event: Any, async_finish: bool,
                 allocate_on_comm_stream: bool) -> None:
        self.comm = comm
        self.compute = torch.cuda.current_stream()
        self.async_finish = async_finish
        self.allocate_on_comm_stream = allocate_on_comm_stream
        if allocate_on_comm_stream:
            torch.cuda.set_stream(comm)
        if previous_event is not None:
            _wait_event(comm, previous_event)
        else:
            comm.wait_stream(self.compute)

    def finish(self, tensors: Sequence[Optional[torch.Tensor]]):
        from deep_ep.event import CudaEventHandle, EventOverlap
        live = tuple(t for t in tensors if isinstance(t, torch.Tensor))
        if self.async_finish:
            event = CudaEventHandle(self.comm)
            for t in live:
                t.record_stream(self.comm)
                if self.allocate_on_comm_stream:
                    t.record_stream(self.compute)
            result = EventOverlap(event, live)
        else:
            self.compute.wait_stream(self.comm)
            result = EventOverlap(None)
        if self.allocate_on_comm_stream:
            torch.cuda.set_stream(self.compute)
        return result


def _restores_stream(method):
    """On an exception, put back the stream that was current at entry (``allocate_on_comm_stream`` switches it)."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        stream = torch.cuda.current_stream()
        try:
            return method(self, *args, **kwargs)
        except BaseException:
            torch.cuda.set_stream(stream)
            raise
    return wrapper


def _flatten_x(x):
    """Split dispatch input ``x`` (Tensor or ``(x_fp8, x_scales)``) into (data, scales or None)."""
    if isinstance(x, tuple):
        return x[0], x[1]
    return x, None


class CudaBackend:
    """Intranode normal-mode dispatch/combine on CUDA tensors for one rank of a group of 1..8 ranks.

    Args:
        rank: this process's rank in the group.
        num_ranks: group size; all ranks share one NVLink domain (several may share one GPU).
        num_nvl_bytes: bytes of this rank's IPC-shared buffer (a multiple of 128; DeepEP's size hints fit).
        all_gather: ``all_gather(obj) -> list`` over the group (``torch.distributed.all_gather_object`` or
            mpi4py's ``allgather``), used once to exchange device ids and IPC handles.
        barrier: optional ``barrier()`` over the group, used by :meth:`destroy`.

    Construction is collective: every rank constructs with the same sizes.
    """

    def __init__(self, rank: int, num_ranks: int, num_nvl_bytes: int,
                 all_gather: Callable[[object], list], barrier: Optional[Callable[[], None]] = None) -> None:
        if not 1 <= num_ranks <= NUM_MAX_SCALEUP_RANKS:
            raise ValueError(f"num_ranks must be in [1, {NUM_MAX_SCALEUP_RANKS}] for the CUDA intranode backend, "
                             f"got {num_ranks}")
        if num_nvl_bytes <= 0 or num_nvl_bytes % 128 != 0:
            raise ValueError(f"num_nvl_bytes must be a positive multiple of 128 for the CUDA backend, got "
                             f"{num_nvl_bytes}")
        self.rank, self.num_ranks, self.num_nvl_bytes = rank, num_ranks, num_nvl_bytes
        self.timeout_s = envs.TIMEOUT_S.get()
        self._barrier = barrier
        self.runtime = _C.Runtime(rank, num_ranks, num_nvl_bytes, self.timeout_s)
        sizes = all_gather(num_nvl_bytes)
        if any(int(size) != num_nvl_bytes for size in sizes):
            raise ValueError(f"num_nvl_bytes must be equal on every rank (the kernels carve every peer's buffer with "
                             f"the same layout), got {sizes}")
        device_ids = all_gather(self.runtime.get_local_device_id())
        ipc_handles = all_gather(bytes(self.runtime.get_local_ipc_handle()))
        self.runtime.sync([int(d) for d in device_ids], [bytes(h) for h in ipc_handles])
        # A high-priority stream, as DeepEP takes from torch's pool.
        self.comm_stream = torch.cuda.Stream(priority=-1)

    @classmethod
    def from_group(cls, group, num_nvl_bytes: int) -> "CudaBackend":
        """Build from a ``torch.distributed`` process group."""
        import torch.distributed as dist

        def all_gather(obj):
            out = [None] * dist.get_world_size(group)
            dist.all_gather_object(out, obj, group=group)
            return out

        return cls(dist.get_rank(group), dist.get_world_size(group), num_nvl_bytes, all_gather,
                   lambda: dist.barrier(group=group))

    @staticmethod
    def is_supported(num_ranks: int, num_scaleup_ranks: int) -> bool:
        """True when this backend serves the topology: one NVLink domain of at most 8 ranks."""
        return num_ranks <= NUM_MAX_SCALEUP_RANKS and num_scaleup_ranks >= num_ranks

    # ------------------------------------------------------------------------------------------------------------
    # Utilities
    # ------------------------------------------------------------------------------------------------------------
    def get_comm_stream(self) -> torch.cuda.Stream:
        return self.comm_stream

    def get_local_buffer_tensor(self, dtype: torch.dtype, size: Optional[torch.Size] = None, offset: int = 0,
                                use_rdma_buffer: bool = False) -> torch.Tensor:
        """A view of this rank's IPC buffer from byte ``offset``: 1-D of ``(num_nvl_bytes - offset) // itemsize``
        elements, or the first ``size.numel()`` reshaped to ``size``. (DeepEP does not subtract the offset, which
        makes its view run past the allocation; this one stays inside it.)"""
        if use_rdma_buffer:
            raise ValueError("use_rdma_buffer=True needs an RDMA buffer, which the intranode CUDA backend has not")
        tensor = self.runtime.get_local_buffer_tensor(dtype, offset)
        if size is None:
            return tensor
        if size.numel() > tensor.numel():
            raise ValueError(f"size {tuple(size)} needs {size.numel()} elements, the buffer view has "
                             f"{tensor.numel()}")
        return tensor[:size.numel()].view(size)

    def check_errors(self) -> None:
        """Raise the pending device error, if any (reads host-mapped memory; never synchronises)."""
        _raise_from_record(self.runtime.read_error())

    def reset(self) -> None:
        """Collective: clear the error record and the kernels' private state on every rank after a failure."""
        torch.cuda.synchronize()
        if self._barrier is not None:
            self._barrier()
        self.runtime.reset(self.comm_stream.cuda_stream)
        torch.cuda.synchronize()
        if self._barrier is not None:
            self._barrier()

    def barrier(self) -> None:
        """Bounded cross-rank barrier kernel on the comm stream; waits for it on the host."""
        self.check_errors()
        self.runtime.barrier(self.comm_stream.cuda_stream)
        self.comm_stream.synchronize()
        self.check_errors()

    def destroy(self) -> None:
        """Collective: release the IPC buffer once every rank is done with it."""
        if self.runtime is None:
            return
        torch.cuda.synchronize()
        if self._barrier is not None:
            self._barrier()
        elif self.runtime.read_error() is None:  # no host barrier given: a bounded barrier kernel instead
            self.runtime.barrier(self.comm_stream.cuda_stream)
            self.comm_stream.synchronize()
        self.runtime.destroy()
        self.runtime = None

    def _call_prologue(self) -> None:
        if self.runtime is None:
            raise RuntimeError("this Buffer's CUDA runtime was destroyed")
        self.check_errors()

    # ------------------------------------------------------------------------------------------------------------
    # get_dispatch_layout
    # ------------------------------------------------------------------------------------------------------------
    @_restores_stream
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, previous_event=None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """Count tokens per rank and expert from ``topk_idx [N, K]`` (``topk_idx_t``; -1 = none).

        Returns ``DispatchLayout(num_tokens_per_rank [R] int32, None, num_tokens_per_expert [E] int32,
        is_token_in_rank [N, R] bool, event)``.
        """
        from deep_ep.results import DispatchLayout
        self._call_prologue()
        scope = _StreamScope(self.comm_stream, previous_event, async_finish, allocate_on_comm_stream)
        num_tokens = topk_idx.size(0)
        device = topk_idx.device
        num_tokens_per_rank = torch.empty(self.num_ranks, dtype=torch.int32, device=device)
        num_tokens_per_expert = torch.empty(num_experts, dtype=torch.int32, device=device)
        is_token_in_rank = torch.empty(num_tokens, self.num_ranks, dtype=torch.bool, device=device)
        self.runtime.get_dispatch_layout(topk_idx, num_experts, num_tokens_per_rank, num_tokens_per_expert,
                                         is_token_in_rank, self.comm_stream.cuda_stream)
        event = scope.finish([topk_idx, num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank])
        return DispatchLayout(num_tokens_per_rank, None, num_tokens_per_expert, is_token_in_rank, event)

    # ------------------------------------------------------------------------------------------------------------
    # dispatch
    # ------------------------------------------------------------------------------------------------------------
    @_restores_stream
    def dispatch(self, x, handle=None, num_tokens_per_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
                 is_token_in_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_expert: Optional[torch.Tensor] = None, topk_idx: Optional[torch.Tensor] = None,
                 topk_weights: Optional[torch.Tensor] = None, expert_alignment: int = 1, num_worst_tokens: int = 0,
                 config: Optional[Config] = None, previous_event=None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False):
        """Send each token of ``x`` to every rank that holds one of its experts (``is_token_in_rank``).

        Args (validated by the front):
            x: ``[N, H]`` (any 2- or 4-byte dtype, typically BF16) or ``(x_fp8 [N, H] float8_e4m3fn,
                x_scales [N, S] float32/int32, any strides)``.
            handle: an ``IntranodeHandle`` for cached dispatch (then top-k and counts are ``None``).
            num_tokens_per_rank ``[R]`` int32, is_token_in_rank ``[N, R]`` bool, num_tokens_per_expert ``[E]``
                int32: the layout (non-cached).
            topk_idx ``[N, K]`` topk_idx_t, topk_weights ``[N, K]`` float32: forwarded as local ids / weights.
            expert_alignment: rounds the reported per-expert counts up.
            num_worst_tokens: > 0 allocates that many rows and skips the CPU wait (CUDA-graph capturable).

        Returns:
            ``DispatchResult(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle,
            event)``; rows ordered by (source rank, source token).
        """
        from deep_ep.handle import IntranodeHandle
        from deep_ep.results import DispatchResult
        self._call_prologue()
        if config is None:
            raise ValueError("config must be resolved by the Buffer front before reaching the CUDA backend")
        data, scales = _flatten_x(x)
        num_tokens, hidden = data.shape
        device = data.device
        num_channels = self.num_channels(config)
        cached = handle is not None
        num_experts = num_tokens_per_expert.numel() if num_tokens_per_expert is not None else 0
        num_local_experts = num_experts // self.num_ranks if num_experts else 0

        scope = _StreamScope(self.comm_stream, previous_event, async_finish, allocate_on_comm_stream)
        if cached:
            handle = self._kernel_handle(handle)
            rank_prefix_matrix = handle.rank_prefix_matrix
            channel_prefix_matrix = handle.channel_prefix_matrix
            recv_channel_prefix_matrix = handle.recv_channel_prefix_matrix
            is_token_in_rank = handle.is_token_in_rank
            if channel_prefix_matrix.size(1) != num_channels:
                raise ValueError(f"config.num_sms ({config.num_sms}) gives {num_channels} channels but the handle was "
                                 f"made with {channel_prefix_matrix.size(1)}; use the dispatch's config")
            num_recv_tokens = handle.recv_src_idx.size(0)
            per_expert_list = None
        else:
            rank_prefix_matrix = torch.empty(self.num_ranks, self.num_ranks, dtype=torch.int32, device=device)
            channel_prefix_matrix = torch.empty(self.num_ranks, num_channels, dtype=torch.int32, device=device)
            recv_channel_prefix_matrix = torch.empty(self.num_ranks, num_channels, dtype=torch.int32, device=device)
            worst = num_worst_tokens > 0
            self.runtime.notify_dispatch(num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank, num_experts,
                                         num_channels, expert_alignment, worst, rank_prefix_matrix,
                                         channel_prefix_matrix, recv_channel_prefix_matrix,
                                         self.comm_stream.cuda_stream)
            if worst:
                num_recv_tokens, per_expert_list = num_worst_tokens, []
            else:
                try:
                    num_recv_tokens, per_expert_list = self.runtime.wait_recv_counts(num_local_experts)
                except (_C.HostTimeout, _C.DeviceError) as exc:
                    self.check_errors()  # a device-side report names the missing peer: prefer it
                    raise CommTimeoutError(str(exc)) from None
                per_expert_list = list(per_expert_list)

        recv_x = torch.empty(num_recv_tokens, hidden, dtype=data.dtype, device=device)
        recv_scales = None
        if scales is not None:
            recv_scales = torch.empty(num_recv_tokens, scales.size(1), dtype=scales.dtype, device=device)
        recv_topk_idx = recv_topk_weights = None
        if topk_idx is not None:
            recv_topk_idx = torch.empty(num_recv_tokens, topk_idx.size(1), dtype=topk_idx.dtype, device=device)
            recv_topk_weights = torch.empty(num_recv_tokens, topk_idx.size(1), dtype=torch.float32, device=device)
        if cached:
            recv_src_idx, send_head = handle.recv_src_idx, handle.send_head
        else:
            recv_src_idx = torch.empty(num_recv_tokens, dtype=torch.int32, device=device)
            send_head = torch.empty(num_tokens, self.num_ranks, dtype=torch.int32, device=device)

        self.runtime.dispatch(data, scales, topk_idx, topk_weights, num_experts, is_token_in_rank,
                              rank_prefix_matrix, recv_channel_prefix_matrix, send_head, recv_x, recv_scales,
                              recv_src_idx, recv_topk_idx, recv_topk_weights, num_worst_tokens > 0 and not cached,
                              num_channels, config.num_max_nvl_chunked_send_tokens,
                              config.num_max_nvl_chunked_recv_tokens,
                              intranode_send_warps("dispatch", self.num_ranks), self.comm_stream.cuda_stream)

        new_handle = None
        if not cached:
            new_handle = self._user_handle(IntranodeHandle(rank_prefix_matrix, channel_prefix_matrix,
                                                           recv_channel_prefix_matrix, recv_src_idx,
                                                           is_token_in_rank, send_head))
        event = scope.finish([data, scales, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_rank,
                              num_tokens_per_expert, rank_prefix_matrix, channel_prefix_matrix,
                              recv_channel_prefix_matrix, recv_x, recv_scales, recv_topk_idx, recv_topk_weights,
                              recv_src_idx, send_head, *(new_handle or ())])
        out_x = (recv_x, recv_scales) if scales is not None else recv_x
        if cached:
            return DispatchResult(out_x, None, None, None, None, event)
        return DispatchResult(out_x, recv_topk_idx, recv_topk_weights, per_expert_list, new_handle, event)

    def _kernel_handle(self, handle):
        """The handle as the kernels read it (an ``IntranodeHandle``); called on entry, after the comm stream
        waited for its dependency. The internode backend converts its handle here."""
        return handle

    def _user_handle(self, handle):
        """The handle returned to the user for the kernels' ``IntranodeHandle``; called after the dispatch kernel
        was launched, before the call's event is recorded."""
        return handle

    # ------------------------------------------------------------------------------------------------------------
    # combine
    # ------------------------------------------------------------------------------------------------------------
    @_restores_stream
    def combine(self, x: torch.Tensor, handle, topk_weights: Optional[torch.Tensor] = None, bias=None,
                config: Optional[Config] = None, previous_event=None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False):
        """Reduce ``x [M, H]`` BF16 (rows aligned with the dispatch's ``recv_x``) back to the original tokens.

        ``combined_x[t] = bf16(b0[t] + b1[t] + sum over ranks d holding t of x_d[row_d(t)])`` with fp32
        accumulation in ascending rank order; ``combined_topk_weights [N, K]`` float32 likewise when
        ``topk_weights [M, K]`` is given. Returns ``CombineResult(combined_x, combined_topk_weights, event)``.
        """
        from deep_ep.results import CombineResult
        self._call_prologue()
        if config is None:
            raise ValueError("config must be resolved by the Buffer front before reaching the CUDA backend")
        num_channels = self.num_channels(config)
        if handle[1].size(1) != num_channels:
            raise ValueError(f"config.num_sms ({config.num_sms}) gives {num_channels} channels but the handle was "
                             f"made with {handle[1].size(1)}; use the dispatch's SM count")
        bias_0, bias_1 = (bias if isinstance(bias, tuple) else (bias, None)) if bias is not None else (None, None)
        scope = _StreamScope(self.comm_stream, previous_event, async_finish, allocate_on_comm_stream)
        handle = self._kernel_handle(handle)
        num_tokens = handle.send_head.size(0)
        combined_x = torch.empty(num_tokens, x.size(1), dtype=x.dtype, device=x.device)
        combined_topk_weights = None
        if topk_weights is not None:
            combined_topk_weights = torch.empty(num_tokens, topk_weights.size(1), dtype=torch.float32,
                                                device=x.device)
        self.runtime.combine(x, topk_weights, bias_0, bias_1, handle.rank_prefix_matrix,
                             handle.recv_channel_prefix_matrix, handle.send_head, combined_x, combined_topk_weights,
                             num_channels, config.num_max_nvl_chunked_send_tokens,
                             config.num_max_nvl_chunked_recv_tokens,
                             intranode_send_warps("combine", self.num_ranks), self.comm_stream.cuda_stream)
        event = scope.finish([x, topk_weights, bias_0, bias_1, combined_x, combined_topk_weights, *handle])
        return CombineResult(combined_x, combined_topk_weights, event)

    @staticmethod
    def num_channels(config: Config) -> int:
        """Channels of the kernels for ``config``: one CTA per channel, so ``config.num_sms`` (DeepEP pairs two
        SMs per channel and has ``num_sms // 2``). The handle's prefix matrices are ``[R, num_channels]``."""
        return int(_C.num_channels_for_sms(config.num_sms))

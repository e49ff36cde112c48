"""CUDA intranode backend of ``deep_ep.Buffer``: the normal-mode ring kernels over NVLink (CUDA IPC buffers).

``Buffer`` builds one :class:`CudaBackend` per rank when the extension imports and the group is one NVLink domain,
and routes the normal mode of CUDA tensors here. This module allocates what a non-cached dispatch needs before its
CPU wait (prefix matrices, ``send_head``) and picks the output-pool blocks of direct-to-output receive.
``deep_ep._C.Runtime`` owns the IPC buffer, the host-mapped error record and the counters; one Python -> C++
crossing per kernel: its entry points allocate the outputs whose shapes they know and make the plain stream waits
of the call (``StreamScope.after_current`` / ``current_after``).

A kernel error raises at the next call (:meth:`CudaBackend.check_errors`), naming rank, peer, channel, phase and the
awaited value; the CPU's wait for notify's counts raises :class:`CommTimeoutError` directly. After an error every
rank calls :meth:`CudaBackend.reset` (collective) before the next call. A non-cached dispatch's call signature
(``deep_ep.backends.agreement``) rides in notify's count exchange, a cached dispatch's or a combine's hash in the
words its kernel exchanges at its start (raised at the next call); ranks that disagree raise
:class:`ArgumentMismatchError` and stay usable (no row moved, no reset needed).
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from deep_ep import envs
from deep_ep.backends import cuda_tuning as tuning
from deep_ep.backends.agreement import SIGNATURE_WORDS, Signature, check_agreement, signature_hash
from deep_ep.backends.base import Backend, CombineRequest, DispatchRequest, LayoutRequest
from deep_ep.backends.common import StreamScope, object_all_gather
from deep_ep.backends.cuda_common import _C, raise_from_record, record_streams
from deep_ep.config import NUM_MAX_RING_RANKS, NUM_MAX_SCALEUP_RANKS
from deep_ep.errors import ArgumentMismatchError, CommTimeoutError, name_ranks
from deep_ep.handle import IntranodeHandle
from deep_ep.layout import intranode_dispatch_output_layout
from deep_ep.pool import OutputPool
from deep_ep.results import CombineResult, DispatchLayout, DispatchResult


class CudaBackend(Backend):
    """Intranode normal-mode dispatch/combine on CUDA tensors for one rank of a group of 1..8 ranks (a Buffer's
    NVLink domain, or the composed path's node stage).

    Args:
        rank: this process's rank in the group.
        num_ranks: group size; all ranks share one NVLink domain (several may share one GPU).
        num_nvl_bytes: bytes of this rank's IPC-shared buffer (a multiple of 128; DeepEP's size hints fit).
        all_gather: ``all_gather(obj) -> list`` over the group (``torch.distributed.all_gather_object`` or
            mpi4py's ``allgather``), used once to exchange device ids and IPC handles.
        barrier: optional ``barrier()`` over the group, used by :meth:`destroy`.

    Construction is collective: every rank constructs with the same sizes.
    """

    # The landing-zone combines (copy engine, zone senders: cuda_tuning.combine_send_path) over this buffer.
    copy_engine_combine = True
    # The Buffer argument that sizes this backend's buffer (named in messages).
    buffer_arg = "num_nvl_bytes"
    # A non-cached dispatch's notify kernel carries the call's signature (Backend.notify_agreement).
    notify_agreement = True
    # A cached dispatch's kernel compares the hashes of the ranks' call signatures (Backend.handle_agreement).
    handle_agreement = True
    # So does a combine's kernel (Backend.combine_agreement).
    combine_agreement = True
    # The ranks this rank reaches by NVSHMEM puts (cuda_internode.SymmetricCuda sets them; none over IPC).
    put_peers: Sequence[int] = ()
    # Whether the buffers of the world end with a put area (some pair of the world is a put pair; SymmetricCuda).
    put_area = False

    def __init__(self, rank: int, num_ranks: int, num_nvl_bytes: int,
                 all_gather: Callable[[object], list], barrier: Optional[Callable[[], None]] = None) -> None:
        if not 1 <= num_ranks <= NUM_MAX_RING_RANKS:  # the ring kernels' limit; a group here has <= 8
            raise ValueError(f"num_ranks must be in [1, {NUM_MAX_RING_RANKS}] for the CUDA ring kernels, "
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
        self._comm_ptr = self.comm_stream.cuda_stream
        # Blocks for direct-to-output dispatch (the buffer's bytes after the rings; empty for DeepEP-sized buffers).
        self.output_pool = OutputPool(self.runtime.get_pool_offset(), self.runtime.get_pool_bytes())

    @classmethod
    def from_group(cls, group, num_nvl_bytes: int) -> "CudaBackend":
        """Build from a ``torch.distributed`` process group."""
        import torch.distributed as dist

        all_gather = object_all_gather(group)
        return cls(dist.get_rank(group), dist.get_world_size(group), num_nvl_bytes, all_gather,
                   lambda: dist.barrier(group=group))

    def ring_bytes(self) -> int:
        """Bytes of the kernels' region of the buffer (control, rings, output pool): all of it, unless NVSHMEM put
        peers need a put area after it (``deep_ep.backends.cuda_internode``)."""
        return int(self.runtime.get_ring_bytes())

    @staticmethod
    def is_supported(num_ranks: int, num_scaleup_ranks: int) -> bool:
        """True when this backend serves the topology: one NVLink domain of at most 8 ranks."""
        return num_ranks <= NUM_MAX_SCALEUP_RANKS and num_scaleup_ranks >= num_ranks

    # ------------------------------------------------------------------------------------------------------------
    # Utilities
    # ------------------------------------------------------------------------------------------------------------
    def get_comm_stream(self) -> torch.cuda.Stream:
        return self.comm_stream

    def get_local_buffer_tensor(self, dtype: torch.dtype, size: Optional[torch.Size], offset: int,
                                use_rdma_buffer: bool) -> torch.Tensor:
        """A view of this rank's IPC buffer from byte ``offset``: 1-D of ``(num_nvl_bytes - offset) // itemsize``
        elements, or the first ``size.numel()`` reshaped to ``size``. (DeepEP does not subtract the offset, which
        makes its view run past the allocation; this one stays inside it.) Bytes past the two ring halves are the
        output pool of direct-to-output dispatch (``deep_ep.layout.intranode_pool_region``): writing there
        corrupts live dispatch outputs, unless every dispatch receives through the rings."""
        if use_rdma_buffer:
            raise ValueError("use_rdma_buffer=True needs an RDMA buffer, which the intranode CUDA backend has not")
        tensor = self.runtime.get_local_buffer_tensor(dtype, offset)
        if size is None:
            return tensor
        if size.numel() > tensor.numel():
            raise ValueError(f"size {tuple(size)} needs {size.numel()} elements, the buffer view has "
                             f"{tensor.numel()}")
        return tensor[:size.numel()].view(size)

    # Ranks in error reports: this group's rank r is reported as rank_names[r] (the Buffer's rank, when this
    # backend is a stage of the composed path over a subgroup), with rank_scope naming the group (set_rank_names).
    rank_names: Optional[list[int]] = None
    rank_scope = ""

    def set_rank_names(self, names: Sequence[int], scope: str) -> None:
        """Report ranks in errors as ``names[r]`` instead of this group's ``r``; ``scope`` names the group."""
        self.rank_names, self.rank_scope = [int(r) for r in names], scope

    def check_errors(self) -> None:
        """Raise the pending device error, if any (reads host-mapped memory; never synchronises). A worst-token
        notify that saw the ranks' signatures differ raises :class:`ArgumentMismatchError` once and leaves the
        backend usable."""
        record = self._error_record()
        if record is not None and record["code"] == "argument_mismatch":
            self.runtime.clear_argument_error(self._comm_ptr)
            if record["phase"] == "dispatch agreement":
                raise ArgumentMismatchError(name_ranks(
                    f"rank {self.rank}: the ranks' cached dispatch call signatures differ ({record['message']}: "
                    "expected is this rank's signature hash, observed the peer's); every rank must pass the same "
                    "handle, x (hidden, dtype), x_scales and config; no rank moved data", self.rank_names,
                    self.rank_scope))
            if record["phase"] == "combine agreement":
                raise ArgumentMismatchError(name_ranks(
                    f"rank {self.rank}: the ranks' combine call signatures differ ({record['message']}: expected is "
                    "this rank's signature hash, observed the peer's); every rank must pass the same handle, x "
                    "hidden size, topk_weights (given or not, and its width), number of bias tensors and config; no "
                    "rank moved data", self.rank_names, self.rank_scope))
            signature, self._worst_signature = self._worst_signature, None
            if signature is not None:
                self._check_signatures(signature)  # names the argument and the ranks, when the words are still those
            raise ArgumentMismatchError(name_ranks(f"rank {self.rank}: the ranks' dispatch call signatures differ "
                                                   f"({record['message']}); no rank moved data", self.rank_names,
                                                   self.rank_scope))
        raise_from_record(record, self.rank_names, self.rank_scope)

    def _error_record(self) -> Optional[dict]:
        """The runtime's pending error record, or ``None`` (a subclass may name more in its message)."""
        return self.runtime.read_error()

    def _checked_hash(self, signature: Optional[Signature]) -> int:
        """The hash a checked call's kernel (a combine; on the fused kernels a cached dispatch too) compares with
        every peer's (never 0, which is "unchecked"), or 0: no signature. A call captured in a CUDA graph is checked
        at each replay (the kernels number checked calls on the device)."""
        return (signature_hash(signature) or 1) if signature is not None else 0

    @staticmethod
    def _verdict_awaited(hashed: int) -> bool:
        """Whether the next call awaits the verdict of a checked call of ``hashed`` launched now (not under CUDA-graph
        capture: a replay's verdict is read from the error record by the call after it)."""
        return hashed != 0 and not torch.cuda.is_current_stream_capturing()

    # The signature of the last worst-token dispatch (its notify reports a disagreement through the error record),
    # and an event after that notify, which the next call waits for (None once waited for, or under graph capture).
    _worst_signature: Optional[Signature] = None
    _worst_notify: Optional["torch.cuda.Event"] = None
    # A cached dispatch or combine whose kernel compares signature hashes was launched: the next call awaits its
    # verdict.
    _verdict_pending = False

    def _check_signatures(self, signature: Signature, words: Optional[list] = None) -> None:
        """``check_agreement`` over the signatures the last notify gathered (ranks named as in errors); ``words``:
        ``signature.words()`` as a list, when the caller has it."""
        raw = self.runtime.gathered_signatures()
        if words is not None and raw == words * self.num_ranks:  # the common case, without building tensors
            return
        gathered = torch.tensor(raw, dtype=torch.int64).view(self.num_ranks, SIGNATURE_WORDS)
        names = self.rank_names if self.rank_names is not None else list(range(self.num_ranks))
        check_agreement(signature, gathered, names, names[self.rank])

    def refuse_dispatch(self, signature: Signature) -> None:
        """This rank's validation refused a non-cached dispatch: launch its notify with zero counts and the refusal
        ``signature`` so that the peers' notify completes and every peer raises :class:`ArgumentMismatchError`
        naming this rank; the caller then raises its own error."""
        if self.runtime is not None:
            self.runtime.refuse_notify(signature.values(), self._comm_ptr)

    def refuse_cached_dispatch(self, signature: Signature, handle: object, num_channels: int) -> None:
        """This rank's validation refused a cached dispatch that its peers make: launch the dispatch kernel of
        ``handle``'s channels (``None``, a handle that is not valid: a stand-in of no tokens over ``num_channels``,
        the call's config's) with the hash of the refusal ``signature`` and a stand-in payload, so that every peer's
        kernel sees a hash that differs at once (no rank moves a row). The caller raises its own error now; the next
        call raises :class:`ArgumentMismatchError` on every rank, this one too, so that the ranks' calls stay
        paired."""
        if self.runtime is None:
            return
        self._call_prologue()
        handle = self._kernel_handle(handle) if handle is not None else self._stand_in_handle(num_channels)
        num_channels = handle.channel_prefix_matrix.size(1)
        is_token_in_rank = handle.is_token_in_rank
        stand_in = torch.empty(is_token_in_rank.size(0), 8, dtype=torch.bfloat16, device=is_token_in_rank.device)
        self.runtime.dispatch(stand_in, None, None, None, 0, is_token_in_rank, handle.rank_prefix_matrix,
                              handle.channel_prefix_matrix, handle.recv_channel_prefix_matrix, handle.send_head,
                              handle.recv_src_idx.size(0), handle.recv_src_idx, -1, -1, False, num_channels, 8, 256,
                              tuning.intranode_send_warps("dispatch", self.num_ranks, num_channels,
                                                          puts=bool(self.put_peers)),
                              self._comm_ptr, True, True, self._checked_hash(signature))
        self._verdict_pending = self._verdict_awaited(self._checked_hash(signature))

    def refuse_combine(self, signature: Signature, handle: object) -> None:
        """This rank's validation refused a combine that its peers make: launch the ring combine kernel of
        ``handle``'s channels (``None``, a handle that is not valid: a stand-in of no tokens over one channel; the
        agreement words do not depend on the channels) with the hash of the refusal ``signature`` and a stand-in
        ``x``, so that every peer's kernel sees a hash that differs at once (no rank moves a row). The caller raises
        its own error now; the next call raises :class:`ArgumentMismatchError` on every rank, this one too."""
        if self.runtime is None:
            return
        self._call_prologue()
        handle = self._kernel_handle(handle) if handle is not None else self._stand_in_handle(1)
        num_channels = handle.channel_prefix_matrix.size(1)
        rows = handle.recv_src_idx.size(0)
        stand_in = torch.empty(rows, 8, dtype=torch.bfloat16, device=handle.send_head.device)
        self.runtime.combine(stand_in, None, None, None, handle.rank_prefix_matrix, handle.recv_channel_prefix_matrix,
                             handle.send_head, num_channels, 8, 256,
                             tuning.intranode_send_warps("combine", self.num_ranks, num_channels,
                                                         puts=bool(self.put_peers)),
                             self._comm_ptr, True, True, None, [], 0, 0, False, self._checked_hash(signature))
        self._verdict_pending = self._verdict_awaited(self._checked_hash(signature))

    def _stand_in_handle(self, num_channels: int) -> IntranodeHandle:
        """A kernel handle of no tokens and no rows over ``num_channels`` channels (every count and prefix 0): the
        handle a refusal launches its kernel with when its own is not valid."""
        R, zeros = self.num_ranks, self._zeros
        return IntranodeHandle(zeros(R, R), zeros(R, num_channels), zeros(R, num_channels), zeros(0),
                               zeros(0, R, dtype=torch.bool), zeros(0, R))

    def _zeros(self, *shape: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
        """A zero tensor on this backend's device (a stand-in handle's field)."""
        return torch.zeros(*shape, dtype=dtype, device=self.comm_stream.device)

    def reset(self) -> None:
        """Collective: clear the error record and the kernels' private state on every rank after a failure."""
        torch.cuda.synchronize()
        if self._barrier is not None:
            self._barrier()
        self._verdict_pending = False
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
        if self._worst_notify is not None:  # bounded: the notify kernel's waits are
            self._worst_notify.synchronize()
            self._worst_notify = None
        if self._verdict_pending:
            self._verdict_pending = False
            try:
                self.runtime.await_agreement()
            except _C.HostTimeout as exc:
                self.check_errors()  # a device-side report names the missing peer: prefer it
                raise CommTimeoutError(name_ranks(str(exc), self.rank_names, self.rank_scope)) from None
        self.check_errors()

    # ------------------------------------------------------------------------------------------------------------
    # Normal mode
    # ------------------------------------------------------------------------------------------------------------
    def _scope(self, request: object) -> StreamScope:
        return StreamScope(self.comm_stream, request.previous_event, request.async_finish,
                           request.allocate_on_comm_stream, launch_waits=True, record=record_streams)

    def get_dispatch_layout(self, request: LayoutRequest) -> DispatchLayout:
        """Count tokens per rank and expert from ``topk_idx [N, K]`` (``topk_idx_t``; -1 = none); no per-node
        counts."""
        self._call_prologue()
        topk_idx = request.topk_idx
        with self._scope(request) as scope:
            num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank = self.runtime.get_dispatch_layout(
                topk_idx, request.num_experts, self._comm_ptr, scope.after_current, scope.current_after)
            event = scope.finish((topk_idx, num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank))
        return DispatchLayout(num_tokens_per_rank, None, num_tokens_per_expert, is_token_in_rank, event)

    def dispatch(self, request: DispatchRequest) -> DispatchResult:
        """Send each token of ``x`` to every rank that holds one of its experts (``is_token_in_rank``); rows ordered
        by (source rank, source token). ``num_worst_tokens > 0`` allocates that many rows and skips the CPU wait
        (CUDA-graph capturable). A cached dispatch (``handle``) returns ``(recv_x, None, None, None, None,
        event)``."""
        self._call_prologue()
        data, scales = request.payload()
        config = request.config
        num_channels = self.num_channels(config)
        cached = request.handle is not None
        topk_idx, is_token_in_rank = request.topk_idx, request.is_token_in_rank
        num_tokens_per_rank, num_tokens_per_expert = request.num_tokens_per_rank, request.num_tokens_per_expert
        num_worst_tokens = request.num_worst_tokens
        num_experts = num_tokens_per_expert.numel() if num_tokens_per_expert is not None else 0
        num_local_experts = num_experts // self.num_ranks if num_experts else 0

        with self._scope(request) as scope:
            after_current = scope.after_current
            if cached:
                handle = self._kernel_handle(request.handle)
                rank_prefix_matrix = handle.rank_prefix_matrix
                channel_prefix_matrix = handle.channel_prefix_matrix
                recv_channel_prefix_matrix = handle.recv_channel_prefix_matrix
                is_token_in_rank = handle.is_token_in_rank
                if channel_prefix_matrix.size(1) != num_channels:
                    raise ValueError(f"config.num_sms ({config.num_sms}) gives {num_channels} channels but the handle "
                                     f"was made with {channel_prefix_matrix.size(1)}; use the dispatch's config")
                num_recv_tokens = handle.recv_src_idx.size(0)
                per_expert_list = None
                # The ranks' agreement rides in the output words the kernel exchanges at its start (never 0: 0 is
                # "unchecked"); the next call raises a disagreement.
                hashed = self._checked_hash(request.signature)
                given_recv_src_idx, send_head = handle.recv_src_idx, handle.send_head
            else:
                given_recv_src_idx = None  # allocated by the runtime, with the outputs
                device = data.device
                send_head = torch.empty(data.size(0), self.num_ranks, dtype=torch.int32, device=device)
                rank_prefix_matrix = torch.empty(self.num_ranks, self.num_ranks, dtype=torch.int32, device=device)
                channel_prefix_matrix = torch.empty(self.num_ranks, num_channels, dtype=torch.int32, device=device)
                recv_channel_prefix_matrix = torch.empty(self.num_ranks, num_channels, dtype=torch.int32,
                                                         device=device)
                worst = num_worst_tokens > 0
                pair_counts = None
                hashed = 0
                signature = request.signature  # the ranks' agreement rides in notify's slots
                words = signature.values() if signature is not None else []
                self.runtime.notify_dispatch(num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank,
                                             num_experts, num_channels, request.expert_alignment, worst,
                                             rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix,
                                             self._comm_ptr, after_current, words, True)
                after_current = False  # the notify launch did it
                if worst:
                    # A disagreement comes back through the error record (the dispatch kernel then moves no row);
                    # the next call waits for this notify before it reads the record, so every rank raises there.
                    self._worst_signature = signature
                    if signature is not None and not torch.cuda.is_current_stream_capturing():
                        self._worst_notify = torch.cuda.Event()
                        self._worst_notify.record(self.comm_stream)
                    num_recv_tokens, per_expert_list = num_worst_tokens, []
                else:
                    try:
                        num_recv_tokens, per_expert_list = self.runtime.wait_recv_counts(num_local_experts)
                    except (_C.HostTimeout, _C.DeviceError) as exc:
                        self.check_errors()  # a device-side report names the missing peer: prefer it
                        raise CommTimeoutError(name_ranks(str(exc), self.rank_names, self.rank_scope)) from None
                    if signature is not None:
                        self._check_signatures(signature, words)  # before any row moves: no rank's dispatch kernel
                    per_expert_list = list(per_expert_list)
                    # The rows of every (source, destination) pair size a landing-zone combine with this handle.
                    pair_counts = self.runtime.pair_counts()

            data_offset, meta_offset = self._pool_blocks(num_recv_tokens, data, scales, topk_idx, cached,
                                                         ordered=request.previous_event is None)
            # The runtime turns the pool blocks into tensors first: even if it raises, they come back through
            # reclaim_pool_blocks once those tensors are gone.
            recv_x, recv_scales, recv_src_idx, recv_topk_idx, recv_topk_weights = self.runtime.dispatch(
                data, scales, topk_idx, request.topk_weights, num_experts, is_token_in_rank, rank_prefix_matrix,
                channel_prefix_matrix, recv_channel_prefix_matrix, send_head, num_recv_tokens, given_recv_src_idx,
                data_offset, meta_offset, num_worst_tokens > 0 and not cached, num_channels,
                config.num_max_nvl_chunked_send_tokens, config.num_max_nvl_chunked_recv_tokens,
                tuning.intranode_send_warps("dispatch", self.num_ranks, num_channels, scales is not None,
                                            bool(self.put_peers)),
                self._comm_ptr, after_current, scope.current_after, hashed)
            self._verdict_pending = self._verdict_awaited(hashed)

            new_handle = None
            if not cached:
                kernel_handle = IntranodeHandle(rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix,
                                                recv_src_idx, is_token_in_rank, send_head)
                kernel_handle.backend_state = pair_counts
                new_handle = self._user_handle(kernel_handle, scope.current_after)
            event = scope.finish((data, scales, topk_idx, request.topk_weights, is_token_in_rank,
                                  num_tokens_per_rank, num_tokens_per_expert, rank_prefix_matrix,
                                  channel_prefix_matrix, recv_channel_prefix_matrix, recv_x, recv_scales,
                                  recv_topk_idx, recv_topk_weights, recv_src_idx, send_head, *(new_handle or ())))
        out_x = (recv_x, recv_scales) if scales is not None else recv_x
        if cached:
            return DispatchResult(out_x, None, None, None, None, event)
        return DispatchResult(out_x, recv_topk_idx, recv_topk_weights, per_expert_list, new_handle, event)

    def _kernel_handle(self, handle: object) -> IntranodeHandle:
        """The handle as the kernels read it (an ``IntranodeHandle`` whose ``backend_state`` holds the pair counts of
        its dispatch, or ``None``). The internode backend converts its handle here (on the comm stream, which
        produced the handle's tensors)."""
        return handle

    def _user_handle(self, handle: IntranodeHandle, current_after: bool) -> object:
        """The handle returned to the user for the kernels' ``IntranodeHandle``; called after the dispatch kernel
        was launched, before the call's event is recorded. ``current_after``: the launch made the current stream
        wait for the comm stream (work this adds to the comm stream must then be waited for again)."""
        return handle

    def reclaim_pool_blocks(self, ordered: bool = False) -> None:
        """Free the output-pool blocks whose tensors are gone and that a dispatch about to run on the comm stream
        may overwrite: at once when ``ordered`` (the comm stream waits for all work enqueued so far on the current
        stream before that dispatch's kernel) and the block was only used on those two streams; otherwise once
        events recorded at the first collection have completed (usually one call later)."""
        for offset in self.runtime.collect_pool_blocks(self._comm_ptr, ordered):
            self.output_pool.free(offset)

    def _pool_blocks(self, num_rows: int, data: torch.Tensor, scales: Optional[torch.Tensor],
                     topk_idx: Optional[torch.Tensor], cached: bool, ordered: bool) -> tuple[int, int]:
        """Byte offsets ``(data, meta)`` of the output-pool blocks for direct-to-output receive, ``-1`` for none.

        ``_C.Runtime.dispatch`` turns the blocks into the outputs: the data block holds ``recv_x``, the scales and
        the received top-k (``deep_ep.layout.intranode_dispatch_output_layout``), the meta block ``recv_src_idx``
        (kept by the handle; non-cached calls only). ``(-1, -1)`` receives through the rings into tensors of torch's
        allocator: receive mode 'rings', CUDA-graph capture (a block's reuse is decided by events that replays
        would bypass), zero rows, or no room in the pool (mode 'direct' then raises). ``ordered``: no
        ``previous_event``, so the comm stream waits for the current stream before the kernel.

        A block returns to the pool when the last tensor viewing it dies, and is reused only when that is safe for
        the streams it was used on: the stream current when it was made, and the one current when it died.
        ``Tensor.record_stream`` has no effect on these tensors: keep a tensor alive while another stream uses it.
        """
        mode = tuning.dispatch_receive_mode()
        if mode == "rings" or num_rows == 0 or torch.cuda.is_current_stream_capturing():
            return -1, -1
        self.reclaim_pool_blocks(ordered)
        num_topk = topk_idx.size(1) if topk_idx is not None else 0
        idx_bytes = topk_idx.element_size() if topk_idx is not None else 8
        num_scales = scales.size(1) if scales is not None else 0
        hidden_bytes = data.size(1) * data.element_size()
        num_bytes = intranode_dispatch_output_layout(num_rows, hidden_bytes, num_scales, num_topk,
                                                     idx_bytes).total_bytes
        data_offset = self.output_pool.allocate(num_bytes)
        meta_offset = -1
        if data_offset is not None and not cached:
            meta_offset = self.output_pool.allocate(num_rows * 4)
            if meta_offset is None:
                self.output_pool.free(data_offset)
                data_offset = None
        if data_offset is None:
            if mode == "direct":
                raise RuntimeError(f"dispatch receive mode 'direct': the output pool has no room for {num_bytes} "
                                   f"bytes (largest free range {self.output_pool.largest_free()} of "
                                   f"{self.output_pool.num_bytes}; num_nvl_bytes={self.num_nvl_bytes})")
            return -1, -1
        return data_offset, meta_offset

    def combine(self, request: CombineRequest) -> CombineResult:
        """Reduce ``x [M, H]`` BF16 (rows aligned with the dispatch's ``recv_x``) back to the original tokens:
        ``combined_x[t] = bf16(b0[t] + b1[t] + sum over ranks d holding t of x_d[row_d(t)])`` with fp32
        accumulation in ascending rank order; ``combined_topk_weights`` likewise when ``topk_weights`` is given."""
        self._call_prologue()
        x, topk_weights, config = request.x, request.topk_weights, request.config
        num_channels = self.num_channels(config)
        handle = request.handle
        if handle[1].size(1) != num_channels:  # channel_prefix_matrix (intranode), rdma_channel_prefix_matrix
            raise ValueError(f"config.num_sms ({config.num_sms}) gives {num_channels} channels but the handle was "
                             f"made with {handle[1].size(1)}; use the dispatch's SM count")
        bias_0, bias_1 = (*request.bias, None, None)[:2]
        with self._scope(request) as scope:
            handle = self._kernel_handle(handle)
            pair_counts = handle.backend_state
            path = tuning.combine_send_path(config.num_sms)
            landed = self.copy_engine_combine and bool(pair_counts) and path != "rings"
            copy_ctas = config.num_sms if landed else 0
            if landed and path == "zone":
                copy_ctas = tuning.zone_ctas(copy_ctas)
            send_warps = tuning.zone_send_warps() if landed and path == "zone" else \
                tuning.intranode_send_warps("combine", self.num_ranks, copy_ctas if landed else num_channels,
                                            puts=bool(self.put_peers))
            # The ranks' agreement rides in the words the kernel exchanges at its start (put peers included); the
            # next call raises a disagreement.
            hashed = self._checked_hash(request.signature)
            combined_x, combined_topk_weights = self.runtime.combine(
                x, topk_weights, bias_0, bias_1, handle.rank_prefix_matrix, handle.recv_channel_prefix_matrix,
                handle.send_head, num_channels, config.num_max_nvl_chunked_send_tokens,
                config.num_max_nvl_chunked_recv_tokens, send_warps, self._comm_ptr, scope.after_current,
                scope.current_after, handle.channel_prefix_matrix, pair_counts or [], copy_ctas,
                tuning.combine_copy_chunk_rows(), path == "zone", hashed)
            self._verdict_pending = self._verdict_awaited(hashed)
            event = scope.finish((x, topk_weights, bias_0, bias_1, combined_x, combined_topk_weights, *handle))
        return CombineResult(combined_x, combined_topk_weights, event)

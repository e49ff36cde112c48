"""CUDA low-latency (LL) backend of ``deep_ep.Buffer``: the NVSHMEM low-latency kernels.

``Buffer`` builds one :class:`LowLatencyCuda` per rank when ``low_latency_mode=True``, ``num_rdma_bytes > 0`` and the
extension was built with NVSHMEM (``deep_ep._C.HAS_LOW_LATENCY``), and routes the LL calls here for CUDA tensors.
This backend keeps the double-buffer parity (it flips on every LL call, as in DeepEP: capture LL calls in
dispatch/combine pairs in CUDA graphs) and the receive hook. A call crosses into C++ once: the runtime's
``dispatch`` / ``combine`` allocate the outputs on the current stream and make the plain stream waits, so a
synchronous call makes no Python stream or event object. A kernel wait that runs out of ``DEEP_EP_TIMEOUT_S``
raises at the next call (``CommTimeoutError`` / ``PeerAbortedError`` naming rank, peer and phase); a dispatch whose
count messages carried another rank's call-signature hash moves no row from that rank, and every low-latency
launch or hook after it raises ``ArgumentMismatchError`` until ``clean_low_latency_buffer`` (collective); a rank
whose own validation refused a dispatch still launches it, with no tokens and the hash of its refusal; a combine's
arrival words carry the hash too, and a rank that sees another hash there (or refuses a combine) tells every rank,
with the same standstill (``clean_low_latency_buffer`` restarts the parity at 0 on every rank); with ``enable_shrink``
a dispatch or combine wait that times out masks the silent rank instead and the call completes for the others
(every rank then calls ``low_latency_clean_mask_buffer`` and ``clean_low_latency_buffer`` to let it rejoin).
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from deep_ep import envs, testing
from deep_ep import handle as hd
from deep_ep.backends.agreement import signature_hash
from deep_ep.backends.base import Backend, LowLatencyCombineRequest, LowLatencyDispatchRequest
from deep_ep.backends.common import ReceiveHook, StreamScope, object_all_gather
from deep_ep.backends.cuda_common import _C, join_nvshmem_world, raise_from_record, record_streams
from deep_ep.errors import ArgumentMismatchError
from deep_ep.results import LowLatencyCombineResult, LowLatencyDispatchResult
from deep_ep.validate import topk_idx_dtype

# Phases of a launch: the send half, the receive half.
_SEND, _RECV = 1, 2


class LowLatencyCuda(Backend):
    """One rank's LL kernels. A dispatch's count messages and a combine's arrival words carry the hash of its call
    signature (``hashes_signature``): ranks that disagree take no row from each other, and until
    :meth:`clean_low_latency_buffer` every LL kernel returns at once and every call raises
    :class:`ArgumentMismatchError`.

    Args:
        rank, num_ranks: position in the group (NVSHMEM PE = rank).
        num_rdma_bytes: symmetric buffer bytes (>= ``Buffer.get_low_latency_rdma_size_hint``).
        all_gather: ``all_gather(obj) -> list`` over the group (bootstrap only).
        other_heap_bytes: bytes the same Buffer's internode backend allocates on the symmetric heap after this
            one (the first join of a process sizes the heap for both).
    """

    hashes_signature = True

    def __init__(self, rank: int, num_ranks: int, num_rdma_bytes: int, num_qps_per_rank: int,
                 allow_nvlink: bool, allow_mnnvl: bool, enable_shrink: bool,
                 all_gather: Callable[[object], list], other_heap_bytes: int = 0) -> None:
        self.rank, self.num_ranks, self.num_rdma_bytes = rank, num_ranks, num_rdma_bytes
        unique_id = join_nvshmem_world(rank, num_rdma_bytes + other_heap_bytes, num_qps_per_rank, allow_nvlink,
                                       allow_mnnvl, all_gather)
        self.runtime = _C.LowLatencyRuntime(rank, num_ranks, num_rdma_bytes, envs.TIMEOUT_S.get(), enable_shrink,
                                            unique_id, testing.current().ll_put_only)
        self.comm_stream = torch.cuda.Stream(priority=-1)
        self._comm_ptr = self.comm_stream.cuda_stream
        self.parity = 0
        self._fits: set = set()  # (T, H, E) whose carving fits num_rdma_bytes

    @classmethod
    def from_group(cls, group: Any, **kwargs: Any) -> "LowLatencyCuda":
        import torch.distributed as dist

        all_gather = object_all_gather(group)
        return cls(dist.get_rank(group), dist.get_world_size(group), all_gather=all_gather, **kwargs)

    @staticmethod
    def is_built() -> bool:
        return bool(getattr(_C, "HAS_LOW_LATENCY", False))

    # ------------------------------------------------------------------------------------------------------------
    def get_comm_stream(self) -> torch.cuda.Stream:
        return self.comm_stream

    def check_errors(self) -> None:
        """Raise the pending kernel error, if any (reads host-mapped memory; never synchronises). A disagreement
        of call signatures raises :class:`ArgumentMismatchError` until :meth:`clean_low_latency_buffer`."""
        record = self.runtime.read_error()
        if record is not None and record["code"] == "argument_mismatch" and "combine" in record["phase"]:
            raise ArgumentMismatchError(
                f"rank {self.rank}: the ranks disagree on the arguments of a low_latency_combine (the handle, hidden, "
                f"num_experts, num_max_dispatch_tokens_per_rank, top-k or use_logfmt), or a rank refused it: "
                f"{record['message']} ('agreement': the rows of the named peer carried another call-signature hash, "
                "expected and observed being the hash sums of its rows; 'told by a peer': the named rank saw such a "
                "difference or refused the call; 'refused': this rank's validation refused it); no rank reduced a "
                "row from a rank that disagrees and the low-latency calls since did nothing; call "
                "clean_low_latency_buffer on every rank before the next low-latency call")
        if record is not None and record["code"] == "argument_mismatch":
            raise ArgumentMismatchError(
                f"rank {self.rank}: the ranks disagree on the arguments of a low_latency_dispatch (hidden, "
                "num_experts, num_max_dispatch_tokens_per_rank, top-k, use_fp8, round_scale or use_ue8m0): "
                f"{record['message']}, expected and observed being this rank's and rank {record['peer']}'s "
                "call-signature hash (a rank whose own validation refused the call sent the hash of its refusal and "
                "raised its own error); no rank took rows from a rank that disagrees and the low-latency calls since "
                "did nothing; call clean_low_latency_buffer on every rank before the next low-latency call")
        raise_from_record(record)

    def _prologue(self, num_max_tokens: int, hidden: int, num_experts: int, check_errors: bool = True) -> None:
        """Runtime alive, no pending kernel error (unless the caller's launch checks it: ``check_errors=False``),
        and the carving of (T, H, E) fits ``num_rdma_bytes`` (asked once per key)."""
        if self.runtime is None:
            raise RuntimeError("this Buffer's low-latency runtime was destroyed")
        if check_errors:
            self.check_errors()
        key = (num_max_tokens, hidden, num_experts)
        if key in self._fits:
            return
        need = self.runtime.required_bytes(num_max_tokens, hidden, num_experts)
        if need <= self.num_rdma_bytes:
            self._fits.add(key)
        else:
            raise ValueError(f"num_rdma_bytes ({self.num_rdma_bytes}) is too small for the CUDA low-latency kernels: "
                             f"num_max_dispatch_tokens_per_rank={num_max_tokens}, hidden={hidden}, "
                             f"num_experts={num_experts} need {need} bytes")

    def _flip(self) -> int:
        half, self.parity = self.parity, 1 - self.parity
        return half

    def _launch(self, launch: Callable[..., Any], *args: Any, half: int = -1) -> Any:
        """``launch(*args)``; a kernel error left pending by an earlier call raises its typed exception (the
        parity then goes back to ``half``, the half this launch would have used, when given)."""
        try:
            return launch(*args)
        except _C.DeviceError:
            if half >= 0:
                self.parity = half
            self.check_errors()
            raise

    def _scope(self, request: Any) -> StreamScope:
        """The call's stream protocol: with the hook the send phase alone runs on the current stream; otherwise both
        phases run on comm, whose launch waits for the current stream (and makes it wait unless ``async_finish``)."""
        return StreamScope(None if request.return_recv_hook else self.comm_stream, None, request.async_finish,
                           launch_waits=True, record=record_streams)

    def _launch_args(self, request: Any, scope: StreamScope) -> tuple[int, int, bool]:
        """(phases, stream, current_after) of the call's first launch."""
        if request.return_recv_hook:
            return _SEND, 0, False
        return _SEND | _RECV, self._comm_ptr, scope.current_after

    def _hook(self, launch: Callable[..., Any], *args: Any) -> ReceiveHook:
        """The receive hook: ``launch(*args)`` (the receive phase, on the stream current when it is called)."""
        def receive() -> None:
            self.check_errors()
            self._launch(launch, *args)

        return ReceiveHook(receive)

    # ------------------------------------------------------------------------------------------------------------
    def low_latency_dispatch(self, request: LowLatencyDispatchRequest) -> LowLatencyDispatchResult:
        """Packed per-expert receive; blocks in ascending source order, rows of a block in (token, k) order."""
        (x, topk_idx, tokens, num_experts, recv_stats, wait_stats, use_fp8, round_scale, use_ue8m0, _,
         return_recv_hook, signature) = request
        hidden = x.size(1)
        sig_hash = signature_hash(signature)
        self._prologue(tokens, hidden, num_experts, check_errors=False)
        half = self._flip()
        runtime = self.runtime
        with self._scope(request) as scope:
            phases, stream, current_after = self._launch_args(request, scope)
            data, scales, count, src_info, layout_range = self._launch(
                runtime.dispatch, x, topk_idx, tokens, num_experts, recv_stats, wait_stats, use_fp8, round_scale,
                use_ue8m0, half, phases, stream, current_after, [], sig_hash, half=half)
            hook = None
            if return_recv_hook:
                outputs = [data, count, src_info, layout_range] + ([scales] if use_fp8 else [])
                hook = self._hook(runtime.dispatch, x, topk_idx, tokens, num_experts, recv_stats, wait_stats, use_fp8,
                                  round_scale, use_ue8m0, half, _RECV, 0, False, outputs, sig_hash)
            event = scope.finish((x, topk_idx, data, scales, count, src_info, layout_range, recv_stats, wait_stats))
        handle = hd.LowLatencyHandle(src_info, layout_range, tokens, hidden, num_experts)
        return LowLatencyDispatchResult((data, scales) if use_fp8 else data, count, handle, event, hook)

    def refuse_low_latency_dispatch(self, signature: Any, num_max_tokens: int, hidden: int, num_experts: int,
                                    device: torch.device) -> None:
        """This rank's validation refused a ``low_latency_dispatch`` of (T, H, E) that its peers make: launch it
        with no tokens (on ``device``, on the current stream) and the hash of the refusal ``signature``, so that
        every peer's kernel receives count words whose hash differs at once instead of waiting for them until the
        timeout. Every rank then raises ``ArgumentMismatchError`` from its next low-latency call until
        ``clean_low_latency_buffer``, as after any disagreement; the caller raises its own error now. With a kernel
        error already pending nothing is launched (the peers wait until that error's abort or their timeout)."""
        if self.runtime is None:
            return
        x = torch.empty(0, hidden, dtype=torch.bfloat16, device=device)
        topk_idx = torch.empty(0, 1, dtype=topk_idx_dtype(), device=device)
        half = self._flip()
        try:
            self.runtime.dispatch(x, topk_idx, num_max_tokens, num_experts, None, None, False, False, False, half,
                                  _SEND | _RECV, 0, False, [], signature_hash(signature))
        except (RuntimeError, ValueError):  # a pending kernel error (DeviceError): the caller's own error prevails
            self.parity = half

    def low_latency_combine(self, request: LowLatencyCombineRequest) -> LowLatencyCombineResult:
        """``out[t] = bf16(sum_k w[t, k] * y(e_k, t))``, summed in fp32 in ascending k."""
        (x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, _, return_recv_hook, out, wait_stats,
         signature) = request
        src_info, layout_range, tokens, hidden, num_experts = handle
        sig_hash = signature_hash(signature)
        self._prologue(tokens, hidden, num_experts, check_errors=False)
        half = self._flip()
        runtime = self.runtime
        with self._scope(request) as scope:
            phases, stream, current_after = self._launch_args(request, scope)
            combined = self._launch(runtime.combine, x, topk_idx, topk_weights, src_info, layout_range, tokens,
                                    num_experts, use_logfmt, zero_copy, out, wait_stats, half, phases, stream,
                                    current_after, sig_hash, half=half)
            hook = None
            if return_recv_hook:
                hook = self._hook(runtime.combine, x, topk_idx, topk_weights, src_info, layout_range, tokens,
                                  num_experts, use_logfmt, zero_copy, combined, wait_stats, half, _RECV, 0, False,
                                  sig_hash)
            event = scope.finish((x, topk_idx, topk_weights, src_info, layout_range, combined, wait_stats))
        return LowLatencyCombineResult(combined, event, hook)

    def refuse_low_latency_combine(self, signature: Any, num_max_tokens: int, hidden: int, num_experts: int,
                                   device: torch.device) -> None:
        """This rank's validation refused a ``low_latency_combine`` of a valid handle of (T, H, E) that its peers
        make: launch, on the current stream, the one-thread kernel that tells every peer (no rank waits for this
        rank's rows) and records the refusal (hash of ``signature``). The buffer half is counted as by the peers'
        combine. Every rank then raises ``ArgumentMismatchError`` until ``clean_low_latency_buffer``; the caller
        raises its own error now. With a kernel error already pending nothing is launched."""
        if self.runtime is None:
            return
        half = self._flip()
        try:
            self.runtime.refuse_combine(num_max_tokens, hidden, num_experts, signature_hash(signature))
        except (RuntimeError, ValueError):  # a pending kernel error (DeviceError): the caller's own error prevails
            self.parity = half

    def get_next_low_latency_combine_buffer(self, handle: hd.LowLatencyHandle) -> torch.Tensor:
        tokens, hidden, num_experts = handle[2], handle[3], handle[4]
        self._prologue(tokens, hidden, num_experts)
        return self.runtime.combine_buffer(tokens, hidden, num_experts, self.parity)

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Collective: bounded barrier, zero every signal word and the kernels' private state, bounded barrier (on
        the current stream); the next call uses buffer half 0, as after a fresh start. It also ends the standstill
        after a disagreement of call signatures, when the ranks may have made different numbers of calls (a rank
        told of a combine's disagreement launches calls that do nothing, while the others raise)."""
        record = self.runtime.read_error() if self.runtime is not None else None
        disagreed = record is not None and record["code"] == "argument_mismatch"
        self._prologue(num_max_dispatch_tokens_per_rank, hidden, num_experts, check_errors=not disagreed)
        stream = torch.cuda.current_stream()
        self.runtime.clean(num_max_dispatch_tokens_per_rank, hidden, num_experts, stream.cuda_stream)
        self.parity = 0
        stream.synchronize()
        if disagreed:
            self.runtime.clear_argument_error(stream.cuda_stream)
        self.check_errors()

    def reset(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """After an error, on every rank between two host barriers: zero every signal word, the kernels' private
        state and the error record, so the Buffer is usable again (the failed call's outputs stay invalid)."""
        torch.cuda.synchronize()
        self.runtime.reset(num_max_dispatch_tokens_per_rank, hidden, num_experts,
                           torch.cuda.current_stream().cuda_stream)
        self.parity = 0

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool) -> None:
        self.runtime.update_mask(rank_to_mask, mask, torch.cuda.current_stream().cuda_stream)

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        if mask_status.is_cuda:
            self.runtime.query_mask(mask_status, torch.cuda.current_stream().cuda_stream)
            return
        staging = torch.empty(self.num_ranks, dtype=torch.int32, device="cuda")
        self.runtime.query_mask(staging, torch.cuda.current_stream().cuda_stream)
        mask_status.copy_(staging.cpu())

    def low_latency_clean_mask_buffer(self) -> None:
        self.runtime.clean_mask(torch.cuda.current_stream().cuda_stream)

    def destroy(self) -> None:
        """Collective: release the symmetric buffer."""
        if self.runtime is None:
            return
        torch.cuda.synchronize()
        self.runtime.destroy()
        self.runtime = None

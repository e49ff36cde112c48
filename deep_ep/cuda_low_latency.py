"""CUDA low-latency (LL) backend of ``deep_ep.Buffer``: the NVSHMEM kernels of ``csrc/kernels/low_latency_nvshmem.cu``.

``Buffer`` builds one :class:`LowLatencyCuda` per rank when ``low_latency_mode=True``, ``num_rdma_bytes > 0`` and the
extension was built with NVSHMEM (``deep_ep._C.HAS_LOW_LATENCY``), and routes the LL methods here for CUDA tensors.
Arguments arrive validated by the front.

This module owns:

* the NVSHMEM environment (set before initialisation; user values win except ``NVSHMEM_DISABLE_NVLS=1``, which is
  always forced) and the bootstrap from the torch process group (rank 0's unique id, all-gathered);
* the double-buffer parity (flips on every LL call, like DeepEP; capture LL calls in dispatch/combine pairs in CUDA
  graphs), the receive hook and the asynchronous-call bookkeeping of the stream protocol (spec §6.3). To keep the
  host path short, a call crosses into C++ once: ``_C.LowLatencyRuntime.dispatch`` / ``combine`` allocate the
  outputs (``at::empty`` on the current stream) and do the plain stream waits (comm after current before the launch,
  current after comm when ``current_after``) with one reusable event; a synchronous call makes no Python stream or
  event object;
* errors: a kernel wait that runs out of ``DEEP_EP_TIMEOUT_S`` fills a host-mapped record; the next call (or
  :meth:`LowLatencyCuda.check_errors`) raises ``CommTimeoutError`` / ``PeerAbortedError`` naming rank, peer and phase.
  With ``enable_shrink`` a dispatch or combine wait that times out masks the silent rank instead (see
  ``low_latency_query_mask_buffer``) and the call completes for the others; to let it rejoin, every rank calls
  ``low_latency_clean_mask_buffer`` then the collective ``clean_low_latency_buffer`` (docs/low_latency.md).
"""
from __future__ import annotations

import os
import socket
from typing import Any, Callable, Optional

import torch

from deep_ep import envs, testing
from deep_ep import handle as hd
from deep_ep.cuda_backend import _C, _raise_from_record, _record_stream
from deep_ep.event import CudaEventHandle, EventOverlap
from deep_ep.results import LowLatencyCombineResult, LowLatencyDispatchResult
from deep_ep.torch_backend import object_all_gather

# NVSHMEM's symmetric heap reserve beyond the LL buffer (teams, internal buffers).
_HEAP_MARGIN = 256 * 1024 * 1024
_SEND, _RECV = 1, 2


def has_nic() -> bool:
    """True when the host exposes an InfiniBand/RoCE device (``/sys/class/infiniband`` is non-empty)."""
    try:
        return len(os.listdir("/sys/class/infiniband")) > 0
    except OSError:
        return False


def nvshmem_environment(heap_bytes: int, num_qps_per_rank: int, allow_nvlink: bool, allow_mnnvl: bool,
                        single_host: bool, nic: bool) -> dict[str, str]:
    """The NVSHMEM variables to set before initialisation (values that ``setdefault`` semantics apply to, except
    ``NVSHMEM_DISABLE_NVLS`` which is always 1: NVLink multicast is never used)."""
    env = {
        "NVSHMEM_DISABLE_P2P": "0" if allow_nvlink else "1",
        "NVSHMEM_DISABLE_MNNVL": "0" if allow_mnnvl else "1",
        "NVSHMEM_IBGDA_NUM_RC_PER_PE": str(num_qps_per_rank),
        "NVSHMEM_QP_DEPTH": "1024",
        "NVSHMEM_MAX_TEAMS": "7",
        "NVSHMEM_CUMEM_GRANULARITY": str(2 ** 29),
        "NVSHMEM_SYMMETRIC_SIZE": str(max(2 ** 30, heap_bytes + _HEAP_MARGIN)),
    }
    if nic:
        env["NVSHMEM_IB_ENABLE_IBGDA"] = "1"
    elif single_host:
        # No NIC and every peer on this host: NVLink P2P only, and no noisy probing of absent RDMA transports.
        env["NVSHMEM_REMOTE_TRANSPORT"] = "none"
        env["NVSHMEM_IB_ENABLE_IBGDA"] = "0"
    return env


def join_nvshmem_world(rank: int, heap_bytes: int, num_qps_per_rank: int, allow_nvlink: bool,
                       allow_mnnvl: bool, all_gather: Callable[[object], list]) -> bytes:
    """Collective: set the NVSHMEM environment (user values win, ``NVSHMEM_DISABLE_NVLS=1`` always) and return
    rank 0's unique id of the world of all ranks (PE = rank). ``heap_bytes``: what this process allocates on the
    symmetric heap (the sum of its symmetric buffers; the first join of a process sizes the heap). The C++ runtimes
    pass the id to the shared bootstrap, which initialises NVSHMEM once per process: the low-latency and the
    internode runtimes join the same world."""
    hosts = all_gather(socket.gethostname())
    for name, value in nvshmem_environment(heap_bytes, num_qps_per_rank, allow_nvlink, allow_mnnvl,
                                           len(set(hosts)) == 1, has_nic()).items():
        os.environ.setdefault(name, value)
    os.environ["NVSHMEM_DISABLE_NVLS"] = "1"
    unique_id = bytes(_C.ll_unique_id()) if rank == 0 else None
    return all_gather(unique_id)[0]


class LowLatencyCuda:
    """One rank's LL kernels.

    Args:
        rank, num_ranks: position in the group (NVSHMEM PE = rank).
        num_rdma_bytes: symmetric buffer bytes (>= ``Buffer.get_low_latency_rdma_size_hint``).
        all_gather: ``all_gather(obj) -> list`` over the group (bootstrap only).
        symmetric_buffers: buffers of ``num_rdma_bytes`` this process allocates on the symmetric heap (2 when an
            internode backend of the same Buffer allocates one after this one).
    """

    def __init__(self, rank: int, num_ranks: int, num_rdma_bytes: int, num_qps_per_rank: int,
                 allow_nvlink: bool, allow_mnnvl: bool, enable_shrink: bool,
                 all_gather: Callable[[object], list], symmetric_buffers: int = 1) -> None:
        self.rank, self.num_ranks, self.num_rdma_bytes = rank, num_ranks, num_rdma_bytes
        unique_id = join_nvshmem_world(rank, symmetric_buffers * num_rdma_bytes, num_qps_per_rank, allow_nvlink,
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
        """Raise the pending kernel error, if any (reads host-mapped memory; never synchronises)."""
        _raise_from_record(self.runtime.read_error())

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

    def _launch(self, launch: Callable[..., Any], *args: Any) -> Any:
        """``launch(*args)``; a kernel error left pending by an earlier call raises its typed exception."""
        try:
            return launch(*args)
        except _C.DeviceError:
            self.check_errors()
            raise

    def _streams(self, async_finish: bool, return_recv_hook: bool) -> tuple[int, int, bool]:
        """(phases, stream, current_after) of the first launch: with the hook the send phase alone on the current
        stream (0); otherwise both phases on comm, and the current stream waits for comm unless ``async_finish``."""
        if return_recv_hook:
            return _SEND, 0, False
        return _SEND | _RECV, self._comm_ptr, not async_finish

    def _finish(self, async_finish: bool, tensors: tuple) -> EventOverlap:
        if not async_finish:
            return EventOverlap(None)
        live = tuple(t for t in tensors if isinstance(t, torch.Tensor))
        _record_stream(live, self.comm_stream)
        return EventOverlap(CudaEventHandle(self.comm_stream), live)

    def _hook(self, launch: Callable[..., Any], *args: Any) -> Callable[[], None]:
        """The receive hook: ``launch(*args)`` (the receive phase, on the stream current when it is called)."""
        done = []

        def hook() -> None:
            if done:
                raise RuntimeError("this low-latency receive hook was already called")
            done.append(True)
            self.check_errors()
            self._launch(launch, *args)

        return hook

    # ------------------------------------------------------------------------------------------------------------
    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                             dispatch_wait_recv_cost_stats: Optional[torch.Tensor] = None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False) -> LowLatencyDispatchResult:
        """Packed per-expert receive; blocks in ascending source order, rows of a block in (token, k) order."""
        tokens, hidden = num_max_dispatch_tokens_per_rank, x.size(1)
        self._prologue(tokens, hidden, num_experts, check_errors=False)
        half = self._flip()
        phases, stream, current_after = self._streams(async_finish, return_recv_hook)
        runtime = self.runtime
        data, scales, count, src_info, layout_range = self._launch(
            runtime.dispatch, x, topk_idx, tokens, num_experts, cumulative_local_expert_recv_stats,
            dispatch_wait_recv_cost_stats, use_fp8, round_scale, use_ue8m0, half, phases, stream, current_after, [])
        hook = None
        if return_recv_hook:
            outputs = [data, count, src_info, layout_range] + ([scales] if use_fp8 else [])
            hook = self._hook(runtime.dispatch, x, topk_idx, tokens, num_experts, cumulative_local_expert_recv_stats,
                              dispatch_wait_recv_cost_stats, use_fp8, round_scale, use_ue8m0, half, _RECV, 0, False,
                              outputs)
        event = self._finish(async_finish, (x, topk_idx, data, scales, count, src_info, layout_range,
                                            cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats))
        handle = hd.LowLatencyHandle(src_info, layout_range, tokens, hidden, num_experts)
        return LowLatencyDispatchResult((data, scales) if use_fp8 else data, count, handle, event, hook)

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                            handle: hd.LowLatencyHandle, use_logfmt: bool = False, zero_copy: bool = False,
                            async_finish: bool = False, return_recv_hook: bool = False,
                            out: Optional[torch.Tensor] = None,
                            combine_wait_recv_cost_stats: Optional[torch.Tensor] = None) -> LowLatencyCombineResult:
        """``out[t] = bf16(sum_k w[t, k] * y(e_k, t))``, summed in fp32 in ascending k."""
        src_info, layout_range, tokens, hidden, num_experts = handle
        self._prologue(tokens, hidden, num_experts, check_errors=False)
        half = self._flip()
        phases, stream, current_after = self._streams(async_finish, return_recv_hook)
        runtime = self.runtime
        combined = self._launch(runtime.combine, x, topk_idx, topk_weights, src_info, layout_range, tokens,
                                num_experts, use_logfmt, zero_copy, out, combine_wait_recv_cost_stats, half, phases,
                                stream, current_after)
        hook = None
        if return_recv_hook:
            hook = self._hook(runtime.combine, x, topk_idx, topk_weights, src_info, layout_range, tokens, num_experts,
                              use_logfmt, zero_copy, combined, combine_wait_recv_cost_stats, half, _RECV, 0, False)
        event = self._finish(async_finish, (x, topk_idx, topk_weights, src_info, layout_range, combined,
                                            combine_wait_recv_cost_stats))
        return LowLatencyCombineResult(combined, event, hook)

    def get_next_low_latency_combine_buffer(self, handle: hd.LowLatencyHandle) -> torch.Tensor:
        tokens, hidden, num_experts = handle[2], handle[3], handle[4]
        self._prologue(tokens, hidden, num_experts)
        return self.runtime.combine_buffer(tokens, hidden, num_experts, self.parity)

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Collective: bounded barrier, zero every signal word, bounded barrier (on the current stream)."""
        self._prologue(num_max_dispatch_tokens_per_rank, hidden, num_experts)
        stream = torch.cuda.current_stream()
        self.runtime.clean(num_max_dispatch_tokens_per_rank, hidden, num_experts, stream.cuda_stream)
        stream.synchronize()
        self.check_errors()

    def reset(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """After an error, on every rank between two host barriers: zero every signal word, the kernels' private
        state and the error record, so the Buffer is usable again (the failed call's outputs stay invalid)."""
        torch.cuda.synchronize()
        self.runtime.reset(num_max_dispatch_tokens_per_rank, hidden, num_experts,
                           torch.cuda.current_stream().cuda_stream)

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
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

"""The row copies that end the torch backend's low-latency calls on CUDA tensors, as two named kernels.

A low-latency dispatch ends by moving each received message's payload into its packed row, a combine by storing
the reduced rows into the output. On CUDA tensors both run as one kernel each, compiled at first use with NVRTC
(``torch.cuda._compile_kernel``): ``deep_ep::torch_low_latency::dispatch`` and ``deep_ep::torch_low_latency::combine``.
The names end as DeepEP's kernel names do (``::dispatch``, ``::combine``), so a profile of CUDA activity alone, the
way DeepEP's own test scripts time the calls, finds one kernel of each operation on this backend too. CPU tensors, and a
torch without NVRTC kernels, take the same copies through tensor indexing.
"""
from __future__ import annotations

import threading
from typing import Any, Optional

import torch

# One body, two names. Row i of `src` (row_bytes bytes from src + i * src_stride + src_offset) goes to row
# rows[i] of `dst` (dst + rows[i] * dst_stride); 16-byte moves when every address and size allows them.
_SOURCE = r"""
#define DEEP_EP_COPY_ROWS(NAME)                                                                                    \
__global__ void NAME(const unsigned char* src, int src_stride, int src_offset, const long long* rows,             \
                     unsigned char* dst, int dst_stride, int row_bytes, int num_rows) {                          \
    for (int i = blockIdx.x; i < num_rows; i += gridDim.x) {                                                     \
        const unsigned char* from = src + static_cast<long long>(i) * src_stride + src_offset;                   \
        unsigned char* to = dst + rows[i] * static_cast<long long>(dst_stride);                                  \
        if (((reinterpret_cast<unsigned long long>(from) | reinterpret_cast<unsigned long long>(to) |           \
              static_cast<unsigned long long>(row_bytes)) & 15ull) == 0ull) {                                    \
            const uint4* f = reinterpret_cast<const uint4*>(from);                                               \
            uint4* t = reinterpret_cast<uint4*>(to);                                                             \
            for (int w = threadIdx.x; w < row_bytes / 16; w += blockDim.x) t[w] = f[w];                          \
        } else {                                                                                                 \
            for (int b = threadIdx.x; b < row_bytes; b += blockDim.x) to[b] = from[b];                           \
        }                                                                                                        \
    }                                                                                                            \
}
namespace deep_ep { namespace torch_low_latency {
DEEP_EP_COPY_ROWS(dispatch)
DEEP_EP_COPY_ROWS(combine)
} }
"""
KERNELS = {"dispatch": "deep_ep::torch_low_latency::dispatch", "combine": "deep_ep::torch_low_latency::combine"}
_compiled: dict = {}
_lock = threading.Lock()


def _kernel(kind: str, device: torch.device) -> Optional[Any]:
    """The compiled kernel of ``kind`` for ``device``, or ``None`` where torch has no NVRTC kernels (a CPU build,
    or a torch without ``torch.cuda._compile_kernel``)."""
    compile_kernel = getattr(torch.cuda, "_compile_kernel", None)
    if compile_kernel is None or torch.version.cuda is None:
        return None
    key = (kind, device.index)
    with _lock:
        if key not in _compiled:
            with torch.cuda.device(device):
                _compiled[key] = compile_kernel(_SOURCE, KERNELS[kind])
        return _compiled[key]


def copy_rows(kind: str, src: torch.Tensor, src_offset: int, dst: torch.Tensor,
              rows: Optional[torch.Tensor] = None) -> None:
    """``dst[rows[i]] = src[i, src_offset:src_offset + dst.size(1)]`` for every row ``i`` of ``src``.

    Args:
        kind: ``"dispatch"`` or ``"combine"`` (the kernel's name).
        src: ``[n, src_bytes]`` uint8, rows contiguous.
        src_offset: first byte of each row's payload.
        dst: ``[m, row_bytes]`` uint8, contiguous, on ``src``'s device.
        rows: ``[n]`` int64 destination rows (``None``: row ``i`` to row ``i``).
    """
    num_rows, row_bytes = src.size(0), dst.size(1)
    if num_rows == 0:
        return
    if rows is None:
        rows = torch.arange(num_rows, dtype=torch.int64, device=src.device)
    kernel = _kernel(kind, src.device) if src.is_cuda else None
    if kernel is None:
        dst[rows] = src[:, src_offset:src_offset + row_bytes]
        return
    src, rows = src.contiguous(), rows.to(torch.int64).contiguous()
    kernel(grid=(min(num_rows, 4096), 1, 1), block=(256, 1, 1),
           args=[src, src.stride(0), src_offset, rows, dst, dst.stride(0), row_bytes, num_rows])

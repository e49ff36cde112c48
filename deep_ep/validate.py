"""Input checks shared by ``deep_ep.Buffer``, its backends and ``reference``.

Every function raises ``TypeError`` (wrong Python type or tensor dtype) or ``ValueError`` (wrong shape, layout,
device or value) with a message that names the argument, the rule and the offending value, for example::

    topk_idx must have dtype torch.int64 (deep_ep.topk_idx_t), got torch.int32

They are plain functions with no state so that any layer can call them. Checks that need the tensor *contents*
(expert-id ranges) read the data and therefore synchronise a CUDA device; they are separate functions.
"""
from __future__ import annotations

import functools
from typing import Optional, Sequence, Union

import torch

from deep_ep import envs

# check_int lives in the stdlib-only deep_ep.config (its dataclasses use it) and is part of this module's API.
from deep_ep.config import FP8_BLOCK, NUM_MAX_LL_TOPK, NUM_MAX_LOCAL_EXPERTS, NUM_MAX_TOPK, check_int

# Low-latency hidden sizes: any multiple of LL_HIDDEN_MULTIPLE in [LL_MIN_HIDDEN, LL_MAX_HIDDEN] (DeepEP V1 compiles
# a fixed list of 8 sizes); UE8M0 scales pack 4 blocks per int32, so use_ue8m0 needs a multiple of 512.
LL_HIDDEN_MULTIPLE = 128
LL_MIN_HIDDEN = 1024
LL_MAX_HIDDEN = 16384
LL_UE8M0_HIDDEN_MULTIPLE = 512
# Top-k limit of the low-latency kernels (DeepEP V1: 11).
LL_MAX_TOPK = NUM_MAX_LL_TOPK
# Largest num_max_dispatch_tokens_per_rank of the low-latency kernels (DeepEP V1: 511 with the default QP depth).
LL_MAX_TOKENS = 1024


@functools.cache
def topk_idx_dtype() -> torch.dtype:
    """``deep_ep.topk_idx_t``: ``torch.int64``, or ``torch.int32`` when ``DEEP_EP_TOPK_IDX_BITS=32``. Read once per
    process (the extension's index width is fixed when it is built; every call checks against this dtype)."""
    bits = envs.TOPK_IDX_BITS.get()
    if bits not in (32, 64):
        raise ValueError(f"DEEP_EP_TOPK_IDX_BITS must be 32 or 64, got {bits}")
    return torch.int32 if bits == 32 else torch.int64


def check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def check_tensor(name: str, tensor: object, *, dtype: Union[torch.dtype, Sequence[torch.dtype], None] = None,
                 ndim: Optional[int] = None, shape: Optional[Sequence[Optional[int]]] = None,
                 contiguous: bool = True, device: Optional[torch.device] = None,
                 dtype_note: str = "") -> torch.Tensor:
    """Check type, dtype, rank, shape (``None`` entries are free), contiguity and device of one tensor."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if dtype is not None:
        allowed = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
        if tensor.dtype not in allowed:
            want = " or ".join(str(d) for d in allowed)
            raise TypeError(f"{name} must have dtype {want}{dtype_note}, got {tensor.dtype}")
    if ndim is None and shape is not None:
        ndim = len(shape)
    if ndim is not None and tensor.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(tensor.shape)}")
    if shape is not None:
        for axis, (want, got) in enumerate(zip(shape, tensor.shape)):
            if want is not None and want != got:
                expected = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
                raise ValueError(f"{name} must have shape {expected}, got {tuple(tensor.shape)} "
                                 f"(dimension {axis} is {got}, expected {want})")
    if contiguous and not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {tensor.stride()} for shape {tuple(tensor.shape)}")
    if device is not None and tensor.device != device:
        raise ValueError(f"{name} must be on device {device} (the device of x), got {tensor.device}")
    return tensor


def check_topk_idx(name: str, topk_idx: object, *, num_tokens: Optional[int] = None,
                   device: Optional[torch.device] = None) -> torch.Tensor:
    """``topk_idx [num_tokens, num_topk]`` contiguous with dtype ``deep_ep.topk_idx_t``."""
    want = topk_idx_dtype()
    return check_tensor(name, topk_idx, dtype=want, shape=(num_tokens, None), device=device,
                        dtype_note=" (deep_ep.topk_idx_t)")


def check_num_experts(num_experts: object, num_ranks: int, name: str = "num_experts") -> int:
    """``num_experts`` must be a positive int divisible by ``num_ranks``; returns local experts per rank."""
    check_int(name, num_experts, 1)
    if num_experts % num_ranks != 0:
        raise ValueError(f"{name} must be divisible by the number of ranks ({num_ranks}), got {num_experts}")
    num_local = num_experts // num_ranks
    if num_local > NUM_MAX_LOCAL_EXPERTS:
        raise ValueError(f"{name} / num_ranks must be <= {NUM_MAX_LOCAL_EXPERTS} local experts, got "
                         f"{num_experts} / {num_ranks} = {num_local}")
    return num_local


def check_expert_range(name: str, topk_idx: torch.Tensor, num_experts: int) -> None:
    """Every entry of ``topk_idx`` must be ``-1`` or in ``[0, num_experts)`` (reads the data)."""
    if topk_idx.numel() == 0:
        return
    lo, hi = int(topk_idx.min()), int(topk_idx.max())
    if lo < -1 or hi >= num_experts:
        bad = lo if lo < -1 else hi
        raise ValueError(f"{name} entries must be -1 or expert ids in [0, {num_experts}), got {bad}")


def check_topk_pair(topk_idx: object, topk_weights: object, num_tokens: int,
                    device: Optional[torch.device]) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Top-k index and weights are both given or both ``None``; weights are float32 ``[num_tokens, num_topk]``."""
    if (topk_idx is None) != (topk_weights is None):
        given = "topk_idx" if topk_idx is not None else "topk_weights"
        raise ValueError(f"topk_idx and topk_weights must be given together, got only {given}")
    if topk_idx is None:
        return None, None
    idx = check_topk_idx("topk_idx", topk_idx, num_tokens=num_tokens, device=device)
    weights = check_tensor("topk_weights", topk_weights, dtype=torch.float32, shape=(num_tokens, idx.size(1)),
                           device=device)
    if idx.size(1) > NUM_MAX_TOPK:
        raise ValueError(f"topk_idx must have at most {NUM_MAX_TOPK} columns (num_topk), got {idx.size(1)}")
    return idx, weights


def split_dispatch_x(x: object) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Normal-dispatch input: a 2-D tensor ``[N, H]`` or a tuple ``(x_fp8 [N, H], x_scales [N, S])``.

    Returns ``(data, scales)``. ``data`` must be contiguous with ``H * itemsize % 16 == 0``. ``scales`` may
    have any strides, is float32 or int32, requires a 1-byte ``data`` dtype and has ``size(0) == N``.
    """
    scales = None
    if isinstance(x, tuple):
        if len(x) != 2:
            raise ValueError(f"x as a tuple must be (x_fp8, x_scales), got a tuple of length {len(x)}")
        x, scales = x
    data = check_tensor("x", x, ndim=2)
    row_bytes = data.size(1) * data.element_size()
    if row_bytes % 16 != 0:
        raise ValueError(f"x must have hidden * element_size divisible by 16 bytes, got hidden={data.size(1)} "
                         f"with element size {data.element_size()} ({row_bytes} bytes)")
    if scales is not None:
        if data.element_size() != 1:
            raise TypeError(f"x_scales requires a 1-byte (FP8) x, got x dtype {data.dtype}")
        check_tensor("x_scales", scales, dtype=(torch.float32, torch.int32), shape=(data.size(0), None),
                     contiguous=False, device=data.device)
    return data, scales


def split_bias(bias: object, num_tokens: int, hidden: int, dtype: torch.dtype,
               device: torch.device) -> tuple[torch.Tensor, ...]:
    """``bias`` is ``None``, a tensor or a 2-tuple of tensors, each ``[num_tokens, hidden]`` of ``dtype``."""
    if bias is None:
        return ()
    items = bias if isinstance(bias, tuple) else (bias,)
    if len(items) > 2:
        raise ValueError(f"bias must be a tensor or a tuple of at most 2 tensors, got a tuple of length {len(items)}")
    return tuple(check_tensor(f"bias[{i}]" if isinstance(bias, tuple) else "bias", b, dtype=dtype,
                              shape=(num_tokens, hidden), device=device) for i, b in enumerate(items))


def check_even_num_sms(name: str, num_sms: object) -> int:
    check_int(name, num_sms, 2)
    if num_sms % 2 != 0:
        raise ValueError(f"{name} must be even (as in DeepEP), got {num_sms}")
    return num_sms


def check_stream_args(previous_event: object, async_finish: object, allocate_on_comm_stream: object) -> None:
    """``allocate_on_comm_stream`` needs both ``previous_event`` and ``async_finish`` (as in DeepEP)."""
    check_bool("async_finish", async_finish)
    check_bool("allocate_on_comm_stream", allocate_on_comm_stream)
    if allocate_on_comm_stream and (previous_event is None or not async_finish):
        raise ValueError("allocate_on_comm_stream=True requires previous_event to be given and async_finish=True, "
                         f"got previous_event={previous_event!r}, async_finish={async_finish}")


def ll_kernel_hidden_refusal(hidden: int, use_fp8: bool, use_ue8m0: bool = False) -> Optional[str]:
    """Why the CUDA low-latency kernels do not serve ``hidden`` (a multiple of 128 in [1024, 16384]; of 512 with
    ``use_ue8m0``), or ``None``."""
    if hidden % LL_HIDDEN_MULTIPLE != 0 or not LL_MIN_HIDDEN <= hidden <= LL_MAX_HIDDEN:
        return (f"x hidden size must be a multiple of {LL_HIDDEN_MULTIPLE} in [{LL_MIN_HIDDEN}, {LL_MAX_HIDDEN}] for "
                f"the CUDA low-latency kernels (Unsupported hidden), got {hidden}")
    if use_fp8 and use_ue8m0 and hidden % LL_UE8M0_HIDDEN_MULTIPLE != 0:
        return (f"x hidden size must be a multiple of {LL_UE8M0_HIDDEN_MULTIPLE} for use_ue8m0=True (4 scales per "
                f"int32), got {hidden}")
    return None


def check_ll_hidden(hidden: int, use_fp8: bool, use_ue8m0: bool = False) -> None:
    """Low-latency hidden sizes of the torch backend: any ``hidden >= 1``; FP8 needs a multiple of 128 (one scale
    per 128 channels), ``use_ue8m0`` a multiple of 512 (4 scales per int32)."""
    if hidden < 1:
        raise ValueError(f"x hidden size must be >= 1 for low-latency calls, got {hidden}")
    if use_fp8 and hidden % FP8_BLOCK != 0:
        raise ValueError(f"x hidden size must be a multiple of {FP8_BLOCK} with use_fp8=True (one scale per "
                         f"{FP8_BLOCK} channels), got {hidden}")
    if use_fp8 and use_ue8m0 and hidden % LL_UE8M0_HIDDEN_MULTIPLE != 0:
        raise ValueError(f"x hidden size must be a multiple of {LL_UE8M0_HIDDEN_MULTIPLE} for use_ue8m0=True (4 "
                         f"scales per int32), got {hidden}")


def check_ll_tokens(name: str, num_tokens: int, num_max_dispatch_tokens_per_rank: int) -> None:
    if num_tokens > num_max_dispatch_tokens_per_rank:
        raise ValueError(f"{name} has {num_tokens} tokens, more than num_max_dispatch_tokens_per_rank="
                         f"{num_max_dispatch_tokens_per_rank}")


def check_ll_topk(name: str, num_topk: int) -> None:
    if num_topk > LL_MAX_TOPK:
        raise ValueError(f"{name} must have at most {LL_MAX_TOPK} columns for low-latency kernels, got {num_topk}")

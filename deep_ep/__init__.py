"""deep_ep: expert-parallel (MoE) dispatch/combine communication for PyTorch.

A drop-in for DeepEP V1's ``deep_ep.Buffer`` API. Public names:

* ``Buffer``: the communication buffer (normal and low-latency dispatch/combine); ``EventOverlap``: the completion
  event every call returns; ``Config``: tuning config of the normal kernels.
* ``topk_idx_t``: dtype of expert indices (``torch.int64``; ``torch.int32`` with ``DEEP_EP_TOPK_IDX_BITS=32``).
* ``per_token_cast_to_fp8``, ``per_token_cast_back``, ``logfmt_roundtrip``: numerics helpers.
* ``CommError`` and its kinds ``CommTimeoutError``, ``PeerAbortedError``, ``RoutingError``: what a failed call
  raises, whichever backend served it.
* ``__version__``: this distribution's version; ``deep_ep.utils`` holds DeepEP's utility names (``EventHandle``,
  ``check_nvlink_connections``, ...).

Importing this package loads neither torch nor CUDA: ``config``, ``errors``, ``layout``, ``envs``, ``testing`` and
``backends.cuda_tuning`` are standard-library only; the torch-dependent names above resolve on first access.
"""
from __future__ import annotations

from importlib import metadata as _metadata
from typing import Any

from deep_ep.config import Config
from deep_ep.errors import (
    ArgumentMismatchError,
    CommError,
    CommTimeoutError,
    LowLatencyMisuseError,
    PeerAbortedError,
    RoutingError,
)

_LAZY = {
    "Buffer": ("deep_ep.buffer", "Buffer"),
    "EventOverlap": ("deep_ep.event", "EventOverlap"),
    "per_token_cast_to_fp8": ("deep_ep.numerics", "per_token_cast_to_fp8"),
    "per_token_cast_back": ("deep_ep.numerics", "per_token_cast_back"),
    "logfmt_roundtrip": ("deep_ep.numerics", "logfmt_roundtrip"),
}

try:
    __version__ = _metadata.version("deep_ep")
except _metadata.PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = ["Buffer", "EventOverlap", "Config", "topk_idx_t", "per_token_cast_to_fp8", "per_token_cast_back",
           "logfmt_roundtrip", "CommError", "CommTimeoutError", "PeerAbortedError", "RoutingError",
           "ArgumentMismatchError", "LowLatencyMisuseError"]


def __getattr__(name: str) -> Any:
    import importlib
    if name == "topk_idx_t":
        from deep_ep.validate import topk_idx_dtype
        return topk_idx_dtype()
    if name in _LAZY:
        module_name, attr = _LAZY[name]
        value = getattr(importlib.import_module(module_name), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'deep_ep' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

"""Pure-PyTorch, single-process reference of the ``deep_ep.Buffer`` semantics: the test oracle.

Global view: every function takes the inputs of all ranks (lists indexed by rank) and returns the outputs of all
ranks. ``reference.distributed`` runs the same semantics inside a ``torch.distributed`` group. The contract, with
worked examples and the order guarantees, is in ``docs/semantics.md``.

Imports torch and the torch-free / torch-only parts of ``deep_ep`` (config, layout, numerics, handle, validate); never
``deep_ep.buffer`` or the CUDA extension.
"""
from deep_ep.handle import InternodeHandle, IntranodeHandle, LayoutResult, LowLatencyHandle
from reference.low_latency import (
                                   LowLatencyDispatchResult,
                                   low_latency_combine,
                                   low_latency_dispatch,
                                   unpack_layout_range,
)
from reference.normal import CombineResult, DispatchResult, combine, dispatch, get_dispatch_layout

__all__ = [
    "CombineResult", "DispatchResult", "InternodeHandle", "IntranodeHandle", "LayoutResult", "LowLatencyDispatchResult",
    "LowLatencyHandle", "combine", "dispatch", "get_dispatch_layout", "low_latency_combine", "low_latency_dispatch",
    "unpack_layout_range",
]

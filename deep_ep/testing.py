"""Test-only overrides of the variants the library otherwise chooses itself (tests and benchmarks use them).

``with deep_ep.testing.overrides(combine_send="rings"): ...`` makes the calls and ``Buffer`` constructions inside
the block see the given fields, merged over any enclosing block; every field left ``None`` / ``False`` is the
library's own choice. Construction-time fields (``internode``, ``ll_put_only``, ``internode_put_only``) are read
when a ``Buffer`` is built, the others when a call is made. The state is a ``contextvars.ContextVar``: it follows the
thread (or task) that entered the block.

Standard library only, so ``deep_ep.backends.cuda_tuning`` (and through it the simulator) can read it.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from dataclasses import dataclass
from typing import Iterator, Optional

_CHOICES = {
    "dispatch_receive": ("rings", "direct"),
    "combine_send": ("copy", "rings", "zone"),
    "internode": ("composed", "torch", "fused"),
}
# Fields that hold a count (None: the tuned value) and their smallest accepted value.
_COUNTS = {"combine_copy_chunk_rows": 1, "dispatch_warps": 0, "combine_warps": 0}


@dataclass(frozen=True)
class Overrides:
    """Variant choices for tests and benchmarks; ``None`` / ``False`` leaves the choice to the library.

    Fields:
        dispatch_receive: intranode dispatch receive path, ``'rings'`` or ``'direct'`` (outputs in the buffer's
            pool; raises when the pool has no room).
        combine_send: intranode combine send path, ``'copy'`` (copy engine), ``'rings'`` or ``'zone'`` (zone
            senders), wherever the path applies.
        combine_copy_chunk_rows: rows per chunk of the copy-engine combine.
        dispatch_warps / combine_warps: copy warps per channel of the dispatch / combine kernel (clamped to what
            each kernel accepts; ``combine_warps`` also sets the zone senders' warps).
        uncapped_channels: ``num_sms`` channels even above the tuned channel cap.
        internode: normal mode of ``N`` nodes x ``G > 1`` GPUs: ``'composed'`` (rail and node stages for every
            tensor; torch stages on CPU), ``'torch'`` (the torch backend) or ``'fused'`` (the fused CUDA kernels,
            deep_ep/backends/fused_internode.py, or a warning naming why they cannot serve the group).
        ll_put_only: the low-latency kernels reach every peer by NVSHMEM put (the RDMA path), even by NVLink.
        internode_put_only: the internode ring kernels reach every peer by NVSHMEM put, the fused kernels every
            rank of another node (their NVLink hops stay pointer); set on any rank, it applies to the whole group.
    """

    dispatch_receive: Optional[str] = None
    combine_send: Optional[str] = None
    combine_copy_chunk_rows: Optional[int] = None
    dispatch_warps: Optional[int] = None
    combine_warps: Optional[int] = None
    uncapped_channels: bool = False
    internode: Optional[str] = None
    ll_put_only: bool = False
    internode_put_only: bool = False

    def __post_init__(self) -> None:
        for name, value in dataclasses.asdict(self).items():
            if name in _CHOICES:
                if value is not None and value not in _CHOICES[name]:
                    raise ValueError(f"deep_ep.testing.overrides: {name} must be None or one of {_CHOICES[name]}, "
                                     f"got {value!r}")
            elif name in _COUNTS:
                if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                          or value < _COUNTS[name]):
                    raise ValueError(f"deep_ep.testing.overrides: {name} must be None or an int >= "
                                     f"{_COUNTS[name]}, got {value!r}")
            elif not isinstance(value, bool):
                raise ValueError(f"deep_ep.testing.overrides: {name} must be a bool, got {value!r}")


_FIELDS = tuple(field.name for field in dataclasses.fields(Overrides))
# Overrides is frozen, so the shared default cannot change.
_CURRENT: contextvars.ContextVar[Overrides] = contextvars.ContextVar(
    "deep_ep_testing_overrides", default=Overrides())  # noqa: B039


def current() -> Overrides:
    """The overrides in effect here (all defaults outside any ``overrides`` block)."""
    return _CURRENT.get()


@contextlib.contextmanager
def overrides(**fields: object) -> Iterator[Overrides]:
    """Within the ``with`` block, calls and ``Buffer`` constructions see ``fields`` merged over the enclosing
    block's. An unknown field raises ``TypeError``, a bad value ``ValueError`` (naming field, rule and value)."""
    unknown = sorted(set(fields) - set(_FIELDS))
    if unknown:
        raise TypeError(f"deep_ep.testing.overrides: unknown field(s) {unknown}; the fields are {list(_FIELDS)}")
    merged = dataclasses.replace(current(), **fields)
    token = _CURRENT.set(merged)
    try:
        yield merged
    finally:
        _CURRENT.reset(token)

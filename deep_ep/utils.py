"""DeepEP V1's ``deep_ep.utils`` names: ``EventOverlap``, ``EventHandle``, ``Config``, ``check_nvlink_connections``.

Clients written for DeepEP (Megatron-core's fused all-to-all among them) import these from ``deep_ep.utils``.
``EventOverlap`` and ``Config`` are the package's own classes; ``EventHandle()`` captures the current CUDA stream
the way DeepEP's extension type does, and without CUDA it is an event that has already happened, so code that
passes ``EventOverlap(EventHandle())`` as ``previous_event`` runs unchanged on the CPU backend.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from deep_ep.backends.common import object_all_gather
from deep_ep.config import Config
from deep_ep.event import CudaEventHandle, EventOverlap

__all__ = ["EventOverlap", "EventHandle", "Config", "check_nvlink_connections"]


class EventHandle(CudaEventHandle):
    """An event recorded on the current CUDA stream when constructed (completed at once without CUDA).

    ``current_stream_wait()`` makes the then-current stream wait for it; ``query()`` and ``synchronize()`` behave
    as ``torch.cuda.Event``'s. Without CUDA there is no stream to order against, so the three are no-ops
    (``query()`` is ``True``).
    """

    def __init__(self) -> None:
        if torch.cuda.is_available():
            super().__init__()

    @property
    def recorded(self) -> bool:
        """Whether a CUDA event was recorded (``False`` without CUDA)."""
        return "cuda_event" in self.__dict__

    def current_stream_wait(self) -> None:
        if self.recorded:
            super().current_stream_wait()

    def query(self) -> bool:
        return super().query() if self.recorded else True

    def synchronize(self) -> None:
        if self.recorded:
            super().synchronize()

    def __repr__(self) -> str:
        return f"EventHandle(recorded={self.recorded})"


def _is_pcie_part(device_name: str) -> bool:
    """PCIe variants of data-center GPUs name themselves ``...-PCIE-...``; SXM parts reach every peer through
    NVSwitch, so only PCIe parts can lack an NVLink between two GPUs of one host."""
    return "PCIE" in device_name.upper()


def _check_pairs(device_ids: Sequence[str], nvlink_between: Callable[[str, str], bool]) -> None:
    """Every pair of distinct entries of ``device_ids`` must be NVLink-connected (``nvlink_between``)."""
    for i, first in enumerate(device_ids):
        for second in device_ids[i + 1:]:
            if first != second and not nvlink_between(first, second):
                raise RuntimeError(f"GPU {first} and GPU {second} of this group are not connected by NVLink; "
                                   "the intranode kernels need an NVLink path between every pair of GPUs")


def _nvml_nvlink_probe() -> tuple[Callable[[str, str], bool], Callable[[], None]]:
    """An NVLink test between two GPUs named by UUID, through NVML (``pynvml``), and NVML's shutdown."""
    try:
        import pynvml
    except ImportError as exc:
        raise RuntimeError("check_nvlink_connections needs NVML to inspect PCIe GPUs: install nvidia-ml-py "
                           "(module pynvml)") from exc
    pynvml.nvmlInit()

    def nvlink_between(first: str, second: str) -> bool:
        a, b = pynvml.nvmlDeviceGetHandleByUUID(first), pynvml.nvmlDeviceGetHandleByUUID(second)
        status = pynvml.nvmlDeviceGetP2PStatus(a, b, pynvml.NVML_P2P_CAPS_INDEX_NVLINK)
        return status == pynvml.NVML_P2P_STATUS_OK

    return nvlink_between, pynvml.nvmlShutdown


def check_nvlink_connections(group: Any) -> None:
    """Check that the GPUs of ``group``'s ranks reach each other over NVLink, as the intranode kernels need.

    Without CUDA there is nothing to check (the torch backend moves data with ``torch.distributed``). SXM GPUs
    are connected through NVSwitch and pass. On PCIe GPUs, where NVLink bridges join at most pairs, the group must
    have at most 2 ranks and NVML must report an NVLink between every two of its GPUs (the ranks exchange their
    GPUs' UUIDs over ``group``, a collective call on every rank). Raises ``RuntimeError`` naming the GPUs
    otherwise.
    """
    if not torch.cuda.is_available():
        return
    if not _is_pcie_part(torch.cuda.get_device_name()):
        return
    size = group.size()
    if size > 2:
        raise RuntimeError(f"PCIe GPUs have NVLink connections between pairs only, so the group may have at most 2 "
                           f"ranks, got {size}")
    uuid = f"GPU-{torch.cuda.get_device_properties(torch.cuda.current_device()).uuid}"
    device_ids = object_all_gather(group)(uuid)
    nvlink_between, shutdown = _nvml_nvlink_probe()
    try:
        _check_pairs([str(d) for d in device_ids], nvlink_between)
    finally:
        shutdown()

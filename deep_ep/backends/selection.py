"""Which backends serve a ``Buffer``: built once, collectively, when the Buffer is constructed.

* the torch backend, whenever a ``torch.distributed`` group is given (any device, any topology);
* the CUDA low-latency backend for ``low_latency_mode`` with ``num_rdma_bytes > 0`` when the extension has NVSHMEM;
* the fused internode kernels for ``N`` nodes x ``G > 1`` GPUs when CUDA, the NVSHMEM build and ``num_rdma_bytes``
  are there, ``N <= 32``, ``N * G <= 64`` and the ranks of each node reach each other by pointer (other nodes by
  pointer or, behind a NIC, by NVSHMEM puts);
* else the composed path for ``G > 1``: a torch rail stage beside a CUDA node stage when CUDA, the extension and
  ``num_nvl_bytes`` are there and each node's ranks share a host, or torch stages under ``deep_ep.testing``
  ``internode='composed'`` (which also skips the fused kernels);
* the CUDA intranode backend (one NVLink domain of at most 8 ranks) or the CUDA internode backend (one GPU per node).

``DEEP_EP_BACKEND=torch`` keeps the torch backend only; ``cuda`` turns a reason the CUDA backend cannot serve the
group into an error. With a GPU present, the automatic choice says in a ``RuntimeWarning`` why CUDA tensors take the
torch backend. :func:`routes` maps (mode, device type) to the backend that serves it.
"""
from __future__ import annotations

import importlib
import socket
import warnings
from typing import Any, NamedTuple, Optional, Sequence

import torch

from deep_ep import envs, testing
from deep_ep.backends.base import Backend
from deep_ep.backends.common import object_all_gather
from deep_ep.config import Topology

# Frames between without_cuda's warning and the code that constructs the Buffer.
_WARNING_STACKLEVEL = 6


class BufferSpec(NamedTuple):
    """The validated constructor arguments of a ``Buffer`` that decide its backends."""

    rank: int
    group_size: int
    topology: Topology
    num_nvl_bytes: int
    num_rdma_bytes: int
    low_latency_mode: bool
    num_qps_per_rank: int
    allow_nvlink_for_low_latency_mode: bool
    allow_mnnvl: bool
    enable_shrink: bool


class Backends(NamedTuple):
    """The backends of one Buffer (``None``: not built) and the device type the composed path serves."""

    torch: Optional[Backend]
    cuda: Optional[Backend]
    cuda_ll: Optional[Backend]
    composed: Optional[Backend]
    composed_device: Optional[str]


def backend_choice() -> str:
    choice = envs.BACKEND.get()
    if choice not in ("auto", "torch", "cuda"):
        raise ValueError(f"DEEP_EP_BACKEND must be 'auto', 'torch' or 'cuda', got {choice!r}")
    return choice


def _import_cuda(module: str, name: str) -> tuple[Any, Optional[str]]:
    """``(class, None)`` for a CUDA backend class of ``deep_ep.backends``, or ``(None, why it cannot be used)``."""
    if not torch.cuda.is_available():
        return None, "CUDA is not available"
    try:
        return getattr(importlib.import_module(f"deep_ep.backends.{module}"), name), None
    except ImportError as exc:
        return None, f"the CUDA extension is not importable ({exc})"


def without_cuda(choice: str, group: Any, what: str, reason: str) -> None:
    """``None`` (the torch backend serves the group), or the error when the CUDA backend was required:
    ``DEEP_EP_BACKEND=cuda``, or ``comm=`` without a torch group. With a GPU present, the automatic choice says
    why in a ``RuntimeWarning`` (e.g. more nodes than the kernels serve): CUDA tensors then take the slow path."""
    if choice == "cuda":
        raise RuntimeError(f"DEEP_EP_BACKEND=cuda but the {what} cannot be used: {reason}")
    if group is None:
        raise ValueError(f"comm= (mpi4py) without group= needs the CUDA backend, which is unavailable: {reason}; "
                         "pass a torch.distributed group")
    if torch.cuda.is_available():
        warnings.warn(f"deep_ep.Buffer: the {what} does not serve this group ({reason}); the torch backend "
                      "(torch.distributed) carries its calls: correct, not fast. DEEP_EP_BACKEND=torch selects it "
                      "without this warning", RuntimeWarning, stacklevel=_WARNING_STACKLEVEL)
    return None


def build_backends(spec: BufferSpec, group: Any, comm: Any) -> Backends:
    """Every backend of a Buffer, in the order the ranks build them (collective)."""
    torch_backend = None
    if group is not None:
        from deep_ep.backends.torch_dist import TorchBackend
        torch_backend = TorchBackend(group, spec.rank, spec.group_size, spec.topology, spec.num_nvl_bytes,
                                     spec.num_rdma_bytes, spec.enable_shrink)
    cuda_ll = _cuda_low_latency(spec, group, comm)
    fused = _fused_internode(spec, group, comm)
    if fused is not None:
        return Backends(torch_backend, fused, cuda_ll, None, None)
    composed, composed_device, refusal = _composed(spec, group)
    cuda = _cuda(spec, group, comm, cuda_ll, refusal) if composed_device != "cuda" else None
    return Backends(torch_backend, cuda, cuda_ll, composed, composed_device)


def routes(backends: Backends, topology: Topology) -> dict[tuple[str, Optional[str]], Optional[Backend]]:
    """(mode, device type) -> the backend serving it (``None``: none can). Modes: ``'normal'`` (layout, dispatch,
    combine), ``'low_latency'`` (device ``None``: the calls without a tensor), ``'buffer'`` (device ``'nvl'`` /
    ``'rdma'``: ``get_local_buffer_tensor``; the CUDA internode backend's buffer is the RDMA one)."""
    torch_backend, cuda, cuda_ll, composed, composed_device = backends
    internode_cuda = cuda is not None and topology.is_internode
    return {
        ("normal", "cpu"): composed if composed_device == "cpu" else torch_backend,
        ("normal", "cuda"): cuda or (composed if composed_device == "cuda" else None) or torch_backend,
        ("low_latency", "cpu"): torch_backend,
        ("low_latency", "cuda"): cuda_ll or torch_backend,
        ("low_latency", None): cuda_ll or torch_backend,
        ("buffer", "nvl"): cuda if cuda is not None and not internode_cuda else torch_backend,
        ("buffer", "rdma"): cuda if internode_cuda else torch_backend,
    }


# ---------------------------------------------------------------------------------------------------------------
# Each CUDA backend: built when it serves the group, else None (or an error, see without_cuda).
# ---------------------------------------------------------------------------------------------------------------

def _cuda_low_latency(spec: BufferSpec, group: Any, comm: Any) -> Optional[Backend]:
    """The CUDA low-latency backend (NVSHMEM) when ``low_latency_mode`` has an RDMA buffer, the extension has the
    LL kernels and ``DEEP_EP_BACKEND`` allows it; else ``None`` (the torch backend serves LL calls)."""
    choice = backend_choice()
    if choice == "torch" or not (spec.low_latency_mode and spec.num_rdma_bytes > 0):
        return None
    backend_cls, reason = _import_cuda("cuda_low_latency", "LowLatencyCuda")
    if backend_cls is not None and not backend_cls.is_built():
        reason = "the CUDA extension was built without NVSHMEM (DEEP_EP_DISABLE_NVSHMEM)"
    if reason is not None:
        if choice == "cuda":
            raise RuntimeError(f"DEEP_EP_BACKEND=cuda but the CUDA low-latency kernels cannot be used: {reason}")
        return None
    # An internode group allocates its normal-mode buffer on the symmetric heap after this one: the heap holds both.
    options = dict(num_rdma_bytes=spec.num_rdma_bytes, num_qps_per_rank=spec.num_qps_per_rank,
                   allow_nvlink=spec.allow_nvlink_for_low_latency_mode, allow_mnnvl=spec.allow_mnnvl,
                   enable_shrink=spec.enable_shrink, other_heap_bytes=_internode_heap_bytes(spec))
    if group is not None:
        return backend_cls.from_group(group, **options)
    return backend_cls(spec.rank, spec.group_size, all_gather=comm.allgather, **options)


def _cuda(spec: BufferSpec, group: Any, comm: Any, cuda_ll: Optional[Backend],
          composed_refusal: Optional[str]) -> Optional[Backend]:
    """The CUDA normal-mode backend when it is built, requested and serves this topology; else ``None``."""
    choice = backend_choice()
    if choice == "torch":
        return None
    if spec.topology.is_internode:
        return _cuda_internode(spec, group, comm, choice, cuda_ll, composed_refusal)
    return _cuda_intranode(spec, group, comm, choice, cuda_ll)


def _cuda_intranode(spec: BufferSpec, group: Any, comm: Any, choice: str,
                    cuda_ll: Optional[Backend]) -> Optional[Backend]:
    backend_cls, reason = _import_cuda("cuda_intranode", "CudaBackend")
    if backend_cls is not None:
        if not backend_cls.is_supported(spec.group_size, spec.topology.num_scaleup_ranks):
            reason = f"the CUDA backend does not serve {spec.group_size} ranks with this topology"
        elif spec.num_nvl_bytes <= 0:
            reason = "num_nvl_bytes is 0"
            if cuda_ll is not None:  # a low-latency-only Buffer: the LL backend serves it
                return None
    if reason is None:
        if group is not None:
            return backend_cls.from_group(group, spec.num_nvl_bytes)
        return backend_cls(spec.rank, spec.group_size, spec.num_nvl_bytes, comm.allgather, comm.Barrier)
    return without_cuda(choice, group, "CUDA backend", reason)


def _cuda_internode(spec: BufferSpec, group: Any, comm: Any, choice: str, cuda_ll: Optional[Backend],
                    composed_refusal: Optional[str]) -> Optional[Backend]:
    """The CUDA internode backend (one GPU per node, NVSHMEM) when it serves this group; else ``None``, or an error
    naming the reason under ``DEEP_EP_BACKEND=cuda`` or with ``comm=`` alone."""
    if choice == "auto" and spec.topology.num_scaleup_ranks > 1 and testing.current().internode == "torch":
        return None
    backend_cls, reason = _import_cuda("cuda_internode", "InternodeCuda")
    if backend_cls is not None:
        reason = backend_cls.unsupported_reason(spec.topology, spec.num_rdma_bytes)
    if composed_refusal is not None:  # G > 1: the composed path's reason is the one that matters
        reason = f"the composed path: {composed_refusal}"
    if reason is None:
        from deep_ep.backends.cuda_internode import UnsupportedTopology
        options = dict(num_rdma_bytes=spec.num_rdma_bytes, num_qps_per_rank=spec.num_qps_per_rank,
                       allow_mnnvl=spec.allow_mnnvl)
        try:
            if group is not None:
                return backend_cls.from_group(group, **options)
            return backend_cls(spec.rank, spec.group_size, all_gather=comm.allgather, barrier=comm.Barrier,
                               **options)
        except UnsupportedTopology as exc:  # collective: every rank gets here together
            reason = str(exc)
    if choice == "auto" and cuda_ll is not None and spec.num_nvl_bytes <= 0:
        return None  # a low-latency Buffer (DeepEP's num_nvl_bytes=0 convention): the LL backend serves it
    return without_cuda(choice, group, "CUDA internode backend", reason)


def _fused_internode(spec: BufferSpec, group: Any, comm: Any) -> Optional[Backend]:
    """The fused internode kernels for ``N x G`` groups with ``G > 1`` when they serve the group (the automatic
    choice, or ``internode='fused'``); else ``None`` and the composed path or the torch backend serves it. Under
    ``internode='fused'`` a reason they cannot is an error with ``DEEP_EP_BACKEND=cuda`` (a ``RuntimeWarning``
    otherwise). Collective: every rank reaches the same decision."""
    choice, override = backend_choice(), testing.current().internode
    topo = spec.topology
    if choice == "torch" or override not in (None, "fused") or not topo.is_internode or topo.num_scaleup_ranks < 2:
        return None
    backend_cls, reason = _import_cuda("fused_internode", "FusedInternodeCuda")
    if backend_cls is not None:
        reason = backend_cls.unsupported_reason(topo, spec.num_rdma_bytes)
    if reason is None:
        from deep_ep.backends.cuda_internode import UnsupportedTopology
        options = dict(num_rdma_bytes=_internode_heap_bytes(spec), num_qps_per_rank=spec.num_qps_per_rank,
                       allow_mnnvl=spec.allow_mnnvl)
        try:
            if group is not None:
                return backend_cls.from_group(group, topo, **options)
            return backend_cls(spec.rank, topo, all_gather=comm.allgather, barrier=comm.Barrier, **options)
        except UnsupportedTopology as exc:  # collective: every rank gets here together
            reason = str(exc)
    if override == "fused":
        return without_cuda(choice, group, "fused CUDA internode backend", reason)
    return None


def _composed(spec: BufferSpec, group: Any) -> tuple[Optional[Backend], Optional[str], Optional[str]]:
    """``(composed path, the device type it serves, None)`` for ``N x G`` groups with ``G > 1`` that the fused kernels
    do not serve; ``(None, None, why its CUDA node stage cannot serve the group)`` when the automatic choice refuses
    it.

    The rail stage is a ``TorchBackend`` over the rail subgroup. A CUDA node stage (a ``CudaBackend``, CUDA IPC: each
    node's ranks on one host) serves CUDA tensors (the group only exchanges objects, gloo or NCCL); a torch node
    stage over the group's backend serves under ``internode='composed'`` only. Collective: every rank creates every
    subgroup (``make_stage_groups``)."""
    topo = spec.topology
    choice = testing.current().internode or "auto"
    if group is None or choice in ("torch", "fused") or not topo.is_internode or topo.num_scaleup_ranks < 2:
        return None, None, None
    reason = None
    if backend_choice() == "torch":
        reason = "DEEP_EP_BACKEND=torch"
    elif spec.num_nvl_bytes <= 0:
        reason = "num_nvl_bytes is 0"
    backend_cls = None
    if reason is None:
        backend_cls, reason = _import_cuda("cuda_intranode", "CudaBackend")
    if reason is None:
        reason = _node_spans_hosts(object_all_gather(group)(socket.gethostname()), topo)
    if reason is not None and choice == "auto":
        return None, None, reason
    from deep_ep.backends.composed import ComposedInternode, make_stage_groups
    from deep_ep.backends.torch_dist import TorchBackend
    groups = make_stage_groups(group, topo)
    num_nodes, per_node = topo.num_scaleout_ranks, topo.num_scaleup_ranks

    def torch_stage(stage_group: Any, stage_rank: int, size: int) -> Backend:
        return TorchBackend(stage_group, stage_rank, size, Topology.one_domain(size), spec.num_nvl_bytes, 0, False)

    rail = torch_stage(groups.rail, topo.node_of(spec.rank), num_nodes)
    if reason is None:
        node = backend_cls.from_group(groups.node, spec.num_nvl_bytes)
        return ComposedInternode(rail, node, spec.rank, topo, cuda_node=True), "cuda", None
    node = torch_stage(groups.node, topo.local_of(spec.rank), per_node)
    return ComposedInternode(rail, node, spec.rank, topo), rail.device.type, None


def _node_spans_hosts(hosts: Sequence[str], topology: Topology) -> Optional[str]:
    """Why the composed path's CUDA node stage (CUDA IPC) cannot serve the group: the ranks of a node span hosts
    (``hosts[r]``: the host name of rank ``r``); ``None`` when every node's ranks share one."""
    per_node = topology.num_scaleup_ranks
    for node in range(topology.num_scaleout_ranks):
        names = sorted(set(hosts[node * per_node:(node + 1) * per_node]))
        if len(names) > 1:
            return (f"the ranks of node {node} span hosts {names} (the node stage needs CUDA IPC; set "
                    f"DEEP_EP_GPUS_PER_NODE to the GPUs per host)")
    return None


def _internode_heap_bytes(spec: BufferSpec) -> int:
    """Bytes the normal-mode internode kernels take on the NVSHMEM symmetric heap (0 for one node): the fused
    kernels (``G > 1``) keep no separate NVLink buffer, so theirs is ``num_nvl_bytes + num_rdma_bytes``; with one
    GPU per node, ``num_rdma_bytes``."""
    topo = spec.topology
    if not topo.is_internode:
        return 0
    return spec.num_nvl_bytes + spec.num_rdma_bytes if topo.num_scaleup_ranks > 1 else spec.num_rdma_bytes

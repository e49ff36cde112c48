"""``deep_ep.Buffer``: DeepEP V1's public API (same constructor, method names, keywords and result positions).

This module is the validating front. It checks every argument (``deep_ep.validate``: ``TypeError``/``ValueError``
naming the argument, the rule and the value), resolves defaults and configs, and routes each call to a backend:

* ``deep_ep.cuda_backend.CudaBackend`` (the CUDA kernels) for CUDA tensors, when the extension is built, the
  topology is one it serves and ``DEEP_EP_BACKEND`` is ``auto`` or ``cuda``. Methods it lacks (e.g. the
  low-latency mode) fall back to the torch backend;
* ``deep_ep.composed_internode.ComposedInternode`` for the normal mode of ``N`` nodes x ``G > 1`` GPUs: a rail
  stage and a node stage, each an intranode backend over a subgroup (CUDA kernels for CUDA tensors: the node stage
  over CUDA IPC, the rail stage over IPC on one host or NVSHMEM across hosts; torch stages on CPU under
  ``DEEP_EP_INTERNODE=composed``);
* ``deep_ep.torch_backend.TorchBackend`` otherwise: real communication over the process group (gloo on CPU,
  NCCL on GPU).

A backend implements the same method names and arguments as ``Buffer`` and returns the NamedTuples of
``deep_ep.results``. See ``docs/torch_backend.md``.
"""
from __future__ import annotations

import importlib
import warnings
import weakref
from typing import Any, Optional, Union

import torch

from deep_ep import config as cfg
from deep_ep import envs, layout, testing
from deep_ep import handle as hd
from deep_ep import validate as v
from deep_ep.backends import cuda_tuning
from deep_ep.config import Config, Topology
from deep_ep.event import COMPLETED, CudaEventHandle, EventOverlap
from deep_ep.results import (
    CombineResult,
    DispatchLayout,
    DispatchResult,
    LowLatencyCombineResult,
    LowLatencyDispatchResult,
)

# Largest int32 value: DeepEP's limit on normal-mode buffer sizes.
_INT_MAX = 2 ** 31 - 1
# Default NVSHMEM queue-pair depth (reported as ``Buffer.nvshmem_qp_depth``; the CUDA low-latency kernels use the
# portable NVSHMEM API and do not tie the token count to it).
_NVSHMEM_QP_DEPTH = 1024
# Largest group of the normal kernels (DeepEP), unless in low-latency mode.
_MAX_NORMAL_RANKS = 160
# (kind, num_ranks, num_sms) -> the tuned default Config (see Buffer._resolve_config).
_DEFAULT_CONFIGS: dict[tuple[str, int, int], Config] = {}


def _backend_choice() -> str:
    choice = envs.BACKEND.get()
    if choice not in ("auto", "torch", "cuda"):
        raise ValueError(f"DEEP_EP_BACKEND must be 'auto', 'torch' or 'cuda', got {choice!r}")
    return choice


def _internode_choice() -> str:
    return testing.current().internode or "auto"


def _import_cuda(module: str, name: str) -> tuple[Any, Optional[str]]:
    """``(class, None)`` for a CUDA backend class, or ``(None, why it cannot be used)``."""
    if not torch.cuda.is_available():
        return None, "CUDA is not available"
    try:
        return getattr(importlib.import_module(module), name), None
    except ImportError as exc:
        return None, f"the CUDA extension is not importable ({exc})"


def _without_cuda(choice: str, group: Any, what: str, reason: str) -> None:
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
                      "without this warning", RuntimeWarning, stacklevel=4)
    return None


class Buffer:
    """Communication buffer for expert-parallel dispatch and combine (DeepEP V1 ``deep_ep.Buffer``).

    Args:
        group: ``torch.distributed`` process group of all EP ranks (``None`` only with ``comm``).
        num_nvl_bytes: bytes of the scale-up (NVLink) buffer, a multiple of 128.
        num_rdma_bytes: bytes of the scale-out / low-latency symmetric buffer, a multiple of 128.
        low_latency_mode: enable the low-latency kernels.
        num_qps_per_rank: RDMA queue pairs per peer (> 0 when an RDMA buffer is used).
        allow_nvlink_for_low_latency_mode, allow_mnnvl, use_fabric: transport choices of the CUDA kernels; the torch
            backend accepts and ignores them.
        explicitly_destroy: the caller must call :meth:`destroy` (or use ``with Buffer(...) as buf``).
        enable_shrink: keep a per-rank mask; low-latency calls skip masked ranks.
        comm: an mpi4py communicator used instead of ``group`` to bootstrap the CUDA backend.

    Construction is collective: every rank constructs with identical sizes and flags.
    """

    num_sms: int = 20

    def __init__(self, group: Any, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 24, allow_nvlink_for_low_latency_mode: bool = True,
                 allow_mnnvl: bool = False, use_fabric: bool = False, explicitly_destroy: bool = False,
                 enable_shrink: bool = False, comm: Any = None) -> None:
        if group is None and comm is None:
            raise ValueError("Either 'group' or 'comm' must be provided.")
        for name, value in (("low_latency_mode", low_latency_mode),
                            ("allow_nvlink_for_low_latency_mode", allow_nvlink_for_low_latency_mode),
                            ("allow_mnnvl", allow_mnnvl), ("use_fabric", use_fabric),
                            ("explicitly_destroy", explicitly_destroy), ("enable_shrink", enable_shrink)):
            v.check_bool(name, value)
        v.check_int("num_nvl_bytes", num_nvl_bytes, 0)
        v.check_int("num_rdma_bytes", num_rdma_bytes, 0)
        v.check_int("num_qps_per_rank", num_qps_per_rank)
        if group is not None:
            rank, group_size = group.rank(), group.size()
        else:
            rank, group_size = comm.Get_rank(), comm.Get_size()
        self.topology = Topology.from_env(group_size)
        for name, value in (("num_nvl_bytes", num_nvl_bytes), ("num_rdma_bytes", num_rdma_bytes)):
            if value % cfg.BUFFER_ALIGNMENT != 0:
                raise ValueError(f"{name} must be a multiple of {cfg.BUFFER_ALIGNMENT}, got {value}")
        if num_rdma_bytes > 0 and num_nvl_bytes > _INT_MAX:
            raise ValueError(f"num_nvl_bytes must be <= {_INT_MAX} when num_rdma_bytes > 0, got {num_nvl_bytes}")
        if not low_latency_mode and num_rdma_bytes > _INT_MAX:
            raise ValueError(f"num_rdma_bytes must be <= {_INT_MAX} unless low_latency_mode=True, got "
                             f"{num_rdma_bytes}")
        if not low_latency_mode and group_size > _MAX_NORMAL_RANKS:
            raise ValueError(f"the group size must be <= {_MAX_NORMAL_RANKS} unless low_latency_mode=True, got "
                             f"{group_size}")
        if num_rdma_bytes > 0 and not (self.topology.is_internode or low_latency_mode):
            raise ValueError(f"num_rdma_bytes must be 0 for a single-node group without low_latency_mode, got "
                             f"{num_rdma_bytes} (group size {group_size}, "
                             f"{self.topology.num_scaleup_ranks} ranks per node)")
        if num_rdma_bytes > 0 and num_qps_per_rank <= 0:
            raise ValueError(f"num_qps_per_rank must be > 0 when num_rdma_bytes > 0, got {num_qps_per_rank}")

        self.rank = rank
        self.group = group if group is not None else comm
        self.group_size = group_size
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.num_qps_per_rank = num_qps_per_rank
        self.allow_nvlink_for_low_latency_mode = allow_nvlink_for_low_latency_mode
        self.allow_mnnvl = allow_mnnvl
        self.use_fabric = use_fabric
        self.explicitly_destroy = explicitly_destroy
        self.enable_shrink = enable_shrink
        if self.topology.is_internode or low_latency_mode:
            self.nvshmem_qp_depth = _NVSHMEM_QP_DEPTH
        self._destroyed = False
        # id(key tensor) -> weak reference, for every handle this Buffer returned (see _check_handle).
        self._handles: dict[int, weakref.ref] = {}
        # (T, H, E) of plain ints that passed _check_low_latency -> local experts per rank.
        self._ll_checked: dict[tuple[int, int, int], int] = {}

        from deep_ep.torch_backend import TorchBackend
        self._torch = None
        if group is not None:
            self._torch = TorchBackend(group, rank, group_size, self.topology, num_nvl_bytes, num_rdma_bytes,
                                       enable_shrink)
        self._cuda_ll = self._make_cuda_low_latency(group, comm)
        # The composed internode path and the device type of the tensors it serves ('cuda' or 'cpu'); why the
        # automatic choice refused its CUDA stages, if it did.
        self._composed_refusal: Optional[str] = None
        self._composed, self._composed_device = self._make_composed(group)
        self._cuda = self._make_cuda_backend(group, comm) if self._composed_device != "cuda" else None
        self.runtime = next((b for b in (self._cuda, self._composed, self._cuda_ll, self._torch) if b is not None),
                            None)

    def _make_composed(self, group: Any) -> tuple[Any, Optional[str]]:
        """``(ComposedInternode, device type)`` for ``N x G`` groups with ``G > 1`` when ``DEEP_EP_INTERNODE``
        selects it, else ``(None, None)``.

        Stages: CUDA kernels (serving CUDA tensors; the group may be gloo or NCCL: the stages only exchange objects
        through it) when CUDA and the extension are available, ``num_nvl_bytes > 0``, ``DEEP_EP_BACKEND`` is not
        ``torch`` and each node's ranks share a host: the node stage a ``CudaBackend`` (CUDA IPC), the rail stage
        a ``TorchBackend`` beyond ``NUM_MAX_RING_RANKS`` (24) nodes or under ``DEEP_EP_COMPOSED_RAIL=torch``, else
        a ``CudaBackend`` when every rank is on one host, else a ``SymmetricCuda`` on the NVSHMEM heap
        (``num_rdma_bytes``; ``deep_ep.config.composed_rail``). Torch stages over the group's backend otherwise,
        used only under ``DEEP_EP_INTERNODE=composed``. Collective: every rank creates every subgroup
        (``make_stage_groups``)."""
        topo = self.topology
        choice = _internode_choice()
        if group is None or choice == "torch" or not topo.is_internode or topo.num_scaleup_ranks < 2:
            return None, None
        reason = None
        if _backend_choice() == "torch":
            reason = "DEEP_EP_BACKEND=torch"
        elif self.num_nvl_bytes <= 0:
            reason = "num_nvl_bytes is 0"
        backend_cls = rail_kind = None
        if reason is None:
            backend_cls, reason = _import_cuda("deep_ep.cuda_backend", "CudaBackend")
        if reason is None:
            import socket

            from deep_ep.torch_backend import object_all_gather
            hosts = object_all_gather(group)(socket.gethostname())
            rail_kind, reason = cuda_tuning.composed_rail(testing.current().composed_rail or "auto", hosts, topo,
                                                          self.num_rdma_bytes,
                                                          bool(getattr(importlib.import_module("deep_ep._C"),
                                                                       "HAS_LOW_LATENCY", False)))
        if reason is not None and choice == "auto":
            self._composed_refusal = reason
            return None, None
        from deep_ep.composed_internode import ComposedInternode, make_stage_groups
        from deep_ep.torch_backend import TorchBackend
        groups = make_stage_groups(group, topo)
        num_nodes, per_node = topo.num_scaleout_ranks, topo.num_scaleup_ranks
        rail = None
        if reason is None and rail_kind == "nvshmem":
            from deep_ep.cuda_internode import UnsupportedTopology
            try:
                rail = self._symmetric_rail(group, groups.rail)
            except UnsupportedTopology as exc:  # decided world-wide: every rank gets here together
                reason = f"the NVSHMEM rail stage: {exc}"
                if choice == "auto":
                    self._composed_refusal = reason
                    return None, None
        def torch_stage(stage_group: Any, stage_rank: int, size: int) -> Any:
            return TorchBackend(stage_group, stage_rank, size, Topology.one_domain(size), self.num_nvl_bytes, 0,
                                False)

        if reason is None:  # a CUDA node stage; the rail on the ring kernels unless it is a torch rail
            if rail_kind == "torch":
                rail = torch_stage(groups.rail, topo.node_of(self.rank), num_nodes)
            elif rail is None:
                rail = backend_cls.from_group(groups.rail, self.num_nvl_bytes)
            node = backend_cls.from_group(groups.node, self.num_nvl_bytes)
            cuda_stages, device = ("node",) if rail_kind == "torch" else ("rail", "node"), "cuda"
        else:
            rail = torch_stage(groups.rail, topo.node_of(self.rank), num_nodes)
            node = torch_stage(groups.node, topo.local_of(self.rank), per_node)
            cuda_stages, device = (), rail.device.type
        return ComposedInternode(rail, node, self.rank, topo, cuda_stages), device

    def _symmetric_rail(self, group: Any, rail_group: Any) -> Any:
        """The composed path's rail stage on the NVSHMEM symmetric heap of the Buffer's group (the NVSHMEM world:
        PE = group rank; rail rank ``n`` of local index ``l`` is PE ``n * G + l``). Collective over the group."""
        import torch.distributed as dist

        from deep_ep.cuda_internode import SymmetricCuda
        from deep_ep.cuda_low_latency import join_nvshmem_world
        from deep_ep.torch_backend import object_all_gather

        topo, world_gather = self.topology, object_all_gather(group)
        unique_id = join_nvshmem_world(self.rank, self.num_rdma_bytes, self.num_qps_per_rank, True, self.allow_mnnvl,
                                       world_gather)
        local = topo.local_of(self.rank)
        pes = [node * topo.num_scaleup_ranks + local for node in range(topo.num_scaleout_ranks)]
        return SymmetricCuda(topo.node_of(self.rank), topo.num_scaleout_ranks, self.num_rdma_bytes, unique_id,
                             self.rank, self.group_size, pes, object_all_gather(rail_group),
                             lambda: dist.barrier(group=rail_group), world_all_gather=world_gather)

    def _make_cuda_low_latency(self, group: Any, comm: Any) -> Any:
        """The CUDA low-latency backend (NVSHMEM) when ``low_latency_mode`` has an RDMA buffer, the extension has
        the LL kernels and ``DEEP_EP_BACKEND`` allows it; else ``None`` (the torch backend serves LL calls)."""
        choice = _backend_choice()
        if choice == "torch" or not (self.low_latency_mode and self.num_rdma_bytes > 0):
            return None
        backend_cls, reason = _import_cuda("deep_ep.cuda_low_latency", "LowLatencyCuda")
        if backend_cls is not None and not backend_cls.is_built():
            reason = "the CUDA extension was built without NVSHMEM (DEEP_EP_DISABLE_NVSHMEM)"
        if reason is not None:
            if choice == "cuda":
                raise RuntimeError(f"DEEP_EP_BACKEND=cuda but the CUDA low-latency kernels cannot be used: {reason}")
            return None
        # An internode group may allocate a second buffer of num_rdma_bytes on the symmetric heap after this one
        # (the CUDA internode backend, or the composed path's rail stage across hosts): the heap holds both.
        options = dict(num_rdma_bytes=self.num_rdma_bytes, num_qps_per_rank=self.num_qps_per_rank,
                       allow_nvlink=self.allow_nvlink_for_low_latency_mode, allow_mnnvl=self.allow_mnnvl,
                       enable_shrink=self.enable_shrink, symmetric_buffers=2 if self.topology.is_internode else 1)
        if group is not None:
            return backend_cls.from_group(group, **options)
        return backend_cls(self.rank, self.group_size, all_gather=comm.allgather, **options)

    def _make_cuda_backend(self, group: Any, comm: Any) -> Any:
        """The CUDA backend when it is built, requested and serves this topology; else ``None``."""
        choice = _backend_choice()
        if choice == "torch":
            return None
        if self.topology.is_internode:
            return self._make_cuda_internode(group, comm, choice)
        backend_cls, reason = _import_cuda("deep_ep.cuda_backend", "CudaBackend")
        if backend_cls is not None:
            if not backend_cls.is_supported(self.group_size, self.topology.num_scaleup_ranks):
                reason = f"the CUDA backend does not serve {self.group_size} ranks with this topology"
            elif self.num_nvl_bytes <= 0:
                reason = "num_nvl_bytes is 0"
                if self._cuda_ll is not None:  # a low-latency-only Buffer: the LL backend serves it
                    return None
        if reason is None:
            if group is not None:
                return backend_cls.from_group(group, self.num_nvl_bytes)
            return backend_cls(self.rank, self.group_size, self.num_nvl_bytes, comm.allgather, comm.Barrier)
        return _without_cuda(choice, group, "CUDA backend", reason)

    def _make_cuda_internode(self, group: Any, comm: Any, choice: str) -> Any:
        """The CUDA internode backend (one GPU per node, NVSHMEM) when it serves this group; else ``None``, or
        an error naming the reason under ``DEEP_EP_BACKEND=cuda`` or with ``comm=`` alone."""
        if choice == "auto" and self.topology.num_scaleup_ranks > 1 and _internode_choice() == "torch":
            return None  # asked for: DEEP_EP_INTERNODE=torch
        backend_cls, reason = _import_cuda("deep_ep.cuda_internode", "InternodeCuda")
        if backend_cls is not None:
            reason = backend_cls.unsupported_reason(self.topology, self.num_rdma_bytes)
        if self._composed_refusal is not None:  # G > 1: the composed path's reason is the one that matters
            reason = f"the composed path: {self._composed_refusal}"
        if reason is None:
            from deep_ep.cuda_internode import UnsupportedTopology
            options = dict(num_rdma_bytes=self.num_rdma_bytes, num_qps_per_rank=self.num_qps_per_rank,
                           allow_mnnvl=self.allow_mnnvl)
            try:
                if group is not None:
                    return backend_cls.from_group(group, **options)
                return backend_cls(self.rank, self.group_size, all_gather=comm.allgather, barrier=comm.Barrier,
                                   **options)
            except UnsupportedTopology as exc:  # collective: every rank gets here together
                reason = str(exc)
        if choice == "auto" and self._cuda_ll is not None and self.num_nvl_bytes <= 0:
            return None  # a low-latency Buffer (DeepEP's num_nvl_bytes=0 convention): the LL backend serves it
        return _without_cuda(choice, group, "CUDA internode backend", reason)

    # ------------------------------------------------------------------------------------------------------------
    # Lifetime
    # ------------------------------------------------------------------------------------------------------------
    def destroy(self) -> None:
        """Release the buffers (collective: every rank must call it). Requires ``explicitly_destroy=True``."""
        if not self.explicitly_destroy:
            raise ValueError("destroy() requires the Buffer to be built with explicitly_destroy=True, got "
                             "explicitly_destroy=False")
        self._release()

    def _release(self) -> None:
        if self._destroyed:
            raise RuntimeError(f"rank {self.rank}: this Buffer was already destroyed")
        if self._cuda is not None:
            self._cuda.destroy()
        if self._composed is not None:
            self._composed.destroy()
        if self._cuda_ll is not None:
            self._cuda_ll.destroy()
        if self._torch is not None:
            self._torch.destroy()
        self._destroyed = True
        self.runtime = None

    def __enter__(self) -> "Buffer":
        return self

    def __exit__(self, exc_type, exc_value, traceback) -> None:
        if not self._destroyed:
            self._release()

    def __del__(self) -> None:
        if getattr(self, "explicitly_destroy", False) and not getattr(self, "_destroyed", True):
            warnings.warn("deep_ep.Buffer was built with explicitly_destroy=True but destroy() was never called; "
                          "its resources leak until the process exits", ResourceWarning, stacklevel=2)

    def _alive(self) -> None:
        if self._destroyed:
            raise RuntimeError(f"rank {self.rank}: this Buffer was destroyed")

    def _backend(self, method: str, tensor: Optional[torch.Tensor]) -> Any:
        """The backend serving ``method`` for ``tensor``'s device (CUDA backend first, torch fallback)."""
        self._alive()
        if self._cuda_ll is not None and hasattr(self._cuda_ll, method) and (tensor is None or tensor.is_cuda):
            return self._cuda_ll
        if self._cuda is not None and tensor is not None and tensor.is_cuda and hasattr(self._cuda, method):
            return self._cuda
        if self._composed is not None and method in ("get_dispatch_layout", "dispatch", "combine") and \
                tensor is not None and tensor.device.type == self._composed_device:
            return self._composed
        if self._torch is None:
            raise RuntimeError(f"{method} needs the torch backend, which needs a torch.distributed group")
        return self._torch

    def _is_torch(self, backend: Any) -> bool:
        """True for the backends that rely on the front's data checks (expert range, counts vs routing)."""
        return backend is self._torch or (backend is not None and backend is self._composed)

    # ------------------------------------------------------------------------------------------------------------
    # Handles
    # ------------------------------------------------------------------------------------------------------------
    @staticmethod
    def _handle_key(handle: Any) -> torch.Tensor:
        if isinstance(handle, hd.InternodeHandle) or (isinstance(handle, tuple) and len(handle) == 10):
            return handle[6]
        return handle[0]

    def _register(self, handle: Any) -> Any:
        key = self._handle_key(handle)
        ident = id(key)
        self._handles[ident] = weakref.ref(key, lambda _ref, ident=ident: self._handles.pop(ident, None))
        return handle

    def _check_handle(self, handle: Any, kind: str) -> Any:
        """``handle`` must be one this Buffer returned: the right tuple type and length, with its tensors."""
        internode = self.topology.is_internode
        if kind == "low_latency":
            cls, length = hd.LowLatencyHandle, 5
        else:
            cls, length = (hd.InternodeHandle, 10) if internode else (hd.IntranodeHandle, 6)
        if not isinstance(handle, tuple) or len(handle) != length:
            got = f"a tuple of length {len(handle)}" if isinstance(handle, tuple) else type(handle).__name__
            raise TypeError(f"handle must be the {cls.__name__} ({length} fields) returned by this Buffer's "
                            f"{'low_latency_dispatch' if kind == 'low_latency' else 'dispatch'}, got {got}")
        key = self._handle_key(handle)
        ref = self._handles.get(id(key)) if isinstance(key, torch.Tensor) else None
        if ref is None or ref() is not key:
            raise ValueError(f"handle was not returned by this Buffer (rank {self.rank}); pass the handle of a "
                             "dispatch made with the same Buffer")
        return handle if type(handle) is cls else cls(*handle)

    # ------------------------------------------------------------------------------------------------------------
    # Static and utility methods
    # ------------------------------------------------------------------------------------------------------------
    @staticmethod
    def is_sm90_compiled() -> bool:
        """True: FP8, TMA-free fallbacks and the internode/low-latency paths are available (torch backend)."""
        try:
            from deep_ep import _C
        except ImportError:
            return True
        return bool(getattr(_C, "is_sm90_compiled", lambda: True)())

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Set the class-wide SM count used by the default configs; must be even."""
        Buffer.num_sms = v.check_even_num_sms("new_num_sms", new_num_sms)

    @staticmethod
    def capture() -> EventOverlap:
        """An event recorded on the current CUDA stream (a completed event without CUDA)."""
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            return EventOverlap(CudaEventHandle())
        return EventOverlap(COMPLETED)

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """Bytes of RDMA buffer the low-latency kernels need (``num_ranks`` is unused, as in DeepEP)."""
        v.check_int("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank, 1)
        v.check_int("hidden", hidden, 128)
        v.check_int("num_experts", num_experts, 1)
        return layout.low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """Tuned default dispatch config for ``num_ranks`` with ``Buffer.num_sms`` SMs."""
        return cfg.get_dispatch_config(num_ranks, Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """Tuned default combine config for ``num_ranks`` with ``Buffer.num_sms`` SMs."""
        return cfg.get_combine_config(num_ranks, Buffer.num_sms)

    def get_comm_stream(self) -> "torch.cuda.Stream":
        """The communication stream (CUDA only)."""
        self._alive()
        for backend in (self._cuda, self._composed, self._cuda_ll, self._torch):
            stream = backend.get_comm_stream() if backend is not None else None
            if stream is not None:
                return stream
        raise RuntimeError("get_comm_stream() has no meaning without CUDA: the torch backend runs on CPU "
                           "synchronously")

    def get_local_buffer_tensor(self, dtype: torch.dtype, size: Optional[torch.Size] = None, offset: int = 0,
                                use_rdma_buffer: bool = False) -> torch.Tensor:
        """A view of the local NVL (or RDMA) buffer starting at byte ``offset``.

        Returns a 1-D tensor of ``(num_bytes - offset) // itemsize`` elements, or its first ``size.numel()``
        elements reshaped to ``size``. (DeepEP does not subtract ``offset``; a real view cannot extend past the
        buffer, so this one does.)
        """
        self._alive()
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
        v.check_int("offset", offset, 0)
        v.check_bool("use_rdma_buffer", use_rdma_buffer)
        num_bytes = self.num_rdma_bytes if use_rdma_buffer else self.num_nvl_bytes
        if offset > num_bytes:
            raise ValueError(f"offset must be <= the buffer size ({num_bytes} bytes), got {offset}")
        if size is not None:
            if not isinstance(size, (torch.Size, tuple)):
                raise TypeError(f"size must be a torch.Size, got {type(size).__name__}")
            size = torch.Size(size)
            available = (num_bytes - offset) // torch.empty(0, dtype=dtype).element_size()
            if size.numel() > available:
                raise ValueError(f"size {tuple(size)} needs {size.numel()} elements of {dtype}, but the buffer has "
                                 f"{available} from offset {offset}")
        # The CUDA internode backend's buffer is the RDMA one; the intranode backend's the NVL one.
        cuda_buffer_is_rdma = self._cuda is not None and self.topology.is_internode
        backend = self._cuda if (self._cuda is not None and use_rdma_buffer == cuda_buffer_is_rdma) else self._torch
        return backend.get_local_buffer_tensor(dtype, size, offset, use_rdma_buffer)

    # ------------------------------------------------------------------------------------------------------------
    # Normal mode
    # ------------------------------------------------------------------------------------------------------------
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int,
                            previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                            allocate_on_comm_stream: bool = False) -> DispatchLayout:
        """Count tokens per rank, node and expert from the routing.

        Args:
            topk_idx: ``[N, K]`` ``topk_idx_t``, contiguous: global expert ids in ``[0, num_experts)`` or -1 (none).
            num_experts: ``E``, divisible by the group size.
            previous_event, async_finish, allocate_on_comm_stream: stream protocol (spec §6.2).
        Returns:
            ``DispatchLayout(num_tokens_per_rank [R] int32, num_tokens_per_rdma_rank [R_nodes] int32 or None,
            num_tokens_per_expert [E] int32, is_token_in_rank [N, R] bool, event)``.
        """
        topk_idx = v.check_topk_idx("topk_idx", topk_idx)
        v.check_num_experts(num_experts, self.group_size)
        v.check_stream_args(previous_event, async_finish, allocate_on_comm_stream)
        backend = self._backend("get_dispatch_layout", topk_idx)
        if self._is_torch(backend):
            v.check_expert_range("topk_idx", topk_idx, num_experts)
        return backend.get_dispatch_layout(topk_idx, num_experts, previous_event, async_finish,
                                           allocate_on_comm_stream)

    @staticmethod
    def _resolve_config(config: Optional[Config], kind: str, num_ranks: int) -> Config:
        """``config`` or the tuned default of ``kind`` ('dispatch' / 'combine'); its ``num_sms`` must be even."""
        if config is None:
            key = (kind, num_ranks, Buffer.num_sms)
            config = _DEFAULT_CONFIGS.get(key)
            if config is None:  # Config is frozen: a default once built is reused
                table = cfg.get_dispatch_config if kind == "dispatch" else cfg.get_combine_config
                config = _DEFAULT_CONFIGS[key] = table(num_ranks, Buffer.num_sms)
        if not isinstance(config, Config):
            raise TypeError(f"config must be a deep_ep.Config, got {type(config).__name__}")
        num_sms = config.num_sms
        if type(num_sms) is not int or num_sms < 2 or num_sms % 2:  # the common valid case without a call
            v.check_even_num_sms("config.num_sms", num_sms)
        return config

    def dispatch(self, x: Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]], handle: Optional[tuple] = None,
                 num_tokens_per_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
                 is_token_in_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_expert: Optional[torch.Tensor] = None, topk_idx: Optional[torch.Tensor] = None,
                 topk_weights: Optional[torch.Tensor] = None, expert_alignment: int = 1, num_worst_tokens: int = 0,
                 config: Optional[Config] = None, previous_event: Optional[EventOverlap] = None,
                 async_finish: bool = False, allocate_on_comm_stream: bool = False) -> DispatchResult:
        """Send every token to each rank that holds one of its experts (normal mode).

        Args:
            x: ``[N, H]`` (BF16, or any dtype with ``H * itemsize % 16 == 0``), contiguous; or a tuple
                ``(x_fp8 [N, H] float8_e4m3fn, x_scales [N, S] float32/int32 with any strides)``.
            handle: a handle from this Buffer's earlier ``dispatch`` for a cached dispatch (top-k must be ``None``,
                the layout tensors are ignored).
            num_tokens_per_rank: ``[R]`` int32; num_tokens_per_rdma_rank: ``[R_nodes]`` int32 (internode only);
                is_token_in_rank: ``[N, R]`` bool (decides the routing); num_tokens_per_expert: ``[E]`` int32.
            topk_idx: ``[N, K]`` ``topk_idx_t`` global expert ids or -1; topk_weights: ``[N, K]`` float32.
            expert_alignment: per-expert counts are rounded up to a multiple of it.
            num_worst_tokens: if > 0, outputs have exactly this many rows (needs top-k); the count list is ``[]``.
            config: ``deep_ep.Config``; ``None`` uses ``get_dispatch_config(R)``.
            previous_event, async_finish, allocate_on_comm_stream: stream protocol (spec §6.2).
        Returns:
            ``DispatchResult(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle,
            event)``: rows ordered by (source rank, source token); ``recv_topk_idx`` holds local expert ids or -1,
            ``recv_topk_weights`` is 0 where the id is -1. A cached dispatch returns
            ``(recv_x, None, None, None, None, event)``.
        """
        data, scales = v.split_dispatch_x(x)
        num_tokens = data.size(0)
        x = (data, scales) if scales is not None else data
        v.check_stream_args(previous_event, async_finish, allocate_on_comm_stream)
        config = self._resolve_config(config, "dispatch", self.group_size)
        v.check_int("expert_alignment", expert_alignment, 1)
        v.check_int("num_worst_tokens", num_worst_tokens, 0)
        backend = self._backend("dispatch", data)
        R = self.group_size

        if handle is not None:
            handle = self._check_handle(handle, "normal")
            if topk_idx is not None or topk_weights is not None:
                raise ValueError("a cached dispatch (handle given) takes no topk_idx/topk_weights, got "
                                 f"topk_idx={'a tensor' if topk_idx is not None else None}, "
                                 f"topk_weights={'a tensor' if topk_weights is not None else None}")
            if handle.is_token_in_rank.size(0) != num_tokens:
                raise ValueError(f"x must have the {handle.is_token_in_rank.size(0)} rows of the dispatch that made "
                                 f"the handle, got {num_tokens}")
            channels = handle[1].size(1)
            expected_channels = backend.num_channels(config) if hasattr(backend, "num_channels") else \
                config.num_channels
            if channels != expected_channels:
                raise ValueError(f"config.num_sms must match the dispatch that made the handle (a handle with "
                                 f"{channels} channels), got num_sms={config.num_sms}")
            result = backend.dispatch(x, handle, config=config, previous_event=previous_event,
                                      async_finish=async_finish, allocate_on_comm_stream=allocate_on_comm_stream)
            return result

        if is_token_in_rank is None or num_tokens_per_rank is None or num_tokens_per_expert is None:
            missing = [n for n, t in (("num_tokens_per_rank", num_tokens_per_rank),
                                      ("is_token_in_rank", is_token_in_rank),
                                      ("num_tokens_per_expert", num_tokens_per_expert)) if t is None]
            raise ValueError(f"a non-cached dispatch needs the layout tensors from get_dispatch_layout; missing: "
                             f"{', '.join(missing)}")
        device = data.device
        v.check_tensor("num_tokens_per_rank", num_tokens_per_rank, dtype=torch.int32, shape=(R,), device=device)
        v.check_tensor("is_token_in_rank", is_token_in_rank, dtype=torch.bool, shape=(num_tokens, R), device=device)
        v.check_tensor("num_tokens_per_expert", num_tokens_per_expert, dtype=torch.int32, ndim=1, device=device)
        num_experts = num_tokens_per_expert.numel()
        v.check_num_experts(num_experts, R, name="num_tokens_per_expert.numel() (num_experts)")
        if self.topology.is_internode:
            if num_tokens_per_rdma_rank is None:
                raise ValueError("num_tokens_per_rdma_rank is required for an internode dispatch, got None")
            v.check_tensor("num_tokens_per_rdma_rank", num_tokens_per_rdma_rank, dtype=torch.int32,
                           shape=(self.topology.num_scaleout_ranks,), device=device)
        topk_idx, topk_weights = v.check_topk_pair(topk_idx, topk_weights, num_tokens, device)
        if num_worst_tokens > 0 and topk_idx is None:
            raise ValueError(f"num_worst_tokens > 0 requires topk_idx and topk_weights, got num_worst_tokens="
                             f"{num_worst_tokens} without top-k")
        if self._is_torch(backend):
            if topk_idx is not None:
                v.check_expert_range("topk_idx", topk_idx, num_experts)
            actual = is_token_in_rank.sum(0, dtype=torch.int32)
            if not torch.equal(actual, num_tokens_per_rank):
                raise ValueError(f"num_tokens_per_rank must equal is_token_in_rank.sum(0) (the routing), got "
                                 f"{num_tokens_per_rank.tolist()} vs {actual.tolist()}")
        result = backend.dispatch(x, None, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                                  num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, num_worst_tokens,
                                  config, previous_event, async_finish, allocate_on_comm_stream)
        self._register(result.handle)
        return result

    def combine(self, x: torch.Tensor, handle: tuple, topk_weights: Optional[torch.Tensor] = None,
                bias: Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor], None] = None,
                config: Optional[Config] = None, previous_event: Optional[EventOverlap] = None,
                async_finish: bool = False, allocate_on_comm_stream: bool = False) -> CombineResult:
        """Reverse of ``dispatch``: sum every token's rows from the ranks that hold it (no top-k weighting).

        Args:
            x: ``[M, H]`` BF16, contiguous, rows aligned with the dispatch's ``recv_x``.
            handle: the dispatch's handle (from this Buffer).
            topk_weights: optional ``[M, K]`` float32, summed the same way.
            bias: ``None``, a tensor or a 2-tuple of tensors, each ``[N, H]`` BF16, added once per token.
            config: ``None`` uses ``get_combine_config(R)``.
        Returns:
            ``CombineResult(combined_x [N, H] BF16, combined_topk_weights [N, K] float32 or None, event)``.
        """
        v.check_tensor("x", x, dtype=torch.bfloat16, ndim=2)
        handle = self._check_handle(handle, "normal")
        num_rows = handle.recv_src_meta.size(0) if self.topology.is_internode else handle.recv_src_idx.size(0)
        if x.size(0) != num_rows:
            raise ValueError(f"x must have the {num_rows} rows of the dispatch's recv_x, got {x.size(0)}")
        if topk_weights is not None:
            v.check_tensor("topk_weights", topk_weights, dtype=torch.float32, shape=(num_rows, None),
                           device=x.device)
        if bias is not None:
            v.split_bias(bias, handle.is_token_in_rank.size(0), x.size(1), x.dtype, x.device)
        v.check_stream_args(previous_event, async_finish, allocate_on_comm_stream)
        config = self._resolve_config(config, "combine", self.group_size)
        backend = self._backend("combine", x)
        return backend.combine(x, handle, topk_weights, bias, config, previous_event, async_finish,
                               allocate_on_comm_stream)

    # ------------------------------------------------------------------------------------------------------------
    # Low-latency mode
    # ------------------------------------------------------------------------------------------------------------
    def _check_low_latency(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> int:
        """Shared low-latency checks; returns local experts per rank. A (T, H, E) of plain ints that passed once is
        remembered (the checks depend on nothing else that can change)."""
        if not self.low_latency_mode:
            raise ValueError("low-latency calls need a Buffer built with low_latency_mode=True, got "
                             "low_latency_mode=False")
        key = (num_max_dispatch_tokens_per_rank, hidden, num_experts)
        if type(num_max_dispatch_tokens_per_rank) is int and type(hidden) is int and type(num_experts) is int:
            num_local = self._ll_checked.get(key)
            if num_local is not None:
                return num_local
        v.check_int("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank, 1, v.LL_MAX_TOKENS)
        if (self.group_size * num_max_dispatch_tokens_per_rank) % 4 != 0:
            raise ValueError(f"num_ranks * num_max_dispatch_tokens_per_rank must be a multiple of 4, got "
                             f"{self.group_size} * {num_max_dispatch_tokens_per_rank}")
        num_local = v.check_num_experts(num_experts, self.group_size)
        need = layout.low_latency_layout(num_max_dispatch_tokens_per_rank, hidden, num_experts).total_bytes
        if need > self.num_rdma_bytes:
            raise ValueError(f"num_rdma_bytes ({self.num_rdma_bytes}) is too small: num_max_dispatch_tokens_per_rank="
                             f"{num_max_dispatch_tokens_per_rank}, hidden={hidden}, num_experts={num_experts} need "
                             f"{need} bytes (see Buffer.get_low_latency_rdma_size_hint)")
        if type(num_max_dispatch_tokens_per_rank) is int and type(hidden) is int and type(num_experts) is int:
            self._ll_checked[key] = num_local
        return num_local

    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                             dispatch_wait_recv_cost_stats: Optional[torch.Tensor] = None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False) -> LowLatencyDispatchResult:
        """Send every token once per selected expert to the expert's rank; pack the rows per local expert.

        Args:
            x: ``[N, H]`` BF16, contiguous, ``N <= num_max_dispatch_tokens_per_rank`` (``T <= 1024``), H a multiple
                of 128 in [1024, 16384] (of 512 with ``use_ue8m0``).
            topk_idx: ``[N, K]`` ``topk_idx_t``, ``K <= 16``: global expert ids or -1.
            num_max_dispatch_tokens_per_rank: ``T``, the same on every rank.
            num_experts: ``E``, divisible by the group size.
            cumulative_local_expert_recv_stats: optional ``[L]`` int32; the received count per local expert is added.
            dispatch_wait_recv_cost_stats: optional ``[R]`` int64; time waited per source rank (ns) is added.
            use_fp8, round_scale, use_ue8m0: FP8 cast of the payload (``use_ue8m0`` requires ``round_scale``).
            async_finish / return_recv_hook: mutually exclusive; with the hook, ``hook()`` completes the receive.
        Returns:
            ``LowLatencyDispatchResult(recv_x, packed_recv_count [L] int32, handle, event, hook)``; ``recv_x`` is
            ``[L, R*T, H]`` BF16 or ``(fp8 [L, R*T, H], scales)`` with column-major scales ``[L, R*T, H/128]``
            float32 (``[L, R*T, H/512]`` int32 with UE8M0).
        """
        v.check_tensor("x", x, dtype=torch.bfloat16, ndim=2)
        num_tokens, hidden = x.shape
        num_local = self._check_low_latency(num_max_dispatch_tokens_per_rank, hidden, num_experts)
        if not (type(use_fp8) is bool and type(round_scale) is bool and type(use_ue8m0) is bool
                and type(async_finish) is bool and type(return_recv_hook) is bool):
            for name, value in (("use_fp8", use_fp8), ("round_scale", round_scale), ("use_ue8m0", use_ue8m0),
                                ("async_finish", async_finish), ("return_recv_hook", return_recv_hook)):
                v.check_bool(name, value)
        v.check_ll_hidden(hidden, use_fp8, use_ue8m0)
        v.check_ll_tokens("x", num_tokens, num_max_dispatch_tokens_per_rank)
        topk_idx = v.check_topk_idx("topk_idx", topk_idx, num_tokens=num_tokens, device=x.device)
        v.check_ll_topk("topk_idx", topk_idx.size(1))
        if use_ue8m0 and not round_scale:
            raise ValueError("use_ue8m0=True requires round_scale=True, got round_scale=False")
        if async_finish and return_recv_hook:
            raise ValueError("async_finish and return_recv_hook are mutually exclusive, got both True")
        if cumulative_local_expert_recv_stats is not None:
            v.check_tensor("cumulative_local_expert_recv_stats", cumulative_local_expert_recv_stats,
                           dtype=torch.int32, shape=(num_local,), device=x.device)
        if dispatch_wait_recv_cost_stats is not None:
            v.check_tensor("dispatch_wait_recv_cost_stats", dispatch_wait_recv_cost_stats, dtype=torch.int64,
                           shape=(self.group_size,), device=x.device)
        backend = self._backend("low_latency_dispatch", x)
        if backend is self._torch:
            v.check_expert_range("topk_idx", topk_idx, num_experts)
            valid = topk_idx[topk_idx >= 0].to(torch.int64)
            if valid.numel():
                most = int(torch.bincount(valid, minlength=num_experts).max())
                if most > num_max_dispatch_tokens_per_rank:
                    raise ValueError(f"topk_idx selects one expert {most} times (duplicate entries), more than "
                                     f"num_max_dispatch_tokens_per_rank={num_max_dispatch_tokens_per_rank}")
        result = backend.low_latency_dispatch(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                                              cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats,
                                              use_fp8, round_scale, use_ue8m0, async_finish, return_recv_hook)
        self._register(result.handle)
        return result

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                            handle: tuple, use_logfmt: bool = False, zero_copy: bool = False,
                            async_finish: bool = False, return_recv_hook: bool = False,
                            out: Optional[torch.Tensor] = None,
                            combine_wait_recv_cost_stats: Optional[torch.Tensor] = None) -> LowLatencyCombineResult:
        """Return the expert outputs to the token owners and reduce them with the top-k weights.

        The sum runs in fp32 with one BF16 rounding, in ascending k; on the CUDA kernels with the opt-in combine by
        partial sums (``DEEP_EP_LL_PARTIALS``, docs/low_latency.md), per expert rank first (ascending k), then over
        ranks in ascending order.

        Args:
            x: ``[L, R*T, H]`` BF16, contiguous: expert outputs in the dispatch's packed layout.
            topk_idx: ``[N, K]`` ``topk_idx_t`` and topk_weights ``[N, K]`` float32: the routing of the matching
                dispatch on this rank.
            handle: the matching ``low_latency_dispatch`` handle (from this Buffer).
            use_logfmt: send the payload in LogFMT-10 (lossy); not with ``zero_copy``.
            zero_copy: the outputs were already written to ``get_next_low_latency_combine_buffer(handle)``.
            out: optional ``[N, H]`` BF16 contiguous output.
            combine_wait_recv_cost_stats: optional ``[R]`` int64; time waited per source rank (ns) is added.
        Returns:
            ``LowLatencyCombineResult(combined_x [N, H] BF16, event, hook)``.
        """
        handle = self._check_handle(handle, "low_latency")
        tokens, hidden, num_experts = handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts
        num_local = self._check_low_latency(tokens, hidden, num_experts)
        v.check_tensor("x", x, dtype=torch.bfloat16, shape=(num_local, self.group_size * tokens, hidden))
        device = x.device
        topk_idx = v.check_topk_idx("topk_idx", topk_idx, device=device)
        num_tokens = topk_idx.size(0)
        v.check_ll_tokens("topk_idx", num_tokens, tokens)
        v.check_ll_topk("topk_idx", topk_idx.size(1))
        v.check_tensor("topk_weights", topk_weights, dtype=torch.float32, shape=(num_tokens, topk_idx.size(1)),
                       device=device)
        if not (type(use_logfmt) is bool and type(zero_copy) is bool and type(async_finish) is bool
                and type(return_recv_hook) is bool):
            for name, value in (("use_logfmt", use_logfmt), ("zero_copy", zero_copy),
                                ("async_finish", async_finish), ("return_recv_hook", return_recv_hook)):
                v.check_bool(name, value)
        if zero_copy and use_logfmt:
            raise ValueError("zero_copy and use_logfmt are mutually exclusive, got both True")
        if async_finish and return_recv_hook:
            raise ValueError("async_finish and return_recv_hook are mutually exclusive, got both True")
        if out is not None:
            v.check_tensor("out", out, dtype=torch.bfloat16, shape=(num_tokens, hidden), device=device)
        if combine_wait_recv_cost_stats is not None:
            v.check_tensor("combine_wait_recv_cost_stats", combine_wait_recv_cost_stats, dtype=torch.int64,
                           shape=(self.group_size,), device=device)
        backend = self._backend("low_latency_combine", x)
        if backend is self._torch:
            v.check_expert_range("topk_idx", topk_idx, num_experts)
        return backend.low_latency_combine(x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, async_finish,
                                           return_recv_hook, out, combine_wait_recv_cost_stats)

    def get_next_low_latency_combine_buffer(self, handle: tuple) -> torch.Tensor:
        """BF16 ``[L, R*T, H]`` view (row stride ``H + H/64``) of the send area the next combine will read with
        ``zero_copy=True``. Valid until another low-latency call is made."""
        handle = self._check_handle(handle, "low_latency")
        self._check_low_latency(handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts)
        backend = self._backend("get_next_low_latency_combine_buffer", handle.packed_recv_src_info)
        return backend.get_next_low_latency_combine_buffer(handle)

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Collective: zero both halves' signal areas (needed after normal kernels used the buffer)."""
        v.check_int("hidden", hidden, 128)
        self._check_low_latency(num_max_dispatch_tokens_per_rank, hidden, num_experts)
        self._backend("clean_low_latency_buffer", None).clean_low_latency_buffer(
            num_max_dispatch_tokens_per_rank, hidden, num_experts)

    def _check_shrink(self) -> Any:
        if not self.enable_shrink:
            raise ValueError("Shrink mode must be enabled: build the Buffer with enable_shrink=True, got "
                             "enable_shrink=False")
        return self._backend("low_latency_update_mask_buffer", None)

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Set (``mask=True``) or clear the mask bit of ``rank_to_mask``; masked ranks are skipped."""
        backend = self._check_shrink()
        v.check_int("rank_to_mask", rank_to_mask, 0, self.group_size - 1)
        v.check_bool("mask", mask)
        backend.low_latency_update_mask_buffer(rank_to_mask, mask)

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """Copy the mask (1 = masked) into ``mask_status`` (``[R]`` int32)."""
        backend = self._check_shrink()
        v.check_tensor("mask_status", mask_status, dtype=torch.int32, shape=(self.group_size,))
        backend.low_latency_query_mask_buffer(mask_status)

    def low_latency_clean_mask_buffer(self) -> None:
        """Clear every mask bit."""
        self._check_shrink().low_latency_clean_mask_buffer()

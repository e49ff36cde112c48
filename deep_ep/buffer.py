"""``deep_ep.Buffer``: DeepEP V1's public API (same constructor, method names, keywords and result positions).

This module is the validating front. It checks every argument (``deep_ep.validate``: ``TypeError``/``ValueError``
naming the argument, the rule and the value), resolves defaults and configs, and hands each call, as one request
(``deep_ep.backends.base``), to the backend that a table built at construction names for the call's mode and
device (``deep_ep.backends.selection``): the CUDA kernels for CUDA tensors where they serve the group, the composed
path for ``N`` nodes x ``G > 1`` GPUs beyond them, else the torch backend (``torch.distributed``: gloo on CPU, NCCL on
GPU). Backends return the NamedTuples of ``deep_ep.results``. Where the torch backend serves a collective call, the
ranks first check that they agree on its arguments (``deep_ep.backends.agreement``); a non-cached dispatch of the CUDA
kernels checks it in their notify kernel. The Buffer also owns the receives of
low-latency hooks (a dropped hook's receive runs at the next call) and counts low-latency calls to refuse reuse of a
buffer half still in use.
"""
from __future__ import annotations

import contextlib
import warnings
import weakref
from typing import Any, Optional, Sequence, Union

import torch

from deep_ep import config as cfg
from deep_ep import envs, layout
from deep_ep import handle as hd
from deep_ep import validate as v
from deep_ep.backends import selection
from deep_ep.backends.agreement import Signature, refused_argument
from deep_ep.backends.base import (
    Backend,
    CombineRequest,
    DispatchRequest,
    LayoutRequest,
    LowLatencyCombineRequest,
    LowLatencyDispatchRequest,
)
from deep_ep.backends.common import PendingReceive, ReceiveHook
from deep_ep.config import Config, Topology
from deep_ep.errors import ArgumentMismatchError, LowLatencyMisuseError
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
# Handle numbers after the n-th clean_low_latency_buffer start at n times this: the ranks may have made different
# numbers of calls before a clean (after a disagreement), and agree on their handles again after it; no handle made
# after a clean has the number of one made before.
_HANDLES_PER_CLEAN = 10 ** 12
# (kind, num_ranks, num_sms) -> the tuned default Config (see Buffer._resolve_config).
_DEFAULT_CONFIGS: dict[tuple[str, int, int], Config] = {}


def _device_type(tensor: torch.Tensor) -> str:
    """The device type a call is routed by."""
    return "cuda" if tensor.is_cuda else tensor.device.type


# The device type of a call whose tensors were refused before their device was known.
_UNKNOWN_DEVICE = "?"


class _Agreement:
    """The agreement step of one collective call (``deep_ep.backends.agreement``), as a context manager around
    its validation: :meth:`agree` exchanges the call's signature; a ``TypeError``/``ValueError`` raised in the block
    before that sends a refusal in its place, so that the peers raise at once instead of waiting."""

    __slots__ = ("buffer", "method", "mode", "device", "backend", "rides", "signature", "done", "cached", "ll_shape",
                 "handle", "config")

    def __init__(self, buffer: "Buffer", method: str, mode: str, cached: bool = False) -> None:
        self.buffer, self.method, self.mode, self.cached = buffer, method, mode, cached
        self.device: Optional[str] = _UNKNOWN_DEVICE
        self.backend: Optional[Backend] = None  # the backend serving the call, once chosen
        # rides: the torch backend's count exchange of the call carries the signature (``signature``, for the
        # request) instead of an exchange of its own.
        self.rides = False
        self.signature: Optional[Signature] = None
        self.done = False
        # A low-latency dispatch's (T, H, E) once validated, and x's device: a refusal after that launches the call's
        # kernel.
        self.ll_shape: Optional[tuple[int, int, int, torch.device]] = None
        # A combine's or cached dispatch's handle, once checked (a refusal before that launches the call's kernel over
        # a stand-in handle of no tokens), and a dispatch's config, once resolved (the stand-in's channels).
        self.handle: Any = None
        self.config: Optional[Config] = None

    def __enter__(self) -> "_Agreement":
        return self

    def _exchange(self, fields: Sequence[tuple[str, Any]], refused: Optional[str] = None) -> None:
        self.done = True
        torch_backend = self.buffer._agreeing(self.mode, self.device, self.backend, self.method)
        if torch_backend is None:
            # The CUDA kernels: a non-cached dispatch carries the signature in its notify kernel (a refusal launches
            # that notify with zero counts), a cached dispatch its hash in its kernel's output or agreement words and
            # a combine in its kernel's agreement words (a refusal launches that kernel, over a stand-in handle of no
            # tokens when its own is not valid), a low-latency
            # dispatch its hash in its count messages (a refusal launches it with no tokens, once (T, H, E) are
            # valid), a low-latency combine in its arrival words (a refusal tells every peer, once the handle is
            # valid); other calls (a clean goes through the torch backend, above), and a single rank, exchange
            # nothing.
            kernels = self.buffer._kernel_agreeing(self.method, self.device, self.backend, self.cached)
            if kernels is not None:
                signature = Signature(self.method, fields, refused)
                if refused is None:
                    self.signature = signature
                elif self.method == "combine":
                    kernels.refuse_combine(signature, self.handle)
                elif kernels.notify_agreement and not self.cached:
                    kernels.refuse_dispatch(signature)
                elif self.cached:
                    config = self.config or self.buffer._resolve_config(None, "dispatch", self.buffer.group_size)
                    kernels.refuse_cached_dispatch(signature, self.handle, kernels.num_channels(config))
                elif kernels.hashes_signature and self.ll_shape is not None:
                    if self.method == "low_latency_combine":
                        kernels.refuse_low_latency_combine(signature, *self.ll_shape)
                        self.buffer._ll_generation += 1  # the peers' combine counted the call and its buffer half
                    else:
                        kernels.refuse_low_latency_dispatch(signature, *self.ll_shape)
                        self.buffer._count_refused_low_latency_dispatch()
            return
        signature = Signature(self.method, fields, refused)
        if self.rides and refused is None:
            self.signature = signature
        else:
            # Low-latency calls exchange point to point with the active ranks; outside shrink mode a clean, and a
            # low-latency call on the kernels before the buffer has a carving, make one all-gather instead (a
            # kernel-served group may never have connected its ranks pairwise through the process group). In shrink
            # mode the exchange skips the ranks that the serving kernels' mask skips.
            handshake = self.buffer._ll_carving_handshake(self.method, self.device, self.backend)
            shrink = self.buffer.enable_shrink
            point_to_point = self.mode == "low_latency" and (
                shrink or (not handshake and self.method != "clean_low_latency_buffer"))
            ranks = self.buffer._kernel_active_ranks(self.device, self.backend) if point_to_point and shrink else None
            torch_backend.agree(signature, f"{self.method} agreement", point_to_point, ranks=ranks)
            if handshake and refused is None:
                self.signature = signature  # the kernels carry its hash too

    def agree(self, *fields: tuple[str, Any]) -> None:
        self._exchange(fields)

    def __exit__(self, exc_type: Any, exc: Optional[BaseException], traceback: Any) -> None:
        if isinstance(exc, (TypeError, ValueError, LowLatencyMisuseError)) and not self.done:
            # If the ranks also made different calls, this rank's own error says more.
            with contextlib.suppress(ArgumentMismatchError):
                self._exchange((), refused_argument(exc))


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
        envs.TIMEOUT_S.get()  # every wait's bound: a finite number > 0, else a ValueError naming the variable
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
        # The owner of every handle this Buffer returns (see _check_handle).
        self._handle_owner = object()
        # The next handle's serial number, and the clean_low_latency_buffer calls so far (_HANDLES_PER_CLEAN).
        self._num_handles = 0
        self._ll_cleans = 0
        # Low-latency calls made so far (the double buffer's generation), the receive hooks not yet run (a weak
        # reference to each hook and its receive), and the generation at which the zero-copy combine buffer was
        # last handed out (-1: never).
        self._ll_generation = 0
        self._ll_receives: list[tuple[weakref.ref, PendingReceive]] = []
        self._zero_copy_generation = -1
        # The one-time warning that the torch backend serves a low-latency hidden size the kernels do not.
        self._ll_fallback_warned = False
        # The kernel backend and (T, H, E, device) of the last clean or low-latency call the kernels ran: the
        # buffer's carving, which every call on the kernels keeps until the next clean; a refusal before a call's own
        # (T, H, E) pass launches the call over these. None until then: the first call agrees through the torch
        # backend (_ll_carving_handshake).
        self._ll_last: Optional[tuple[Backend, tuple[int, int, int, torch.device]]] = None
        # (T, H, E) of plain ints that passed _check_low_latency -> local experts per rank.
        self._ll_checked: dict[tuple[int, int, int], int] = {}

        spec = selection.BufferSpec(rank, group_size, self.topology, num_nvl_bytes, num_rdma_bytes, low_latency_mode,
                                    num_qps_per_rank, allow_nvlink_for_low_latency_mode, allow_mnnvl, enable_shrink)
        backends = selection.build_backends(spec, group, comm)
        # The backends by role (None: not built) and the device type of the tensors the composed path serves.
        self._torch, self._cuda, self._cuda_ll, self._composed, self._composed_device = backends
        self._backends: tuple[Backend, ...] = tuple(b for b in (self._cuda, self._composed, self._cuda_ll,
                                                                self._torch) if b is not None)
        # The backend that serves each (mode, device type): see deep_ep.backends.selection.routes.
        self._routes = selection.routes(backends, self.topology)
        # The main backend (the CUDA one when built).
        self.runtime: Optional[Backend] = self._backends[0] if self._backends else None

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
        for backend in self._backends:
            backend.destroy()
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

    def _backend(self, method: str, mode: str, device: Optional[str]) -> Backend:
        """The backend that serves ``method`` of ``mode`` for tensors of ``device`` type (the routing table)."""
        self._alive()
        backend = self._routes.get((mode, device), self._torch)
        if backend is None:
            raise RuntimeError(f"{method} needs the torch backend, which needs a torch.distributed group")
        return backend

    def _agreeing(self, mode: str, device: Optional[str], backend: Optional[Backend] = None,
                  method: Optional[str] = None) -> Optional[Backend]:
        """The torch backend when a call of ``mode`` served by ``backend`` (``None``: the route of ``device``)
        checks its agreement through it, else ``None``: a multi-rank group served by the torch backend, or by the
        composed path (its stages run on subgroups, so the whole group exchanges the signature first, whatever
        stage runs on the kernels), ``clean_low_latency_buffer`` (``method``) whatever serves it (the kernels
        carry no signature for a clean, which is rare and moves no rows), and a low-latency call on the kernels
        before the buffer has a carving (:meth:`_ll_carving_handshake`). An unknown device agrees only if every
        device type's route does."""
        if self.group_size == 1 or self._torch is None or self._destroyed:
            return None
        if method == "clean_low_latency_buffer":
            return self._torch
        if self._ll_carving_handshake(method, device, backend):
            return self._torch
        if backend is not None:
            candidates = [backend]
        else:
            devices = ("cpu", "cuda") if device == _UNKNOWN_DEVICE else (device,)
            candidates = [self._routes.get((mode, d), self._torch) for d in devices]
        for candidate in candidates:
            if candidate is not self._torch and candidate is not self._composed:
                return None
        return self._torch

    def _ll_carving_handshake(self, method: Optional[str], device: Optional[str],
                              backend: Optional[Backend]) -> bool:
        """Whether a low-latency dispatch or combine agrees through the torch backend (one all-gather; in shrink mode
        point to point with the ranks the kernels' mask leaves active, :meth:`_kernel_active_ranks`) instead of its
        kernels' count messages: the first call on the kernels since the Buffer was built, while the buffer has no
        carving (``_ll_last``; a clean sets one). Ranks whose (T, H, E) differ would carve the buffer differently,
        so their count words would miss each other. Not under CUDA-graph capture, not without a torch.distributed
        group."""
        if method not in ("low_latency_dispatch", "low_latency_combine") or self._ll_last is not None:
            return False
        if self._torch is None or self.group_size == 1 or self._destroyed:
            return False
        backend = self._ll_route(device, backend)
        return (backend is not None and backend.hashes_signature
                and not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()))

    def _ll_route(self, device: Optional[str], backend: Optional[Backend]) -> Optional[Backend]:
        """``backend`` when the call has chosen one, else the low-latency route of ``device`` (CUDA when unknown)."""
        if backend is not None:
            return backend
        return self._routes.get(("low_latency", "cuda" if device in (None, _UNKNOWN_DEVICE) else device))

    def _kernel_active_ranks(self, device: Optional[str], backend: Optional[Backend]) -> Optional[list[int]]:
        """The ranks a shrink-mode low-latency agreement of the torch backend exchanges with when kernels serve the
        call (``backend``, else the low-latency route of ``device``): those their mask leaves active, this rank
        included (one host sync; the call is a clean or a first call). ``None`` when the torch backend serves the
        call (it keeps its own mask)."""
        backend = self._ll_route(device, backend)
        if backend is None or backend is self._torch:
            return None
        mask = torch.zeros(self.group_size, dtype=torch.int32, device="cpu")
        backend.low_latency_query_mask_buffer(mask)
        return [r for r in range(self.group_size) if r == self.rank or int(mask[r]) == 0]

    def _kernel_agreeing(self, method: str, device: Optional[str], backend: Optional[Backend],
                         cached: bool) -> Optional[Backend]:
        """The CUDA backend whose kernels carry the agreement of the call: the notify kernel of a non-cached
        ``dispatch`` (``backend``, or the CUDA route when the device is unknown), the output words of a cached one,
        the agreement words of a ``combine``, the count messages of a ``low_latency_dispatch``; else ``None``."""
        if self.group_size == 1 or self._destroyed:
            return None
        if method in ("low_latency_dispatch", "low_latency_combine"):
            return backend if backend is not None and backend.hashes_signature else None
        if method not in ("dispatch", "combine"):
            return None
        if backend is None and device == _UNKNOWN_DEVICE:
            backend = self._routes.get(("normal", "cuda"))
        if method == "combine":
            return backend if backend is not None and backend.combine_agreement else None
        if cached:
            return backend if backend is not None and backend.handle_agreement else None
        return backend if backend is not None and backend.notify_agreement else None

    def _ll_backend(self, method: str, device: Optional[str], hidden: int, use_fp8: bool = False,
                    use_ue8m0: bool = False) -> Backend:
        """The backend of a low-latency call of ``hidden`` channels: the route of ``device``, or the torch backend
        when the CUDA kernels do not serve ``hidden`` (with a one-time ``RuntimeWarning``; an error under
        ``DEEP_EP_BACKEND=cuda``)."""
        backend = self._backend(method, "low_latency", device)
        if backend is not self._torch:
            reason = v.ll_kernel_hidden_refusal(hidden, use_fp8, use_ue8m0)
            if reason is None:
                return backend
            if self._torch is None or selection.backend_choice() == "cuda":
                raise ValueError(reason)
            backend = self._torch
            if not self._ll_fallback_warned:
                self._ll_fallback_warned = True
                warnings.warn(f"deep_ep.Buffer: the torch backend (torch.distributed) carries the low-latency calls of "
                              f"hidden={hidden}: {reason}; correct, not fast", RuntimeWarning, stacklevel=3)
        v.check_ll_hidden(hidden, use_fp8, use_ue8m0)
        return backend

    def _settle_receives(self) -> None:
        """Run the receive of every low-latency hook that was dropped uncalled (its result garbage-collected), so
        that its messages are consumed and no rank waits for them; forget the hooks that ran."""
        pending = []
        for hook, receive in self._ll_receives:
            if receive.done:
                continue
            if hook() is None:
                receive.run()
            else:
                pending.append((hook, receive))
        self._ll_receives = pending

    def _check_in_flight(self, method: str) -> None:
        """A low-latency call reuses the buffer half of the call two before: that call's hook must have run."""
        for _, receive in self._ll_receives:
            if not receive.done and receive.generation <= self._ll_generation - 2:
                raise LowLatencyMisuseError(
                    f"{method} would be a third low-latency call in flight: the receive hook of low-latency call "
                    f"#{receive.generation} (this is call #{self._ll_generation}) has not been called, and this call "
                    "reuses its buffer half; call that hook first (at most two low-latency calls may be in flight)")

    def _check_ll_carving(self, method: str, backend: Backend, tokens: int, hidden: int, num_experts: int) -> None:
        """The kernels carve the low-latency buffer by (T, H, E): a call on them takes those of the Buffer's
        low-latency calls since the last ``clean_low_latency_buffer`` (``_ll_last``), else ValueError (a refusal, so
        that the peers, still on that carving, raise at once)."""
        if not backend.hashes_signature or self._ll_last is None:
            return
        carving = self._ll_last[1][:3]
        if carving != (tokens, hidden, num_experts):
            raise ValueError(
                f"{method}: (num_max_dispatch_tokens_per_rank, hidden, num_experts) must stay {carving} (the "
                f"low-latency buffer's carving) until clean_low_latency_buffer, got {(tokens, hidden, num_experts)}; "
                f"call clean_low_latency_buffer({tokens}, {hidden}, {num_experts}) on every rank first")

    def _remember_ll_shape(self, backend: Backend, shape: tuple[int, int, int, torch.device]) -> None:
        """Keep ``shape`` (T, H, E, device) of a clean or low-latency call that ``backend`` ran, if it carries the
        agreement in its kernels (``Buffer._ll_last``: the buffer's carving)."""
        if backend.hashes_signature:
            self._ll_last = (backend, shape)

    def _count_refused_low_latency_dispatch(self) -> None:
        """This rank refused a low-latency dispatch whose kernel still ran with the peers' (they got a handle and
        counted a call): count the handle number and the call too, so that later handles and buffer halves match."""
        self._num_handles += 1
        self._ll_generation += 1

    def _track_receive(self, hook: Optional[ReceiveHook]) -> None:
        """Count a low-latency call; keep its hook's receive until it runs."""
        if hook is not None:
            hook.pending.generation = self._ll_generation
            self._ll_receives.append((weakref.ref(hook), hook.pending))
        self._ll_generation += 1

    # ------------------------------------------------------------------------------------------------------------
    # Handles
    # ------------------------------------------------------------------------------------------------------------
    def _register(self, handle: hd.HandleState) -> None:
        handle.owner = self._handle_owner
        handle.serial = self._num_handles
        self._num_handles += 1

    def _check_handle(self, handle: Any, kind: str) -> Any:
        """``handle`` must be one this Buffer returned (its ``owner``), of the right type and length."""
        internode = self.topology.is_internode
        if kind == "low_latency":
            cls, length = hd.LowLatencyHandle, 5
        else:
            cls, length = (hd.InternodeHandle, 10) if internode else (hd.IntranodeHandle, 6)
        if not isinstance(handle, tuple) or len(handle) != length:
            got = f"a tuple of length {len(handle)}" if isinstance(handle, tuple) else type(handle).__name__
            raise TypeError(f"handle must be the {cls.__name__} ({length} fields) returned by this Buffer's "
                            f"{'low_latency_dispatch' if kind == 'low_latency' else 'dispatch'}, got {got}")
        if not isinstance(handle, cls) or handle.owner is not self._handle_owner:
            raise ValueError(f"handle was not returned by this Buffer (rank {self.rank}); pass the handle of a "
                             "dispatch made with the same Buffer")
        return handle

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
        v.check_int("hidden", hidden, 1)
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
        for backend in self._backends:
            stream = backend.get_comm_stream()
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
            available = (num_bytes - offset) // torch.empty(0, dtype=dtype, device="cpu").element_size()
            if size.numel() > available:
                raise ValueError(f"size {tuple(size)} needs {size.numel()} elements of {dtype}, but the buffer has "
                                 f"{available} from offset {offset}")
        backend = self._backend("get_local_buffer_tensor", "buffer", "rdma" if use_rdma_buffer else "nvl")
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
            previous_event, async_finish, allocate_on_comm_stream: the stream protocol (see ``dispatch``).
        Returns:
            ``DispatchLayout(num_tokens_per_rank [R] int32, num_tokens_per_rdma_rank [R_nodes] int32 or None,
            num_tokens_per_expert [E] int32, is_token_in_rank [N, R] bool, event)``.
        """
        topk_idx = v.check_topk_idx("topk_idx", topk_idx)
        v.check_num_experts(num_experts, self.group_size)
        v.check_stream_args(previous_event, async_finish, allocate_on_comm_stream)
        backend = self._backend("get_dispatch_layout", "normal", _device_type(topk_idx))
        if backend.needs_host_checks:
            v.check_expert_range("topk_idx", topk_idx, num_experts)
        return backend.get_dispatch_layout(LayoutRequest(topk_idx, num_experts, previous_event, async_finish,
                                                         allocate_on_comm_stream))

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
            previous_event: the call's work waits for this event (else for the current stream).
            async_finish: return an event of the work instead of making the current stream wait for it.
            allocate_on_comm_stream: allocate the outputs on the communication stream (needs both of the above).
        Returns:
            ``DispatchResult(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle,
            event)``: rows ordered by (source rank, source token); ``recv_topk_idx`` holds local expert ids or -1,
            ``recv_topk_weights`` is 0 where the id is -1. A cached dispatch returns
            ``(recv_x, None, None, None, None, event)``.
        """
        self._settle_receives()
        with _Agreement(self, "dispatch", "normal", cached=handle is not None) as agreement:
            data, scales = v.split_dispatch_x(x)
            agreement.device = _device_type(data)
            agreement.backend = self._backend("dispatch", "normal", agreement.device)
            agreement.rides = handle is None and agreement.backend is self._torch
            request = self._dispatch_request(data, scales, handle, num_tokens_per_rank, num_tokens_per_rdma_rank,
                                             is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights,
                                             expert_alignment, num_worst_tokens, config, previous_event,
                                             async_finish, allocate_on_comm_stream, agreement)
            req_handle, req_idx = request.handle, request.topk_idx
            agreement.backend.check_rings("dispatch", data.size(1) * data.element_size(),
                                          scales.size(1) if scales is not None else 0,
                                          req_idx.size(1) if req_idx is not None else 0, request.config)
            agreement.agree(("cached (handle given)", req_handle is not None),
                            ("handle (its dispatch number)", req_handle.serial if req_handle is not None else -1),
                            ("x.size(1) (hidden)", data.size(1)), ("x.dtype", data.dtype),
                            ("x_scales given", scales is not None),
                            ("x_scales.size(1)", scales.size(1) if scales is not None else 0),
                            ("x_scales.dtype", scales.dtype if scales is not None else None),
                            ("num_tokens_per_expert.numel() (num_experts)",
                             request.num_tokens_per_expert.numel() if req_handle is None else 0),
                            ("topk_idx given", req_idx is not None),
                            ("topk_idx.size(1) (num_topk)", req_idx.size(1) if req_idx is not None else 0),
                            ("expert_alignment", request.expert_alignment),
                            ("num_worst_tokens", request.num_worst_tokens), ("config", request.config))
        result = agreement.backend.dispatch(request._replace(signature=agreement.signature))
        if req_handle is None:
            self._register(result.handle)
        return result

    def _dispatch_request(self, data: torch.Tensor, scales: Optional[torch.Tensor], handle: Optional[tuple],
                          num_tokens_per_rank: Optional[torch.Tensor],
                          num_tokens_per_rdma_rank: Optional[torch.Tensor],
                          is_token_in_rank: Optional[torch.Tensor], num_tokens_per_expert: Optional[torch.Tensor],
                          topk_idx: Optional[torch.Tensor], topk_weights: Optional[torch.Tensor],
                          expert_alignment: int, num_worst_tokens: int, config: Optional[Config],
                          previous_event: Optional[EventOverlap], async_finish: bool,
                          allocate_on_comm_stream: bool, agreement: _Agreement) -> DispatchRequest:
        """``dispatch``'s checks after ``x``; returns the validated request (a cached call's checked handle goes
        to ``agreement`` at once)."""
        num_tokens = data.size(0)
        x = (data, scales) if scales is not None else data
        v.check_stream_args(previous_event, async_finish, allocate_on_comm_stream)
        config = agreement.config = self._resolve_config(config, "dispatch", self.group_size)
        v.check_int("expert_alignment", expert_alignment, 1)
        v.check_int("num_worst_tokens", num_worst_tokens, 0)
        backend = self._backend("dispatch", "normal", _device_type(data))
        R = self.group_size

        if handle is not None:
            handle = agreement.handle = self._check_handle(handle, "normal")
            if topk_idx is not None or topk_weights is not None:
                raise ValueError("a cached dispatch (handle given) takes no topk_idx/topk_weights, got "
                                 f"topk_idx={'a tensor' if topk_idx is not None else None}, "
                                 f"topk_weights={'a tensor' if topk_weights is not None else None}")
            if handle.is_token_in_rank.size(0) != num_tokens:
                raise ValueError(f"x must have the {handle.is_token_in_rank.size(0)} rows of the dispatch that made "
                                 f"the handle, got {num_tokens}")
            channels = handle[1].size(1)
            if channels != backend.num_channels(config):
                raise ValueError(f"config.num_sms must match the dispatch that made the handle (a handle with "
                                 f"{channels} channels), got num_sms={config.num_sms}")
            return DispatchRequest(x, handle, config=config, previous_event=previous_event,
                                   async_finish=async_finish, allocate_on_comm_stream=allocate_on_comm_stream)

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
        if backend.needs_host_checks:
            if topk_idx is not None:
                v.check_expert_range("topk_idx", topk_idx, num_experts)
            actual = is_token_in_rank.sum(0, dtype=torch.int32)
            if not torch.equal(actual, num_tokens_per_rank):
                raise ValueError(f"num_tokens_per_rank must equal is_token_in_rank.sum(0) (the routing), got "
                                 f"{num_tokens_per_rank.tolist()} vs {actual.tolist()}")
        return DispatchRequest(x, None, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                               num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, num_worst_tokens,
                               config, previous_event, async_finish, allocate_on_comm_stream)

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
        self._settle_receives()
        with _Agreement(self, "combine", "normal") as agreement:
            if isinstance(x, torch.Tensor):
                agreement.device = _device_type(x)
                agreement.backend = self._routes.get(("normal", agreement.device), self._torch)
            # The handle first: a refusal once it is valid still launches the combine kernel (the ranks' agreement).
            handle = agreement.handle = self._check_handle(handle, "normal")
            v.check_tensor("x", x, dtype=torch.bfloat16, ndim=2)
            num_rows = handle.recv_src_meta.size(0) if self.topology.is_internode else handle.recv_src_idx.size(0)
            if x.size(0) != num_rows:
                raise ValueError(f"x must have the {num_rows} rows of the dispatch's recv_x, got {x.size(0)}")
            if topk_weights is not None:
                v.check_tensor("topk_weights", topk_weights, dtype=torch.float32, shape=(num_rows, None),
                               device=x.device)
            biases = v.split_bias(bias, handle.is_token_in_rank.size(0), x.size(1), x.dtype, x.device)
            v.check_stream_args(previous_event, async_finish, allocate_on_comm_stream)
            config = self._resolve_config(config, "combine", self.group_size)
            backend = agreement.backend = self._backend("combine", "normal", _device_type(x))
            if handle[1].size(1) != backend.num_channels(config):
                raise ValueError(f"config.num_sms must match the dispatch that made the handle (a handle with "
                                 f"{handle[1].size(1)} channels), got num_sms={config.num_sms}")
            backend.check_rings("combine", x.size(1) * x.element_size(), 0,
                                topk_weights.size(1) if topk_weights is not None else 0, config)
            agreement.agree(("handle (its dispatch number)", handle.serial), ("x.size(1) (hidden)", x.size(1)),
                            ("topk_weights given", topk_weights is not None),
                            ("topk_weights.size(1)", topk_weights.size(1) if topk_weights is not None else 0),
                            ("bias (number of tensors)", len(biases)), ("config", config))
        return backend.combine(CombineRequest(x, handle, topk_weights, biases, config, previous_event, async_finish,
                                              allocate_on_comm_stream, agreement.signature))

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
        self._settle_receives()
        with _Agreement(self, "low_latency_dispatch", "low_latency") as agreement:
            if isinstance(x, torch.Tensor):
                agreement.device = _device_type(x)
            if self._ll_last is not None:
                agreement.backend, agreement.ll_shape = self._ll_last
            self._check_in_flight("low_latency_dispatch")
            v.check_tensor("x", x, dtype=torch.bfloat16, ndim=2)
            num_tokens, hidden = x.shape
            num_local = self._check_low_latency(num_max_dispatch_tokens_per_rank, hidden, num_experts)
            if not (type(use_fp8) is bool and type(round_scale) is bool and type(use_ue8m0) is bool
                    and type(async_finish) is bool and type(return_recv_hook) is bool):
                for name, value in (("use_fp8", use_fp8), ("round_scale", round_scale), ("use_ue8m0", use_ue8m0),
                                    ("async_finish", async_finish), ("return_recv_hook", return_recv_hook)):
                    v.check_bool(name, value)
            backend = agreement.backend = self._ll_backend("low_latency_dispatch", _device_type(x), hidden, use_fp8,
                                                           use_ue8m0)
            self._check_ll_carving("low_latency_dispatch", backend, num_max_dispatch_tokens_per_rank, hidden,
                                   num_experts)
            agreement.rides = backend is self._torch
            agreement.ll_shape = (num_max_dispatch_tokens_per_rank, hidden, num_experts, x.device)
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
            if backend.needs_host_checks:
                v.check_expert_range("topk_idx", topk_idx, num_experts)
                valid = topk_idx[topk_idx >= 0].to(torch.int64)
                if valid.numel():
                    most = int(torch.bincount(valid, minlength=num_experts).max())
                    if most > num_max_dispatch_tokens_per_rank:
                        raise ValueError(f"topk_idx selects one expert {most} times (duplicate entries), more than "
                                         f"num_max_dispatch_tokens_per_rank={num_max_dispatch_tokens_per_rank}")
            agreement.agree(("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank),
                            ("x.size(1) (hidden)", hidden), ("num_experts", num_experts),
                            ("topk_idx.size(1) (num_topk)", topk_idx.size(1)), ("use_fp8", use_fp8),
                            ("round_scale", round_scale), ("use_ue8m0", use_ue8m0))
        result = backend.low_latency_dispatch(LowLatencyDispatchRequest(
            x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, cumulative_local_expert_recv_stats,
            dispatch_wait_recv_cost_stats, use_fp8, round_scale, use_ue8m0, async_finish, return_recv_hook,
            agreement.signature))
        self._remember_ll_shape(backend, agreement.ll_shape)
        self._register(result.handle)
        self._track_receive(result.hook)
        return result

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                            handle: tuple, use_logfmt: bool = False, zero_copy: bool = False,
                            async_finish: bool = False, return_recv_hook: bool = False,
                            out: Optional[torch.Tensor] = None,
                            combine_wait_recv_cost_stats: Optional[torch.Tensor] = None) -> LowLatencyCombineResult:
        """Return the expert outputs to the token owners and reduce them with the top-k weights.

        The sum runs in fp32 with one BF16 rounding, in ascending k.

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
        self._settle_receives()
        with _Agreement(self, "low_latency_combine", "low_latency") as agreement:
            if isinstance(x, torch.Tensor):
                agreement.device = _device_type(x)
            if self._ll_last is not None:
                agreement.backend, agreement.ll_shape = self._ll_last
            self._check_in_flight("low_latency_combine")
            handle = self._check_handle(handle, "low_latency")
            tokens, hidden, num_experts = handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts
            num_local = self._check_low_latency(tokens, hidden, num_experts)
            if isinstance(handle.packed_recv_src_info, torch.Tensor) and handle.packed_recv_src_info.is_cuda:
                agreement.backend = self._ll_backend("low_latency_combine", "cuda", hidden)
                self._check_ll_carving("low_latency_combine", agreement.backend, tokens, hidden, num_experts)
                agreement.ll_shape = (tokens, hidden, num_experts, handle.packed_recv_src_info.device)
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
            if zero_copy and self._zero_copy_generation != self._ll_generation:
                raise LowLatencyMisuseError(
                    "zero_copy=True needs the combine buffer from get_next_low_latency_combine_buffer(handle) filled "
                    "after the last low-latency call (another low-latency call reuses it); got "
                    + ("none since the Buffer was built or last cleaned (clean_low_latency_buffer)"
                       if self._zero_copy_generation < 0 else
                       f"a buffer handed out before low-latency call #{self._zero_copy_generation}, and this is call "
                       f"#{self._ll_generation}"))
            if async_finish and return_recv_hook:
                raise ValueError("async_finish and return_recv_hook are mutually exclusive, got both True")
            if out is not None:
                v.check_tensor("out", out, dtype=torch.bfloat16, shape=(num_tokens, hidden), device=device)
            if combine_wait_recv_cost_stats is not None:
                v.check_tensor("combine_wait_recv_cost_stats", combine_wait_recv_cost_stats, dtype=torch.int64,
                               shape=(self.group_size,), device=device)
            backend = agreement.backend = self._ll_backend("low_latency_combine", _device_type(x), hidden)
            if backend.needs_host_checks:
                v.check_expert_range("topk_idx", topk_idx, num_experts)
            agreement.agree(("handle (its dispatch number)", handle.serial),
                            ("num_max_dispatch_tokens_per_rank", tokens), ("hidden", hidden),
                            ("num_experts", num_experts), ("topk_idx.size(1) (num_topk)", topk_idx.size(1)),
                            ("use_logfmt", use_logfmt))
        result = backend.low_latency_combine(LowLatencyCombineRequest(
            x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, async_finish, return_recv_hook, out,
            combine_wait_recv_cost_stats, agreement.signature))
        self._remember_ll_shape(backend, (tokens, hidden, num_experts, x.device))
        self._track_receive(result.hook)
        return result

    def get_next_low_latency_combine_buffer(self, handle: tuple) -> torch.Tensor:
        """BF16 ``[L, R*T, H]`` view (row stride ``H + H/64``) of the send area the next combine will read with
        ``zero_copy=True``. Valid until another low-latency call is made."""
        handle = self._check_handle(handle, "low_latency")
        self._check_low_latency(handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts)
        backend = self._ll_backend("get_next_low_latency_combine_buffer", _device_type(handle.packed_recv_src_info),
                                   handle.hidden)
        view = backend.get_next_low_latency_combine_buffer(handle)
        self._zero_copy_generation = self._ll_generation
        return view

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Collective: zero both halves' signal areas (needed after normal kernels used the buffer). The ranks'
        next low-latency calls use the first buffer half and the same handle numbers, whatever calls they made
        before (after a disagreement they may differ); a combine buffer handed out before is no longer valid."""
        self._settle_receives()
        with _Agreement(self, "clean_low_latency_buffer", "low_latency") as agreement:
            agreement.device = None
            v.check_int("hidden", hidden, 1)
            self._check_low_latency(num_max_dispatch_tokens_per_rank, hidden, num_experts)
            backend = agreement.backend = self._ll_backend("clean_low_latency_buffer", None, hidden)
            agreement.agree(("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank),
                            ("hidden", hidden), ("num_experts", num_experts))
        backend.clean_low_latency_buffer(num_max_dispatch_tokens_per_rank, hidden, num_experts)
        if backend.hashes_signature:  # the clean sets the carving of the calls after it
            self._remember_ll_shape(backend, (num_max_dispatch_tokens_per_rank, hidden, num_experts,
                                              backend.comm_stream.device))
        # The backend restarted the double buffer at half 0 on every rank; the handle numbers restart in step.
        self._ll_cleans += 1
        self._num_handles = self._ll_cleans * _HANDLES_PER_CLEAN
        self._zero_copy_generation = -1

    def _check_shrink(self, method: str) -> Backend:
        if not self.enable_shrink:
            raise ValueError("Shrink mode must be enabled: build the Buffer with enable_shrink=True, got "
                             "enable_shrink=False")
        return self._backend(method, "low_latency", None)

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Set (``mask=True``) or clear the mask bit of ``rank_to_mask``; masked ranks are skipped."""
        backend = self._check_shrink("low_latency_update_mask_buffer")
        v.check_int("rank_to_mask", rank_to_mask, 0, self.group_size - 1)
        v.check_bool("mask", mask)
        backend.low_latency_update_mask_buffer(rank_to_mask, mask)

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """Copy the mask (1 = masked) into ``mask_status`` (``[R]`` int32)."""
        backend = self._check_shrink("low_latency_query_mask_buffer")
        v.check_tensor("mask_status", mask_status, dtype=torch.int32, shape=(self.group_size,))
        backend.low_latency_query_mask_buffer(mask_status)

    def low_latency_clean_mask_buffer(self) -> None:
        """Clear every mask bit."""
        self._check_shrink("low_latency_clean_mask_buffer").low_latency_clean_mask_buffer()

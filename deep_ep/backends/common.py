"""Helpers every backend shares: the stream protocol of a call, bootstrap exchange, byte records, padding.

:class:`StreamScope` is the one implementation of the stream protocol (``previous_event``, ``async_finish``,
``allocate_on_comm_stream``) for every backend: the torch backend runs a call's work on its communication stream,
the CUDA backends let the kernel launch do the plain waits, the composed path has its stages run on the caller's
stream.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from deep_ep import numerics
from deep_ep.event import COMPLETED, CudaEventHandle, EventOverlap


def object_all_gather(group: Any) -> Callable[[object], list]:
    """``all_gather(obj) -> list`` of every rank's ``obj`` over the ``torch.distributed`` ``group``
    (``all_gather_object``): the bootstrap exchanges of the CUDA backends and the NVLink check of PCIe parts."""
    import torch.distributed as dist

    def all_gather(obj: object) -> list:
        out = [None] * dist.get_world_size(group)
        dist.all_gather_object(out, obj, group=group)
        return out

    return all_gather


# ---------------------------------------------------------------------------------------------------------------
# Byte records: rows of several tensors travel as one uint8 row.
# ---------------------------------------------------------------------------------------------------------------

def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``[rows, ...]`` tensor -> ``[rows, row_bytes]`` uint8 (contiguous copy if needed)."""
    t = t.contiguous()
    if t.dim() and t.stride(-1) != 1:  # "contiguous" with size-1 dims of odd strides: views need unit strides
        t = t.clone(memory_format=torch.contiguous_format)
    rows = t.size(0)
    row_bytes = t.element_size()
    for size in t.shape[1:]:
        row_bytes *= size
    if t.numel() == 0:
        return torch.empty(rows, row_bytes, dtype=torch.uint8, device=t.device)
    return t.view(rows, -1).view(torch.uint8).view(rows, row_bytes)


def from_bytes(raw: torch.Tensor, dtype: torch.dtype, cols: int) -> torch.Tensor:
    """``[rows, cols * itemsize]`` uint8 (any slice) -> ``[rows, cols]`` of ``dtype`` (contiguous)."""
    rows = raw.size(0)
    if rows == 0 or cols == 0:
        return torch.empty(rows, cols, dtype=dtype, device=raw.device)
    # A fresh row-major copy: a column slice (even a single row of one) keeps the record's row stride.
    return numerics.dense_copy(raw).view(dtype).view(rows, cols)


# ---------------------------------------------------------------------------------------------------------------
# Worst-token mode.
# ---------------------------------------------------------------------------------------------------------------

def check_worst_tokens(num_worst_tokens: int, num_recv: int, rank: int) -> None:
    """Worst-token mode: ``rank`` receives ``num_recv`` tokens, which must fit in ``num_worst_tokens`` rows."""
    if num_recv > num_worst_tokens:
        raise ValueError(f"num_worst_tokens must be >= the number of tokens rank {rank} receives, got "
                         f"{num_worst_tokens} < {num_recv}")


def pad_rows(t: Optional[torch.Tensor], num_rows: int, fill: float = 0) -> Optional[torch.Tensor]:
    """``t`` with rows of ``fill`` appended up to ``num_rows`` rows (worst-token mode); ``None`` stays ``None``."""
    if t is None:
        return None
    extra_rows = torch.full((num_rows - t.size(0), *t.shape[1:]), fill, dtype=t.dtype, device=t.device)
    return torch.cat([t, extra_rows], dim=0)


# ---------------------------------------------------------------------------------------------------------------
# Streams.
# ---------------------------------------------------------------------------------------------------------------

def record_streams(tensors: Sequence[torch.Tensor], stream: "torch.cuda.Stream") -> None:
    """``t.record_stream(stream)`` for every tensor."""
    for t in tensors:
        t.record_stream(stream)


def wait_event(stream: "torch.cuda.Stream", event: Any) -> None:
    """Make ``stream`` wait for ``event``: an ``EventOverlap``, a ``torch.cuda.Event`` or an object with
    ``current_stream_wait()`` (run with ``stream`` current)."""
    inner = getattr(event, "event", event)
    if inner is None:
        raise ValueError("previous_event must wrap an event, got an EventOverlap with event=None")
    inner = getattr(inner, "cuda_event", inner)  # deep_ep.event.CudaEventHandle wraps a torch.cuda.Event
    if isinstance(inner, torch.cuda.Event):
        stream.wait_event(inner)
    else:
        with torch.cuda.stream(stream):
            inner.current_stream_wait()


class StreamScope:
    """The stream protocol around one call's work, as a context manager; ``finish`` gives the call's event.

    ``comm``: the stream the work runs on (``None``: the call completes on the caller's thread, as on CPU). On
    entry ``comm`` waits for ``previous_event`` if given, else for the current stream; with ``launch_waits`` the
    kernel launch makes that plain wait itself (``after_current``) and, for a synchronous call, the current stream's
    wait for ``comm`` (``current_after``). ``comm`` is current inside the block unless ``launch_waits`` without
    ``allocate_on_comm_stream`` (the kernels then take ``comm`` as an argument and the outputs are allocated on the
    current stream). :meth:`finish`: a synchronous call makes the current stream wait for ``comm``; an asynchronous
    one returns an event recorded on ``comm`` and has every returned CUDA tensor recorded on ``comm`` (and on the
    caller's stream under ``allocate_on_comm_stream``) by ``record``.
    """

    __slots__ = ("comm", "previous_event", "async_finish", "allocate_on_comm_stream", "launch_waits",
                 "after_current", "current_after", "compute", "_switch", "_record")

    def __init__(self, comm: Optional["torch.cuda.Stream"], previous_event: Any = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False, launch_waits: bool = False,
                 record: Callable[[Sequence[torch.Tensor], Any], None] = record_streams) -> None:
        self.comm, self.previous_event, self.async_finish = comm, previous_event, async_finish
        self.allocate_on_comm_stream, self.launch_waits, self._record = allocate_on_comm_stream, launch_waits, record
        launches = launch_waits and comm is not None
        self.after_current = launches and previous_event is None and not allocate_on_comm_stream
        self.current_after = launches and not async_finish
        self._switch = comm is not None and (allocate_on_comm_stream or not launch_waits)
        self.compute: Optional["torch.cuda.Stream"] = None

    def __enter__(self) -> "StreamScope":
        comm = self.comm
        if comm is None:
            return self
        if self.previous_event is not None:
            wait_event(comm, self.previous_event)
        elif not self.after_current:
            self.compute = torch.cuda.current_stream()
            if comm != self.compute:
                comm.wait_stream(self.compute)
        if self._switch:
            if self.compute is None:
                self.compute = torch.cuda.current_stream()
            torch.cuda.set_stream(comm)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._switch and self.compute is not None:
            torch.cuda.set_stream(self.compute)

    def finish(self, tensors: Sequence[Any]) -> EventOverlap:
        """The call's event (see the class docstring); ``None`` entries of ``tensors`` are skipped."""
        if self.comm is None:
            return EventOverlap(COMPLETED if self.async_finish else None)
        if not self.async_finish:
            if not self.launch_waits and self.comm != self.compute:
                self.compute.wait_stream(self.comm)
            return EventOverlap(None)
        event = CudaEventHandle(self.comm)
        live = tuple(t for t in tensors if isinstance(t, torch.Tensor))
        self._record(live, self.comm)
        if self.allocate_on_comm_stream:
            self._record(live, self.compute)
        return EventOverlap(event, live)


class PendingReceive:
    """The receive phase of a low-latency call with ``return_recv_hook``: runs exactly once, by ``hook()`` or, when
    the hook object was dropped uncalled, by the ``Buffer`` at its next call (so that no peer waits for it)."""

    __slots__ = ("receive", "done", "generation")

    def __init__(self, receive: Callable[[], None], generation: int = -1) -> None:
        self.receive, self.done, self.generation = receive, False, generation

    def run(self) -> None:
        if self.done:
            raise RuntimeError("this low-latency receive hook was already called")
        self.done = True
        self.receive()


class ReceiveHook:
    """``hook()`` of a low-latency call with ``return_recv_hook``: completes the receive, exactly once."""

    __slots__ = ("pending", "__weakref__")

    def __init__(self, receive: Callable[[], None]) -> None:
        self.pending = PendingReceive(receive)

    def __call__(self) -> None:
        self.pending.run()

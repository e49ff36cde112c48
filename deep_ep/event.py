"""``EventOverlap``: DeepEP's wrapper around a completion event of asynchronous communication.

On CUDA the wrapped object is a ``torch.cuda.Event`` recorded on the buffer's communication stream. On CPU all
communication of the torch backend has completed when a call returns, so an asynchronous call returns
:data:`COMPLETED`, whose wait is a no-op; DeepEP-style code (``event.current_stream_wait()``) runs unchanged.
"""
from __future__ import annotations

from typing import Any, Optional

import torch


class CompletedEvent:
    """An event that has already happened (CPU work, or a synchronous CUDA call)."""

    def current_stream_wait(self) -> None:
        """Nothing to wait for."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        """Nothing to wait for."""

    def __repr__(self) -> str:
        return "CompletedEvent()"


COMPLETED = CompletedEvent()


class CudaEventHandle:
    """A ``torch.cuda.Event`` recorded on a stream, with DeepEP's ``EventHandle`` method names."""

    def __init__(self, stream: Optional["torch.cuda.Stream"] = None) -> None:
        self.cuda_event = torch.cuda.Event()
        self.cuda_event.record(stream if stream is not None else torch.cuda.current_stream())

    def current_stream_wait(self) -> None:
        torch.cuda.current_stream().wait_event(self.cuda_event)

    def query(self) -> bool:
        return self.cuda_event.query()

    def synchronize(self) -> None:
        self.cuda_event.synchronize()


class EventOverlap:
    """Wrapper of a communication event plus tensors to keep alive until it is dropped.

    Args:
        event: an object with ``current_stream_wait()`` (:class:`CudaEventHandle`, :data:`COMPLETED`, or the CUDA
            extension's event handle), or ``None`` for a synchronous call.
        extra_tensors: tensors kept alive as long as this object (a stand-in for ``record_stream``).
    """

    def __init__(self, event: Any = None, extra_tensors: Optional[tuple] = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        """Make the current stream wait for the event (a no-op for completed CPU work)."""
        if self.event is None:
            raise ValueError("EventOverlap.current_stream_wait() needs an event, but this EventOverlap wraps None "
                             "(the call was not asynchronous: pass async_finish=True to get an event)")
        self.event.current_stream_wait()

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, exc_type, exc_value, traceback) -> None:
        if self.event is not None:
            self.event.current_stream_wait()

    def __repr__(self) -> str:
        return f"EventOverlap(event={self.event!r})"

"""Exceptions of the communication calls, shared by every backend (torch, CUDA intranode / internode, low-latency).

Standard-library only, so ``except deep_ep.CommTimeoutError`` works whichever backend served the call. Messages name
rank, peer, phase (and channel where there is one) and what was awaited.
"""
from __future__ import annotations


class CommError(RuntimeError):
    """A communication kernel or host wait failed (a peer process died, a kernel reported an error)."""


class CommTimeoutError(CommError, TimeoutError):
    """A bounded wait (GPU or CPU) ran out of ``DEEP_EP_TIMEOUT_S``."""


class PeerAbortedError(CommError):
    """A peer reported an error and aborted the collective call."""


class RoutingError(CommError, ValueError):
    """The kernels detected routing inconsistent with the counts or the handle (DeepEP would hang here)."""

"""Exceptions of the communication calls, shared by every backend (torch, CUDA intranode / internode, low-latency).

Standard-library only, so ``except deep_ep.CommTimeoutError`` works whichever backend served the call. Messages name
rank, peer, phase (and channel where there is one) and what was awaited.
"""
from __future__ import annotations

import re
from typing import Optional, Sequence


class CommError(RuntimeError):
    """A communication kernel or host wait failed (a peer process died, a kernel reported an error).

    Raised by the torch backend with ``rank`` (this rank), ``peer`` (the peer whose operation failed, ``None`` for
    a collective of all ranks) and ``phase`` set, in the Buffer's rank numbers; the CUDA backends leave them
    ``None`` and name them in the message.
    """

    rank: Optional[int] = None
    peer: Optional[int] = None
    phase: Optional[str] = None

    def with_origin(self, rank: Optional[int], peer: Optional[int], phase: Optional[str]) -> "CommError":
        """``self`` with ``rank``, ``peer`` and ``phase`` set."""
        self.rank, self.peer, self.phase = rank, peer, phase
        return self


class CommTimeoutError(CommError, TimeoutError):
    """A bounded wait (GPU or CPU) ran out of ``DEEP_EP_TIMEOUT_S``."""


class PeerAbortedError(CommError):
    """A peer reported an error and aborted the collective call."""


class RoutingError(CommError, ValueError):
    """The kernels detected routing inconsistent with the counts or the handle (DeepEP would hang here)."""


class ArgumentMismatchError(ValueError):
    """The ranks of a collective call disagree on its arguments (shapes, dtypes, expert count, top-k, config, mode
    flags, optional tensors, the handle) or made different calls, or another rank refused its arguments. Raised on
    every rank of the call before any row moves; the Buffer stays usable."""


class LowLatencyMisuseError(RuntimeError):
    """A low-latency call that would overwrite data still in use: a third call while the receive hook of the call
    two before is pending (its buffer half), or a zero-copy combine whose buffer was filled before another
    low-latency call. Raised on every rank of the call before any data moves; the pending work stays valid."""


_RANK_PEER = re.compile(r"rank (-?\d+) peer (-?\d+)")


def rank_name(names: Optional[Sequence[int]], rank: int) -> str:
    """Group rank ``rank`` as reports name it: ``names[rank]`` (a subgroup's ranks in the Buffer's group), else
    itself."""
    return str(names[rank]) if names and 0 <= rank < len(names) else str(rank)


def name_ranks(message: str, names: Optional[Sequence[int]], scope: str) -> str:
    """``message`` of a runtime whose group is a subgroup: its first ``rank R peer P`` (group ranks) becomes
    ``rank names[R] peer names[P] (scope ranks R / P)``, so the report names the ranks the user knows. Unchanged
    without ``names``."""
    if not names:
        return message

    def renamed(match: re.Match) -> str:
        rank, peer = int(match.group(1)), int(match.group(2))
        return f"rank {rank_name(names, rank)} peer {rank_name(names, peer)} ({scope} ranks {rank} / {peer})"

    return _RANK_PEER.sub(renamed, message, count=1)

"""Bookkeeping of the output pool of direct-to-output dispatch (intranode dispatch receiving into its outputs).

Standard library only, so the logic is tested on CPU. The pool is the part of a rank's CUDA-IPC buffer after the
rings (:func:`deep_ep.layout.intranode_pool_region`). A dispatch that receives straight into its outputs takes
blocks from it: this allocator picks their byte offsets, ``deep_ep._C.Runtime.dispatch`` hands them to torch as the
call's outputs (tensors whose deleter queues the block in C++), and ``Runtime.collect_pool_blocks`` gives back the
queued blocks whose stream work is complete (by stream order, or by events recorded on the streams that used the
block, queried without blocking). Only then does the pool free them here.

The allocator is first-fit over a free list kept sorted by offset, merging neighbours on free, so a block kept
alive for a long time (a handle's ``recv_src_idx``, a ``recv_x`` saved for backward) only fragments the pool and
never blocks the blocks around it.
"""
from __future__ import annotations

import bisect
from typing import Optional

from deep_ep.config import BUFFER_ALIGNMENT, align_up


class OutputPool:
    """First-fit allocator of ``[offset, offset + num_bytes)``; every block starts and ends on ``alignment``.

    Args:
        offset: first byte of the pool in the buffer (a multiple of ``alignment``).
        num_bytes: pool size (rounded down to ``alignment``); 0 gives a pool that never has room.
    """

    def __init__(self, offset: int, num_bytes: int, alignment: int = BUFFER_ALIGNMENT) -> None:
        if offset < 0 or offset % alignment != 0:
            raise ValueError(f"pool offset must be a non-negative multiple of {alignment}, got {offset}")
        if num_bytes < 0:
            raise ValueError(f"pool num_bytes must be >= 0, got {num_bytes}")
        self.offset, self.alignment = offset, alignment
        self.num_bytes = num_bytes // alignment * alignment
        self._free_starts: list[int] = [offset] if self.num_bytes > 0 else []  # sorted
        self._free_size: dict[int, int] = {offset: self.num_bytes} if self.num_bytes > 0 else {}
        self._live: dict[int, int] = {}  # offset -> size of every allocated block

    # ---- queries ----
    @property
    def free_bytes(self) -> int:
        return sum(self._free_size.values())

    @property
    def num_live(self) -> int:
        return len(self._live)

    def largest_free(self) -> int:
        return max(self._free_size.values(), default=0)

    def free_ranges(self) -> list[tuple[int, int]]:
        """Free ``(offset, size)`` ranges in address order (disjoint, never adjacent)."""
        return [(start, self._free_size[start]) for start in self._free_starts]

    # ---- allocation ----
    def allocate(self, num_bytes: int) -> Optional[int]:
        """Offset of a new block of at least ``num_bytes`` (> 0), or ``None`` when no free range is large enough."""
        if num_bytes <= 0:
            raise ValueError(f"num_bytes must be > 0, got {num_bytes}")
        size = align_up(num_bytes, self.alignment)
        for i, start in enumerate(self._free_starts):
            free = self._free_size[start]
            if free < size:
                continue
            del self._free_size[start]
            if free == size:
                del self._free_starts[i]
            else:
                self._free_starts[i] = start + size
                self._free_size[start + size] = free - size
            self._live[start] = size
            return start
        return None

    def free(self, offset: int) -> None:
        """Return the block at ``offset``; raises ``ValueError`` for an offset that is not a live block."""
        size = self._live.pop(offset, None)
        if size is None:
            raise ValueError(f"offset {offset} is not a live block of this pool")
        i = bisect.bisect_left(self._free_starts, offset)
        start = offset
        # Merge with the free range just before, and with the one just after.
        if i > 0:
            prev = self._free_starts[i - 1]
            if prev + self._free_size[prev] == offset:
                start, size = prev, self._free_size.pop(prev) + size
                del self._free_starts[i - 1]
                i -= 1
        nxt = start + size
        if i < len(self._free_starts) and self._free_starts[i] == nxt:
            size += self._free_size.pop(nxt)
            del self._free_starts[i]
        self._free_starts.insert(i, start)
        self._free_size[start] = size

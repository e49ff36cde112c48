"""Argument checks of the global-view reference functions that ``deep_ep.validate`` has no counterpart for (per-rank
lists, masked rank sets); tensor and integer checks come from ``deep_ep.validate``, shared with ``deep_ep.Buffer``.
Each raises TypeError/ValueError naming the argument."""
from __future__ import annotations

from typing import Sequence


def check_per_rank(name: str, value: object, num_ranks: int) -> Sequence:
    """``value`` must be a list/tuple with one entry per rank."""
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{name} must be a list with one entry per rank, got {type(value).__name__}")
    if len(value) != num_ranks:
        raise ValueError(f"{name} must have one entry per rank ({num_ranks}), got {len(value)}")
    return value


def check_masked_ranks(masked_ranks: object, num_ranks: int) -> frozenset[int]:
    ranks = frozenset(masked_ranks)  # type: ignore[arg-type]
    for r in ranks:
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < num_ranks:
            raise ValueError(f"masked_ranks entries must be ranks in [0, {num_ranks}), got {r!r}")
    return ranks

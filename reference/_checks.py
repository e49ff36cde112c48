"""Argument checks shared by the reference functions: each raises TypeError/ValueError naming the argument."""
from __future__ import annotations

from typing import Sequence

import torch


def check_per_rank(name: str, value: object, num_ranks: int) -> Sequence:
    """``value`` must be a list/tuple with one entry per rank."""
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{name} must be a list with one entry per rank, got {type(value).__name__}")
    if len(value) != num_ranks:
        raise ValueError(f"{name} must have one entry per rank ({num_ranks}), got {len(value)}")
    return value


def check_tensor(name: str, value: object, dim: int, dtypes: tuple[torch.dtype, ...] | None = None,
                 rows: int | None = None) -> torch.Tensor:
    """``value`` must be a ``dim``-D tensor, of one of ``dtypes``, with ``rows`` rows when given."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(value.shape)}")
    if dtypes is not None and value.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {value.dtype}")
    if rows is not None and value.size(0) != rows:
        raise ValueError(f"{name} must have {rows} rows, got {value.size(0)}")
    return value


def check_positive_int(name: str, value: object, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_masked_ranks(masked_ranks: object, num_ranks: int) -> frozenset[int]:
    ranks = frozenset(masked_ranks)  # type: ignore[arg-type]
    for r in ranks:
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < num_ranks:
            raise ValueError(f"masked_ranks entries must be ranks in [0, {num_ranks}), got {r!r}")
    return ranks

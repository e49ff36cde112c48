"""Hypothesis strategies for routing cases, shared by the reference, backend and GPU tests.

A :class:`Case` is a small frozen description (topology, sizes, seed). Hypothesis draws it once; every rank (or
process) regenerates its own tensors from it with :meth:`Case.make_inputs`, so all ranks agree on one example.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
from hypothesis import strategies as st

from deep_ep.config import Topology


class RankInputs(NamedTuple):
    """One rank's inputs.

    Fields:
        x: ``[N, H]`` bfloat16 small integers in ``[-8, 8]`` (sums over up to 16 holders stay exact in BF16).
        topk_idx: ``[N, K]`` int64 global expert ids, -1 for masked slots.
        topk_weights: ``[N, K]`` float32 in ``[0.25, 1.25)`` (also for -1 slots: the APIs must ignore them).
    """

    x: torch.Tensor
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor


@dataclass(frozen=True)
class Case:
    """A routing case: ``num_ranks`` ranks in nodes of ``num_scaleup_ranks``, per-rank token counts, sizes, seed.

    ``mask_percent`` is the chance (in %) that a top-k slot is -1; ``allow_duplicates`` lets a row pick the same
    expert twice (legal for the normal path, where it counts twice per expert).
    """

    num_ranks: int
    num_scaleup_ranks: int
    num_tokens: tuple[int, ...]
    hidden: int
    num_topk: int
    num_experts: int
    mask_percent: int = 0
    allow_duplicates: bool = False
    num_channels: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        if len(self.num_tokens) != self.num_ranks:
            raise ValueError(f"num_tokens needs one entry per rank ({self.num_ranks}), got {len(self.num_tokens)}")
        if self.num_experts % self.num_ranks != 0:
            raise ValueError(f"num_experts ({self.num_experts}) must divide by num_ranks ({self.num_ranks})")
        if not self.allow_duplicates and self.num_topk > self.num_experts:
            raise ValueError(f"num_topk ({self.num_topk}) must be <= num_experts ({self.num_experts}) without "
                             "duplicates")

    @property
    def topology(self) -> Topology:
        return Topology(self.num_ranks, self.num_scaleup_ranks)

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.num_ranks

    def describe(self) -> str:
        """One line that reproduces the case."""
        return (f"Case(num_ranks={self.num_ranks}, num_scaleup_ranks={self.num_scaleup_ranks}, "
                f"num_tokens={self.num_tokens}, hidden={self.hidden}, num_topk={self.num_topk}, "
                f"num_experts={self.num_experts}, mask_percent={self.mask_percent}, "
                f"allow_duplicates={self.allow_duplicates}, num_channels={self.num_channels}, seed={self.seed})")

    def make_inputs(self, rank: int, device: Optional[torch.device | str] = None) -> RankInputs:
        """Rank ``rank``'s tensors, regenerated deterministically from ``(seed, rank)``; created on the CPU, then
        moved to ``device`` if given."""
        if not 0 <= rank < self.num_ranks:
            raise ValueError(f"rank must be in [0, {self.num_ranks}), got {rank}")
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + rank)
        n, k, e = self.num_tokens[rank], self.num_topk, self.num_experts
        x = torch.randint(-8, 9, (n, self.hidden), generator=gen).to(torch.bfloat16)
        if self.allow_duplicates:
            idx = torch.randint(0, e, (n, k), generator=gen)
        else:
            idx = torch.rand(n, e, generator=gen).argsort(dim=1)[:, :k]
        masked = torch.randint(0, 100, (n, k), generator=gen) < self.mask_percent
        idx = torch.where(masked, torch.full_like(idx, -1), idx)
        weights = torch.rand(n, k, generator=gen) + 0.25
        inputs = RankInputs(x, idx.to(torch.int64), weights)
        if device is not None:
            inputs = RankInputs(*(t.to(device) for t in inputs))
        return inputs

    def all_inputs(self) -> list[RankInputs]:
        return [self.make_inputs(r) for r in range(self.num_ranks)]


@st.composite
def cases(draw: st.DrawFn, *, max_ranks: int = 8, max_tokens: int = 12, hiddens: tuple[int, ...] = (128, 256),
          max_topk: int = 4, max_local_experts: int = 3, internode: Optional[bool] = None,
          allow_duplicates: Optional[bool] = None, allow_empty: bool = True) -> Case:
    """Draw a :class:`Case`.

    Args:
        max_ranks: largest ``num_ranks``.
        max_tokens: largest per-rank token count (0 allowed when ``allow_empty``).
        hiddens: candidate hidden sizes.
        max_topk: largest ``num_topk``.
        max_local_experts: largest experts per rank.
        internode: force several nodes (True) or one (False); ``None`` draws either.
        allow_duplicates: force/forbid duplicate experts in a top-k row; ``None`` draws either.
        allow_empty: allow ranks with 0 tokens.
    """
    per_node = draw(st.sampled_from([p for p in (1, 2, 4, 8) if p <= max_ranks]))
    max_nodes = max_ranks // per_node
    if internode is True:
        if max_nodes < 2:
            per_node = max(1, max_ranks // 2)
            max_nodes = max_ranks // per_node
        num_nodes = draw(st.integers(2, max(2, min(max_nodes, 4))))
    elif internode is False:
        num_nodes = 1
    else:
        num_nodes = draw(st.integers(1, max(1, min(max_nodes, 4))))
    num_ranks = per_node * num_nodes
    min_tokens = 0 if allow_empty else 1
    num_tokens = tuple(draw(st.lists(st.integers(min_tokens, max_tokens), min_size=num_ranks, max_size=num_ranks)))
    num_experts = num_ranks * draw(st.integers(1, max_local_experts))
    duplicates = draw(st.booleans()) if allow_duplicates is None else allow_duplicates
    num_topk = draw(st.integers(1, max_topk if duplicates else min(max_topk, num_experts)))
    return Case(num_ranks=num_ranks, num_scaleup_ranks=per_node, num_tokens=num_tokens,
                hidden=draw(st.sampled_from(hiddens)), num_topk=num_topk, num_experts=num_experts,
                mask_percent=draw(st.sampled_from([0, 0, 20, 60, 100])), allow_duplicates=duplicates,
                num_channels=draw(st.integers(1, 4)), seed=draw(st.integers(0, 2**20)))


def ll_cases(max_ranks: int = 4, max_tokens: int = 6, hiddens: tuple[int, ...] = (512, 1024)) -> st.SearchStrategy:
    """Cases for the low-latency path: no duplicate experts in a row, hidden a multiple of 512."""
    return cases(max_ranks=max_ranks, max_tokens=max_tokens, hiddens=hiddens, allow_duplicates=False)

"""Reference semantics of the low-latency kernels: per-expert dispatch and weighted combine.

Global view, plain loops: inputs of all ranks in, outputs of all ranks out.

Packed order chosen here (one valid order; the contract only fixes the set of rows per expert and the
``layout_range`` bookkeeping): inside local expert ``j`` of rank ``d``, rows come by source rank ascending, then
source token ascending, then top-k slot ``k`` ascending (a token that selects the same expert twice appears twice).
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence, Union

import torch

from deep_ep import numerics
from deep_ep.config import FP8_BLOCK, num_local_experts
from deep_ep.handle import LowLatencyHandle, unpack_layout_range
from deep_ep.validate import check_expert_range, check_int, check_tensor
from reference._checks import check_masked_ranks, check_per_rank

RecvX = Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]


class LowLatencyDispatchResult(NamedTuple):
    """One rank's low-latency dispatch outputs (``L`` local experts, ``R`` ranks, ``T`` max tokens per rank).

    Fields:
        recv_x: ``[L, R*T, H]`` bfloat16, or ``(data [L, R*T, H] float8_e4m3fn, scales)`` where ``scales`` is a
            column-major view: ``[L, R*T, H/128]`` float32 with strides ``(H/128*R*T, 1, R*T)``, or with UE8M0
            ``[L, R*T, H/512]`` int32 with strides ``(H/512*R*T, 1, R*T)``. Rows ``>= packed_recv_count[j]`` are
            unspecified (zero here). Set-defined within an expert (this reference's order: see module doc).
        packed_recv_count: ``[L]`` int32 valid rows per local expert.
        handle: :class:`deep_ep.handle.LowLatencyHandle`.
    """

    recv_x: RecvX
    packed_recv_count: torch.Tensor
    handle: LowLatencyHandle


def _routing_rows(topk_idx: torch.Tensor, expert: int) -> list[int]:
    """Tokens of one source that select ``expert``, ascending token then ``k`` (a duplicate gives two rows)."""
    hits = (topk_idx == expert).nonzero()  # row-major: token asc, k asc
    return hits[:, 0].tolist()


def low_latency_dispatch(x: Sequence[torch.Tensor], topk_idx: Sequence[torch.Tensor],
                         num_max_dispatch_tokens_per_rank: int, num_experts: int, *,
                         use_fp8: bool = True, round_scale: bool = False, use_ue8m0: bool = False,
                         masked_ranks: Sequence[int] = ()) -> list[LowLatencyDispatchResult]:
    """Low-latency dispatch of every rank, global view.

    Each valid top-k entry ``(s, t, k)`` with expert ``e`` sends token ``t`` of rank ``s`` to local expert
    ``e % L`` of rank ``e // L``: one copy per selected expert, not per rank.

    Args:
        x: per rank ``[N_s, H]`` bfloat16, ``N_s <= T``; with ``use_fp8`` ``H % 128 == 0`` (``H % 512 == 0`` with
            UE8M0).
        topk_idx: per rank ``[N_s, K]`` int32/int64 global expert ids or -1 (skipped).
        num_max_dispatch_tokens_per_rank: ``T``.
        num_experts: ``E``, divisible by ``R`` (the list lengths).
        use_fp8: cast each token with :func:`deep_ep.numerics.per_token_cast_to_fp8`.
        round_scale: power-of-two scales (FP8 only).
        use_ue8m0: packed exponent-byte scales; requires ``round_scale``.
        masked_ranks: ranks excluded from the exchange: they send nothing and receive nothing.
    Returns:
        per rank :class:`LowLatencyDispatchResult`. ``packed_recv_count``, the per-source ``count`` of
        ``layout_range`` and the set of (source, token) rows per expert are contract; ``begin`` values and the row
        order inside an expert follow this reference's order (source asc, token asc, k asc).
    """
    num_ranks = len(check_per_rank("x", x, len(x)))
    check_per_rank("topk_idx", topk_idx, num_ranks)
    tokens_cap = check_int("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank, 1)
    experts_per_rank = num_local_experts(num_experts, num_ranks)
    masked = check_masked_ranks(masked_ranks, num_ranks)
    if use_ue8m0 and not round_scale:
        raise ValueError("use_ue8m0=True requires round_scale=True")
    hidden = None
    for s in range(num_ranks):
        check_tensor(f"x[{s}]", x[s], dtype=torch.bfloat16, ndim=2, contiguous=False)
        hidden = x[s].size(1) if hidden is None else hidden
        if x[s].size(1) != hidden or (use_fp8 and hidden % FP8_BLOCK != 0):
            rule = f", a multiple of {FP8_BLOCK} with use_fp8" if use_fp8 else ""
            raise ValueError(f"x[{s}] must have the common hidden size{rule}; got {x[s].size(1)} (rank 0 has "
                             f"{hidden})")
        if x[s].size(0) > tokens_cap:
            raise ValueError(f"x[{s}] has {x[s].size(0)} tokens, more than num_max_dispatch_tokens_per_rank "
                             f"({tokens_cap})")
        check_tensor(f"topk_idx[{s}]", topk_idx[s], dtype=(torch.int32, torch.int64), shape=(x[s].size(0), None),
                     contiguous=False)
        check_expert_range(f"topk_idx[{s}]", topk_idx[s], num_experts)
    assert hidden is not None

    casts: list[Optional[tuple[torch.Tensor, torch.Tensor]]] = [
        numerics.per_token_cast_to_fp8(x[s], round_scale=round_scale, use_ue8m0=use_ue8m0) if use_fp8 else None
        for s in range(num_ranks)]
    num_slots = num_ranks * tokens_cap
    results = []
    for d in range(num_ranks):
        count = torch.zeros(experts_per_rank, dtype=torch.int32)
        src_info = torch.zeros(experts_per_rank, num_slots, dtype=torch.int32)
        layout_range = torch.zeros(experts_per_rank, num_ranks, dtype=torch.int64)
        data = torch.zeros(experts_per_rank, num_slots, hidden,
                           dtype=torch.float8_e4m3fn if use_fp8 else torch.bfloat16)
        scales_store = None
        if use_fp8:
            num_scales = hidden // (FP8_BLOCK * 4) if use_ue8m0 else hidden // FP8_BLOCK
            scales_store = torch.zeros(experts_per_rank, num_scales, num_slots,
                                       dtype=torch.int32 if use_ue8m0 else torch.float32)
        for j in range(experts_per_rank):
            expert = d * experts_per_rank + j
            begin = 0
            for s in range(num_ranks):
                if s in masked or d in masked:
                    continue
                tokens = _routing_rows(topk_idx[s], expert)
                if len(tokens) > tokens_cap:
                    raise ValueError(f"rank {s} sends {len(tokens)} copies to expert {expert}, more than "
                                     f"num_max_dispatch_tokens_per_rank ({tokens_cap}); duplicate top-k entries?")
                rows = slice(begin, begin + len(tokens))
                index = torch.tensor(tokens, dtype=torch.int64)
                src_info[j, rows] = index.to(torch.int32)
                if use_fp8:
                    q, sc = casts[s]
                    data[j, rows] = q[index]
                    scales_store[j, :, rows] = sc[index].t()
                else:
                    data[j, rows] = x[s][index]
                layout_range[j, s] = (begin << 32) | len(tokens)
                begin += len(tokens)
            count[j] = begin
        recv_x: RecvX = (data, scales_store.transpose(1, 2)) if use_fp8 else data
        handle = LowLatencyHandle(src_info, layout_range, tokens_cap, hidden, num_experts)
        results.append(LowLatencyDispatchResult(recv_x, count, handle))
    return results


def low_latency_combine(y: Sequence[torch.Tensor], topk_idx: Sequence[torch.Tensor],
                        topk_weights: Sequence[torch.Tensor], handles: Sequence[LowLatencyHandle], *,
                        use_logfmt: bool = False, zero_copy: bool = False,
                        masked_ranks: Sequence[int] = ()) -> list[torch.Tensor]:
    """Low-latency combine of every rank, global view::

        out[s][t] = bf16( sum_{k asc, e = topk_idx[s][t,k] >= 0, owner(e) not masked}
                          f32(topk_weights[s][t,k]) * f32(Y(e, s, t)) )

    where ``Y(e, s, t)`` is the row of ``y[e // L][e % L]`` that holds ``(s, t)`` (found through the owner's
    ``layout_range`` and ``src_info``; the first such row if the token selected ``e`` twice), passed through
    :func:`deep_ep.numerics.logfmt_roundtrip` when ``use_logfmt``. No bias. A masked rank's output is all zero (it
    took part in no exchange); a row with every entry -1 or masked is zero.

    Args:
        y: per rank ``[L, R*T, H]`` bfloat16 expert outputs in the dispatch's packed layout. Contiguous unless
            ``zero_copy``, in which case it may be any strided view (e.g. the buffer returned by
            ``get_next_low_latency_combine_buffer``); only rows covered by ``layout_range`` are read.
        topk_idx: per rank ``[N_s, K]``, the same routing as the matching dispatch.
        topk_weights: per rank ``[N_s, K]`` float32.
        handles: per rank, the handle of the matching :func:`low_latency_dispatch`.
        use_logfmt: the payload travels as LogFMT-10 (lossy).
        zero_copy: read ``y`` in place (no contiguity requirement); incompatible with ``use_logfmt``.
        masked_ranks: ranks excluded from the exchange.
    Returns:
        per rank ``[N_s, H]`` bfloat16; fully defined (the fixed summation order makes it deterministic).
    """
    num_ranks = len(check_per_rank("y", y, len(y)))
    for name, value in (("topk_idx", topk_idx), ("topk_weights", topk_weights), ("handles", handles)):
        check_per_rank(name, value, num_ranks)
    if zero_copy and use_logfmt:
        raise ValueError("zero_copy=True cannot be combined with use_logfmt=True")
    masked = check_masked_ranks(masked_ranks, num_ranks)
    num_experts = handles[0].num_experts
    experts_per_rank = num_local_experts(num_experts, num_ranks)
    tokens_cap, hidden = handles[0].num_max_dispatch_tokens_per_rank, handles[0].hidden
    for d in range(num_ranks):
        check_tensor(f"y[{d}]", y[d], dtype=torch.bfloat16, ndim=3, contiguous=False)
        if tuple(y[d].shape) != (experts_per_rank, num_ranks * tokens_cap, hidden):
            raise ValueError(f"y[{d}] must have shape {(experts_per_rank, num_ranks * tokens_cap, hidden)}, got "
                             f"{tuple(y[d].shape)}")
        if not zero_copy and not y[d].is_contiguous():
            raise ValueError(f"y[{d}] must be contiguous unless zero_copy=True")
        check_tensor(f"topk_idx[{d}]", topk_idx[d], dtype=(torch.int32, torch.int64), ndim=2, contiguous=False)
        check_tensor(f"topk_weights[{d}]", topk_weights[d], dtype=torch.float32, shape=tuple(topk_idx[d].shape),
                     contiguous=False)
        if topk_idx[d].size(0) > tokens_cap:
            raise ValueError(f"topk_idx[{d}] has {topk_idx[d].size(0)} rows, more than T = {tokens_cap}")

    outputs = []
    for s in range(num_ranks):
        num_tokens = topk_idx[s].size(0)
        acc = torch.zeros(num_tokens, hidden, dtype=torch.float32)
        if s not in masked:
            rows_cache: dict[int, dict[int, int]] = {}
            for t in range(num_tokens):
                for k in range(topk_idx[s].size(1)):
                    e = int(topk_idx[s][t, k])
                    if e < 0 or e // experts_per_rank in masked:
                        continue
                    owner, local = divmod(e, experts_per_rank)
                    if e not in rows_cache:
                        rows_cache[e] = _rows_of_source(handles[owner], local, s)
                    row = rows_cache[e].get(t)
                    if row is None:
                        raise ValueError(f"rank {owner} expert {local} holds no row for token {t} of rank {s}: "
                                         f"topk_idx[{s}] differs from the dispatch that produced handles[{owner}]")
                    expert_row = y[owner][local, row].unsqueeze(0)
                    if use_logfmt:
                        expert_row = numerics.logfmt_roundtrip(expert_row)
                    acc[t] += topk_weights[s][t, k] * expert_row[0].to(torch.float32)
        outputs.append(acc.to(torch.bfloat16))
    return outputs


def _rows_of_source(h: LowLatencyHandle, local_expert: int, src: int) -> dict[int, int]:
    """``{source token: first packed row}`` of ``src``'s block in ``local_expert`` of the handle's owner."""
    begin, count = (int(v) for v in unpack_layout_range(h.packed_recv_layout_range[local_expert, src]))
    mapping: dict[int, int] = {}
    for row in range(begin, begin + count):
        mapping.setdefault(int(h.packed_recv_src_info[local_expert, row]), row)
    return mapping

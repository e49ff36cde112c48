"""A user script of DeepEP V1's ``deep_ep.Buffer`` API that runs unchanged on ``deep_ep`` (gloo on CPU).

It uses only V1's public names (``Buffer``, ``Config``, ``topk_idx_t``) with V1's constructor arguments, keyword
names and result / handle tuple positions. Every rank regenerates all ranks' inputs from per-rank seeds and checks
its results against what they imply:

- normal mode: ``get_dispatch_layout``; ``dispatch`` of BF16 and of FP8 ``(data, column-major scales)``, with and
  without top-k, synchronous, ``async_finish`` and ``previous_event=capture()``; expert alignment, worst-token
  padding, cached dispatch by handle, the intranode handle's fields; ``combine`` with bias and top-k weights;
- low-latency mode: ``low_latency_dispatch`` (BF16, FP8, rounded and UE8M0 scales, hooks, two calls in a row,
  receive statistics) and ``low_latency_combine`` (weights, ``out``, zero-copy through
  ``get_next_low_latency_combine_buffer``).

Run: ``python tests/compat/deepep_v1_script.py --num-processes 4 [--port P]``; a failed check exits non-zero.
"""
from __future__ import annotations

import argparse
import itertools
import os
from dataclasses import dataclass, field
from typing import Union

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import deep_ep

FP8_MAX = 448.0  # the largest finite float8_e4m3fn
BLOCK = 128  # channels that share one FP8 scale
XInput = Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative L2 distance of ``got`` from ``want``."""
    got, want = got.double(), want.double()
    return float((got - want).norm() / want.norm().clamp_min(1e-12))


def to_fp8(x: torch.Tensor, round_scale: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 data and float32 scales per (token, 128 channels), with ``data * scale ~= x``; ``round_scale`` rounds
    the scales up to powers of two."""
    blocks = x.float().unflatten(-1, (-1, BLOCK))
    scales = blocks.abs().amax(-1).clamp_min(1e-4) / FP8_MAX
    if round_scale:
        scales = torch.exp2(scales.log2().ceil())
    return (blocks / scales.unsqueeze(-1)).to(torch.float8_e4m3fn).flatten(-2), scales


def from_fp8(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """BF16 values of FP8 ``data``; int32 ``scales`` pack four UE8M0 exponent bytes (lowest byte first)."""
    if scales.dtype == torch.int32:
        scales = torch.exp2(scales.contiguous().view(torch.uint8).float() - 127)
    return (data.float().unflatten(-1, (-1, BLOCK)) * scales.unsqueeze(-1)).flatten(-2).bfloat16()


def as_bf16(x: XInput) -> torch.Tensor:
    return from_fp8(*x) if isinstance(x, tuple) else x


def take(x: XInput, rows: Union[torch.Tensor, slice]) -> XInput:
    """Rows of a tensor, or of both members of an FP8 pair."""
    return (x[0][rows], x[1][rows]) if isinstance(x, tuple) else x[rows]


def num_rows(x: XInput) -> int:
    return (x[0] if isinstance(x, tuple) else x).size(0)


def identical(got: XInput, want: XInput) -> bool:
    """Bitwise equality of tensors or FP8 pairs (FP8 data compared as bytes)."""
    if isinstance(want, tuple):
        return (isinstance(got, tuple) and torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
                and torch.equal(got[1], want[1]))
    return not isinstance(got, tuple) and torch.equal(got, want)


def stacked(parts: list[XInput]) -> XInput:
    if isinstance(parts[0], tuple):
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    return torch.cat(parts)


@dataclass
class Source:
    """One rank's tokens and routing (identical on every rank) and the layout they imply."""

    x: torch.Tensor  # [N, H] bf16
    topk_idx: torch.Tensor  # [N, K] global expert ids, -1 = unused slot
    topk_weights: torch.Tensor  # [N, K] float32
    num_ranks: int
    num_experts: int
    num_local: int = field(init=False)  # experts per rank
    in_rank: torch.Tensor = field(init=False)  # [N, R] bool
    per_rank: torch.Tensor = field(init=False)  # [R] int32
    per_expert: torch.Tensor = field(init=False)  # [E] int32

    def __post_init__(self) -> None:
        self.num_local = self.num_experts // self.num_ranks
        owner = torch.where(self.topk_idx >= 0, self.topk_idx // self.num_local, self.num_ranks).long()
        hits = torch.zeros(self.x.size(0), self.num_ranks + 1, dtype=torch.bool).scatter_(1, owner, True)
        self.in_rank = hits[:, :-1].contiguous()
        self.per_rank = self.in_rank.sum(0).int()
        used = self.topk_idx[self.topk_idx >= 0].long()
        self.per_expert = torch.bincount(used, minlength=self.num_experts).int()

    def local_topk(self, rank: int) -> torch.Tensor:
        """``topk_idx`` as rank ``rank``'s local expert ids; -1 where the expert lives elsewhere."""
        local = self.topk_idx - rank * self.num_local
        return local.masked_fill((self.topk_idx < 0) | (local < 0) | (local >= self.num_local), -1)


def make_sources(num_ranks: int, num_tokens: int, hidden: int, num_experts: int, num_topk: int) -> list[Source]:
    """Every rank's inputs, seeded by rank; about a quarter as many top-k slots as tokens are -1."""
    sources = []
    for rank in range(num_ranks):
        gen = torch.Generator().manual_seed(7919 * (rank + 1))
        x = torch.randn(num_tokens, hidden, generator=gen).bfloat16()
        topk_idx = torch.rand(num_tokens, num_experts, generator=gen).topk(num_topk, dim=1).indices
        topk_idx.view(-1)[torch.randint(0, topk_idx.numel(), (num_tokens // 4,), generator=gen)] = -1
        weights = torch.rand(num_tokens, num_topk, generator=gen) + 0.5
        sources.append(Source(x, topk_idx.to(deep_ep.topk_idx_t), weights, num_ranks, num_experts))
    return sources


# ---- Normal mode
@dataclass(frozen=True)
class Variant:
    """One way of calling the normal-mode methods."""

    fp8: bool
    with_topk: bool
    async_finish: bool
    previous: bool

    def stream_args(self, buffer: deep_ep.Buffer) -> dict:
        args: dict = {"async_finish": self.async_finish}
        if self.previous:
            args.update(previous_event=buffer.capture(), allocate_on_comm_stream=self.async_finish)
        return args

    def finish(self, event: object) -> None:
        if self.async_finish:
            event.current_stream_wait()

    def payload(self, source: Source) -> XInput:
        """BF16 tokens, or their FP8 cast with the scales in column-major storage."""
        if not self.fp8:
            return source.x
        data, scales = to_fp8(source.x)
        return data, scales.t().contiguous().t()


def check_layout(buffer: deep_ep.Buffer, me: Source) -> None:
    """``get_dispatch_layout`` returns (per rank, per RDMA rank, per expert, is_token_in_rank, event)."""
    for kwargs in ({}, {"previous_event": buffer.capture(), "async_finish": True}):
        per_rank, per_rdma_rank, per_expert, in_rank, event = buffer.get_dispatch_layout(
            me.topk_idx, me.num_experts, **kwargs)
        if kwargs:
            event.current_stream_wait()
        assert per_rdma_rank is None, "num_tokens_per_rdma_rank is None within one node"
        assert torch.equal(per_rank, me.per_rank), f"num_tokens_per_rank {per_rank} != {me.per_rank}"
        assert torch.equal(per_expert, me.per_expert), f"num_tokens_per_expert {per_expert} != {me.per_expert}"
        assert torch.equal(in_rank, me.in_rank), "is_token_in_rank differs from the routing"


def check_intranode_handle(handle: tuple, sources: list[Source], rank: int, picks: list[torch.Tensor]) -> None:
    """V1's intranode handle: (rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix,
    recv_src_idx, is_token_in_rank, send_head)."""
    assert len(handle) == 6, f"the intranode handle has 6 fields, got {len(handle)}"
    sent = torch.stack([s.per_rank for s in sources]).long()  # [source, destination]
    assert torch.equal(handle[0].long(), sent.cumsum(0)), "rank_prefix_matrix is the prefix over sources"
    me = sources[rank]
    assert torch.equal(handle[1][:, -1].long(), me.per_rank.long()), "channel_prefix_matrix ends at the totals"
    assert not handle[2][:, 0].any(), "recv_channel_prefix_matrix starts every source at 0"
    assert torch.equal(handle[3].long(), torch.cat(picks)), "recv_src_idx lists the source rows"
    assert torch.equal(handle[4], me.in_rank), "the handle keeps is_token_in_rank"
    assert torch.equal(handle[5] >= 0, me.in_rank), "send_head is -1 exactly where a token is not sent"


def check_worst_tokens(buffer: deep_ep.Buffer, args: dict, variant: Variant, first: tuple) -> None:
    """With ``num_worst_tokens`` every output has that many rows; the leading rows repeat the plain dispatch."""
    worst = args["num_tokens_per_rank"].numel() * num_rows(args["x"])
    recv_x, recv_idx, recv_weights, counts, _, event = buffer.dispatch(
        **args, num_worst_tokens=worst, **variant.stream_args(buffer))
    variant.finish(event)
    real = num_rows(first[0])
    assert counts == [], "the expert count list is empty in worst-token mode"
    for got, want in ((recv_x, first[0]), (recv_idx, first[1]), (recv_weights, first[2])):
        assert num_rows(got) == worst, f"worst-token output has {num_rows(got)} rows, not {worst}"
        assert identical(take(got, slice(0, real)), want), "worst-token rows differ from the plain dispatch"
    assert (recv_idx[real:] == -1).all(), "padding rows carry topk id -1"


def check_cached(buffer: deep_ep.Buffer, handle: tuple, sources: list[Source], rank: int, picks: list[torch.Tensor],
                 variant: Variant, config: deep_ep.Config) -> None:
    """A cached dispatch moves new data (tokens in reverse order) along the handle's routes."""
    backwards = torch.arange(sources[rank].x.size(0) - 1, -1, -1)
    reversed_x = [take(variant.payload(s), backwards) for s in sources]
    result = buffer.dispatch(reversed_x[rank], handle=handle, config=config, **variant.stream_args(buffer))
    variant.finish(result[5])
    assert identical(result[0], stacked([take(x, p) for x, p in zip(reversed_x, picks)])), "cached dispatch rows"
    assert all(v is None for v in result[1:5]), "a cached dispatch returns only recv_x and the event"


def check_combine(buffer: deep_ep.Buffer, handle: tuple, recv: tuple, me: Source, rank: int, variant: Variant,
                  config: deep_ep.Config) -> None:
    """Rank ``d`` returns ``(d + 1) * row``; combine sums the holders' rows plus the bias."""
    y = (as_bf16(recv[0]).float() * (rank + 1)).bfloat16()
    gen = torch.Generator().manual_seed(rank)
    b0, b1 = (torch.randn(me.x.shape, generator=gen).bfloat16() for _ in range(2))
    bias = (b0, b1) if variant.with_topk else b0
    combined, combined_weights, event = buffer.combine(y, handle, topk_weights=recv[2], bias=bias, config=config,
                                                       **variant.stream_args(buffer))
    variant.finish(event)
    holders = me.in_rank.float() @ torch.arange(1, me.num_ranks + 1, dtype=torch.float)
    own = as_bf16(variant.payload(me)).float()
    want = own * holders.unsqueeze(1) + b0.float() + (b1.float() if variant.with_topk else 0)
    assert rel_error(combined, want) < 5e-3, f"combine error {rel_error(combined, want):.2e} ({variant})"
    if variant.with_topk:
        assert torch.equal(combined_weights, me.topk_weights.masked_fill(me.topk_idx < 0, 0)), "combined weights"
    else:
        assert combined_weights is None, "combined_topk_weights is None without top-k"


def check_dispatch(buffer: deep_ep.Buffer, sources: list[Source], rank: int, variant: Variant,
                   config: deep_ep.Config) -> None:
    """Dispatch with ``variant``: rows by (source rank, source token), local top-k ids, counts, handle; then the
    worst-token or cached dispatch, then combine."""
    me = sources[rank]
    picks = [s.in_rank[:, rank].nonzero().flatten() for s in sources]
    alignment = 4 if variant.async_finish else 1
    args = {"x": variant.payload(me), "num_tokens_per_rank": me.per_rank, "is_token_in_rank": me.in_rank,
            "num_tokens_per_expert": me.per_expert, "expert_alignment": alignment, "config": config}
    if variant.with_topk:
        args.update(topk_idx=me.topk_idx, topk_weights=me.topk_weights)
    result = buffer.dispatch(**args, **variant.stream_args(buffer))
    recv_x, recv_idx, recv_weights, counts, handle, event = result
    variant.finish(event)
    assert identical(recv_x, stacked([take(variant.payload(s), p) for s, p in zip(sources, picks)])), \
        f"recv_x rows differ ({variant})"
    check_intranode_handle(handle, sources, rank, picks)
    totals = sum(s.per_expert for s in sources)[rank * me.num_local:(rank + 1) * me.num_local]
    assert counts == [-(-int(c) // alignment) * alignment for c in totals], f"expert counts {counts} ({variant})"
    if variant.with_topk:
        want_idx = torch.cat([s.local_topk(rank)[p] for s, p in zip(sources, picks)])
        want_weights = torch.cat([s.topk_weights[p] for s, p in zip(sources, picks)]).masked_fill(want_idx < 0, 0)
        assert torch.equal(recv_idx, want_idx), "recv_topk_idx holds local ids or -1"
        assert torch.equal(recv_weights, want_weights), "recv_topk_weights is 0 on -1 slots"
        check_worst_tokens(buffer, args, variant, result)
    else:
        assert recv_idx is None and recv_weights is None, "no top-k outputs without top-k inputs"
        check_cached(buffer, handle, sources, rank, picks, variant, config)
    check_combine(buffer, handle, result, me, rank, variant, config)


def run_normal_mode(group: dist.ProcessGroup, rank: int, num_ranks: int) -> None:
    hidden = 256
    sources = make_sources(num_ranks, num_tokens=64, hidden=hidden, num_experts=4 * num_ranks, num_topk=4)
    hints = (deep_ep.Buffer.get_dispatch_config(num_ranks), deep_ep.Buffer.get_combine_config(num_ranks))
    num_nvl_bytes = max(c.get_nvl_buffer_size_hint(hidden * 2, num_ranks) for c in hints)
    buffer = deep_ep.Buffer(group, num_nvl_bytes, 0, low_latency_mode=False, num_qps_per_rank=1,
                            explicitly_destroy=True)
    assert (buffer.rank, buffer.group_size) == (rank, num_ranks)
    deep_ep.Buffer.set_num_sms(24)
    config = deep_ep.Config(24, 8, 256, 6, 128)
    check_layout(buffer, sources[rank])
    for flags in itertools.product((False, True), repeat=4):
        check_dispatch(buffer, sources, rank, Variant(*flags), config)
    deep_ep.Buffer.set_num_sms(20)
    assert deep_ep.Buffer.num_sms == 20
    buffer.destroy()


# ---- Low-latency mode
@dataclass(frozen=True)
class Cast:
    """The payload options of ``low_latency_dispatch``."""

    use_fp8: bool = False
    round_scale: bool = False
    use_ue8m0: bool = False

    def round_trip(self, x: torch.Tensor) -> torch.Tensor:
        """What a receiver reads back for the BF16 rows ``x``."""
        return from_fp8(*to_fp8(x, self.round_scale)) if self.use_fp8 else x


def check_ll_received(recv_x: XInput, recv_count: torch.Tensor, handle: tuple, stats: torch.Tensor, repeats: int,
                      sources: list[Source], rank: int, cast: Cast, max_tokens: int) -> torch.Tensor:
    """Checks the packed per-expert rows against the sources; returns them as BF16 ``[L, R*T, H]``."""
    src_info, layout_range, handle_tokens, handle_hidden, handle_experts = handle
    me = sources[rank]
    assert (handle_tokens, handle_hidden, handle_experts) == (max_tokens, me.x.size(1), me.num_experts)
    if cast.use_fp8:
        scales = recv_x[1]
        assert scales.dtype == (torch.int32 if cast.use_ue8m0 else torch.float32), f"scale dtype {scales.dtype}"
        assert scales.transpose(1, 2).is_contiguous(), "packed scales are column-major per expert"
    values = as_bf16(recv_x)
    assert values.shape == (me.num_local, me.num_ranks * max_tokens, me.x.size(1))
    for local in range(me.num_local):
        expert = rank * me.num_local + local
        begins, counts = layout_range[local] >> 32, layout_range[local] & 0xFFFFFFFF
        want = torch.stack([(s.topk_idx == expert).sum() for s in sources])
        assert torch.equal(counts, want), f"expert {expert}: per-source counts {counts} != {want}"
        assert int(recv_count[local]) == int(want.sum()) and int(stats[local]) == repeats * int(want.sum())
        order = begins.argsort()
        assert torch.equal(begins[order], counts[order].cumsum(0) - counts[order]), "source blocks tile the rows"
        for source, begin, count in zip(sources, begins.tolist(), counts.tolist()):
            tokens = src_info[local, begin:begin + count].long()
            assert torch.equal(tokens.sort().values, (source.topk_idx == expert).any(1).nonzero().flatten())
            got, ref = values[local, begin:begin + count], cast.round_trip(source.x[tokens])
            assert torch.equal(got, ref) if not cast.use_fp8 else rel_error(got, ref) < 1e-2, "packed rows"
    return values


def check_ll_round(buffer: deep_ep.Buffer, sources: list[Source], rank: int, max_tokens: int, cast: Cast,
                   use_hook: bool, repeats: int) -> None:
    """``repeats`` dispatches in a row (both buffer halves), then combines with and without zero-copy."""
    me = sources[rank]
    stats = torch.zeros(me.num_local, dtype=torch.int32)
    for _ in range(repeats):
        recv_x, recv_count, handle, event, hook = buffer.low_latency_dispatch(
            me.x, me.topk_idx, max_tokens, me.num_experts, cumulative_local_expert_recv_stats=stats,
            use_fp8=cast.use_fp8, round_scale=cast.round_scale, use_ue8m0=cast.use_ue8m0,
            async_finish=not use_hook, return_recv_hook=use_hook)
        hook() if use_hook else event.current_stream_wait()
    values = check_ll_received(recv_x, recv_count, handle, stats, repeats, sources, rank, cast, max_tokens)
    gains = torch.arange(rank * me.num_local + 1, (rank + 1) * me.num_local + 1, dtype=torch.float).view(-1, 1, 1)
    y = (values.float() * gains).bfloat16()  # expert e returns (e + 1) * its input
    factor = (me.topk_weights * (me.topk_idx + 1)).masked_fill(me.topk_idx < 0, 0).sum(1, keepdim=True)
    for zero_copy in (False, True):
        if zero_copy:
            buffer.get_next_low_latency_combine_buffer(handle)[:, :, :] = y
        out = torch.empty_like(me.x)
        combined, event, hook = buffer.low_latency_combine(y, me.topk_idx, me.topk_weights, handle,
                                                           zero_copy=zero_copy, async_finish=not use_hook,
                                                           return_recv_hook=use_hook, out=out)
        hook() if use_hook else event.current_stream_wait()
        assert combined.data_ptr() == out.data_ptr(), "low_latency_combine writes into out"
        error = rel_error(combined, cast.round_trip(me.x).float() * factor)
        assert error < (1e-2 if cast.use_fp8 else 5e-3), f"combine error {error:.2e} ({cast}, {zero_copy=})"


def run_low_latency_mode(group: dist.ProcessGroup, rank: int, num_ranks: int) -> None:
    max_tokens, hidden, num_experts = 16, 2048, 2 * num_ranks
    sources = make_sources(num_ranks, num_tokens=max_tokens - 3, hidden=hidden, num_experts=num_experts, num_topk=4)
    num_rdma_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(max_tokens, hidden, num_ranks, num_experts)
    buffer = deep_ep.Buffer(group, 0, num_rdma_bytes, low_latency_mode=True,
                            num_qps_per_rank=num_experts // num_ranks, allow_nvlink_for_low_latency_mode=True,
                            explicitly_destroy=True)
    buffer.clean_low_latency_buffer(max_tokens, hidden, num_experts)
    casts = (Cast(), Cast(use_fp8=True), Cast(True, round_scale=True), Cast(True, True, use_ue8m0=True))
    for use_hook, cast, repeats in itertools.product((False, True), casts, (1, 2)):
        check_ll_round(buffer, sources, rank, max_tokens, cast, use_hook, repeats)
    buffer.destroy()


def worker(rank: int, num_ranks: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=num_ranks, rank=rank)
    torch.set_num_threads(1)
    group = dist.new_group(list(range(num_ranks)))
    run_normal_mode(group, rank, num_ranks)
    dist.barrier(group)
    run_low_latency_mode(group, rank, num_ranks)
    dist.barrier(group)
    if rank == 0:
        print("deepep_v1_script: all checks passed", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="DeepEP V1 API compatibility script (gloo, CPU)")
    parser.add_argument("--num-processes", type=int, default=4)
    parser.add_argument("--port", type=int, default=int(os.environ.get("MASTER_PORT", "29531")))
    cli = parser.parse_args()
    mp.spawn(worker, args=(cli.num_processes, cli.port), nprocs=cli.num_processes)

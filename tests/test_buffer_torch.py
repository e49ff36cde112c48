"""``deep_ep.Buffer`` on the torch backend over real gloo process groups, checked against ``reference``.

The driver (hypothesis) draws a small frozen case; a persistent pool of ranks (``tests/dist.py``) runs it. Every
rank regenerates all ranks' inputs from the case's seed, runs ``Buffer`` on its own part, computes the global
reference and compares its own outputs bit for bit (``torch.equal`` on exact bit patterns).

Views covered: intranode (one node) and internode (``DEEP_EP_GPUS_PER_NODE`` makes virtual nodes), world sizes
2, 3, 4 and 8; BF16 and FP8 (column-major scales), with/without top-k, -1 slots, empty ranks, expert alignment,
worst-token mode, cached dispatch, biases, async events; low-latency BF16/FP8, round_scale, UE8M0, LogFMT,
zero-copy, ``out=``, receive hooks, both buffer halves back to back, and shrink masks.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

import dist
import pytest
import strategies
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

# Low-latency cases: one T for all (R*T must be a multiple of 4); H is LL_HIDDEN or a size DeepEP V1 does not
# compile (any multiple of 128 in [1024, 16384] is allowed); the buffer is sized for LL_HIDDEN, the largest.
LL_TOKENS = 8
LL_HIDDEN = 2048
LL_OTHER_HIDDEN = 1152
LL_MAX_LOCAL_EXPERTS = 2
# Examples per world size; the 8-rank pool is the slowest, so it gets fewer.
EXAMPLES = {2: 40, 3: 30, 4: 30, 8: 12}


# No shrinking: a failing case restarts the whole pool, so shrinking would cost minutes; the failure message
# already carries case.describe() and every rank's report.
PHASES = (Phase.explicit, Phase.reuse, Phase.generate)


def _examples(world_size: int) -> int:
    scale = float(os.environ.get("DEEP_EP_TEST_EXAMPLE_SCALE", "1"))
    return max(1, int(EXAMPLES[world_size] * scale))


# ---------------------------------------------------------------------------------------------------------------
# Cases (drawn in the driver, frozen, shipped to every rank).
# ---------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class NormalCase:
    """A normal-mode case: routing plus the dispatch/combine options."""

    routing: strategies.Case
    use_fp8: bool
    with_topk: bool
    expert_alignment: int
    worst_tokens: bool
    num_bias: int
    async_finish: bool
    previous_event: bool

    def describe(self) -> str:
        return (f"NormalCase({self.routing.describe()}, use_fp8={self.use_fp8}, with_topk={self.with_topk}, "
                f"expert_alignment={self.expert_alignment}, worst_tokens={self.worst_tokens}, "
                f"num_bias={self.num_bias}, async_finish={self.async_finish}, previous_event={self.previous_event})")


@dataclass(frozen=True)
class LowLatencyCase:
    """A low-latency case: routing (hidden ``LL_HIDDEN`` or ``LL_OTHER_HIDDEN``, ``N <= LL_TOKENS``) plus options."""

    routing: strategies.Case
    use_fp8: bool
    round_scale: bool
    use_ue8m0: bool
    use_logfmt: bool
    zero_copy: bool
    use_out: bool
    return_recv_hook: bool
    back_to_back: bool
    masked_rank: int  # -1: none

    def describe(self) -> str:
        return (f"LowLatencyCase({self.routing.describe()}, use_fp8={self.use_fp8}, round_scale={self.round_scale}, "
                f"use_ue8m0={self.use_ue8m0}, use_logfmt={self.use_logfmt}, zero_copy={self.zero_copy}, "
                f"use_out={self.use_out}, return_recv_hook={self.return_recv_hook}, "
                f"back_to_back={self.back_to_back}, masked_rank={self.masked_rank})")


@st.composite
def routing_cases(draw: st.DrawFn, num_ranks: int, num_scaleup_ranks: int, max_tokens: int, hidden: tuple,
                  max_local_experts: int = 3, allow_duplicates: bool = True) -> strategies.Case:
    num_experts = num_ranks * draw(st.integers(1, max_local_experts))
    duplicates = draw(st.booleans()) if allow_duplicates else False
    num_topk = draw(st.integers(1, 4 if duplicates else min(4, num_experts)))
    num_tokens = tuple(draw(st.lists(st.integers(0, max_tokens), min_size=num_ranks, max_size=num_ranks)))
    return strategies.Case(num_ranks=num_ranks, num_scaleup_ranks=num_scaleup_ranks, num_tokens=num_tokens,
                           hidden=draw(st.sampled_from(hidden)), num_topk=num_topk, num_experts=num_experts,
                           mask_percent=draw(st.sampled_from([0, 0, 20, 60, 100])), allow_duplicates=duplicates,
                           num_channels=draw(st.integers(1, 4)), seed=draw(st.integers(0, 2 ** 20)))


@st.composite
def normal_cases(draw: st.DrawFn, num_ranks: int, num_scaleup_ranks: int) -> NormalCase:
    routing = draw(routing_cases(num_ranks, num_scaleup_ranks, max_tokens=10, hidden=(128, 256)))
    with_topk = draw(st.booleans())
    return NormalCase(routing=routing, use_fp8=draw(st.booleans()), with_topk=with_topk,
                      expert_alignment=draw(st.sampled_from([1, 1, 2, 4])),
                      worst_tokens=with_topk and draw(st.booleans()), num_bias=draw(st.integers(0, 2)),
                      async_finish=draw(st.booleans()), previous_event=draw(st.booleans()))


@st.composite
def low_latency_cases(draw: st.DrawFn, num_ranks: int, num_scaleup_ranks: int) -> LowLatencyCase:
    routing = draw(routing_cases(num_ranks, num_scaleup_ranks, max_tokens=LL_TOKENS,
                                 hidden=(LL_HIDDEN, LL_OTHER_HIDDEN),
                                 max_local_experts=LL_MAX_LOCAL_EXPERTS, allow_duplicates=False))
    use_fp8 = draw(st.booleans())
    round_scale = use_fp8 and draw(st.booleans())
    use_logfmt = draw(st.booleans())
    return LowLatencyCase(routing=routing, use_fp8=use_fp8, round_scale=round_scale,
                          use_ue8m0=round_scale and routing.hidden % 512 == 0 and draw(st.booleans()),
                          use_logfmt=use_logfmt,
                          zero_copy=not use_logfmt and draw(st.booleans()), use_out=draw(st.booleans()),
                          return_recv_hook=draw(st.booleans()), back_to_back=draw(st.booleans()),
                          masked_rank=draw(st.sampled_from([-1, -1, -1, num_ranks - 1])))


# ---------------------------------------------------------------------------------------------------------------
# Worker side (runs in the pool processes).
# ---------------------------------------------------------------------------------------------------------------

def _bits(t: torch.Tensor) -> torch.Tensor:
    """Exact bit pattern view for bitwise comparison (float8/bf16/f32 -> integer views)."""
    t = t.contiguous()
    if t.dtype.is_floating_point:
        return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


def _same(name: str, got: Any, want: Any) -> Optional[str]:
    """``None`` if equal bit for bit (tensors) or by value; else a message."""
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return f"{name}: expected a tensor, got {type(got).__name__}"
        if got.shape != want.shape or got.dtype != want.dtype:
            return f"{name}: shape/dtype {tuple(got.shape)} {got.dtype} != expected {tuple(want.shape)} {want.dtype}"
        if not torch.equal(_bits(got), _bits(want)):
            diff = (_bits(got) != _bits(want)).nonzero()[:5].tolist()
            return f"{name}: values differ (first differing indices {diff})"
        return None
    if got != want:
        return f"{name}: {got!r} != expected {want!r}"
    return None


def _expect(errors: list, name: str, got: Any, want: Any) -> None:
    message = _same(name, got, want)
    if message is not None:
        errors.append(message)


def _buffer(ctx: dist.WorkerContext, key: str, **kwargs: Any) -> Any:
    """A Buffer cached in the worker across cases (construction is collective; all ranks build the same key)."""
    import deep_ep
    if key not in ctx.cache:
        ctx.cache[key] = deep_ep.Buffer(ctx.group, **kwargs)
    return ctx.cache[key]


def _fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 tuple with column-major scales (as DeepEP's intranode test passes them)."""
    from deep_ep import numerics
    q, scales = numerics.per_token_cast_to_fp8(x)
    return q, scales.t().contiguous().t()


def _randint_bf16(seed: int, shape: tuple) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-8, 9, shape, generator=gen).to(torch.bfloat16)


def run_normal(ctx: dist.WorkerContext, case: NormalCase) -> Optional[str]:
    """Layout, dispatch, cached dispatch and combine on this rank vs the global reference."""
    import reference
    from deep_ep.backends.cuda_tuning import intranode_channels
    from deep_ep.config import Config

    routing, rank = case.routing, ctx.rank
    topo = routing.topology
    num_experts, num_channels = routing.num_experts, routing.num_channels
    inputs = routing.all_inputs()
    mine = inputs[rank]
    buf = _buffer(ctx, "normal", num_nvl_bytes=1 << 20)
    errors: list[str] = []

    layout = buf.get_dispatch_layout(mine.topk_idx, num_experts)
    ref_layouts = [reference.get_dispatch_layout(i.topk_idx, num_experts, topo) for i in inputs]
    for field in ("num_tokens_per_rank", "num_tokens_per_rdma_rank", "num_tokens_per_expert", "is_token_in_rank"):
        want = getattr(ref_layouts[rank], field)
        got = getattr(layout, field)
        if want is None:
            if got is not None:
                errors.append(f"layout.{field}: expected None, got {got}")
        else:
            _expect(errors, f"layout.{field}", got, want)

    xs = [_fp8(i.x) if case.use_fp8 else i.x for i in inputs]
    config = Config(num_sms=2 * num_channels)
    num_channels = intranode_channels(config.num_sms, routing.num_ranks)  # every backend's channel rule
    num_worst = sum(routing.num_tokens) if case.worst_tokens else 0
    topk = dict(topk_idx=mine.topk_idx, topk_weights=mine.topk_weights) if case.with_topk else {}
    previous = buf.capture() if case.previous_event else None
    result = buf.dispatch(xs[rank], num_tokens_per_rank=layout.num_tokens_per_rank,
                          num_tokens_per_rdma_rank=layout.num_tokens_per_rdma_rank,
                          is_token_in_rank=layout.is_token_in_rank, num_tokens_per_expert=layout.num_tokens_per_expert,
                          expert_alignment=case.expert_alignment, num_worst_tokens=num_worst, config=config,
                          previous_event=previous, async_finish=case.async_finish, **topk)
    if case.async_finish:
        result.event.current_stream_wait()
    recv_x, recv_topk_idx, recv_topk_weights, num_list, handle, _ = result  # DeepEP's tuple positions
    ref_topk = dict(topk_idx=[i.topk_idx for i in inputs], topk_weights=[i.topk_weights for i in inputs],
                    num_experts=num_experts) if case.with_topk else {}
    refs = reference.dispatch(xs, [r.is_token_in_rank for r in ref_layouts], topo,
                              expert_alignment=case.expert_alignment, num_worst_tokens=num_worst,
                              num_channels=num_channels, **ref_topk)
    ref = refs[rank]
    if case.use_fp8:
        _expect(errors, "recv_x[0] (fp8)", recv_x[0], ref.recv_x[0])
        _expect(errors, "recv_x[1] (scales)", recv_x[1], ref.recv_x[1])
        if not recv_x[1].is_contiguous():
            errors.append(f"recv scales must be row-major contiguous, got strides {recv_x[1].stride()}")
    else:
        _expect(errors, "recv_x", recv_x, ref.recv_x)
    if case.with_topk:
        _expect(errors, "recv_topk_idx", recv_topk_idx, ref.recv_topk_idx)
        _expect(errors, "recv_topk_weights", recv_topk_weights, ref.recv_topk_weights)
        _expect(errors, "num_recv_tokens_per_expert_list", num_list, ref.num_recv_tokens_per_expert_list)
    elif recv_topk_idx is not None or recv_topk_weights is not None:
        errors.append("recv_topk_idx/recv_topk_weights must be None without top-k")
    expected_type = deep_ep_handle_type(topo)
    if type(handle) is not expected_type:
        errors.append(f"handle type {type(handle).__name__} != {expected_type.__name__}")
    for field, want in zip(ref.handle._fields, ref.handle):
        _expect(errors, f"handle.{field}", getattr(handle, field), want)

    # Cached dispatch reproduces recv_x exactly (no top-k, no counts).
    cached = buf.dispatch(xs[rank], handle=handle, config=config)
    if cached[1:5] != (None, None, None, None):
        errors.append(f"cached dispatch must return None for fields 1..4, got {cached[1:5]}")
    num_real = int(handle[0][-1, rank]) if not topo.is_internode else int(handle[6][-1])
    if case.use_fp8:
        _expect(errors, "cached recv_x[0]", cached.recv_x[0], recv_x[0][:num_real])
        _expect(errors, "cached recv_x[1]", cached.recv_x[1], recv_x[1][:num_real])
    else:
        _expect(errors, "cached recv_x", cached.recv_x, recv_x[:num_real])

    # Combine: every rank returns deterministic pseudo expert outputs; biases per original token.
    rows = [(r.recv_x[0] if case.use_fp8 else r.recv_x).size(0) for r in refs]
    ys = [_randint_bf16(routing.seed * 31 + d, (rows[d], routing.hidden)) for d in range(routing.num_ranks)]
    biases = [tuple(_randint_bf16(routing.seed * 97 + s * 7 + b, (routing.num_tokens[s], routing.hidden))
                    for b in range(case.num_bias)) for s in range(routing.num_ranks)]
    bias_arg = [None if not b else (b[0] if len(b) == 1 else b) for b in biases]
    weights = [r.recv_topk_weights for r in refs] if case.with_topk else None
    combined = buf.combine(ys[rank], handle, topk_weights=recv_topk_weights if case.with_topk else None,
                           bias=bias_arg[rank], config=config,
                           async_finish=case.async_finish)
    if case.async_finish:
        combined.event.current_stream_wait()
    ref_c = reference.combine(ys, [r.handle for r in refs], topo, topk_weights=weights, bias=bias_arg)[rank]
    _expect(errors, "combined_x", combined[0], ref_c.combined_x)
    if case.with_topk:
        _expect(errors, "combined_topk_weights", combined[1], ref_c.combined_topk_weights)
    elif combined[1] is not None:
        errors.append("combined_topk_weights must be None without topk_weights")
    return "\n".join(errors) or None


def deep_ep_handle_type(topology: Any) -> type:
    from deep_ep import handle as hd
    return hd.InternodeHandle if topology.is_internode else hd.IntranodeHandle


def run_channel_rule(ctx: dist.WorkerContext, case: None) -> Optional[str]:
    """The torch backend's handles have the CUDA kernels' channel count for the same Config
    (``cuda_tuning.intranode_channels``: ``num_sms`` channels up to the cap per rank count), and a cached dispatch
    accepts any Config with that count."""
    from deep_ep import testing
    from deep_ep.backends.cuda_tuning import INTRANODE_CHANNEL_CAP
    from deep_ep.config import Config

    buf = _buffer(ctx, "normal", num_nvl_bytes=1 << 20)
    world = ctx.world_size
    idx = torch.tensor([[r, (r + 1) % world] for r in range(world)], dtype=torch.int64)
    x = torch.ones(world, 128, dtype=torch.bfloat16)
    layout = buf.get_dispatch_layout(idx, world)
    counts = dict(num_tokens_per_rank=layout.num_tokens_per_rank,
                  num_tokens_per_rdma_rank=layout.num_tokens_per_rdma_rank, is_token_in_rank=layout.is_token_in_rank,
                  num_tokens_per_expert=layout.num_tokens_per_expert)
    cap = INTRANODE_CHANNEL_CAP.get(world, 1 << 30)
    errors = []
    for num_sms, uncapped in ((8, False), (24, False), (24, True)):
        want = num_sms if uncapped else min(num_sms, cap)
        with testing.overrides(uncapped_channels=uncapped):
            handle = buf.dispatch(x, config=Config(num_sms=num_sms), **counts).handle
            if buf.topology.is_internode:
                shapes = {"rdma_channel_prefix_matrix": handle.rdma_channel_prefix_matrix.shape,
                          "gbl_channel_prefix_matrix": handle.gbl_channel_prefix_matrix.shape,
                          "recv_rdma_channel_prefix_matrix": handle.recv_rdma_channel_prefix_matrix.shape,
                          "recv_gbl_channel_prefix_matrix": handle.recv_gbl_channel_prefix_matrix.shape}
                rows = {"rdma_channel_prefix_matrix": buf.topology.num_scaleout_ranks,
                        "recv_rdma_channel_prefix_matrix": buf.topology.num_scaleout_ranks}
            else:
                shapes = {"channel_prefix_matrix": handle.channel_prefix_matrix.shape,
                          "recv_channel_prefix_matrix": handle.recv_channel_prefix_matrix.shape}
                rows = {}
            for name, shape in shapes.items():
                if tuple(shape) != (rows.get(name, world), want):
                    errors.append(f"num_sms={num_sms} uncapped={uncapped}: {name} {tuple(shape)}, want "
                                  f"{(rows.get(name, world), want)}")
            same = want if uncapped or want < cap else cap + 2  # another budget with the same channel count
            buf.dispatch(x, handle=handle, config=Config(num_sms=same))
            try:
                buf.dispatch(x, handle=handle, config=Config(num_sms=want - 2 if want > 2 else want + 2))
                errors.append(f"num_sms={num_sms}: a cached dispatch with another channel count was accepted")
            except ValueError as exc:
                if "config.num_sms must match" not in str(exc):
                    errors.append(f"unexpected error: {exc}")
    return "\n".join(errors) or None


def run_profiler_ranges(ctx: dist.WorkerContext, case: None) -> Optional[str]:
    """Each torch-backend dispatch and combine shows in a CPU profile as one ``deep_ep::dispatch`` /
    ``deep_ep::combine`` range; a hooked low-latency call adds one range for its receive."""
    from torch.profiler import ProfilerActivity, profile

    import deep_ep
    world, hidden, experts = ctx.world_size, 128, 2 * ctx.world_size
    idx = torch.tensor([[r % experts, (r + 1) % experts] for r in range(4)], dtype=torch.int64)
    x = torch.ones(4, hidden, dtype=torch.bfloat16)
    normal = _buffer(ctx, "normal", num_nvl_bytes=1 << 20)
    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(4, hidden, world, experts)
    ll = _buffer(ctx, f"ll-{hint}", num_rdma_bytes=hint, low_latency_mode=True, num_qps_per_rank=1)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        layout = normal.get_dispatch_layout(idx, experts)
        recv = normal.dispatch(x, num_tokens_per_rank=layout.num_tokens_per_rank,
                               is_token_in_rank=layout.is_token_in_rank,
                               num_tokens_per_expert=layout.num_tokens_per_expert, topk_idx=idx,
                               topk_weights=torch.ones(4, 2))
        normal.combine(recv[0], recv[4])
        recv_x, _, handle, _, hook = ll.low_latency_dispatch(x, idx, 4, experts, use_fp8=False,
                                                             return_recv_hook=True)
        hook()
        _, _, hook = ll.low_latency_combine(recv_x, idx, torch.ones(4, 2), handle, return_recv_hook=True)
        hook()
    counts = {e.key: e.count for e in prof.key_averages() if e.key.startswith("deep_ep::")}
    expected = {"deep_ep::dispatch": 3, "deep_ep::combine": 3}
    return None if counts == expected else f"rank {ctx.rank}: profiler ranges {counts}, expected {expected}"


def run_low_latency(ctx: dist.WorkerContext, case: LowLatencyCase) -> Optional[str]:
    """Low-latency dispatch and combine on this rank vs the global reference."""
    import deep_ep
    import reference

    routing, rank, num_ranks = case.routing, ctx.rank, ctx.world_size
    num_experts, num_local = routing.num_experts, routing.num_local_experts
    tokens, hidden = LL_TOKENS, routing.hidden
    shrink = case.masked_rank >= 0
    num_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(tokens, LL_HIDDEN, num_ranks,
                                                              num_ranks * LL_MAX_LOCAL_EXPERTS)
    buf = _buffer(ctx, f"ll-shrink={shrink}", num_rdma_bytes=num_bytes, low_latency_mode=True,
                  num_qps_per_rank=LL_MAX_LOCAL_EXPERTS, enable_shrink=shrink)
    if rank == case.masked_rank:  # a "dead" rank takes part in nothing
        return None
    errors: list[str] = []
    masked = [case.masked_rank] if shrink else []
    if shrink:
        buf.low_latency_update_mask_buffer(case.masked_rank, True)
        status = torch.zeros(num_ranks, dtype=torch.int32)
        buf.low_latency_query_mask_buffer(status)
        _expect(errors, "mask status", status.tolist(), [int(r == case.masked_rank) for r in range(num_ranks)])
    inputs = routing.all_inputs()
    mine = inputs[rank]
    stats = torch.zeros(num_local, dtype=torch.int32)
    wait_stats = torch.zeros(num_ranks, dtype=torch.int64)
    mode = dict(use_fp8=case.use_fp8, round_scale=case.round_scale, use_ue8m0=case.use_ue8m0,
                async_finish=not case.return_recv_hook, return_recv_hook=case.return_recv_hook)
    issues = 2 if case.back_to_back else 1
    results = [buf.low_latency_dispatch(mine.x, mine.topk_idx, tokens, num_experts,
                                        cumulative_local_expert_recv_stats=stats,
                                        dispatch_wait_recv_cost_stats=wait_stats, **mode) for _ in range(issues)]
    for res in results:  # both halves in flight before either receive completes
        res.hook() if case.return_recv_hook else res.event.current_stream_wait()
    refs = reference.low_latency_dispatch([i.x for i in inputs], [i.topk_idx for i in inputs], tokens, num_experts,
                                          use_fp8=case.use_fp8, round_scale=case.round_scale,
                                          use_ue8m0=case.use_ue8m0, masked_ranks=masked)
    ref = refs[rank]
    for n, res in enumerate(results):
        recv_x, count, handle, _event, _hook = res  # DeepEP's tuple positions
        _expect(errors, f"[{n}] packed_recv_count", count, ref.packed_recv_count)
        _expect(errors, f"[{n}] layout_range", handle[1], ref.handle.packed_recv_layout_range)
        _expect(errors, f"[{n}] handle ints", tuple(handle[2:]), (tokens, hidden, num_experts))
        for j in range(num_local):
            valid = int(ref.packed_recv_count[j])
            _expect(errors, f"[{n}] src_info[{j}]", handle[0][j, :valid], ref.handle.packed_recv_src_info[j, :valid])
            if case.use_fp8:
                _expect(errors, f"[{n}] recv fp8[{j}]", recv_x[0][j, :valid], ref.recv_x[0][j, :valid])
                _expect(errors, f"[{n}] recv scales[{j}]", recv_x[1][j, :valid], ref.recv_x[1][j, :valid])
            else:
                _expect(errors, f"[{n}] recv_x[{j}]", recv_x[j, :valid], ref.recv_x[j, :valid])
        if case.use_fp8:
            scales = recv_x[1]
            cols = hidden // 512 if case.use_ue8m0 else hidden // 128
            rows = num_ranks * tokens
            want_stride = (cols * rows, 1, rows)
            if tuple(scales.shape) != (num_local, rows, cols) or scales.stride() != want_stride:
                errors.append(f"scales shape/stride {tuple(scales.shape)} {scales.stride()} != "
                              f"{(num_local, rows, cols)} {want_stride}")
    _expect(errors, "cumulative_local_expert_recv_stats", stats, ref.packed_recv_count * issues)
    if int(wait_stats.min()) < 0:
        errors.append(f"dispatch_wait_recv_cost_stats must stay >= 0, got {wait_stats.tolist()}")

    # Combine each dispatch (back to back when two are in flight).
    ys = [_randint_bf16(routing.seed * 13 + d, (num_local, num_ranks * tokens, hidden)) for d in range(num_ranks)]
    ref_out = reference.low_latency_combine(ys, [i.topk_idx for i in inputs], [i.topk_weights for i in inputs],
                                            [r.handle for r in refs], use_logfmt=case.use_logfmt,
                                            masked_ranks=masked)[rank]
    combines = []
    for res in results:
        if case.zero_copy:
            buf.get_next_low_latency_combine_buffer(res.handle)[:, :, :] = ys[rank]
        out = torch.empty(mine.x.size(0), hidden, dtype=torch.bfloat16) if case.use_out else None
        combined = buf.low_latency_combine(ys[rank], mine.topk_idx, mine.topk_weights, res.handle,
                                           use_logfmt=case.use_logfmt, zero_copy=case.zero_copy,
                                           async_finish=not case.return_recv_hook,
                                           return_recv_hook=case.return_recv_hook, out=out)
        combines.append((combined, out))
        if case.zero_copy:  # the zero-copy staging area is reused by the next call: finish this one first
            combined.hook() if case.return_recv_hook else combined.event.current_stream_wait()
    for n, (combined, out) in enumerate(combines):
        if not case.zero_copy:
            combined.hook() if case.return_recv_hook else combined.event.current_stream_wait()
        _expect(errors, f"[{n}] combined_x", combined.combined_x, ref_out)
        if out is not None and combined.combined_x.data_ptr() != out.data_ptr():
            errors.append("low_latency_combine(out=...) must return `out`")
    if shrink:
        buf.low_latency_clean_mask_buffer()
    return "\n".join(errors) or None


# ---------------------------------------------------------------------------------------------------------------
# Driver side.
# ---------------------------------------------------------------------------------------------------------------

# (world size, ranks per node): intranode views and internode views through DEEP_EP_GPUS_PER_NODE.
TOPOLOGIES = [(2, 2), (3, 3), (4, 4), (4, 2), (2, 1), (8, 8), (8, 4)]


def _pool(pools: dist.PoolManager, world_size: int, per_node: int) -> dist.RankPool:
    return pools.get(world_size, {"DEEP_EP_GPUS_PER_NODE": str(per_node)})


def _topology_id(topology: tuple) -> str:
    world, per_node = topology
    return f"{world}ranks-{world // per_node}x{per_node}"


# mode -> (case strategy, worker, topologies).
MODES = {"normal": (normal_cases, "run_normal", TOPOLOGIES),
         "low_latency": (low_latency_cases, "run_low_latency", [(2, 2), (3, 3), (4, 2), (8, 8)])}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode, topology", [(mode, t) for mode, (_, _, ts) in MODES.items() for t in ts],
                         ids=lambda v: _topology_id(v) if isinstance(v, tuple) else v)
def test_dispatch_combine(pools, mode, topology):
    world, per_node = topology
    cases, worker, _ = MODES[mode]

    @settings(max_examples=_examples(world), phases=PHASES)
    @given(case=cases(world, per_node))
    def check(case: Any) -> None:
        _pool(pools, world, per_node).check("test_buffer_torch", worker, case)

    check()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("topology", [(2, 2), (3, 3), (4, 2)], ids=_topology_id)
def test_handles_follow_the_channel_rule(pools, topology):
    """Handles from the same Config have the same shape on every backend: the torch backend's follow the CUDA
    kernels' channel rule."""
    _pool(pools, *topology).check("test_buffer_torch", "run_channel_rule", None)


@pytest.mark.timeout(300)
def test_profiler_ranges_name_each_operation(pools):
    _pool(pools, 2, 2).check("test_buffer_torch", "run_profiler_ranges", None)

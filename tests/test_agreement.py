"""Ranks that disagree on a call's arguments all raise promptly, before any row moves, and the next call works.

On gloo pools of 2 and 4 ranks one rank (the "odd" one) passes a different hidden size, dtype, expert count, top-k,
config, optional tensor, cached-ness, low-latency flag, makes another call, or fails its own validation. Every rank
must raise within a second: the odd rank's own ``TypeError``/``ValueError`` when its validation failed, else
``deep_ep.errors.ArgumentMismatchError`` naming the argument and the differing ranks; then a correct dispatch and
combine on every rank must match ``reference``.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Optional

import dist
import pytest
import torch

MODULE = "test_agreement"
NUM_TOKENS = 6
HIDDEN = 128
LL_TOKENS = 4
LL_HIDDEN = 1024
# Seconds a disagreement may take to surface on every rank.
PROMPT_S = 1.0


def _buffers(ctx: dist.WorkerContext) -> tuple[Any, Any]:
    import deep_ep
    if "bufs" not in ctx.cache:
        num_experts = 2 * ctx.world_size
        hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(LL_TOKENS, LL_HIDDEN, ctx.world_size, num_experts)
        ctx.cache["bufs"] = (deep_ep.Buffer(ctx.group, 1 << 22),
                             deep_ep.Buffer(ctx.group, num_rdma_bytes=hint, low_latency_mode=True,
                                            num_qps_per_rank=1))
    return ctx.cache["bufs"]


def _x(hidden: int = HIDDEN, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.zeros(NUM_TOKENS, hidden, dtype=dtype)


def _dispatch(ctx: dist.WorkerContext, x: Any = None, num_experts: int = 0, num_topk: int = 2,
              with_topk: bool = False, **kwargs: Any) -> Any:
    """A dispatch on the normal Buffer of ``x`` (default: zeros ``[NUM_TOKENS, HIDDEN]`` BF16), each token routed to
    ``num_topk`` of ``num_experts`` experts (default: 2 per rank); ``with_topk``: pass the top-k too."""
    buf, _ = _buffers(ctx)
    num_experts = num_experts or 2 * ctx.world_size
    x = _x() if x is None else x
    gen = torch.Generator().manual_seed(17 + ctx.rank)
    idx = torch.rand(NUM_TOKENS, num_experts, generator=gen).argsort(1)[:, :num_topk].contiguous()
    if with_topk:
        kwargs.update(topk_idx=idx, topk_weights=torch.ones(idx.shape))
    layout = buf.get_dispatch_layout(idx, num_experts)
    return buf.dispatch(x, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
                        num_tokens_per_expert=layout[2], **kwargs)


def _ll_dispatch(ctx: dist.WorkerContext, num_tokens: int = LL_TOKENS, use_fp8: bool = False) -> Any:
    """A low-latency dispatch of ``num_tokens`` zero rows, every token to expert 0."""
    _, ll = _buffers(ctx)
    x = torch.zeros(num_tokens, LL_HIDDEN, dtype=torch.bfloat16)
    return ll.low_latency_dispatch(x, torch.zeros(num_tokens, 1, dtype=torch.int64), LL_TOKENS, 2 * ctx.world_size,
                                   use_fp8=use_fp8)


def _round_trip(ctx: dist.WorkerContext, buf: Any) -> Optional[str]:
    """A correct dispatch + combine, compared with ``reference``."""
    message = dist.round_trip_matches_reference(buf, ctx.rank, ctx.world_size, 2 * ctx.world_size, seed=5,
                                                num_tokens=NUM_TOKENS, hidden=HIDDEN)
    return message and f"after the disagreement: {message}"


def _ll_round_trip(ctx: dist.WorkerContext, ll: Any, use_fp8: bool = False) -> Any:
    num_experts = 2 * ctx.world_size
    x = torch.ones(LL_TOKENS, LL_HIDDEN, dtype=torch.bfloat16)
    idx = torch.full((LL_TOKENS, 1), (2 * ctx.rank + 2) % num_experts, dtype=torch.int64)
    recv_x, _, handle, _, _ = ll.low_latency_dispatch(x, idx, LL_TOKENS, num_experts, use_fp8=use_fp8)
    if use_fp8:
        recv_x = recv_x[0].to(torch.bfloat16)
    combined, _, _ = ll.low_latency_combine(recv_x, idx, torch.ones(LL_TOKENS, 1), handle)
    return None if torch.equal(combined, x) else "the correct low-latency round trip gave wrong results"


# Each case: (call made by every rank, told whether it is the odd rank; the words the errors must contain).
def _cases() -> dict[str, tuple[Callable[[dist.WorkerContext, bool], Any], tuple[str, ...]]]:
    def hidden(ctx: dist.WorkerContext, odd: bool) -> Any:
        return _dispatch(ctx, _x(2 * HIDDEN if odd else HIDDEN))

    def byte_compatible_dtype(ctx: dist.WorkerContext, odd: bool) -> Any:
        return _dispatch(ctx, _x(HIDDEN, torch.float32) if odd else _x(2 * HIDDEN))  # the same row bytes

    def num_experts(ctx: dist.WorkerContext, odd: bool) -> Any:
        return _dispatch(ctx, num_experts=4 * ctx.world_size if odd else 2 * ctx.world_size)

    def topk(ctx: dist.WorkerContext, odd: bool) -> Any:
        return _dispatch(ctx, num_topk=3 if odd else 2, with_topk=True)

    def config(ctx: dist.WorkerContext, odd: bool) -> Any:
        import deep_ep
        return _dispatch(ctx, config=deep_ep.Config(24 if odd else 20, 6, 256, 6, 128))

    def combine_weights(ctx: dist.WorkerContext, odd: bool) -> Any:
        buf, _ = _buffers(ctx)
        recv_x, _, _, _, handle, _ = _dispatch(ctx)
        weights = torch.ones(recv_x.size(0), 2) if odd else None
        return buf.combine(recv_x, handle, topk_weights=weights)

    def cached(ctx: dist.WorkerContext, odd: bool) -> Any:
        buf, _ = _buffers(ctx)
        handle = _dispatch(ctx).handle
        return buf.dispatch(_x(), handle=handle) if odd else _dispatch(ctx)

    def other_call(ctx: dist.WorkerContext, odd: bool) -> Any:
        buf, _ = _buffers(ctx)
        recv_x, _, _, _, handle, _ = _dispatch(ctx)
        return buf.combine(recv_x, handle) if odd else buf.dispatch(_x(), handle=handle)

    def refused(ctx: dist.WorkerContext, odd: bool) -> Any:
        return _dispatch(ctx, expert_alignment=0 if odd else 1)

    def refused_ll(ctx: dist.WorkerContext, odd: bool) -> Any:
        return _ll_dispatch(ctx, LL_TOKENS + (1 if odd else 0))

    def ll_fp8(ctx: dist.WorkerContext, odd: bool) -> Any:
        return _ll_dispatch(ctx, use_fp8=odd)

    def ll_combine_handle(ctx: dist.WorkerContext, odd: bool) -> Any:
        _, ll = _buffers(ctx)
        first, second = _ll_dispatch(ctx), _ll_dispatch(ctx)
        recv_x, _, handle, _, _ = first if odd else second
        return ll.low_latency_combine(recv_x, torch.zeros(LL_TOKENS, 1, dtype=torch.int64), torch.ones(LL_TOKENS, 1),
                                      handle)

    return {
        "hidden": (hidden, ("x.size(1) (hidden)",)),
        "byte_compatible_dtype": (byte_compatible_dtype, ("hidden",)),
        "num_experts": (num_experts, ("num_experts",)),
        "topk": (topk, ("num_topk",)),
        "config": (config, ("config",)),
        "combine_weights": (combine_weights, ("topk_weights given",)),
        "cached": (cached, ("cached",)),
        "other_call": (other_call, ("different calls", "combine", "dispatch")),
        "refused": (refused, ("expert_alignment",)),
        "refused_ll": (refused_ll, ("x",)),
        "ll_fp8": (ll_fp8, ("use_fp8",)),
        "ll_combine_handle": (ll_combine_handle, ("handle",)),
    }


def run_disagreement(ctx: dist.WorkerContext, name: str) -> Optional[str]:
    from deep_ep.errors import ArgumentMismatchError
    world, rank = ctx.world_size, ctx.rank
    odd_rank = world // 2
    call, words = _cases()[name]
    start = time.monotonic()
    try:
        call(ctx, rank == odd_rank)
    except ArgumentMismatchError as exc:
        caught: Exception = exc
    except (TypeError, ValueError) as exc:
        caught = exc
        if rank != odd_rank or not name.startswith("refused"):
            return f"{type(exc).__name__} instead of ArgumentMismatchError: {exc}"
    else:
        return "no error although the ranks disagree"
    waited = time.monotonic() - start
    text = str(caught)
    if waited > PROMPT_S:
        return f"the error took {waited:.2f} s: {text}"
    if isinstance(caught, ArgumentMismatchError):
        missing = [w for w in (*words, str(odd_rank)) if w not in text]
        if missing:
            return f"the error lacks {missing}: {text}"
    buf, ll = _buffers(ctx)
    return _round_trip(ctx, buf) or _ll_round_trip(ctx, ll)


def run_exchange_count(ctx: dist.WorkerContext, case: None) -> Optional[str]:
    """The check rides on the exchanges a call makes anyway: a dispatch makes one all-gather (signature and
    counts), a low-latency dispatch two point-to-point batches (signature with counts, then rows)."""
    buf, ll = _buffers(ctx)
    counts: dict[str, int] = {}
    for backend in (buf._torch, ll._torch):
        for name in ("all_gather", "post"):
            original = getattr(backend.comm, name)

            def counted(*args: Any, _original: Any = original, _name: str = name, **kwargs: Any) -> Any:
                counts[_name] = counts.get(_name, 0) + 1
                return _original(*args, **kwargs)
            setattr(backend.comm, name, counted)
    try:
        _dispatch(ctx)
        normal = dict(counts)
        counts.clear()
        _ll_dispatch(ctx)
        low_latency = dict(counts)
    finally:
        for backend in (buf._torch, ll._torch):
            for name in ("all_gather", "post"):
                delattr(backend.comm, name)
    if normal != {"all_gather": 1, "post": 1}:
        return f"a dispatch made {normal} exchanges, expected one all-gather and one batch of rows"
    if low_latency != {"post": 2}:
        return f"a low-latency dispatch made {low_latency} exchanges, expected two point-to-point batches"
    return None


CASES = sorted(_cases())


# Four ranks: the cases whose exchange differs with more peers (collective, point-to-point, refusal, other call).
CASES_4 = ("hidden", "ll_fp8", "other_call", "refused", "refused_ll")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
def test_disagreeing_ranks_raise_promptly(pools, world):
    pool = pools.get(world, {"DEEP_EP_GPUS_PER_NODE": str(world), "DEEP_EP_TIMEOUT_S": "20"})
    for name in CASES if world == 2 else CASES_4:
        pool.check(MODULE, "run_disagreement", name)


@pytest.mark.timeout(300)
def test_agreement_rides_on_the_count_exchanges(pools):
    pools.get(2, {"DEEP_EP_GPUS_PER_NODE": "2", "DEEP_EP_TIMEOUT_S": "20"}).check(MODULE, "run_exchange_count", None)


def test_signature_hash_cache_gives_the_hash_of_the_words():
    """The cached hash of a signature is the CRC of its words, whatever came before: equal signatures (values that
    compare equal, such as 1, 1.0 and True) hash equally, different ones differently, refusals and unhashable values
    included, and a full cache starts over."""
    import struct
    import zlib

    import deep_ep
    from deep_ep.backends import agreement as ag

    def crc(signature):
        return zlib.crc32(struct.pack(f"<{ag.SIGNATURE_WORDS}q", *signature.values()))

    config = deep_ep.Config(20, 6, 256, 6, 128)
    signatures = [ag.Signature("combine", (("hidden", h), ("flag", flag), ("dtype", dt), ("config", config)))
                  for h in (128, 256) for flag in (True, False) for dt in (torch.bfloat16, torch.float32)]
    signatures += [ag.Signature("combine", (("hidden", 128.0), ("flag", 1), ("dtype", torch.bfloat16),
                                            ("config", config))),
                   ag.Signature("combine", (), "x"), ag.Signature("combine", (), "topk_idx"),
                   ag.Signature("low_latency_dispatch", (("hidden", 128), ("tensors", [1, 2])))]
    for _ in range(2):  # the second round reads the cache
        for signature in signatures:
            assert ag.signature_hash(signature) == crc(signature)
    assert ag.signature_hash(signatures[-4]) == ag.signature_hash(signatures[0])
    assert len({ag.signature_hash(s) for s in signatures}) == len(signatures) - 1
    for i in range(ag._HASHES_MAX + 10):
        signature = ag.Signature("dispatch", (("n", i),))
        assert ag.signature_hash(signature) == crc(signature)
    assert len(ag._HASHES) <= ag._HASHES_MAX
    assert ag.signature_hash(None) == 0

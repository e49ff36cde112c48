"""Failures and misuse of ``deep_ep.Buffer`` on the torch backend (gloo, 2 and 4 ranks): a dead peer raises a
``deep_ep.CommError`` naming rank, peer and phase (and, in shrink mode, the rank to mask); ``DEEP_EP_TIMEOUT_S``
must be finite and positive; dropped receive hooks are drained; misuse of the low-latency double buffer across
calls raises; any low-latency hidden size works on the torch backend; calls ignore ``torch.set_default_device``.
"""
from __future__ import annotations

import os
from typing import Any, Optional

import pytest
import torch

import dist

MODULE = "test_misuse"
NUM_TOKENS = 6
HIDDEN = 128
LL_TOKENS = 4
LL_HIDDEN = 256


def _ll_buffer(ctx: dist.WorkerContext, num_experts: int, hidden: int = LL_HIDDEN, **kwargs: Any) -> Any:
    import deep_ep
    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(LL_TOKENS, hidden, ctx.world_size, num_experts)
    return deep_ep.Buffer(ctx.group, num_rdma_bytes=hint, low_latency_mode=True, num_qps_per_rank=1, **kwargs)


def _ll_identity(buf: Any, x: torch.Tensor, idx: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """A BF16 low-latency dispatch and a combine of the received rows with weight 1: returns ``x`` when every
    token has one valid expert."""
    recv_x, _, handle, _, _ = buf.low_latency_dispatch(x, idx, LL_TOKENS, kwargs.pop("num_experts"), use_fp8=False)
    weights = torch.ones(idx.shape, dtype=torch.float32)
    combined, _, _ = buf.low_latency_combine(recv_x, idx, weights, handle)
    return combined


# ---------------------------------------------------------------------------------------------------------------
# Item: DEEP_EP_TIMEOUT_S is refused at construction unless finite and > 0.
# ---------------------------------------------------------------------------------------------------------------

def run_bad_timeout(ctx: dist.WorkerContext, case: None) -> Optional[str]:
    import deep_ep
    errors = []
    saved = os.environ.get("DEEP_EP_TIMEOUT_S")
    try:
        for value in ("0", "-1", "inf", "nan", "-inf", "soon"):
            os.environ["DEEP_EP_TIMEOUT_S"] = value
            try:
                deep_ep.Buffer(ctx.group, num_nvl_bytes=1 << 20)
            except ValueError as exc:
                if "DEEP_EP_TIMEOUT_S" not in str(exc) or value not in str(exc):
                    errors.append(f"{value}: the error does not name the variable and value: {exc}")
            else:
                errors.append(f"DEEP_EP_TIMEOUT_S={value} was accepted")
        os.environ["DEEP_EP_TIMEOUT_S"] = "0.5"
        deep_ep.Buffer(ctx.group, num_nvl_bytes=1 << 20)
    finally:
        if saved is None:
            os.environ.pop("DEEP_EP_TIMEOUT_S", None)
        else:
            os.environ["DEEP_EP_TIMEOUT_S"] = saved
    return "\n".join(errors) or None


# ---------------------------------------------------------------------------------------------------------------
# Item: a dead peer surfaces as a CommError naming rank, peer and phase; in shrink mode the rank to mask.
# ---------------------------------------------------------------------------------------------------------------

def run_dead_peer(ctx: dist.WorkerContext, mode: str) -> Optional[str]:
    """The last rank dies after a good call; the others' next call raises CommError naming it, and (shrink) masking
    it lets the survivors go on."""
    import time

    import deep_ep
    rank, world = ctx.rank, ctx.world_size
    dead = world - 1
    num_experts = 2 * world
    shrink = mode == "shrink"
    hidden = 1024
    buf = _ll_buffer(ctx, num_experts, hidden, enable_shrink=True) if shrink else deep_ep.Buffer(ctx.group, 1 << 20)
    x = torch.arange(LL_TOKENS * hidden, dtype=torch.float32).view(LL_TOKENS, hidden).remainder(7)
    x = x.to(torch.bfloat16)
    # Every token goes to an expert of the next rank (the dead rank's experts are never chosen after the fault).
    idx = torch.full((LL_TOKENS, 1), 2 * ((rank + 1) % world), dtype=torch.int64)

    def call() -> None:
        if shrink:
            _ll_identity(buf, x, idx, num_experts=num_experts)
        else:
            layout = buf.get_dispatch_layout(idx, num_experts)
            buf.dispatch(x, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
                         num_tokens_per_expert=layout[2])

    call()
    ctx.group.barrier() if hasattr(ctx.group, "barrier") else torch.distributed.barrier(group=ctx.group)
    if rank == dead:
        os._exit(0)
    time.sleep(0.5)  # let the survivors' gloo pairs see the closed connection
    start = time.monotonic()
    try:
        call()
    except deep_ep.CommError as exc:
        waited = time.monotonic() - start
        text = str(exc)
        if exc.rank != rank or exc.phase is None:
            return f"CommError attributes rank={exc.rank} phase={exc.phase!r}: {text}"
        if f"rank {rank}" not in text or exc.phase not in text:
            return f"the message does not name this rank and the phase: {text}"
        if shrink:
            if exc.peer != dead or f"mask rank {dead}" not in text:
                return f"shrink mode: the error does not name rank {dead} to mask (peer={exc.peer}): {text}"
        if waited > 10:
            return f"the fault took {waited:.1f} s to surface"
    except RuntimeError as exc:
        return f"a raw {type(exc).__name__} instead of deep_ep.CommError: {exc}"
    else:
        return "no error although a peer died"
    if not shrink:
        return None
    buf.low_latency_update_mask_buffer(dead, True)
    if rank == dead - 1:
        idx = torch.zeros(LL_TOKENS, 1, dtype=torch.int64)
    combined = _ll_identity(buf, x, idx, num_experts=num_experts)
    if not torch.equal(combined, x):
        return "after masking the dead rank, the survivors' low-latency round trip is wrong"
    return None


@pytest.fixture(scope="module")
def pools():
    with dist.PoolManager() as manager:
        yield manager


@pytest.mark.timeout(300)
def test_timeout_must_be_finite_and_positive(pools):
    pools.get(2, {"DEEP_EP_GPUS_PER_NODE": "2"}).check(MODULE, "run_bad_timeout", None)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world, mode", [(2, "normal"), (4, "shrink")])
def test_dead_peer_raises_comm_error(pools, world, mode):
    pool = pools.get(world, {"DEEP_EP_GPUS_PER_NODE": str(world), "DEEP_EP_TIMEOUT_S": "20", "CASE": mode})
    reports = pool.run(MODULE, "run_dead_peer", mode)
    failures = {r: m for r, m in reports.items() if m is not None and r != world - 1}
    assert not failures, failures
    assert "died" in (reports[world - 1] or ""), reports

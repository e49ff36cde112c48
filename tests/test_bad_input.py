"""Bad input to ``deep_ep.Buffer`` raises ``ValueError``/``TypeError`` naming the argument and the value, before any
communication, and the next valid call still works. Also: a peer that never arrives gives a bounded,
descriptive timeout instead of a hang.

Runs on a 2-rank gloo pool (``tests/dist.py``): every rank makes the same bad calls, so no rank is left waiting.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import dist
import pytest
import torch

NUM_EXPERTS = 4
HIDDEN = 128
NUM_TOKENS = 6
LL_TOKENS = 4
LL_HIDDEN = 2048


def _valid_round_trip(buf: Any, rank: int, seed: int) -> Optional[str]:
    """A correct dispatch + combine on ``buf``; every rank must call it. Returns an error message or None."""
    message = dist.round_trip_matches_reference(buf, rank, 2, NUM_EXPERTS, seed, NUM_TOKENS, HIDDEN)
    return message and f"after a rejected call: {message}"


def _bad_calls(ctx: dist.WorkerContext) -> list[tuple[str, Callable[[], Any], type, tuple[str, ...]]]:
    """(description, call, expected exception type, substrings the message must contain)."""
    import deep_ep
    from deep_ep import Buffer, Config
    rank = ctx.rank
    buf = ctx.cache["normal"]
    ll = ctx.cache["ll"]
    other = ctx.cache["other"]
    idx = torch.tensor([[0, 3]] * NUM_TOKENS, dtype=deep_ep.topk_idx_t)  # tokens go to both ranks
    x = torch.zeros(NUM_TOKENS, HIDDEN, dtype=torch.bfloat16)
    layout = buf.get_dispatch_layout(idx, NUM_EXPERTS)
    counts = dict(num_tokens_per_rank=layout[0], is_token_in_rank=layout[3], num_tokens_per_expert=layout[2])
    weights = torch.ones(NUM_TOKENS, 2)
    recv_x, _, _, _, handle, _ = buf.dispatch(x, **counts)
    other_layout = other.get_dispatch_layout(idx, NUM_EXPERTS)
    _, _, _, _, other_handle, _ = other.dispatch(x, num_tokens_per_rank=other_layout[0],
                                                 is_token_in_rank=other_layout[3],
                                                 num_tokens_per_expert=other_layout[2])
    ll_x = torch.zeros(LL_TOKENS, LL_HIDDEN, dtype=torch.bfloat16)
    ll_idx = torch.tensor([[0, 3]] * LL_TOKENS, dtype=deep_ep.topk_idx_t)
    del rank
    return [
        ("topk_idx int32", lambda: buf.get_dispatch_layout(idx.to(torch.int32), NUM_EXPERTS), TypeError,
         ("topk_idx", "torch.int64", "torch.int32")),
        ("topk_idx 1-D", lambda: buf.get_dispatch_layout(idx[:, 0].contiguous(), NUM_EXPERTS), ValueError,
         ("topk_idx", "2-D", f"({NUM_TOKENS},)")),
        ("topk_idx non-contiguous", lambda: buf.get_dispatch_layout(idx.t().contiguous().t(), NUM_EXPERTS),
         ValueError, ("topk_idx", "contiguous")),
        ("expert id out of range", lambda: buf.get_dispatch_layout(idx + NUM_EXPERTS - 1, NUM_EXPERTS), ValueError,
         ("topk_idx", str(NUM_EXPERTS))),
        ("expert id below -1", lambda: buf.get_dispatch_layout(idx - 3, NUM_EXPERTS), ValueError,
         ("topk_idx", "-3")),
        ("experts not divisible by ranks", lambda: buf.get_dispatch_layout(idx, 3), ValueError,
         ("num_experts", "divisible", "3")),
        ("num_experts not an int", lambda: buf.get_dispatch_layout(idx, 4.0), TypeError, ("num_experts", "4.0")),
        ("x 1-D", lambda: buf.dispatch(x[0], **counts), ValueError, ("x", "2-D")),
        ("x row bytes", lambda: buf.dispatch(torch.zeros(NUM_TOKENS, 4, dtype=torch.bfloat16), **counts),
         ValueError, ("x", "16", "hidden=4")),
        ("x non-contiguous", lambda: buf.dispatch(torch.zeros(HIDDEN, NUM_TOKENS, dtype=torch.bfloat16).t(),
                                                  **counts), ValueError, ("x", "contiguous")),
        ("is_token_in_rank dtype", lambda: buf.dispatch(x, num_tokens_per_rank=layout[0],
                                                        is_token_in_rank=layout[3].int(),
                                                        num_tokens_per_expert=layout[2]), TypeError,
         ("is_token_in_rank", "torch.bool", "torch.int32")),
        ("is_token_in_rank shape", lambda: buf.dispatch(x, num_tokens_per_rank=layout[0],
                                                        is_token_in_rank=layout[3][:-1],
                                                        num_tokens_per_expert=layout[2]), ValueError,
         ("is_token_in_rank", f"({NUM_TOKENS - 1}, 2)")),
        ("is_token_in_rank device", lambda: buf.dispatch(x, num_tokens_per_rank=layout[0],
                                                         is_token_in_rank=layout[3].to("meta"),
                                                         num_tokens_per_expert=layout[2]), ValueError,
         ("is_token_in_rank", "device", "meta")),
        ("num_tokens_per_rank inconsistent", lambda: buf.dispatch(x, num_tokens_per_rank=layout[0] + 1,
                                                                  is_token_in_rank=layout[3],
                                                                  num_tokens_per_expert=layout[2]), ValueError,
         ("num_tokens_per_rank", "is_token_in_rank")),
        ("missing layout", lambda: buf.dispatch(x), ValueError, ("num_tokens_per_rank", "is_token_in_rank")),
        ("weights without idx", lambda: buf.dispatch(x, topk_weights=weights, **counts), ValueError,
         ("topk_idx", "topk_weights")),
        ("weights dtype", lambda: buf.dispatch(x, topk_idx=idx, topk_weights=weights.double(), **counts),
         TypeError, ("topk_weights", "torch.float32", "torch.float64")),
        ("scales with a BF16 x", lambda: buf.dispatch((x, torch.ones(NUM_TOKENS, 1)), **counts), TypeError,
         ("x_scales", "torch.bfloat16")),
        ("worst tokens without top-k", lambda: buf.dispatch(x, num_worst_tokens=12, **counts), ValueError,
         ("num_worst_tokens", "12")),
        ("negative expert_alignment", lambda: buf.dispatch(x, expert_alignment=0, **counts), ValueError,
         ("expert_alignment", "0")),
        ("odd config num_sms", lambda: buf.dispatch(x, config=Config(num_sms=3), **counts), ValueError,
         ("num_sms", "even", "3")),
        ("config of the wrong type", lambda: buf.dispatch(x, config=(20, 6, 256), **counts), TypeError,
         ("config", "tuple")),
        ("cached dispatch with top-k", lambda: buf.dispatch(x, handle=handle, topk_idx=idx, topk_weights=weights),
         ValueError, ("topk_idx", "handle")),
        ("cached dispatch with other num_sms", lambda: buf.dispatch(x, handle=handle, config=Config(num_sms=4)),
         ValueError, ("num_sms", "4")),
        ("combine x float32", lambda: buf.combine(recv_x.float(), handle), TypeError,
         ("x", "torch.bfloat16", "torch.float32")),
        ("combine x rows", lambda: buf.combine(recv_x[1:], handle), ValueError, ("x", "rows")),
        ("combine bias shape", lambda: buf.combine(recv_x, handle, bias=x[:2]), ValueError, ("bias", "(2, 128)")),
        ("handle from another Buffer", lambda: buf.combine(recv_x, other_handle), ValueError,
         ("handle", "this Buffer")),
        ("handle of the wrong type", lambda: buf.combine(recv_x, (1, 2)), TypeError, ("handle", "length 2")),
        ("odd set_num_sms", lambda: Buffer.set_num_sms(23), ValueError, ("new_num_sms", "even", "23")),
        ("Buffer without group", lambda: Buffer(None), ValueError, ("Either 'group' or 'comm' must be provided.",)),
        ("num_nvl_bytes alignment", lambda: Buffer(ctx.group, num_nvl_bytes=1000), ValueError,
         ("num_nvl_bytes", "128", "1000")),
        ("LL without low_latency_mode", lambda: buf.low_latency_dispatch(ll_x, ll_idx, LL_TOKENS, NUM_EXPERTS),
         ValueError, ("low_latency_mode",)),
        ("LL too many tokens", lambda: ll.low_latency_dispatch(torch.zeros(LL_TOKENS + 1, LL_HIDDEN,
                                                                           dtype=torch.bfloat16),
                                                               torch.zeros(LL_TOKENS + 1, 2, dtype=torch.int64),
                                                               LL_TOKENS, NUM_EXPERTS), ValueError,
         ("num_max_dispatch_tokens_per_rank", str(LL_TOKENS + 1))),
        ("LL hidden", lambda: ll.low_latency_dispatch(torch.zeros(LL_TOKENS, 960, dtype=torch.bfloat16), ll_idx,
                                                      LL_TOKENS, NUM_EXPERTS), ValueError, ("hidden", "960")),
        ("LL hidden above 16384", lambda: ll.low_latency_dispatch(torch.zeros(LL_TOKENS, 16512, dtype=torch.bfloat16),
                                                                  ll_idx, LL_TOKENS, NUM_EXPERTS), ValueError,
         ("hidden", "16512")),
        ("LL UE8M0 hidden not a multiple of 512", lambda: ll.low_latency_dispatch(
            torch.zeros(LL_TOKENS, 1152, dtype=torch.bfloat16), ll_idx, LL_TOKENS, NUM_EXPERTS, round_scale=True,
            use_ue8m0=True), ValueError, ("512", "1152")),
        ("LL top-k above 16", lambda: ll.low_latency_dispatch(ll_x, torch.zeros(LL_TOKENS, 17, dtype=torch.int64),
                                                              LL_TOKENS, NUM_EXPERTS), ValueError, ("16", "17")),
        ("LL tokens above 1024", lambda: ll.low_latency_dispatch(ll_x, ll_idx, 1025, NUM_EXPERTS), ValueError,
         ("num_max_dispatch_tokens_per_rank", "1025")),
        ("LL x dtype", lambda: ll.low_latency_dispatch(ll_x.float(), ll_idx, LL_TOKENS, NUM_EXPERTS), TypeError,
         ("x", "torch.float32")),
        ("LL ue8m0 without round_scale", lambda: ll.low_latency_dispatch(ll_x, ll_idx, LL_TOKENS, NUM_EXPERTS,
                                                                         use_ue8m0=True), ValueError,
         ("use_ue8m0", "round_scale")),
        ("LL async and hook", lambda: ll.low_latency_dispatch(ll_x, ll_idx, LL_TOKENS, NUM_EXPERTS,
                                                              async_finish=True, return_recv_hook=True), ValueError,
         ("async_finish", "return_recv_hook")),
        ("LL stats shape", lambda: ll.low_latency_dispatch(
            ll_x, ll_idx, LL_TOKENS, NUM_EXPERTS,
            cumulative_local_expert_recv_stats=torch.zeros(5, dtype=torch.int32)), ValueError,
         ("cumulative_local_expert_recv_stats", "(5,)")),
        ("LL experts not divisible", lambda: ll.low_latency_dispatch(ll_x, ll_idx, LL_TOKENS, 5), ValueError,
         ("num_experts", "5")),
        ("LL expert id out of range", lambda: ll.low_latency_dispatch(ll_x, ll_idx + 1, LL_TOKENS, NUM_EXPERTS),
         ValueError, ("topk_idx", str(NUM_EXPERTS))),
        ("LL buffer too small", lambda: ll.low_latency_dispatch(ll_x, ll_idx, LL_TOKENS, 64), ValueError,
         ("num_rdma_bytes",)),
        ("LL combine with a normal handle", lambda: ll.low_latency_combine(
            torch.zeros(2, 2 * LL_TOKENS, LL_HIDDEN, dtype=torch.bfloat16), ll_idx, torch.ones(LL_TOKENS, 2), handle),
         TypeError, ("handle", "LowLatencyHandle")),
        ("mask without shrink", lambda: ll.low_latency_update_mask_buffer(1, True), ValueError,
         ("Shrink mode must be enabled",)),
        ("destroy without explicitly_destroy", lambda: buf.destroy(), ValueError, ("explicitly_destroy",)),
        ("local buffer offset", lambda: buf.get_local_buffer_tensor(torch.int32, offset=(1 << 20) + 4), ValueError,
         ("offset",)),
    ]


def _lifetime_errors(ctx: dist.WorkerContext) -> list[str]:
    """Local buffer views, destroy(), use after destroy, and EventOverlap(None)."""
    import deep_ep
    errors = []
    buf = deep_ep.Buffer(ctx.group, num_nvl_bytes=1 << 12, explicitly_destroy=True)
    view = buf.get_local_buffer_tensor(torch.int32, torch.Size([4, 8]), offset=128)
    if tuple(view.shape) != (4, 8) or view.dtype != torch.int32:
        errors.append(f"get_local_buffer_tensor gave {view.dtype} {tuple(view.shape)}")
    flat = buf.get_local_buffer_tensor(torch.bfloat16)
    if flat.numel() != (1 << 12) // 2:
        errors.append(f"get_local_buffer_tensor(bfloat16) has {flat.numel()} elements, expected {(1 << 12) // 2}")
    buf.destroy()
    for what, call in (("use after destroy", lambda: buf.get_local_buffer_tensor(torch.int32)),
                       ("second destroy", buf.destroy)):
        try:
            call()
            errors.append(f"{what}: no exception")
        except RuntimeError as exc:
            if "destroyed" not in str(exc):
                errors.append(f"{what}: message {str(exc)!r} lacks 'destroyed'")
    with deep_ep.Buffer(ctx.group, num_nvl_bytes=1 << 12) as scoped:
        scoped.get_local_buffer_tensor(torch.uint8)
    try:
        deep_ep.EventOverlap(None).current_stream_wait()
        errors.append("EventOverlap(None).current_stream_wait(): no exception")
    except ValueError as exc:
        if "async_finish" not in str(exc):
            errors.append(f"EventOverlap(None) message {str(exc)!r} lacks 'async_finish'")
    deep_ep.Buffer.capture().current_stream_wait()  # a completed event on CPU: waiting is a no-op
    return errors


def run_bad_inputs(ctx: dist.WorkerContext, case: Any) -> Optional[str]:
    import deep_ep
    if "normal" not in ctx.cache:
        ctx.cache["normal"] = deep_ep.Buffer(ctx.group, num_nvl_bytes=1 << 20)
        ctx.cache["other"] = deep_ep.Buffer(ctx.group, num_nvl_bytes=1 << 20)
        hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(LL_TOKENS, LL_HIDDEN, 2, NUM_EXPERTS)
        ctx.cache["ll"] = deep_ep.Buffer(ctx.group, num_rdma_bytes=hint, low_latency_mode=True,
                                         num_qps_per_rank=2)
    errors = []
    num_sms_before = deep_ep.Buffer.num_sms
    for number, (what, call, exc_type, words) in enumerate(_bad_calls(ctx)):
        try:
            call()
        except exc_type as exc:
            missing = [w for w in words if w not in str(exc)]
            if missing:
                errors.append(f"{what}: message {str(exc)!r} lacks {missing}")
        except Exception as exc:  # the wrong kind of error
            errors.append(f"{what}: expected {exc_type.__name__}, got {type(exc).__name__}: {exc}")
        else:
            errors.append(f"{what}: no exception raised")
        # The next valid call still works (every few bad calls, to keep the run short).
        if number % 8 == 7:
            message = _valid_round_trip(ctx.cache["normal"], ctx.rank, seed=number)
            if message:
                errors.append(f"after '{what}': {message}")
    errors += _lifetime_errors(ctx)
    if deep_ep.Buffer.num_sms != num_sms_before:
        errors.append(f"a rejected set_num_sms changed Buffer.num_sms to {deep_ep.Buffer.num_sms}")
    message = _valid_round_trip(ctx.cache["normal"], ctx.rank, seed=12345)
    if message:
        errors.append(f"final valid call: {message}")
    return "\n".join(errors) or None


def run_timeout(ctx: dist.WorkerContext, phase: str) -> Optional[str]:
    """Rank 1 never joins; rank 0's wait must end within DEEP_EP_TIMEOUT_S with a descriptive error."""
    import time

    import deep_ep
    from deep_ep import CommTimeoutError  # one class for every backend (deep_ep.errors)
    if phase == "normal":
        buf = deep_ep.Buffer(ctx.group, num_nvl_bytes=1 << 20)
    else:
        hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(LL_TOKENS, LL_HIDDEN, 2, NUM_EXPERTS)
        buf = deep_ep.Buffer(ctx.group, num_rdma_bytes=hint, low_latency_mode=True, num_qps_per_rank=2)
    if ctx.rank == 1:
        time.sleep(6)  # stays alive (so the wait is a timeout, not a closed connection) but never calls
        return None
    start = time.monotonic()
    try:
        if phase == "normal":
            idx = torch.zeros(NUM_TOKENS, 1, dtype=torch.int64)
            layout = buf.get_dispatch_layout(idx, NUM_EXPERTS)
            buf.dispatch(torch.zeros(NUM_TOKENS, HIDDEN, dtype=torch.bfloat16), num_tokens_per_rank=layout[0],
                         is_token_in_rank=layout[3], num_tokens_per_expert=layout[2])
        else:
            buf.low_latency_dispatch(torch.zeros(LL_TOKENS, LL_HIDDEN, dtype=torch.bfloat16),
                                     torch.full((LL_TOKENS, 1), 3, dtype=torch.int64), LL_TOKENS, NUM_EXPERTS)
    except CommTimeoutError as exc:
        waited = time.monotonic() - start
        words = ["rank 0", "phase", "DEEP_EP_TIMEOUT_S"] + (["peer 1"] if phase == "low_latency" else [])
        missing = [w for w in words if w not in str(exc)]
        if missing:
            return f"timeout message {str(exc)!r} lacks {missing}"
        if waited > 10:
            return f"the timeout took {waited:.1f} s with DEEP_EP_TIMEOUT_S=2"
        return None
    return "no timeout raised although rank 1 never joined"


@pytest.mark.timeout(600)
def test_bad_inputs_are_rejected_and_recoverable(pools):
    pools.get(2, {"DEEP_EP_GPUS_PER_NODE": "2"}).check("test_bad_input", "run_bad_inputs", "bad-inputs")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("phase", ["normal", "low_latency"])
def test_missing_peer_times_out_with_context(pools, phase):
    # A private pool: a timed-out gloo group is unusable afterwards.
    pool = pools.get(2, {"DEEP_EP_GPUS_PER_NODE": "2", "DEEP_EP_TIMEOUT_S": "2", "PHASE": phase})
    pool.check("test_bad_input", "run_timeout", phase)
